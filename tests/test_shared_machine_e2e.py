"""Safe on a shared machine: with somebody else's Ray cluster running on this machine (and
RAY_ADDRESS pointing at it), two short quick-start runs at once and a replay each use a Ray
instance of their own, finish with balanced ledgers, and leave the other cluster and its actor
untouched; `streamrl run` into a directory that holds a run exits 2 and changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from streamkit import (
    assert_ledger_balanced,
    child_env,
    finish_streamrl,
    pool_stats,
    ray_head,
    run_streamrl,
    short_quickstart,
    start_streamrl,
)

pytestmark = pytest.mark.slow

THEIRS = textwrap.dedent("""
    import json, sys, ray
    ray.init(address=sys.argv[1], namespace="theirs", logging_level="ERROR")
    if sys.argv[2] == "start":
        @ray.remote
        class Keeper:
            def ping(self): return "pong"
        k = Keeper.options(name="keeper", lifetime="detached").remote()
        print(json.dumps({"ping": ray.get(k.ping.remote())}))
    else:
        k = ray.get_actor("keeper")
        actors = ray._private.state.actors()  # every actor this cluster ever ran (state API needs no dashboard)
        print(json.dumps({"ping": ray.get(k.ping.remote()), "nodes": len(ray.nodes()),
                          "actors": sorted({a["ActorClassName"] for a in actors.values()}),
                          "alive": sorted(a["ActorClassName"] for a in actors.values() if a["State"] == "ALIVE")}))
""")


def _theirs(address: str, what: str) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    r = subprocess.run([sys.executable, "-c", THEIRS, address, what], capture_output=True, text=True, timeout=120,
                       env=env, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def other_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Somebody else's Ray cluster as a user would start it, with a detached actor of theirs."""
    with ray_head(tmp_path_factory.mktemp("other-ray") / "ray-start.log", num_cpus=1) as address:
        assert _theirs(address, "start") == {"ping": "pong"}
        yield address


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return short_quickstart(tmp_path_factory.mktemp("qs-inputs"))


def test_runs_use_their_own_ray_and_never_disturb_another_cluster(other_cluster: str, inputs: list[str],
                                                                     tmp_path: Path) -> None:
    env = {"RAY_ADDRESS": other_cluster}  # exported for their cluster: a run must not join it
    dirs = [tmp_path / "run-a", tmp_path / "run-b"]
    procs = [start_streamrl(["run", "recipes/quickstart.yaml", *inputs, "--run-dir", str(d), "--quiet"],
                            tmp_path / f"io-{d.name}", env) for d in dirs]
    for proc, d in zip(procs, dirs):  # two runs at once: their ports, stores and groups never collide
        finish_streamrl(proc, tmp_path / f"io-{d.name}", run_dir=d)
    for d in dirs:
        stats = assert_ledger_balanced(d)
        assert stats["ledger"]["consumed"] == 4 * 4, stats["ledger"]
        log = (d / "run.log").read_text()
        assert "Ray: a local instance of its own" in log and other_cluster not in log, log[:2000]
    rows = [json.loads(line) for line in run_streamrl(["replay", str(dirs[0]), "--steps", "2-3", "--json"]).stdout
            .splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [2, 3] and all(r["identical"] for r in rows), rows
    theirs = _theirs(other_cluster, "check")
    assert theirs == {"ping": "pong", "nodes": 1, "actors": ["Keeper"], "alive": ["Keeper"]}, theirs

    # A run directory that holds a run is not replaced: exit 2 before anything starts, the pool unchanged.
    rows_before = pool_stats(dirs[0])["rows"]
    res = run_streamrl(["run", "recipes/quickstart.yaml", *inputs, "--run-dir", str(dirs[0])], check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"streamrl run --resume {dirs[0]}" in res.stderr and "Traceback" not in res.stderr
    assert pool_stats(dirs[0])["rows"] == rows_before


def test_a_ray_address_that_cannot_be_joined_is_one_line_and_exit_2(inputs: list[str], tmp_path: Path) -> None:
    res = run_streamrl(["run", "recipes/quickstart.yaml", *inputs, "ray.address=127.0.0.1:1", "--run-dir",
                        str(tmp_path / "run"), "--quiet"], check=False, timeout_s=180)
    assert res.returncode == 2, res.stderr[-2000:]
    err = [line for line in res.stderr.splitlines() if line.startswith("streamrl: error:")]
    assert len(err) == 1 and "could not join the Ray cluster at '127.0.0.1:1'" in err[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


__all__ = ["child_env"]
