"""An external producer: a separate process runs the calculator environment
(recipes/envs/calculator.py) against a live run's engines and streams its groups into the run's
pool through the producer API (streamrl/producers/sdk.py), under the run's staleness leases.

    streamrl run recipes/external_producers.yaml                      # terminal 1 (rollout.workers: 0)
    python -m streamrl.recipes.external_producer runs/external_producers --producer-id calc-a   # terminal 2
    python -m streamrl.recipes.external_producer runs/external_producers --producer-id calc-b   # more of them

Prompts are taken in a fixed order (the run's data.path unless --data), so group ids are
deterministic: a producer killed at any moment and started again skips what the pool already
holds and submits the rest once. It exits when the run's service goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp

from streamrl.connectors.auth import Keys
from streamrl.connectors.sglang.client import SGLangClient
from streamrl.core.types import SampleGroup, make_group_id
from streamrl.plugins.data import PromptSource
from streamrl.producers.episode import Episode, to_samples
from streamrl.producers.sdk import ProducerClient, ProducerError
from streamrl.recipe import load_recipe
from streamrl.recipes.envs.calculator import solve


async def produce(run_dir: Path, producer_id: str, data: str | None, turns: int, concurrency: int,
                  limit: int | None, timeout_s: float = 60) -> dict[str, int]:
    from transformers import AutoConfig, AutoTokenizer

    r = load_recipe(run_dir / "recipe.yaml")
    tok = AutoTokenizer.from_pretrained(r.model.tokenizer or r.model.path)
    max_context = AutoConfig.from_pretrained(r.model.path).max_position_embeddings
    client = ProducerClient.from_run_dir(run_dir, producer_id, timeout_s=timeout_s)
    st = await client.status()
    source = PromptSource(data or r.data.path, r.data.prompt_key, r.data.label_key, shuffle=False)
    sampling = {"temperature": r.rollout.temperature, "top_p": r.rollout.top_p, "top_k": r.rollout.top_k}
    counts = {"stored": 0, "skipped": 0, "refused": 0}
    gate = asyncio.Semaphore(concurrency)

    async def one(rec: Any, engines: SGLangClient) -> None:
        async with gate:
            gid = make_group_id(producer_id, rec.epoch, rec.index)
            if await client.stored(gid):
                counts["skipped"] += 1
                return
            lease = await client.lease(1)
            eps = [Episode(engines, tok, sampling=sampling, max_new_tokens=r.rollout.max_new_tokens,
                           max_context=max_context, policy=r.staleness.partial_rollout) for _ in range(st["n_samples"])]
            task = {"prompt": rec.prompt, "label": rec.label, "id": rec.prompt_id, "record": rec.record}
            outs = await asyncio.gather(*(solve({**task, "sample": i}, ep, turns) for i, ep in enumerate(eps)),
                                        return_exceptions=True)
            prompt, samples = to_samples(eps)
            for s, out in zip(samples, outs):
                if isinstance(out, BaseException):
                    s.failed, s.error = True, f"{type(out).__name__}: {out}"
                elif not s.failed:
                    s.reward, s.rewards = out["reward"], {"right_turns": out["right_turns"]}
            group = SampleGroup(group_id=gid, prompt_id=rec.prompt_id, prompt_tokens=prompt, samples=samples,
                                producer_id=producer_id, metadata={"label": rec.label})
            try:
                await client.submit(group, lease)
                counts["stored"] += 1
            except ProducerError as e:
                if e.status == 0:  # unreachable: the run is over (or its service died)
                    raise
                counts["refused"] += 1
                print(f"{producer_id}: {gid} refused: {e}", file=sys.stderr)

    recs = []
    while (rec := source.next()) is not None and (limit is None or len(recs) < limit):
        recs.append(rec)
    try:
        async with SGLangClient(st["router_url"], connect_retries=2, keys=Keys(api=st["router_api_key"])) as engines:
            await asyncio.gather(*(one(rec, engines) for rec in recs))
    except (aiohttp.ClientError, OSError, ProducerError) as e:
        if isinstance(e, ProducerError) and e.status != 0:  # 0: the service could not be reached
            raise
        print(f"{producer_id}: the run's service or engines went away ({e}); stopping", file=sys.stderr)
    finally:
        await client.close()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--producer-id", default="calc", help="names this producer; its group ids start with it")
    p.add_argument("--data", help="prompts (default: the run's data.path)")
    p.add_argument("--turns", type=int, default=3, help="additions per episode")
    p.add_argument("--concurrency", type=int, default=16, help="groups generated at once")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--timeout", type=float, default=60, help="seconds to keep retrying an unreachable service")
    a = p.parse_args()
    print(asyncio.run(produce(a.run_dir, a.producer_id, a.data, a.turns, a.concurrency, a.limit, a.timeout)), flush=True)


if __name__ == "__main__":
    main()
