"""slime users' functions, unchanged, in short real runs (Ray, router, engines, megatron learner,
LanceDB): a per-sample reward with --reward-key, a --group-rm reward and slime's DAPO dynamic
sampling filter (tests/slimekit.py); and a filter that raises on every group stops the run with
its error instead of training on nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit import (
    Runs,
    assert_ledger_balanced,
    check_step_metrics,
    pool_rows,
    read_jsonl,
    read_metrics,
    run_recipe,
    task_data,  # noqa: F401 - fixtures
    tiny_model,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS = 3


# Two runs carry four of the tests (a run costs 45-60 s of CI, nearly all start-up), each with a slime custom
# generate: one with the per-sample reward (--reward-key) and the DAPO filter, one with the --group-rm reward.
# eta 1: the next groups generate while the learner trains, so updates interrupt them.
GENERATE_STEPS = 6
RUNS = {fn: {"run.steps": GENERATE_STEPS, "rollout.max_new_tokens": 48, "staleness.max_staleness": 1,
             "engines.keep_weights": 0, "env": {"fn": f"slimekit:{fn}", "style": "slime"},
             "data.eval_size": 2, "data.eval_samples": 2, "run.eval_mode": "inline", **run}
        for fn, run in (
            ("generate", {"reward": {"fn": "slimekit:reward_func", "style": "slime", "args": {"reward_key": "score"}},
                          "filters": [{"fn": "slimekit:check_reward_nonzero_std", "style": "slime",
                                       "args": {"reward_key": "score"}}]}),
            # a group reward is given whole groups: the held-out ones too (data.eval_samples = rollout.n_samples)
            ("generate_text", {"reward": {"fn": "slimekit:group_reward", "style": "slime", "args": {"group_rm": True}},
                               "data.eval_samples": 4}))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, task_data: dict[str, Path]) -> Runs:  # noqa: F811
    return Runs(tmp_path_factory.mktemp("slime-runs"), tiny_model, task_data["train"],
                {fn: {**ov, "data.eval_path": str(task_data["eval"])} for fn, ov in RUNS.items()})


def test_slime_reward_and_filter_run_unchanged(runs: Runs) -> None:
    run_dir = runs.get("generate").dir
    stats = assert_ledger_balanced(run_dir)
    rows = pool_rows(run_dir, ["status", "failed", "error", "reward", "rewards_json", "drop_reason"])
    done = [r for r in rows if r["status"] == "consumed"]
    assert done and all(not r["failed"] and r["reward"] is not None for r in done), done[:3]
    assert all('"response_length"' in r["rewards_json"] and "pred" not in r["rewards_json"] for r in done), done[0]
    drops = {r["drop_reason"] for r in rows if r["status"] == "dropped"}
    assert all(d.startswith("zero_std_") or d == "stale" for d in drops), drops  # eta 1 may drop a late group
    assert stats["groups_by_status"].get("consumed", 0) >= GENERATE_STEPS * 2


def test_slime_group_reward_runs(runs: Runs) -> None:
    run_dir = runs.get("generate_text").dir
    stats = assert_ledger_balanced(run_dir)
    assert stats["groups_by_status"].get("consumed", 0) >= GENERATE_STEPS * 2
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


@pytest.mark.parametrize("fn", ["generate", "generate_text"])
def test_slime_custom_generate_keeps_versions_exact(runs: Runs, tiny_model: Path, fn: str) -> None:  # noqa: F811
    """slime's custom generate POSTs /generate to the address in its args (a StreamRL proxy),
    with input_ids or (generate_text) the whole text each turn: the stored samples are the exact
    tokens, log-probs and versions of those calls, the tool text between its two calls is masked,
    and a call a version update interrupted carries two versions, each span's log-probs its own
    version's."""
    import numpy as np
    from transformers import AutoTokenizer

    import slimekit
    from streamkit import LogprobOracle, pool_groups, resumed_samples

    steps, run_dir = GENERATE_STEPS, runs.get(fn).dir
    check_step_metrics(read_metrics(run_dir), steps)
    stats = assert_ledger_balanced(run_dir)
    assert stats["groups_by_status"].get("consumed", 0) >= steps * 2
    evals = read_jsonl(run_dir / "eval.jsonl")  # the held-out evaluation ran the generate too
    assert len(evals) >= 2 and all(0.0 <= e["accuracy"] <= 1.0 for e in evals), evals
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tool = tok(slimekit.TOOL_TEXT, add_special_tokens=False)["input_ids"]
    groups = pool_groups(run_dir, "status = 'consumed'")
    for g in groups:
        for s in g.samples:
            assert not s.failed, s.error
            assert s.spans[0].start == 0 and s.spans[-1].end == s.num_tokens
            masked = s.response_tokens[s.loss_mask == 0].tolist()
            assert masked == tool, (masked, tool)
            assert (s.rollout_logprobs[s.loss_mask == 1] < 0).all() and (s.rollout_logprobs[s.loss_mask == 0] == 0).all()
    resumed = resumed_samples(groups)
    assert resumed, "no sample spans two versions: no generate call was interrupted by an update"
    oracle = LogprobOracle(run_dir, tiny_model, 1.0)
    prev_max = 0.0  # the previous version's log-probs of later spans: far off, or the check is vacuous
    for g, s in resumed[:4]:
        for k, sp in enumerate(s.spans):
            head = s.response_tokens[:sp.end]
            mask = s.loss_mask[sp.start:sp.end] == 1
            got = s.rollout_logprobs[sp.start:sp.end][mask]
            want = oracle.logprobs(sp.version, g.prompt_tokens, head)[sp.start:sp.end][mask]
            assert np.abs(want - got).max(initial=0.0) < 1e-3, (g.group_id, s.index, sp)
            if k:
                prev = oracle.logprobs(s.spans[k - 1].version, g.prompt_tokens, head)[sp.start:sp.end][mask]
                prev_max = max(prev_max, float(np.abs(prev - got).max(initial=0.0)))
    assert prev_max > 1e-2, "versions are indistinguishable by log-prob; the check is vacuous"
