"""Held-out evaluation through the engines, at the version they serve.

Accuracy is the mean reward of `k` sampled responses per prompt at the rollout temperature
(pass@1 averaged over k, the figure RL moves first), reported with the greedy accuracy; with a
0/1 reward such as exact match both are fractions of correct answers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streamrl.connectors.sglang_client import SGLangClient
from streamrl.plugins.data import PromptRecord
from streamrl.plugins.rewards import RewardHub
from streamrl.recipe import Recipe
from streamrl.runtime.rollout import decode_response, encode_prompt


def eval_due(run: Any, version: int) -> bool:
    """Whether `version` gets a periodic evaluation (`run.eval_every`; the last version is
    evaluated at the end of the run anyway). One rule for the runtime and the learner, which
    keeps that version's weights when the evaluation runs in the background."""
    return bool(run.eval_every) and version % run.eval_every == 0 and 0 < version < run.steps


async def evaluate(client: SGLangClient, tokenizer: Any, records: list[PromptRecord], recipe: Recipe,
                   concurrency: int = 64) -> dict[str, Any]:
    ro, k = recipe.rollout, recipe.data.eval_samples
    hub = RewardHub(recipe.reward.fn, recipe.reward.args)
    sem = asyncio.Semaphore(concurrency)
    versions: set[str] = set()

    async def one(rec: PromptRecord) -> tuple[float, float]:
        ids = encode_prompt(tokenizer, rec.prompt)
        async with sem:
            sampled = await asyncio.gather(*(client.generate(ids, {
                "temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k,
                "max_new_tokens": ro.max_new_tokens}, return_logprob=False) for _ in range(k)))
            greedy = await client.generate(ids, {"temperature": 0.0, "max_new_tokens": ro.max_new_tokens},
                                           return_logprob=False)
        for res in (*sampled, greedy):
            versions.add(str(res.meta_info.weight_version))
        texts = [decode_response(tokenizer, r.output_ids) for r in (*sampled, greedy)]
        scores = await hub.score(rec.prompt, rec.label, texts, rec.record)
        vals = [s.reward or 0.0 for s in scores]
        return sum(vals[:-1]) / k, vals[-1]

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(r) for r in records))
    n = max(1, len(res))
    return {"accuracy": sum(a for a, _ in res) / n, "greedy_accuracy": sum(g for _, g in res) / n,
            "prompts": len(res), "samples_per_prompt": k, "engine_versions": sorted(versions),
            "eval_s": time.perf_counter() - t0}
