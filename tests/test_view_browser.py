"""The viewer's page in real headless Chromium (Debian's `chromium`, which `make install` installs,
driven by playwright from PyPI; playwright's own browser download is never used): open a small
run, filter by reward, open a sample, and check each token's colour and version against
`pool query`. A screenshot is kept in out/test-artifacts/ (git-ignored). Skipped, saying why,
where no Chromium is installed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from streamrl.pools import open_pool
from streamrl.pools.queries import pool_query
from streamrl.tools.view import open_run, running

from poolkit import REPO_ROOT, small_run

CHROMIUM = os.environ.get("STREAMRL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("STREAMRL_TEST_ARTIFACTS", REPO_ROOT / "out" / "test-artifacts"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (`make install` installs Debian's chromium as "
                                                 "root; or set STREAMRL_CHROMIUM to a Chromium binary)"),
]


def test_filter_by_reward_open_a_sample_and_its_token_versions_match_pool_query(tmp_path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    small_run(run_dir)
    data = open_run(str(run_dir))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running(data) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)  # CSP violations too
        page.goto(srv.url)
        page.wait_for_selector("#charts .chart svg")
        page.click("button[data-tab=samples]")
        # Waits go through locators: the page's Content-Security-Policy forbids the eval a string predicate needs.
        page.wait_for_selector("#rows tbody tr")  # the unfiltered first page
        before = page.text_content("#f-count")
        page.fill("#f-rmin", "0.75")
        with page.expect_response(lambda r: "/api/samples" in r.url and "reward_min=0.75" in r.url) as resp:
            page.click("#f-apply")
        assert resp.value.status == 200
        sync_api.expect(page.locator("#f-count")).not_to_have_text(before or "")
        rewards = page.eval_on_selector_all("#rows tbody tr td:nth-child(5)", "tds => tds.map(td => Number(td.textContent))")
        assert rewards and all(r >= 0.75 for r in rewards), rewards
        uid = page.get_attribute("#rows tbody tr:first-child", "data-uid")
        assert uid
        page.click("#rows tbody tr:first-child")
        page.wait_for_selector("#detail .tok")
        shown = page.eval_on_selector_all(
            "#detail .tokens .tok", "ts => ts.map(t => [t.dataset.version, getComputedStyle(t).backgroundColor])")
        page.hover("#detail .tok")
        assert "version" in page.text_content("#tip")
        page.screenshot(path=str(ARTIFACTS / "view-sample.png"), full_page=True)
        browser.close()
    data.close()
    assert not errors, errors
    with open_pool(str(run_dir), create=False) as pool:
        spans = pool_query(pool, f"SELECT version_spans FROM pool WHERE uid = '{uid}'")["version_spans"][0].as_py()
    want = [str(sp["version"]) for sp in spans for _ in range(sp["end"] - sp["start"])]
    assert [v for v, _ in shown] == want
    colour = {}
    for version, rgb in shown:  # one colour per version, and different versions differ
        assert colour.setdefault(version, rgb) == rgb
    assert len(set(colour.values())) == len(colour) == 2
