"""StreamRL installs like any Python package: the wheel built from pyproject.toml holds every
package (connectors/, pools/ and recipes/ of the repository as streamrl.connectors, streamrl.pools
and streamrl.recipes: one top-level name) and the files a run needs; installed into a fresh venv
outside the checkout, `streamrl init` + `check` + a short `run` work from a project directory with
a reward function defined there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _packages_in_tree() -> set[str]:
    """Every package directory, by the name it installs under (pyproject's package-dir)."""
    roots = {"streamrl": REPO / "streamrl", "streamrl/connectors": REPO / "connectors", "streamrl/pools": REPO / "pools",
             "streamrl/recipes": REPO / "recipes"}
    out = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).as_posix()
            out.add(name if rel == "." else f"{name}/{rel}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("streamrl-*.whl")
    return whl


def test_wheel_holds_every_package_and_the_files_a_run_needs(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert _packages_in_tree() - packages == set(), "packages missing from the wheel"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"streamrl"}, f"top-level names other than streamrl: {tops}"
    for needed in ("streamrl/core/algorithms/losses.py", "streamrl/connectors/megatron/cpu_shim.py",
                   "streamrl/plugins/tasks.py", "streamrl/recipes/quickstart.yaml", "streamrl/recipes/starter.yaml",
                   "streamrl/recipes/starter_rewards.py", "streamrl/recipes/envs/calculator.py",
                   "streamrl/tools/view_static/index.html", "streamrl/tools/view_static/view.js",
                   "streamrl/tools/view_static/view.css"):
        assert needed in names, needed
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "streamrl = streamrl.tools.cli:main" in entry


def test_installed_wheel_runs_a_project_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # The dependencies (torch, ray, ... 2 GB) come from the test's own environment; StreamRL itself
    # only from the wheel: a .pth path entry does not run that environment's editable-install hook.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    py, bin_ = venv / "bin" / "python", venv / "bin" / "streamrl"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def cli(*args: str, cwd: Path = tmp_path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    where = subprocess.run([str(py), "-c", "import streamrl, streamrl.connectors.ports as p; print(p.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel's copy, not the checkout
    assert cli("init", "proj").returncode == 0
    proj = tmp_path / "proj"
    # A reward only this directory defines: every scored sample gets 0.25 if the run used it.
    (proj / "my_rewards.py").write_text("def score(response, label):\n    return 0.25\n")
    r = cli("check", "recipe.yaml", cwd=proj)
    assert r.returncode == 0 and "fn: my_rewards:score" in r.stdout, r.stderr[-2000:]
    short = ["run.steps=3", "run.checkpoint_every=3", "run.eval_every=0", "sft.steps=5", "sft.batch_size=8",
             "data.eval_size=4", "data.eval_samples=1", "rollout.groups_per_step=2", "rollout.n_samples=4",
             "engines.num=1", "data.generate.args={seed: 0, n_train: 200, n_eval: 8, n_sft: 50}"]
    r = cli("run", "recipe.yaml", *short, "--quiet", cwd=proj, timeout=480)
    assert r.returncode == 0, r.stderr[-4000:]
    stats = json.loads(cli("pool", "stats", "runs/starter", "--json", cwd=proj).stdout)
    assert stats["ledger"]["balanced"] and stats["ledger"]["consumed"] == 6, stats["ledger"]
    q = cli("pool", "query", "runs/starter", "SELECT DISTINCT reward FROM pool WHERE reward IS NOT NULL", "--json",
            cwd=proj)
    assert q.returncode == 0 and [row["reward"] for row in json.loads(q.stdout)] == [0.25], q.stdout + q.stderr
