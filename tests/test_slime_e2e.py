"""slime users' functions, unchanged, in short real runs (Ray, router, engines, megatron learner,
LanceDB): a per-sample reward with --reward-key, a --group-rm reward and slime's DAPO dynamic
sampling filter (tests/slimekit.py); and a filter that raises on every group stops the run with
its error instead of training on nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit import (
    assert_ledger_balanced,
    check_step_metrics,
    pool_rows,
    read_metrics,
    run_recipe,
    task_data,  # noqa: F401 - fixtures
    tiny_model,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS = 3


def test_slime_reward_and_filter_run_unchanged(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path]) -> None:
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": STEPS,
        "reward": {"fn": "slimekit:reward_func", "style": "slime", "args": {"reward_key": "score"}},
        "filters": [{"fn": "slimekit:check_reward_nonzero_std", "style": "slime", "args": {"reward_key": "score"}}]})
    run_dir = tmp_path / "run"
    run_recipe(recipe, run_dir)
    check_step_metrics(read_metrics(run_dir), STEPS)
    stats = assert_ledger_balanced(run_dir)
    assert stats["groups_by_status"].get("consumed", 0) >= STEPS * 2
    rows = pool_rows(run_dir, ["status", "failed", "error", "reward", "rewards_json", "drop_reason"])
    done = [r for r in rows if r["status"] == "consumed"]
    assert done and all(not r["failed"] and r["reward"] is not None for r in done), done[:3]
    assert all('"response_length"' in r["rewards_json"] and "pred" not in r["rewards_json"] for r in done), done[0]
    drops = {r["drop_reason"] for r in rows if r["status"] == "dropped"}
    assert all(d.startswith("zero_std_") for d in drops), drops


def test_slime_group_reward_runs(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path]) -> None:
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": 2, "run.mode": "lockstep",
        "reward": {"fn": "slimekit:group_reward", "style": "slime", "args": {"group_rm": True}}})
    run_dir = tmp_path / "run"
    run_recipe(recipe, run_dir)
    stats = assert_ledger_balanced(run_dir)
    assert stats["groups_by_status"].get("consumed", 0) >= 4
    rows = pool_rows(run_dir, ["status", "failed", "reward"])
    assert all(not r["failed"] and r["reward"] is not None for r in rows if r["status"] == "consumed")


def test_a_filter_that_always_raises_stops_the_run(tmp_path: Path, tiny_model: Path,
                                                  task_data: dict[str, Path]) -> None:
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": STEPS, "filters": [{"fn": "slimekit:broken_filter", "style": "slime"}]})
    run_dir = tmp_path / "run"
    res = run_recipe(recipe, run_dir, check=False)
    assert res.returncode != 0, res.stderr[-2000:]
    assert "groups all failed" in res.stderr and "filter broken_filter: AttributeError" in res.stderr, \
        res.stderr[-3000:]
    assert "no_such_field" in res.stderr
