"""Agent environments in real runs (Ray, router, engines, megatron learner, LanceDB): the
openai-only calculator agent trained in stream mode, the native calculator environment in
lockstep and one-step-off, each with a different partial-rollout policy. The pool must hold the
exact conversations: model tokens trained (mask 1, real log-probs), tool tokens masked (0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit import (
    assert_ledger_balanced,
    check_step_metrics,
    pool_groups,
    read_jsonl,
    read_metrics,
    run_log,
    run_recipe,
    task_data,  # noqa: F401 - fixtures
    tiny_model,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS = 3


def _recipe(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path], mode: str, fn: str, policy: str) -> Path:
    return write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.mode": mode, "run.steps": STEPS, "env": {"fn": fn, "args": {"turns": 2}},
        "reward": None, "staleness.partial_rollout": policy, "rollout.max_new_tokens": 4})


# A lockstep case (policy restart) was dropped when CI neared 30 minutes: lockstep interrupts no episode, so
# it ran no path these two do not (lockstep itself: tests/test_stream_e2e.py).
@pytest.mark.parametrize("mode, fn, policy", [
    ("stream", "streamrl.recipes.envs.calculator:solve_openai", "in_place"),
    ("one_step_off", "streamrl.recipes.envs.calculator:solve", "abort_resume"),
])
def test_env_runs_store_exact_conversations(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path],
                                            mode: str, fn: str, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    run_recipe(_recipe(tmp_path, tiny_model, task_data, mode, fn, policy), run_dir)
    check_step_metrics(read_metrics(run_dir), STEPS)
    if policy == "in_place":  # distributed sync mid-generation: SGLang's session and flush_cache rules held
        log = run_log(run_dir)
        assert "using disk" not in log and "did not take version" not in log, log[-3000:]
    stats = assert_ledger_balanced(run_dir)
    assert stats["groups_by_status"].get("consumed", 0) >= STEPS * 2
    tok = AutoTokenizer.from_pretrained(tiny_model)
    groups = pool_groups(run_dir, "status = 'consumed'")
    chat = fn.endswith("openai")
    for g in groups:
        first = tok.decode(g.prompt_tokens, skip_special_tokens=False)
        assert first.endswith("<|im_start|>assistant\n" if chat else "="), first
        for s in g.samples:
            assert not s.failed, s.error
            masked = tok.decode(s.response_tokens[s.loss_mask == 0].tolist(), skip_special_tokens=False)
            trained = s.response_tokens[s.loss_mask == 1]
            # one tool observation "<total>+<d>=" between the two model turns, never trained
            assert masked.count("+") == 1 and masked.endswith("<|im_start|>assistant\n" if chat else "="), masked
            if chat:
                assert "<|im_start|>tool\n" in masked
            assert len(trained) >= 2 and (s.rollout_logprobs[s.loss_mask == 1] < 0).all()
            assert (s.rollout_logprobs[s.loss_mask == 0] == 0).all()
            assert s.metadata["turns"] == 2 and 0.0 <= s.reward <= 1.0 and "right_turns" in s.rewards
            assert s.spans[0].start == 0 and s.spans[-1].end == s.num_tokens
    metrics = read_metrics(run_dir)
    assert all(m["loss"] is not None for m in metrics)
    from streamrl.tools.cli import main

    capsys.readouterr()
    assert main(["pool", "show", str(run_dir), groups[0].group_id]) == 0
    shown = capsys.readouterr().out
    assert "masked=" in shown and "[[" in shown, shown  # the tool's tokens are marked as not trained


def test_a_function_calling_agent_is_trained_and_evaluated_on_its_task(tmp_path: Path) -> None:
    """recipes/tool_agent.yaml in small: SFT on the tool-call format, then the openai SDK's tools= loop
    (streaming) in stream mode; the pool holds the parsed calls' exact tokens, the tool results
    masked, and held-out accuracy is the agent's task reward before and after."""
    from transformers import AutoTokenizer

    from streamrl.plugins.tool_tasks import write_tool_task

    data = write_tool_task(tmp_path / "data", n_train=64, n_eval=4, n_sft=512)
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, tmp_path / "model", data["train"], {
        "run.steps": 2, "reward": None, "rollout.max_new_tokens": 64, "learner.lr": 6.0e-4,
        "env": {"fn": "streamrl.recipes.envs.calculator:solve_tools", "args": {"stream": True}},
        "data.eval_path": str(data["eval"]), "data.eval_size": 4, "data.eval_samples": 1,
        "sft": {"path": str(data["sft"]), "steps": 120, "lr": 5.0e-3, "batch_size": 32}})
    run_recipe(recipe, run_dir)
    check_step_metrics(read_metrics(run_dir), 2)
    assert_ledger_balanced(run_dir)
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, 2] and all(0 <= e["accuracy"] <= 1 for e in evals)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    calls = 0
    for g in pool_groups(run_dir, "status = 'consumed'"):
        prompt = tok.decode(g.prompt_tokens, skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>system\n<tools>\ncalculator(expression)\n</tools>"), prompt
        assert prompt.endswith("<|im_start|>assistant\n"), prompt
        for s in g.samples:
            assert not s.failed, s.error
            assert s.reward in (0.0, 1.0) and "answered" in s.rewards
            assert (s.rollout_logprobs[s.loss_mask == 1] < 0).all() and (s.rollout_logprobs[s.loss_mask == 0] == 0).all()
            if s.metadata["tool_calls"]:
                calls += 1
                trained = tok.decode(s.response_tokens[s.loss_mask == 1].tolist(), skip_special_tokens=False)
                masked = tok.decode(s.response_tokens[s.loss_mask == 0].tolist(), skip_special_tokens=False)
                assert trained.startswith('<tool_call>\n{"name": "calculator"'), trained
                assert "<|im_start|>tool\n" in masked and masked.endswith("<|im_start|>assistant\n"), masked
    assert calls > 0, "no sample called the tool after SFT on the tool-call format"
