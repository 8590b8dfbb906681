"""The layout shows the architecture (README "Layout"): the functional core imports no Ray, HTTP,
LanceDB or clock; pools/, connectors/ and the cluster simulator use only the core from the rest
of StreamRL; no two modules import each other, even through others; a file over 400 lines says
why in its opening lines; every package is in the README's table."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each installed package lives in the repository (pyproject.toml [tool.setuptools.package-dir]).
ROOTS = {"streamrl": REPO / "streamrl", "streamrl.connectors": REPO / "connectors", "streamrl.pools": REPO / "pools",
         "streamrl.recipes": REPO / "recipes"}
IMPURE = {"ray", "aiohttp", "lancedb", "lance", "pylance", "duckdb", "urllib", "http", "socket", "requests",
          "time", "datetime", "asyncio", "subprocess", "threading", "transformers", "openai"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in ROOTS.items():
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports too)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


MODS = modules()


def streamrl_deps(module: str) -> set[str]:
    """The StreamRL modules `module` imports (a `from pkg import name` counts when name is a module)."""
    return {m for m in imports(MODS[module], module) if m in MODS and m != module}


def test_core_imports_nothing_impure() -> None:
    bad = []
    for mod, f in MODS.items():
        if not mod.startswith("streamrl.core"):
            continue
        for name in imports(f, mod):
            top = name.split(".")[0]
            if top in IMPURE or (name.startswith("streamrl") and not name.startswith("streamrl.core")):
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("prefix", ["streamrl.pools", "streamrl.connectors"])
def test_pools_and_connectors_use_only_the_core(prefix: str) -> None:
    bad = [f"{MODS[m].relative_to(REPO)} imports {d}" for m in MODS if m.startswith(prefix)
           for d in streamrl_deps(m) if not d.startswith((prefix, "streamrl.core"))]
    assert not bad, "\n".join(bad)


def test_cluster_simulator_uses_only_the_core() -> None:
    """The simulator's model (streamrl/sim/cluster.py) runs the core's rules and nothing else of StreamRL;
    what reads a run's pool and log to feed it lives beside it (streamrl/sim/fromrun.py)."""
    used = {d for d in streamrl_deps("streamrl.sim.cluster")}
    assert used and all(n.startswith("streamrl.core") for n in used), sorted(used)


def test_no_import_circle() -> None:
    graph = {m: streamrl_deps(m) for m in MODS}
    # A package imports its own submodules; that is how packages work, not a circle.
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".") and not m.startswith(d + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_long_files_say_why() -> None:
    long = []
    for top in ("streamrl", "connectors", "pools", "recipes", "benchmarks", "tests"):
        for f in (REPO / top).rglob("*.py"):
            text = f.read_text()
            lines = text.splitlines()
            opening = ast.get_docstring(ast.parse(text)) or "\n".join(x for x in lines[:10] if x.startswith("#"))
            if len(lines) > 400 and "Long file:" not in opening:
                long.append(f"{f.relative_to(REPO)}: {len(lines)} lines")
    assert not long, "over 400 lines with no 'Long file:' reason in the opening docstring:\n" + "\n".join(long)


def test_readme_layout_table_matches_the_tree() -> None:
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Layout"):]
    named = set(re.findall(r"`(streamrl/[\w/]+/|connectors/[\w/]*|pools/|recipes/|benchmarks/|tests/)`", table))
    packages = {f"streamrl/{d.name}/" for d in (REPO / "streamrl").iterdir() if (d / "__init__.py").exists()}
    packages |= {f"connectors/{d.name}/" for d in (REPO / "connectors").iterdir() if (d / "__init__.py").exists()}
    packages |= {"connectors/", "pools/", "recipes/", "benchmarks/", "tests/", "streamrl/core/algorithms/"}
    assert packages - named == set(), f"missing from the README's layout table: {sorted(packages - named)}"
    assert named - packages == set(), f"in the README's layout table but not in the tree: {sorted(named - packages)}"


def test_a_recipe_naming_the_old_examples_path_is_told_the_installed_one(tmp_path: Path) -> None:
    """Outside the repository root `recipes.envs...` does not import: exit 2 naming streamrl.recipes.envs..."""
    import subprocess
    import sys

    text = (REPO / "recipes" / "calculator_env.yaml").read_text().replace("streamrl.recipes.envs", "recipes.envs")
    (tmp_path / "old.yaml").write_text(text)
    r = subprocess.run([sys.executable, "-m", "streamrl", "check", "old.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 2, r.stderr
    assert "cannot import module 'recipes.envs.calculator'" in r.stderr
    assert "'streamrl.recipes.envs.calculator:solve'" in r.stderr


def test_reading_a_recipe_does_not_import_torch() -> None:
    """The CLI's pool/check commands and the rollout workers only read recipes: importing torch
    would add about a second to each of them (streamrl/core/corrections.py keeps the recipe's
    off-policy names out of the torch formulas)."""
    code = ("import sys, streamrl.recipe, streamrl.runtime.rollout, streamrl.pools.queries; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_own_modules_are_imported_at_the_top() -> None:
    """A StreamRL module imported inside a function is a dependency no reader or tool sees (issue
    45). The few left say why on the line above: each keeps a heavy library (lancedb, torch, Ray)
    out of the processes and commands that never use it."""
    inside = []
    for mod, f in sorted(MODS.items()):
        class Visit(ast.NodeVisitor):
            depth = 0

            def visit_FunctionDef(self, node: ast.AST) -> None:
                self.depth += 1
                self.generic_visit(node)
                self.depth -= 1

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_Import(self, node: ast.Import) -> None:
                if self.depth:
                    inside.extend(f"{f.relative_to(REPO)}:{node.lineno} {a.name}" for a in node.names
                                  if a.name.split(".")[0] == "streamrl")

            def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
                if self.depth and (node.level or (node.module or "").split(".")[0] == "streamrl"):
                    inside.append(f"{f.relative_to(REPO)}:{node.lineno} {'.' * node.level}{node.module or ''}")

        Visit().visit(ast.parse(f.read_text()))
    assert len(inside) < 10, f"{len(inside)} StreamRL imports inside functions (fewer than 10 allowed; move them " \
                             "to the top of the file, or say on the line above why one cannot be):\n" + "\n".join(inside)


BENCH_MODULES = {f.stem: f for f in sorted((REPO / "benchmarks").glob("*.py")) if f.stem != "__init__"}


def _bench_deps(path: Path) -> set[str]:
    """The benchmarks modules `path` imports (module-level and inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                out |= {a.name for a in node.names}
            elif node.module.startswith("benchmarks."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_benchmarks_have_no_import_circle() -> None:
    graph = {m: _bench_deps(f) - {m} for m, f in BENCH_MODULES.items()}
    assert graph["pool_throughput"] and graph["learner_step"]  # the parser sees their imports at all
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in benchmarks/: " + " -> ".join(cycle or [])


def test_the_circle_check_finds_a_circle() -> None:
    # The shape issue 45 found (pool_scale <-> pool_throughput), as the check sees it.
    assert find_cycle({"pool_scale": {"pool_throughput"}, "pool_throughput": {"pool_scale", "_pool"},
                       "_pool": set()}) == ["pool_scale", "pool_throughput", "pool_scale"]
