"""Background evaluation pinned to a version (streamrl/runtime/background_eval.py), end to end: a real Ray
local cluster, a real embedded eval engine started as an EngineActor, two exports with different
weights evaluated as versions 3 and 5, a full queue, a failing evaluation, and the clean-up."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

PROMPT_TEXTS = [("397+8=", "405"), ("12+3=", "15"), ("640+9=", "649"), ("58+7=", "65")]
GREEDY_TOKENS = 6


def _perturbed(base: Path, out: Path, seed: int) -> Path:
    """The base model with Gaussian noise (half each tensor's std) on every weight, saved in HF
    format (safetensors + config, what the eval engine loads from the learner's export)."""
    import torch

    from enginekit import load_model

    model = load_model(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture
def ray_cluster():
    import ray

    from streamrl.connectors.sglang.launcher import ensure_ray

    ensure_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_background_eval_pins_each_version(tmp_path: Path, ray_cluster: None) -> None:
    from transformers import AutoTokenizer

    from streamrl.connectors.sglang.client import SGLangClient
    from streamrl.plugins.data import PromptRecord
    from streamrl.recipe import load_recipe
    from streamrl.runtime.background_eval import BackgroundEval
    from streamrl.runtime.rollout import encode_prompt
    from streamrl.runtime.runlog import RunLog, read_jsonl

    from enginekit import hf_greedy, load_model, make_model_dir, pid_alive
    from streamkit import write_recipe

    t_start = time.monotonic()
    base = make_model_dir(tmp_path / "base", seed=0)
    run_dir = tmp_path / "run"
    log = RunLog(run_dir, echo=False)
    w3 = _perturbed(base, run_dir / "weights" / "v000003", seed=3)
    w5 = _perturbed(base, run_dir / "weights" / "v000005", seed=5)
    w7 = _perturbed(base, run_dir / "weights" / "v000007", seed=7)
    recipe = load_recipe(write_recipe(tmp_path, base, tmp_path / "unused.jsonl", {
        "data.eval_samples": 2, "rollout.max_new_tokens": 5, "reward.fn": "streamrl.plugins.rewards:exact_match"}))
    tok = AutoTokenizer.from_pretrained(base)
    records = [PromptRecord(epoch=0, index=i, line=i + 1, prompt_id=f"e{i}", prompt=p, label=a,
                            record={"prompt": p, "label": a}) for i, (p, a) in enumerate(PROMPT_TEXTS)]
    prompt = encode_prompt(tok, PROMPT_TEXTS[0][0])
    # What each export generates greedily (transformers): they must differ, or the test proves nothing.
    ref = {v: hf_greedy(load_model(w), prompt, GREEDY_TOKENS) for v, w in ((3, w3), (5, w5))}
    assert ref[3] != ref[5]

    async def greedy(url: str) -> tuple[list[int], str]:
        async with SGLangClient(url) as c:
            r = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True},
                                 return_logprob=False)
            return r.output_ids, str(r.meta_info.weight_version)

    async def export_later(path: Path) -> str:  # an awaitable export, like the learner's ref
        await asyncio.sleep(0.05)
        return str(path)

    timings: dict[str, float] = {}

    async def scenario() -> None:
        bg = BackgroundEval(recipe, log, tok, records, str(base), backend="embedded",
                            engine_kwargs={"max_running": 16, "seed": 0}, log_dir=run_dir / "logs", max_pending=2)
        try:
            s = time.monotonic()
            await bg.start()
            timings["engine_start_s"] = time.monotonic() - s
            engine_pid = await bg._actor.pid.remote()
            assert engine_pid and pid_alive(engine_pid)
            assert os.sched_getscheduler(engine_pid) == os.SCHED_IDLE  # only CPU time training leaves idle

            outs = {}
            for v, w in ((3, w3), (5, w5)):
                s = time.monotonic()
                assert bg.submit(v, v - 1, str(w), wall_time_s=float(v))
                await bg.drain(120)
                timings[f"eval_v{v}_s"] = time.monotonic() - s
                assert not w.exists()  # a temporary export under RUN_DIR/weights/: deleted once evaluated
                outs[v] = await greedy(bg.url)  # the engine still holds version v
            assert outs[3] == (ref[3], "3") and outs[5] == (ref[5], "5")

            # A full queue never blocks: the oldest waiting evaluation is skipped, the newest kept.
            # Version 8's export does not exist: a warning, no row, and the next one still runs.
            # Version 9 is evaluated from a directory outside RUN_DIR/weights/: it is kept.
            assert bg.submit(7, 6, export_later(w7), wall_time_s=7.0)
            assert bg.submit(8, 7, str(run_dir / "weights" / "missing"), wall_time_s=8.0)
            assert bg.submit(9, 8, str(base), wall_time_s=9.0) is False
            assert bg.skipped == [7]
            await bg.drain(120)
            assert not w7.exists()  # the skipped export is deleted too
            assert (base / "config.json").exists()
            assert [r["policy_version"] for r in bg.rows] == [3, 5, 9]

            # Held (run.eval_mode: after): nothing is evaluated, and nothing skipped, until drain().
            bg.hold()
            for v in (10, 11, 12):  # one more than max_pending
                assert bg.submit(v, v - 1, str(base), wall_time_s=float(v))
            await asyncio.sleep(1.0)
            assert len(bg.rows) == 3 and bg.skipped == [7]
            await bg.drain(120)
            assert [r["policy_version"] for r in bg.rows] == [3, 5, 9, 10, 11, 12]
        finally:
            await bg.stop()
        assert not pid_alive(engine_pid)

    asyncio.run(scenario())

    rows = read_jsonl(run_dir / "eval.jsonl")
    assert [r["policy_version"] for r in rows] == [3, 5, 9, 10, 11, 12]
    assert [r["step"] for r in rows] == [2, 4, 8, 9, 10, 11]
    assert [r["wall_time_s"] for r in rows] == [3.0, 5.0, 9.0, 10.0, 11.0, 12.0]
    assert [r["mode"] for r in rows] == ["background"] * 3 + ["after"] * 3
    for r in rows:
        assert "version_mismatch" not in r
        assert r["engine_versions"] == [str(r["policy_version"])]
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["greedy_accuracy"] <= 1.0
        assert r["prompts"] == len(PROMPT_TEXTS) and r["samples_per_prompt"] == 2
        assert r["finished_wall_s"] > 0
    text = (run_dir / "run.log").read_text()
    assert "background evaluation of version 7 skipped" in text
    assert "background evaluation of version 8 failed" in text
    assert "background eval at version 5: accuracy" in text
    print(f"timings: {timings}, total {time.monotonic() - t_start:.1f}s")
