"""A run on an existing two-node Ray cluster (`ray.address`): the learner on one node, engines and
rollout workers on the other (recipe `placement`), a reward module that exists only next to the
recipe travelling to the workers as a Ray `py_modules` entry (it is on no worker's path
otherwise), a balanced ledger, every sample scored by that module; a placement no node can take
is exit 2. Also: which modules a run ships, and the error a worker gives for one it cannot import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamkit import (
    REPO,
    assert_ledger_balanced,
    finish_streamrl,
    pool_stats,
    ray_head,
    ray_node,
    run_streamrl,
    short_quickstart,
    start_streamrl,
)

REWARD = "def score(response, label, **_):\n    return 0.5  # no built-in reward gives 0.5 on this task\n"


def _recipe_with_module(root: Path, module: str, fn: str) -> Path:
    """recipes/quickstart.yaml copied into `root` with `module` (a .py file) next to it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_reward.py").write_text(module)
    text = (REPO / "recipes" / "quickstart.yaml").read_text().replace("streamrl.plugins.rewards:exact_match", fn)
    (root / "recipe.yaml").write_text(text)
    return root / "recipe.yaml"


def test_the_modules_a_run_ships_are_the_users_own(tmp_path: Path) -> None:
    from streamrl.recipe import load_recipe
    from streamrl.runtime.user_code import runtime_env

    recipe = load_recipe(_recipe_with_module(tmp_path / "r", REWARD, "my_reward:score"))
    env = runtime_env(recipe, {"OMP_NUM_THREADS": "1"})
    assert env["py_modules"] == [str((tmp_path / "r" / "my_reward.py").resolve())]  # not streamrl's own fns
    assert env["env_vars"]["OMP_NUM_THREADS"] == "1" and env["env_vars"]["STREAMRL_FNS_CHECKED"] == "1"

    pkg = tmp_path / "p" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(REWARD)
    recipe = load_recipe(_recipe_with_module(tmp_path / "p", "", "mypkg.rewards:score"))
    assert runtime_env(recipe, {})["py_modules"] == [str(pkg.resolve())]  # a package goes as its directory
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert "py_modules" not in runtime_env(recipe, {})  # only streamrl's functions: nothing to ship


