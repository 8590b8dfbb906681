#!/usr/bin/env python
"""The embedded engine on each device torch sees: the same requests on the CPU and on the GPU.

    python benchmarks/engine_devices.py --presets tiny small

For each model preset (connectors/megatron/model_kit, seed 0) and each device (cpu, and cuda when torch
sees a GPU), runs connectors.sglang.engine_core.EngineCore in this process, no HTTP:

  parity    --parity-requests greedy requests of --max-new-tokens tokens (ignore_eos) on every
            device; the other devices' tokens and log-probs are compared with the CPU's
  rate      output tokens/s at concurrency 1, 8 and 64: C sampled requests (temperature 1,
            seeded, ignore_eos, --max-new-tokens each) submitted at once, until every one is done,
            repeated --rounds times; the median round

figures (per preset, per device):
  parity.same_tokens         fraction of requests whose tokens equal the CPU's exactly
  parity.max_logprob_diff    largest |log-prob - CPU's| over the tokens before the first difference
  tokens_per_s.cC            output tokens / wall seconds of one round at concurrency C (median)

Prints one JSON object on stdout (progress on stderr). On a machine without a GPU it measures the
CPU alone, so it runs anywhere; the GPU figures are the point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

import torch  # noqa: E402

from streamrl.connectors.megatron.model_kit import init_model_dir  # noqa: E402
from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest  # noqa: E402

from benchmarks._common import emit, git_rev, log, machine  # noqa: E402

CONCURRENCY = (1, 8, 64)


def run_batch(core: EngineCore, loop: threading.Thread, prompts: list[list[int]],
              **sampling: Any) -> tuple[list[Any], float]:
    """Submit one request per prompt at once; wait for all; return them and the wall seconds.
    Raises at once if the engine's `loop` thread died (it would never finish them)."""
    done = threading.Semaphore(0)
    reqs = [GenRequest(rid=f"r{i}", input_ids=p, ignore_eos=True, on_done=lambda _: done.release(), **sampling)
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    core.submit_many(reqs)
    deadline = t + 600
    for _ in reqs:
        while not done.acquire(timeout=0.5):
            if not loop.is_alive():
                raise RuntimeError("the engine loop thread died (its traceback is on stderr)")
            if time.perf_counter() > deadline:
                raise TimeoutError("the engine did not finish a batch in 600 s")
    wall = time.perf_counter() - t
    if bad := [r.finish for r in reqs if (r.finish or {}).get("type") != "length"]:
        raise RuntimeError(f"requests ended early: {bad[:3]}")
    return reqs, wall


def measure(model_dir: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    core = EngineCore(model_dir, max_running=max(CONCURRENCY), device=device)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        prompts = [[5 + i, 17, 42 + i, 99, 7] for i in range(args.parity_requests)]
        greedy, _ = run_batch(core, thread, prompts, max_new_tokens=args.max_new_tokens, temperature=0.0)
        run_batch(core, thread, prompts[:8], max_new_tokens=8, temperature=1.0, sampling_seed=0)  # warm-up
        rate = {}
        for c in CONCURRENCY:
            walls, tokens = [], c * args.max_new_tokens
            for k in range(args.rounds):
                ps = [[3 + (i + k) % 200, 11, 23, 9] for i in range(c)]
                _, wall = run_batch(core, thread, ps, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                    sampling_seed=1000 * k)
                walls.append(wall)
            rate[f"c{c}"] = round(tokens / statistics.median(walls), 1)
            log(f"  {device}: concurrency {c}: {rate[f'c{c}']:.0f} tokens/s")
        return {"greedy": [(r.output_ids, r.logprobs) for r in greedy], "tokens_per_s": rate,
                "decode_steps": core.steps}
    finally:
        core.stop()
        thread.join(timeout=60)


def parity(ref: list[Any], got: list[Any]) -> dict[str, Any]:
    same, diff = 0, 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(ref, got):
        same += ids_a == ids_b
        for a, b, x, y in zip(ids_a, ids_b, lp_a, lp_b):
            if a != b:
                break
            diff = max(diff, abs(x - y))
    return {"same_tokens": round(same / len(ref), 3), "max_logprob_diff": float(f"{diff:.3g}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", choices=("tiny", "small"), default=["tiny", "small"])
    ap.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--parity-requests", type=int, default=16, help="greedy requests compared (default 16)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per concurrency, median taken (default 3)")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict[str, Any] = {"benchmark": "engine_devices", "devices": devices}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = init_model_dir(Path(tmp) / preset, preset, seed=0)
            log(f"{preset}: devices {devices}")
            runs = {d: measure(model_dir, d, args) for d in devices}
            out[preset] = {d: {"tokens_per_s": r["tokens_per_s"], "parity": parity(runs["cpu"]["greedy"], r["greedy"])}
                           for d, r in runs.items()}
    out |= {"config": {"max_new_tokens": args.max_new_tokens, "parity_requests": args.parity_requests,
                       "rounds": args.rounds, "concurrency": list(CONCURRENCY), "torch_threads": torch.get_num_threads()},
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "git": git_rev(), "machine": machine(load0, ("torch", "transformers")),
            "wall_s": round(time.perf_counter() - wall0, 1)}
    emit(out, args.out)


if __name__ == "__main__":
    main()
