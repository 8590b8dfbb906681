"""`streamrl plan`: what it reads from a run (a synthetic run directory with a real LanceDB pool of known
lengths and a metrics log of known step times), the presets, splits and choice against hand-computed
values, and the command itself (its JSON, PNG, calibration and refusals)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.core.lengths import within_share
from streamrl.pools import LancePool
from streamrl.sim import plan
from streamrl.sim.cluster import Cluster, Workload, simulate
from streamrl.sim.fromrun import RunReadError, calibrated_cluster, learner_rate, read_run, workload

from poolkit import make_group
from streamkit import child_env, write_recipe

# prompt -> the base length of its samples (sample i: base + i, 4 samples); every prompt seen in 2 epochs
BASES = {"p0": 5, "p1": 40, "p2": 12, "p3": 90}
STEPS, STEP_S = 4, 0.8


def _run_dir(tmp_path: Path, mode: str = "lockstep", name: str = "run") -> Path:
    d = tmp_path / name
    d.mkdir()
    (tmp_path / "train.jsonl").write_text("")
    recipe = write_recipe(tmp_path, tmp_path / "model", tmp_path / "train.jsonl", {
        "run.mode": mode, "run.dir": str(d), "rollout.max_new_tokens": 128, "rollout.groups_per_step": 2,
        "rollout.n_samples": 4, "staleness.max_staleness": 0 if mode == "lockstep" else 2}, name=f"{name}.yaml")
    (d / "recipe.yaml").write_text(recipe.read_text())
    with LancePool(d / "pool", create=True) as pool:
        pool.append([make_group(f"g{e}{k}", n=4, num_tokens=n, prompt_id=p, prompt_len=10, created_at=1 + 10 * e + k,
                                status="consumed") for e in range(2) for k, (p, n) in enumerate(BASES.items())],
                    admit=True)
    # training takes 0.25 s + tokens / 2000 (tokens: response + 10 prompt tokens per sample)
    rows = []
    for s in range(STEPS):
        resp = 100 + 40 * s
        tokens = resp + 8 * 10
        rows.append({"step": s, "train_s": 0.25 + tokens / 2000, "train_tokens": resp, "samples": 8,
                     "push_s": 0.01, "pause_s": 0.0, "wait_s": 0.1, "wall_time_s": STEP_S * (s + 1)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"steps": STEPS, "start_step": 0, "policy_version": STEPS,
                                                "rl_s": STEP_S * STEPS}))
    return d


def test_within_share_against_hand_computed_values() -> None:
    a, b = (statistics.NormalDist().inv_cdf(q) for q in (0.875, 0.625))  # normal scores of ranks 4 and 3 of 4
    # z = (-a, -b, b, a); groups (-a, -b) and (b, a): within SS (a-b)^2 over 2 dof, total 2(a^2+b^2) over 3
    assert within_share([[1, 2], [3, 4]]) == pytest.approx(3 * (a - b) ** 2 / (4 * (a * a + b * b)))
    assert within_share([[1, 1], [5, 5]]) == 0.0  # the prompt says it all
    assert within_share([[1, 5], [5, 1]]) == 1.0  # nothing (capped at 1)
    assert within_share([[3], [7]]) is None and within_share([[2, 2], [2, 2]]) is None


def test_read_run_takes_the_pool_lengths_prompts_and_the_learner_rate(tmp_path: Path) -> None:
    p = read_run(_run_dir(tmp_path))
    want = sorted(n + i for n in BASES.values() for i in range(4))
    assert p.lengths.values == sorted(set(want)) and sum(p.lengths.counts) == 2 * len(want)
    assert p.lengths.max_new_tokens == 128 and p.prompts == 4 and p.groups_per_prompt == 2.0
    groups = [[n + i for i in range(4)] for _ in range(2) for n in BASES.values()]
    assert p.lengths.within == pytest.approx(within_share(groups))
    assert p.prompt_tokens == 10 and p.step_s == pytest.approx(STEP_S) and p.mode == "lockstep"
    fixed, rate = learner_rate(p)
    assert fixed == pytest.approx(0.25) and rate == pytest.approx(2000)
    w = workload(p, mode="stream")
    assert (w.mode, w.groups_per_step, w.n_samples, w.prompt_tokens, w.prompts) == ("stream", 2, 4, 10, 4)


def test_a_resumed_run_counts_only_the_steps_its_rl_time_covers(tmp_path: Path) -> None:
    d = _run_dir(tmp_path)
    (d / "summary.json").write_text(json.dumps({"steps": STEPS, "start_step": 3, "policy_version": STEPS, "rl_s": 0.5}))
    assert read_run(d).step_s == pytest.approx(0.5)  # one step trained after the checkpoint at step 3
    (d / "summary.json").unlink()  # killed: no summary; the last step's wall time over the steps
    assert read_run(d).step_s == pytest.approx(STEP_S)


def test_read_run_skips_a_half_written_line_and_imports_no_user_code(tmp_path: Path) -> None:
    d = _run_dir(tmp_path)
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train_s": 0.')  # killed mid-write
    text = (d / "recipe.yaml").read_text().replace("rewardkit:", "no_such_module_here:")
    assert "no_such_module_here:" in text
    (d / "recipe.yaml").write_text(text)
    assert read_run(d).steps == STEPS


def test_read_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunReadError, match="no recipe.yaml"):
        read_run(tmp_path)
    d = _run_dir(tmp_path)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "train_s": 1.0}) + "\n")
    with pytest.raises(RunReadError, match="1 learner step"):
        read_run(d)


def test_calibrated_cluster_reproduces_the_measured_step_time(tmp_path: Path) -> None:
    p = read_run(_run_dir(tmp_path))
    c, fitted = calibrated_cluster(p)
    assert simulate(c, workload(p))["wall_s"] / p.steps == pytest.approx(STEP_S, rel=0.01), fitted
    assert c.learner_step_overhead_s == pytest.approx(0.25) and c.learner_tokens_per_s_per_gpu == pytest.approx(2000)


def test_presets_scale_by_parameter_count_and_tensor_parallelism() -> None:
    d = Cluster()
    c7, tp7 = plan.preset("7.6b")
    assert tp7 == 1 and c7.decode_base_s == pytest.approx(d.decode_base_s) and c7.model_bytes == pytest.approx(15.2e9)
    c32, tp32 = plan.preset("32B")
    k = 32e9 / 7.6e9
    assert tp32 == 2 and c32.decode_base_s == pytest.approx(d.decode_base_s * k / 2)
    assert c32.learner_tokens_per_s_per_gpu == pytest.approx(d.learner_tokens_per_s_per_gpu / k)
    assert plan.preset("72b")[1] == 4 and plan.preset("400b")[1] == 8
    for bad in ("seven", "0b", "7"):
        with pytest.raises(plan.PlanError, match="--model-size"):
            plan.preset(bad)


def test_splits_give_each_side_at_least_one_and_never_repeat() -> None:
    assert plan.splits(64, 1) == [(16, 48), (21, 43), (32, 32)]
    assert plan.splits(8, 2) == [(2, 3), (3, 2), (4, 2)]
    assert plan.splits(2, 1) == [(1, 1)]
    with pytest.raises(plan.PlanError, match="too few"):
        plan.splits(2, 2)


def _row(mode: str, eta: int, tok: float, waste: float = 0.0, schedule: str = "fifo") -> dict:
    return {"mode": mode, "max_staleness": eta, "train_tokens_per_s": tok, "wasted_token_fraction": waste,
            "schedule": schedule, "partial_rollout": None if mode != "stream" else "abort_resume",
            "samples_per_s": tok / 10, "learner_gpus": 1, "engines": 1}


def test_recommend_takes_the_least_staleness_near_the_best() -> None:
    rows = [_row("lockstep", 0, 50), _row("lockstep", 0, 60, schedule="longest_first"), _row("one_step_off", 1, 80),
            _row("stream", 2, 96), _row("stream", 4, 100), _row("stream", 8, 101, waste=0.3)]
    assert plan.recommend(rows)["max_staleness"] == 2  # 96 is within 5% of 101
    assert plan.recommend(rows, tolerance=0.01)["max_staleness"] == 4  # 100: the least waste within 1%
    assert plan.baseline(rows)["train_tokens_per_s"] == 50  # lockstep with fifo prompts, not the schedule's
    # a schedule a little faster than fifo at the same bound is not worth the change; one that alone is near the best is
    tb = _row("stream", 2, 97, schedule="tail_batching")
    assert plan.recommend([*rows, tb])["schedule"] == "fifo"
    assert plan.recommend([r for r in rows if r["max_staleness"] != 2] + [tb])["schedule"] == "tail_batching"
    keys = plan.recipe_keys(plan.recommend(rows), Workload(groups_per_step=10, n_samples=4, workers=2))
    # up to max_staleness + 1 = 3 steps of 10 groups in flight, over 2 workers: 15 each
    assert keys == {"run.mode": "stream", "staleness.max_staleness": 2, "rollout.schedule": "fifo", "engines.num": 1,
                    "rollout.groups_per_step": 10, "rollout.n_samples": 4, "rollout.max_concurrency": 15,
                    "staleness.partial_rollout": "abort_resume"}


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl", "plan", *args], capture_output=True, text=True,
                          env=child_env(), timeout=300)


def test_plan_command_writes_json_and_png_and_calibrates(tmp_path: Path) -> None:
    d = _run_dir(tmp_path)
    other = _run_dir(tmp_path, "stream", "stream-run")
    res = _plan(str(d), "--gpus", "8", "--steps", "8", "--json", "--calibrate", str(other))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert Path(out["png"]).stat().st_size > 10_000 and json.loads(Path(out["json"]).read_text())["gpus"] == 8
    pick, lock = out["recommended"], out["lockstep"]
    assert pick in [{**r, "speedup_over_lockstep": pick["speedup_over_lockstep"],
                     "samples_speedup_over_lockstep": pick["samples_speedup_over_lockstep"]} for r in out["sweep"]]
    assert pick["speedup_over_lockstep"] == pytest.approx(pick["train_tokens_per_s"] / lock["train_tokens_per_s"])
    assert {(r["learner_gpus"], r["engines"]) for r in out["sweep"]} == set(plan.splits(8, 1))
    assert out["lengths"]["prompts"] == 4 and out["recipe_keys"]["run.mode"] == pick["mode"]
    cal = {r["mode"]: r for r in out["calibration"]["rows"]}
    assert cal["lockstep"]["step_error"] == pytest.approx(0, abs=0.01)  # fitted on it
    stream = cal["stream"]  # the other run measured the same step time: speedup 1
    assert stream["measured_speedup"] == pytest.approx(1.0)
    assert stream["predicted_speedup"] == pytest.approx(out["calibration"]["predicted_step_s"]["lockstep"]
                                                        / out["calibration"]["predicted_step_s"]["stream"])
    table = _plan(str(d), "--gpus", "4", "--steps", "6", "--model-size", "run", "--out", str(tmp_path / "p"))
    assert table.returncode == 0 and "recommended" in table.stdout and (tmp_path / "p" / "plan.png").is_file()


@pytest.mark.parametrize("where, args, says", [
    ("run", ["--gpus", "1"], "at least 2"),
    ("run", ["--gpus", "8", "--model-size", "huge"], "--model-size 'huge'"),
    ("run", ["--gpus", "8", "--groups-per-step", "0"], "--groups-per-step 0: at least 1"),
    (".", ["--gpus", "8"], "not a StreamRL run directory"),
])
def test_plan_command_refuses_bad_arguments_with_code_2(tmp_path: Path, where: str, args: list[str], says: str) -> None:
    _run_dir(tmp_path)
    res = _plan(str(tmp_path / where), *args)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "run" / "plan").exists()  # nothing written


def test_the_sweep_gives_the_same_rows_in_one_process_or_several(tmp_path: Path) -> None:
    p = read_run(_run_dir(tmp_path))
    base = plan.plan_workload(p, 6, None, None)
    make, tp, _ = plan.cluster_maker(p, "7b")
    one = plan.sweep(base, make, 4, tp)
    assert plan.sweep(base, make, 4, tp, processes=2) == one
    assert len(one) == plan.sweep_size(4, tp) and all(r["staleness_max"] <= r["max_staleness"] for r in one)