def test_a_worker_that_cannot_import_a_module_says_the_driver_could(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.recipe import DRIVER_IMPORTED_ENV, resolve_fn

    with pytest.raises(ValueError, match="no_such_module_here.*ModuleNotFoundError") as plain:
        resolve_fn("no_such_module_here:score")
    assert "driver" not in str(plain.value)
    monkeypatch.setenv(DRIVER_IMPORTED_ENV, "1")
    with pytest.raises(ValueError, match="imported on the driver but not on this worker .*recipe's directory"):
        resolve_fn("no_such_module_here:score")


WHERE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
tags = {n["NodeID"]: [k for k in ("trainer", "rollout") if k in n["Resources"]] for n in ray.nodes()}
ran: dict = {}
for a in ray._private.state.actors().values():  # the GCS's actor table (no dashboard needed), dead ones included
    ran.setdefault(a["ActorClassName"], set()).update(tags.get(a["Address"]["NodeID"], ["?"]))
print(json.dumps({k: sorted(v) for k, v in ran.items()}))
"""


def _unauthenticated_generate(run: Path, proc: subprocess.Popen[bytes]) -> int | None:
    """Once the run has written its router's URL: the status of a /generate sent there without the key."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 300
    while not (run / "endpoints.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    url = json.loads((run / "endpoints.json").read_text())["router_url"]
    req = urllib.request.Request(url + "/generate", data=b'{"text": "1+1=", "sampling_params": {"max_new_tokens": 1}}',
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_a_run_on_a_two_node_cluster_places_learner_and_engines_and_ships_a_reward(tmp_path: Path) -> None:
    """Two Ray nodes on this machine (`ray start --head` + `ray start --address`), told apart by
    custom resources; the learner goes to one, the engines and rollout workers to the other
    (checked in the GCS's actor table); the reward module exists only beside the recipe."""
    inputs = short_quickstart(tmp_path / "inputs")
    recipe = _recipe_with_module(tmp_path / "elsewhere", REWARD, "my_reward:score")
    run = tmp_path / "run"
    place = ["placement.learner.resources={trainer: 1}", "placement.engines.resources={rollout: 1}"]
    with ray_head(tmp_path / "head.log", num_cpus=2, resources='{"trainer": 2}') as address, \
            ray_node(address, tmp_path / "node.log", num_cpus=3, resources='{"rollout": 4}'):
        # a group no node can take: exit 2 before anything starts, naming what is short
        res = run_streamrl(["run", str(recipe), *inputs, f"ray.address={address}", "placement.engines.resources="
                            "{gpu_box: 1}", "--run-dir", str(tmp_path / "refused"), "--quiet"], check=False)
        assert res.returncode == 2, res.stderr[-3000:]
        assert "placement: the run needs gpu_box 2 in all (the engines 1, the rollout workers 1)" in res.stderr
        # from the repository (the cwd is on the workers' path, the recipe's directory is not);
        # network.bind node: the servers bind the node's cluster address, still behind the run's keys
        proc = start_streamrl(["run", str(recipe), *inputs, *place, f"ray.address={address}", "network.bind=node",
                               "--run-dir", str(run), "--quiet"], tmp_path / "io")
        refused = _unauthenticated_generate(run, proc)
        finish_streamrl(proc, tmp_path / "io", run_dir=run)
        where = subprocess.run([sys.executable, "-c", WHERE, address], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"}, cwd="/")
    assert where.returncode == 0, where.stderr[-3000:]
    ran = json.loads(where.stdout.strip().splitlines()[-1])
    assert ran["_Rank"] == ["trainer"] and ran["EngineActor"] == ["rollout"] and ran["_ActorWorker"] == ["rollout"], ran
    log = (run / "run.log").read_text()
    assert f"joined the cluster at {address}" in log, log[:2000]
    node_ip = address.rpartition(":")[0]  # ray_head's address: the head's node IP (both nodes share it here)
    assert node_ip not in ("127.0.0.1", "0.0.0.0", "localhost"), address
    assert f"sglang-router at http://{node_ip}:" in log and f"engines at http://{node_ip}:" in log, log[:3000]
    assert refused == 401, refused  # the router on the node address wants the run's API key
    assert f"shipping your modules to every Ray worker: {(recipe.parent / 'my_reward.py').resolve()}" in log
    assert assert_ledger_balanced(run)["ledger"]["consumed"] == 4 * 4
    means = {v["mean_reward"] for v in pool_stats(run)["reward_by_version"]}
    assert means == {0.5}, means  # every sample scored by the shipped module


@pytest.mark.slow
def test_losing_the_engine_node_ends_the_run_with_a_resume_hint_and_resume_loses_nothing(tmp_path: Path) -> None:
    """The node holding the engines and rollout workers dies mid-run (its `ray start` killed): the
    run ends (exit 1) saying `--resume` continues it; with the node back, the resumed run trains
    every step once and the ledger balances. (Carrying on without the node is not built.)"""
    from streamkit import read_metrics

    inputs = [a for a in short_quickstart(tmp_path / "inputs") if not a.startswith("run.steps")]
    run, steps = tmp_path / "run", 12
    place = ["placement.learner.resources={trainer: 1}", "placement.engines.resources={rollout: 1}"]
    recipe = REPO / "recipes" / "quickstart.yaml"
    with ray_head(tmp_path / "head.log", num_cpus=2, resources='{"trainer": 2}') as address:
        with ray_node(address, tmp_path / "node.log", num_cpus=3, resources='{"rollout": 4}'):
            proc = start_streamrl(["run", str(recipe), *inputs, *place, f"run.steps={steps}", f"ray.address={address}",
                                   "--run-dir", str(run), "--quiet"], tmp_path / "io")
            deadline = time.monotonic() + 300
            while len(read_metrics(run)) < 3:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "io" / "streamrl.stderr").read_text()
                time.sleep(0.2)
        # the node is gone (its processes killed)
        res = finish_streamrl(proc, tmp_path / "io", run_dir=run, check=False)
        assert res.returncode == 1, res.stderr[-3000:]
        assert f"`streamrl run --resume {run}` continues this run" in res.stderr and "its node has died" in res.stderr
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        assert len(read_metrics(run)) < steps
        with ray_node(address, tmp_path / "node2.log", num_cpus=3, resources='{"rollout": 4}'):
            run_streamrl(["run", "--resume", str(run), "--quiet"], run_dir=run)
    last = {m["step"]: m for m in read_metrics(run)}
    assert sorted(last) == list(range(steps)) and [last[s]["policy_version"] for s in range(steps)] == list(
        range(1, steps + 1))
    led = assert_ledger_balanced(run)["ledger"]
    assert led["consumed"] == steps * 4 and led["lost"] == 0 and led["duplicated"] == 0, led
