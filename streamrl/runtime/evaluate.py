"""Held-out evaluation through the engines, at the version they serve.

Accuracy is the mean reward of `k` sampled responses per prompt at the rollout temperature
(pass@1 averaged over k, the figure RL moves first), reported with the greedy accuracy; with a
0/1 reward such as exact match both are fractions of correct answers. A recipe with an `env`
(agent environments) is evaluated on its task: the environment runs on each held-out prompt and
its reward is the score.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streamrl.connectors.sglang.client import SGLangClient
from streamrl.core.evalstats import accuracy_report
from streamrl.plugins.data import PromptRecord
from streamrl.plugins.rewards import RewardHub, Scored
from streamrl.plugins.slime import reward_hub
from streamrl.producers import episode as agent
from streamrl.producers.generate_proxy import SlimeGenerateHub
from streamrl.producers.openai_proxy import OpenAIProxy
from streamrl.recipe import Recipe
from streamrl.runtime.rollout import decode_response, encode_prompt, env_hub


def eval_due(run: Any, version: int) -> bool:
    """Whether `version` gets a periodic evaluation (`run.eval_every`; the last version is
    evaluated at the end of the run anyway). One rule for the runtime and the learner, which
    keeps that version's weights when the evaluation runs in the background."""
    return bool(run.eval_every) and version % run.eval_every == 0 and 0 < version < run.steps


async def evaluate(client: SGLangClient, tokenizer: Any, records: list[PromptRecord], recipe: Recipe,
                   concurrency: int = 64) -> dict[str, Any]:
    ro, k = recipe.rollout, recipe.data.eval_samples
    hub = reward_hub(recipe, getattr(client, "base_url", None), tokenizer)
    sem = asyncio.Semaphore(concurrency)
    versions: set[str] = set()
    if recipe.env is not None:
        return await _evaluate_env(client, tokenizer, records, recipe, hub, sem)

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
        vals = [metric_value(s, recipe.data.eval_metric) for s in scores]
        return sum(vals[:-1]) / k, vals[-1]

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(r) for r in records))
    return _result(res, k, versions, t0)


def _result(res: list[tuple[float, float]], k: int, versions: set[str], t0: float) -> dict[str, Any]:
    """An evaluation's row from its per-prompt (sampled mean, greedy) scores."""
    return {**accuracy_report([a for a, _ in res], [g for _, g in res]), "prompts": len(res),
            "samples_per_prompt": k, "engine_versions": sorted(versions), "eval_s": time.perf_counter() - t0}


def metric_value(s: Scored, metric: str) -> float:
    """An evaluated response's score: its reward or the component `data.eval_metric` names (a failed
    score counts 0)."""
    if s.reward is None:
        return 0.0
    if metric == "reward":
        return s.reward
    if metric not in s.components:
        raise ValueError(f"data.eval_metric: the reward function returned no component {metric!r} "
                         f"(it returned {sorted(s.components) or 'none'}); name one of them or 'reward'")
    return float(s.components[metric])


async def _evaluate_env(client: SGLangClient, tokenizer: Any, records: list[PromptRecord], recipe: Recipe,
                        hub: RewardHub, sem: asyncio.Semaphore) -> dict[str, Any]:
    """With a recipe `env`, the task is the environment's: each held-out prompt runs `k` sampled
    episodes and a greedy one (agents reach them through an OpenAI proxy, as in training); the
    accuracy is their mean reward (a failed episode scores 0)."""
    ro, k = recipe.rollout, recipe.data.eval_samples
    env = env_hub(recipe, getattr(client, "base_url", None), tokenizer, evaluation=True)
    max_context = agent.context_length(recipe.model.path)
    sampled = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}
    versions: set[str] = set()
    proxy = OpenAIProxy()
    await proxy.start()
    if isinstance(env, SlimeGenerateHub):
        await env.start()

    async def group(rec: PromptRecord, n: int, sampling: dict[str, Any]) -> list[float]:
        eps = [agent.Episode(client, tokenizer, sampling=sampling, max_new_tokens=ro.max_new_tokens,
                             max_context=max_context, policy=recipe.staleness.partial_rollout) for _ in range(n)]
        task = {"prompt": rec.prompt, "label": rec.label, "id": rec.prompt_id, "record": rec.record}
        _, samples = await agent.play_group(env, proxy, eps, task, hub,
                                            {**rec.record, "prompt": rec.prompt, "label": rec.label})
        versions.update(str(v) for ep in eps for v in ep.versions if v >= 0)
        return [0.0 if s.failed else metric_value(Scored(s.reward, s.rewards, s.error), recipe.data.eval_metric)
                for s in samples]

    async def one(rec: PromptRecord) -> tuple[float, float]:
        async with sem:
            many, greedy = await asyncio.gather(group(rec, k, sampled), group(rec, 1, {"temperature": 0.0}))
        return sum(many) / k, greedy[0]

    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(one(r) for r in records))
    finally:
        await proxy.close()
        if isinstance(env, SlimeGenerateHub):
            await env.close()
    return _result(res, k, versions, t0)
