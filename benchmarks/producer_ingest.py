#!/usr/bin/env python
"""Producer API ingest: external producer processes submitting groups to `streamrl produce serve`.

Starts the service on a temporary run directory (a recipe whose admission capacity is never the
limit), runs --producers processes that each lease slots and submit synthetic groups through the
SDK (msgpack bodies) for --seconds, then checks the pool's ledger. Prints one JSON object on
stdout (progress on stderr); what each figure means is listed below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

from streamrl.core.types import Sample, SampleGroup, VersionSpan, make_group_id  # noqa: E402
from streamrl.pools import LancePool  # noqa: E402
from streamrl.producers.sdk import ProducerClient  # noqa: E402
from streamrl.producers.api_process import start_service_process, stop_service_process  # noqa: E402

from benchmarks._common import emit, gather, git_rev, log, machine  # noqa: E402

N_SAMPLES = 8  # responses per group
VOCAB = 151_936  # Qwen2 vocabulary: realistic token ids
LEASE_SLOTS = 16  # slots a producer asks for at a time

FIGURES = """
figures (wall-clock; synthetic group generation is outside the latency but inside the window):
  groups_per_s / samples_per_s / tokens_per_s   groups accepted (stored) by the service per second,
                     all producers together, and their samples and response tokens
  p50_ms / p99_ms    latency of one ProducerClient.submit call (request sent -> group committed to
                     the pool -> answer received); each producer has one submission in flight
  lease_calls        POST /v1/leases calls (each for up to 16 slots)
  accepted / duplicates / rejected   the service's counters (/v1/status): stored groups, retries
                     answered as duplicates (--dup-every), refused submissions of any kind
  ledger             pool.ledger() after the service stopped: balanced, and admitted == accepted
  group shape        8 samples, responses of 24-40 tokens, prompts of 48-80 tokens, int32 ids,
                     float32 log-probs, uint8 masks, one version span each
  machine            loadavg_1m_at_start: other jobs running on the box make every figure noisy
"""


def make_run(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": 4096}))
    recipe = {"run": {"name": "ingest", "dir": "run", "mode": "stream"}, "model": {"path": "model"},
              "data": {"path": "unused.jsonl"},
              # capacity (0+1+1)*10**7: leases are never the limit
              "rollout": {"workers": 0, "n_samples": N_SAMPLES, "groups_per_step": 10**7},
              "staleness": {"max_staleness": 1}, "producer_api": {"enabled": True}}
    (root / "run").mkdir()
    (root / "run" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root / "run"


def synthetic_group(producer_id: str, i: int, rng: np.random.Generator) -> Any:
    samples = []
    for k in range(N_SAMPLES):
        n = int(rng.integers(24, 41))
        samples.append(Sample(index=k, response_tokens=rng.integers(0, VOCAB, n, dtype=np.int32),
                              rollout_logprobs=-rng.standard_exponential(n, dtype=np.float32),
                              loss_mask=np.ones(n, np.uint8), spans=[VersionSpan(0, 0, n)],
                              reward=float(rng.integers(0, 2)), finish_reason="stop"))
    prompt = rng.integers(0, VOCAB, int(rng.integers(48, 81)), dtype=np.int32)
    return SampleGroup(group_id=make_group_id(producer_id, 0, i), prompt_id=f"p{i}", prompt_tokens=prompt,
                       samples=samples)


def producer(run_dir: str, index: int, seconds: float, dup_every: int, ready: Any, start: Any, out: Any) -> None:
    """One producer process: lease, generate, submit until the window closes."""
    async def go() -> dict[str, Any]:
        pid = f"bench-{index}"
        rng = np.random.default_rng(index)
        lat: list[float] = []
        stats = {"stored": 0, "duplicate": 0, "tokens": 0, "lease_calls": 0}
        async with ProducerClient.from_run_dir(run_dir, pid) as client:
            await client.status()  # connection up before the clock starts
            ready.put(index)
            start.wait()
            deadline, lease, i = time.perf_counter() + seconds, None, 0
            while time.perf_counter() < deadline:
                if lease is None or lease.used >= lease.slots:
                    lease = await client.lease(LEASE_SLOTS)
                    stats["lease_calls"] += 1
                g = synthetic_group(pid, i, rng)
                t0 = time.perf_counter()
                res = await client.submit(g, lease)
                lat.append(time.perf_counter() - t0)
                stats["stored" if res["stored"] else "duplicate"] += 1
                stats["tokens"] += sum(s.num_tokens for s in g.samples) if res["stored"] else 0
                if dup_every and i % dup_every == 0:  # a retry of a group already stored
                    t0 = time.perf_counter()
                    assert (await client.submit(g, lease))["duplicate"]
                    lat.append(time.perf_counter() - t0)
                    stats["duplicate"] += 1
                i += 1
        return {**stats, "lat": lat}

    out.put(asyncio.run(go()))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog=FIGURES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20, help="length of the submission window (default 20)")
    ap.add_argument("--producers", type=int, default=8, help="concurrent producer processes (default 8)")
    ap.add_argument("--dup-every", type=int, default=0,
                    help="each producer submits every Nth group twice (a retry); 0 = never (default)")
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench",
                    help="parent of the temporary run directory; the disk under test (default runs/bench)")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    return ap.parse_args()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = make_run(work)
    proc, url = start_service_process("run", work, work / "service.log")
    log(f"service at {url}; {args.producers} producers for {args.seconds:g}s")
    try:
        ctx = mp.get_context("spawn")
        ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
        # Daemons, gathered fail-fast: a producer's failure, or this process's, ends them all at once.
        procs = [ctx.Process(target=producer, args=(str(run_dir), k, args.seconds, args.dup_every, ready, start, out),
                             daemon=True) for k in range(args.producers)]
        for p in procs:
            p.start()
        gather(ready, procs, timeout=120)
        start.set()
        t0 = time.perf_counter()
        results = gather(out, procs, timeout=args.seconds + 120)
        window = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=60)
        status = get_status(url, (run_dir / "producer_token").read_text().strip())
    finally:
        stop_service_process(proc)
    with LancePool(run_dir / "pool", create=False) as pool:
        led = pool.ledger()
    lat = np.array([x for r in results for x in r["lat"]]) * 1000
    stored = sum(r["stored"] for r in results)
    return {
        "groups_per_s": round(stored / window, 1), "samples_per_s": round(stored * N_SAMPLES / window, 1),
        "tokens_per_s": round(sum(r["tokens"] for r in results) / window),
        "p50_ms": round(float(np.percentile(lat, 50)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "producers": args.producers, "duration_s": round(window, 2),
        "accepted": status["accepted"], "duplicates": status["duplicates"],
        "rejected": sum(status["refused"].values()), "lease_calls": sum(r["lease_calls"] for r in results),
        "ledger": {"balanced": led.balanced, "admitted": led.admitted, "complete": led.complete,
                   "duplicated": led.duplicated, "unadmitted": led.unadmitted,
                   "admitted_equals_accepted": led.admitted == status["accepted"] == stored},
    }


def get_status(url: str, token: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def main() -> None:
    args = parse_args()
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="producer_ingest-", dir=args.dir))
    try:
        r = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "producer_ingest", **r,
              "config": {"n_samples": N_SAMPLES, "response_tokens": [24, 40], "prompt_tokens": [48, 80],
                         "lease_slots": LEASE_SLOTS, "dup_every": args.dup_every, "body": "msgpack",
                         "dir": str(args.dir)},
              "git": git_rev(), "machine": machine(load0, ("aiohttp", "msgspec", "lancedb")),
              "wall_s": round(time.perf_counter() - wall0, 1)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
