"""`streamrl replay`: re-training past steps from the pool reproduces the run's losses and grad
norms exactly on CPU, from a checkpoint and from the run's starting weights (SFT policy, with a
KL reference built from it); `--where` re-trains a SQL-selected set of groups. The same run has
background evaluations pinned to versions, and `streamrl report` draws it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamkit import (pool_groups, read_jsonl, read_metrics, run_recipe, run_streamrl, task_data, tiny_model,
                       write_recipe)

pytestmark = pytest.mark.slow
__all__ = ["task_data", "tiny_model"]  # fixtures

STEPS = 7


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, task_data: dict[str, Path]) -> Path:
    tmp = tmp_path_factory.mktemp("replay")
    recipe = write_recipe(tmp, tiny_model, task_data["train"], {
        "run.steps": STEPS, "run.checkpoint_every": 3, "run.keep_checkpoints": 0,
        "sft.path": str(task_data["sft"]), "sft.steps": 4, "sft.batch_size": 1, "sft.lr": 1.0e-3,
        "learner.kl_coef": 0.05, "rollout.groups_per_step": 3,
        "run.eval_every": 2, "data.eval_path": str(task_data["eval"]), "data.eval_size": 8, "data.eval_samples": 2})
    d = tmp / "run"
    run_recipe(recipe, d, ["--quiet"])
    return d


def _replay(run_dir: Path, *args: str) -> list[dict]:
    res = run_streamrl(["replay", str(run_dir), *args, "--json"], run_dir=None)
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_replay_reproduces_losses_exactly(run_dir: Path) -> None:
    logged = {m["step"]: m for m in read_metrics(run_dir)}
    assert sorted(logged) == list(range(STEPS))
    # Steps 4-6: from the checkpoint saved after step 2 (or after step 3: in stream mode the next
    # step may train while the checkpoint is being asked for; its meta.json says which).
    rows = _replay(run_dir, "--steps", "4-6")
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert {r["start_version"] for r in rows} <= {3, 4} and rows[0]["start_version"] > 0
    for r in rows:
        assert r["loss"] == logged[r["step"]]["loss"], r
        assert r["grad_norm"] == logged[r["step"]]["grad_norm"], r
        assert r["identical"] is True
    # Steps 0-1: no checkpoint before them: from the SFT policy the run started RL with.
    rows = _replay(run_dir, "--steps", "0-1")
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(logged[s]["loss"], logged[s]["grad_norm"]) for s in (0, 1)]
    assert any(logged[s]["kl"] != 0 for s in range(STEPS)), "the KL term must be in play for this test to mean much"


def test_replay_where_trains_selected_groups(run_dir: Path) -> None:
    groups = [g for g in pool_groups(run_dir) if g.status == "consumed" and g.consumed_step in (4, 5)]
    rows = _replay(run_dir, "--where", "consumed_step IN (4, 5)")
    assert sum(r["groups"] for r in rows) == len(groups) == 6
    assert [r["orig_steps"] for r in rows] == [[4], [5]]  # oldest first, 3 per batch: the steps' own batches
    logged = {m["step"]: m for m in read_metrics(run_dir)}
    # From the checkpoint before step 4 (version 3), batch 0 is not step 4 (step 3 is not re-trained),
    # but it is a real optimizer step on those groups: a finite loss and a non-zero grad norm.
    assert all(r["grad_norm"] > 0 for r in rows)
    assert rows[0]["reward_mean"] == pytest.approx(logged[4]["reward_mean"])


def test_replay_bad_input_exits_2(run_dir: Path) -> None:
    res = run_streamrl(["replay", str(run_dir), "--steps", "50-52"], check=False)
    assert res.returncode == 2 and "consumed no groups" in res.stderr and "0-6" in res.stderr
    res = run_streamrl(["replay", str(run_dir), "--where", "no_such_column = 1"], check=False)
    assert res.returncode == 2 and "reward_std" in res.stderr  # the error lists the columns
    res = run_streamrl(["replay", str(run_dir), "--where", "reward_std < 0"], check=False)
    assert res.returncode == 2 and "selects no group" in res.stderr


def test_background_eval_rows_are_pinned_to_versions(run_dir: Path) -> None:
    rows = read_jsonl(run_dir / "eval.jsonl")
    bg = [r for r in rows if r["mode"] == "background"]
    assert [r["policy_version"] for r in bg] == [2, 4, 6]
    for r in bg:
        # the eval engine served exactly that version for every response
        assert r["engine_versions"] == [str(r["policy_version"])] and not r.get("version_mismatch"), r
        assert r["finished_wall_s"] >= r["wall_time_s"] and 0 <= r["accuracy"] <= 1
    inline = [r["policy_version"] for r in rows if r["mode"] == "inline"]
    assert inline == [0, STEPS]  # before and after training, on the rollout engines
    # every row's clock is when its version was trained, not when the evaluation ran
    trained = {m["policy_version"]: m["wall_time_s"] for m in read_metrics(run_dir)}
    assert [r["wall_time_s"] for r in rows if r["policy_version"]] == [trained[r["policy_version"]]
                                                                       for r in rows if r["policy_version"]]
    assert not list((run_dir / "weights").glob("eval-*")), "evaluated exports are deleted"


def test_report_draws_the_run(run_dir: Path) -> None:
    res = run_streamrl(["report", str(run_dir), "--json"])
    s = json.loads(res.stdout)
    assert s["steps"] == STEPS and s["ledger"]["balanced"] and s["ledger"]["lost"] == 0
    assert s["eval_last"]["policy_version"] == STEPS
    names = sorted(Path(f).name for f in s["files"])
    assert names == ["drops.png", "learner.png", "reward.png", "staleness.png", "throughput.png"]
    for f in s["files"]:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(f).stat().st_size > 10_000
