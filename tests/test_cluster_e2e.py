"""A run on an existing two-node Ray cluster (`ray.address`): the learner on one node, engines and
rollout workers on the other (recipe `placement`), a reward module that exists only next to the
recipe travelling to the workers as a Ray `py_modules` entry (it is on no worker's path
otherwise), a balanced ledger, every sample scored by that module; a placement no node can take
is exit 2. Losing a node mid-run: the engines' and workers' node (the run carries on once a node
returns), the learner's (the run ends saying `--resume`, which loses nothing). Also: which modules
a run ships, and the error a worker gives for one it cannot import."""

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
def test_loopback_across_two_hosts_is_exit_2_naming_network_bind(tmp_path: Path) -> None:
    """The engines' node registers another address (127.0.0.2: another host to Ray) than the driver's and the
    learner's: with network.bind loopback the router could never reach the engines; the run stops once Ray
    placed the groups, before an engine starts or a step trains, saying to set network.bind: node."""
    inputs = short_quickstart(tmp_path / "inputs")
    place = ["placement.learner.resources={trainer: 1}", "placement.engines.resources={rollout: 1}"]
    with ray_head(tmp_path / "head.log", num_cpus=2, resources='{"trainer": 2}') as address, \
            ray_node(address, tmp_path / "node.log", num_cpus=3, resources='{"rollout": 4}', node_ip="127.0.0.2"):
        res = run_streamrl(["run", str(REPO / "recipes" / "quickstart.yaml"), *inputs, *place, f"ray.address={address}",
                            "--run-dir", str(tmp_path / "run"), "--quiet"], check=False, timeout_s=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "network.bind is loopback" in res.stderr and "set network.bind: node" in res.stderr, res.stderr[-3000:]
    assert "the engines on 127.0.0.2" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


RANKS_AT = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
print(json.dumps(sorted(ip.get(a["Address"]["NodeID"], "?") for a in ray._private.state.actors().values()
                        if a["ActorClassName"] == "_Rank")))
"""


@pytest.mark.slow
def test_learner_ranks_on_two_hosts_train_with_network_bind_node(tmp_path: Path) -> None:
    """A data-parallel learner of two ranks, one on each node (STRICT_SPREAD; the second node registers
    127.0.0.2, another host to Ray): they meet at a store on the driver's node address (network.bind: node),
    train the run (SFT and RL steps, checkpoints every 2 steps from both ranks) and the ledger balances."""
    inputs = short_quickstart(tmp_path / "inputs")
    run = tmp_path / "run"
    place = ["placement.learner.resources={trainer: 1}", "placement.learner.strategy=STRICT_SPREAD",
             "placement.engines.resources={rollout: 1}", "learner.parallel.dp=2"]
    with ray_head(tmp_path / "head.log", num_cpus=3, resources='{"trainer": 1, "rollout": 4}') as address, \
            ray_node(address, tmp_path / "node.log", num_cpus=2, resources='{"trainer": 1}', node_ip="127.0.0.2"):
        run_streamrl(["run", str(REPO / "recipes" / "quickstart.yaml"), *inputs, *place, f"ray.address={address}",
                      "network.bind=node", "--run-dir", str(run), "--quiet"], run_dir=run, timeout_s=400)
        ranks = subprocess.run([sys.executable, "-c", RANKS_AT, address], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"}, cwd="/")
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    head_ip = address.rpartition(":")[0]
    assert json.loads(ranks.stdout.strip().splitlines()[-1]) == sorted([head_ip, "127.0.0.2"]), ranks.stdout
    log = (run / "run.log").read_text()
    assert "the learner's ranks on 127.0.0.2, " + head_ip in log or f"the learner's ranks on {head_ip}, 127.0.0.2" in log, \
        log[:3000]
    assert f"learner: 2 ranks meet at {head_ip}:" in log, log[:3000]  # the driver's node address, not loopback
    assert assert_ledger_balanced(run)["ledger"]["consumed"] == 4 * 4
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")), list((run / "checkpoints").iterdir())


STEPS = 40  # ~0.15 s a step: a node dies with most of the run to go


def _run_until_step_3(tmp_path: Path, address: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A quick-start run on the cluster (learner on `trainer`, engines and workers on `rollout`),
    returned once it has logged 3 steps."""
    from streamkit import read_metrics

    inputs = [a for a in short_quickstart(tmp_path / "inputs") if not a.startswith("run.steps")]
    run = tmp_path / "run"
    place = ["placement.learner.resources={trainer: 1}", "placement.engines.resources={rollout: 1}"]
    proc = start_streamrl(["run", str(REPO / "recipes" / "quickstart.yaml"), *inputs, *place, f"run.steps={STEPS}",
                           f"ray.address={address}", "--run-dir", str(run), "--quiet"], tmp_path / "io")
    deadline = time.monotonic() + 300
    while len(read_metrics(run)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "io" / "streamrl.stderr").read_text()
        time.sleep(0.2)
    return proc, run


def _every_step_once_and_balanced(run: Path) -> list[dict]:
    from streamkit import read_metrics

    metrics = read_metrics(run)
    last = {m["step"]: m for m in metrics}
    assert sorted(last) == list(range(STEPS)), [m["step"] for m in metrics]
    assert [last[s]["policy_version"] for s in range(STEPS)] == list(range(1, STEPS + 1))
    led = assert_ledger_balanced(run)["ledger"]
    assert led["consumed"] == STEPS * 4 and led["lost"] == 0 and led["duplicated"] == 0, led
    return metrics


@pytest.mark.slow
def test_losing_the_engine_node_mid_run_the_run_carries_on_when_a_node_returns(tmp_path: Path) -> None:
    """The node holding the engines and rollout workers dies mid-run (its raylet and every process
    on it SIGKILLed). The run does not end: its placement groups wait for resources, a new node with
    them joins, the engines and the rollout worker start again there and the worker picks up its
    groups from the pool; the run finishes by itself, every step once, the ledger balanced."""
    from streamkit import read_metrics

    with ray_head(tmp_path / "head.log", num_cpus=2, resources='{"trainer": 2}') as address:
        with ray_node(address, tmp_path / "node.log", num_cpus=3, resources='{"rollout": 4}', kill=True):
            proc, run = _run_until_step_3(tmp_path, address)
            lost_at = len(read_metrics(run))
        assert lost_at < STEPS
        with ray_node(address, tmp_path / "node2.log", num_cpus=3, resources='{"rollout": 4}'):
            finish_streamrl(proc, tmp_path / "io", run_dir=run)
    metrics = _every_step_once_and_balanced(run)
    assert len(metrics) == STEPS  # no step logged twice: the run never stopped
    end = metrics[-1]  # (groups_resumed may be 0: a worker waiting on admission control had none in flight)
    assert end["worker_restarts"] >= 1 and end["engine_restarts"] >= 1, end
    log = (run / "run.log").read_text()
    assert "rollout worker 0 died" in log and "rollout worker 0 is up again" in log, log[-3000:]
    gaps = [b["wall_time_s"] - a["wall_time_s"] for a, b in zip(metrics, metrics[1:])]
    print(f"node lost after step {lost_at - 1}; longest gap between steps {max(gaps):.1f} s; "
          f"groups resumed {end['groups_resumed']}")


@pytest.mark.slow
def test_losing_the_learner_node_ends_the_run_with_a_resume_hint_and_resume_loses_nothing(tmp_path: Path) -> None:
    """The learner's node dies mid-run (SIGKILLed): the run ends (exit 1) saying `--resume`
    continues it; with a node for the learner back, the resumed run trains every step once and
    the ledger balances."""
    from streamkit import read_metrics

    with ray_head(tmp_path / "head.log", num_cpus=3, resources='{"rollout": 4}') as address:
        with ray_node(address, tmp_path / "node.log", num_cpus=2, resources='{"trainer": 2}', kill=True):
            proc, run = _run_until_step_3(tmp_path, address)
        res = finish_streamrl(proc, tmp_path / "io", run_dir=run, check=False)
        assert res.returncode == 1, res.stderr[-3000:]
        assert f"`streamrl run --resume {run}` continues this run" in res.stderr, res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        assert len(read_metrics(run)) < STEPS
        with ray_node(address, tmp_path / "node2.log", num_cpus=2, resources='{"trainer": 2}'):
            run_streamrl(["run", "--resume", str(run), "--quiet"], run_dir=run)
    _every_step_once_and_balanced(run)
