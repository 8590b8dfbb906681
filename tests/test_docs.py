"""The documentation stays true to the tree: the recipe reference is what the schema generates,
the README stays a front page, every relative link (and its #anchor) leads somewhere, and a
newcomer reaches "add my own reward" and "run on a cluster" in one click from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrl.tools.recipe_reference import COMMAND, render, slug

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _links(page: Path) -> list[str]:
    """Link targets outside code blocks and inline code."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_recipe_reference_is_what_the_schema_generates() -> None:
    page = REPO / "docs" / "recipe-reference.md"
    assert page.read_text() == render(), f"docs/recipe-reference.md is out of date; regenerate it: {COMMAND}"


def test_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the depth to a page under docs/"
    text = "\n".join(lines)
    assert "make quickstart" in text and "make test" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_leads_to_the_reward_and_cluster_pages_in_one_click() -> None:
    links = {t.partition("#")[0] for t in _links(REPO / "README.md")}
    assert "docs/recipes.md" in links and "add-your-own-reward" in _anchors(REPO / "docs" / "recipes.md")
    assert "docs/cluster.md" in links
    text = (REPO / "README.md").read_text()
    assert "[Add your own reward](docs/recipes.md#add-your-own-reward)" in text
    assert "[Run on a cluster](docs/cluster.md)" in text
