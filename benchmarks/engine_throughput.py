#!/usr/bin/env python
"""Embedded-engine throughput: output tokens/s at concurrency 1, 8 and 64, straight to one
engine and through the real sglang-router in front of it; and a group of --group-n samples
of one prompt sent as one `n` request against the same samples as separate requests.

Builds a model (model_kit preset) in a temporary directory under runs/, starts the engine
(streamrl.connectors.sglang.engine_server.serve) and sglang-router as subprocesses on 127.0.0.1, warms both
paths up, then measures. Prints one JSON object on stdout (progress on stderr); every process
it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

import msgspec  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from streamrl.connectors.megatron.model_kit import PRESETS, init_model_dir  # noqa: E402
from streamrl.connectors.sglang import api  # noqa: E402
from streamrl.connectors.sglang.client import EngineError, GenerateResult, SGLangClient  # noqa: E402
from streamrl.connectors.sglang.router import Router  # noqa: E402

from benchmarks._common import emit, git_rev, log, machine, start_engine, stop  # noqa: E402

CONCURRENCY = (1, 8, 64)
ENGINE_MAX_RUNNING = 64  # serve()'s default: at most this many requests decode together

FIGURES = """
method: C clients in a closed loop (each sends its next request as soon as its last one
returns) for --seconds; the clients then finish what they have in flight, and that time
counts too. Every request is a short arithmetic prompt with max_new_tokens=--max-new-tokens,
ignore_eos, return_logprob and temperature 1, so it returns exactly that many tokens.
Direct and router measurements alternate, --rounds times, so load from other jobs on the
machine hits both paths alike.

figures:
  direct / router        requests sent straight to the engine / through sglang-router
    c1, c8, c64          one entry per concurrency C:
      tokens_per_s       median over rounds of (output tokens / wall time of the measurement)
      tokens_per_s_by_round  each round's rate: their spread is the machine's noise
      p50_ms / p99_ms    latency of one request (send to reply, as the client sees it), all rounds
      requests           requests timed, all rounds
  speedup_over_c1        tokens_per_s at C / tokens_per_s at C=1, per path: what continuous
                         batching buys (1.0 would mean one request at a time)
  router_overhead        direct tokens_per_s / router tokens_per_s per C (1.0 = the router is
                         free; 1.1 = it costs 10%); router_overhead_by_round: each round's ratio
  group                  --group-n samples of one --group-prompt-tokens prompt, --group-clients
                         clients in a closed loop, straight to the engine:
    n_request            each client sends one /generate with sampling_params.n = N
    separate             each client sends the N samples as N concurrent requests (what
                         rollouts do today); the engine shares their prefill too when they
                         are admitted in one turn (identical sequences share a row)
    speedup              n_request tokens_per_s / separate tokens_per_s
  config                 engine_threads: torch threads of the engine (serve()'s default 1); more
                         than one can collapse on a busy box (threads spin waiting for each other)
  model                  preset, parameters (unique: the tied lm_head counted once), layers, hidden
  machine                cpus, 1-minute loadavg at start and end (anything above ~0 on this box is
                         other jobs competing for the cores: every figure gets noisier), versions
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def param_count(model_dir: Path) -> int:
    n = 0
    for f in model_dir.glob("*.safetensors"):  # a tied lm_head is not stored, so it counts once
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


async def wait_engine(proc: subprocess.Popen[bytes], client: SGLangClient, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.health():
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine was not healthy after {timeout_s}s")
        await asyncio.sleep(0.2)


class Load:
    """Closed-loop load: `concurrency` clients, each sending requests back to back."""

    def __init__(self, tokenizer_file: Path, max_new_tokens: int) -> None:
        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.max_new = max_new_tokens
        self.rng = random.Random(0)

    def prompt(self) -> list[int]:
        return self.tok.encode(f"What is {self.rng.randint(0, 999)}+{self.rng.randint(0, 999)}=").ids

    async def run(self, client: SGLangClient, concurrency: int, seconds: float,
                  max_new: int | None = None) -> dict[str, Any]:
        """Until `seconds` have passed (at least one request per client); wall time, tokens, latencies."""
        max_new = max_new or self.max_new
        sp = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0}
        lat: list[float] = []
        t0 = time.perf_counter()

        async def client_loop() -> None:
            while True:
                t = time.perf_counter()
                r = await client.generate(self.prompt(), sp, return_logprob=True)
                lat.append(time.perf_counter() - t)
                if len(r.output_ids) != max_new or len(r.logprobs) != max_new:
                    raise RuntimeError(f"expected {max_new} tokens with log-probs, got {len(r.output_ids)} "
                                       f"tokens and {len(r.logprobs)} log-probs")
                if time.perf_counter() - t0 >= seconds:
                    return

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return {"seconds": time.perf_counter() - t0, "tokens": len(lat) * max_new, "latencies": lat}


_results = msgspec.json.Decoder(list[GenerateResult])


async def group_run(client: SGLangClient, clients: int, seconds: float, ids: list[int], n: int, max_new: int,
                    as_n: bool) -> dict[str, Any]:
    """Closed loop of `clients`, each getting `n` samples of `ids` per round trip: one request
    with sampling_params.n (as_n) or n concurrent requests."""
    sp = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0}
    lat: list[float] = []
    t0 = time.perf_counter()

    async def one_group() -> None:
        if as_n:
            req = api.GenerateReqInput(input_ids=ids, sampling_params=api.SamplingParams(**sp, n=n), return_logprob=True)
            outs = _results.decode(await client.request("POST", "/generate", req))
        else:
            outs = await asyncio.gather(*(client.generate(ids, sp, return_logprob=True) for _ in range(n)))
        if len(outs) != n or any(len(o.output_ids) != max_new for o in outs):
            raise RuntimeError(f"expected {n} samples of {max_new} tokens, got {[len(o.output_ids) for o in outs]}")

    async def client_loop() -> None:
        while True:
            t = time.perf_counter()
            await one_group()
            lat.append(time.perf_counter() - t)
            if time.perf_counter() - t0 >= seconds:
                return

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return {"seconds": time.perf_counter() - t0, "tokens": len(lat) * n * max_new, "latencies": lat}


async def bench_group(args: argparse.Namespace, load: Load, client: SGLangClient) -> dict[str, Any]:
    """The group row: N samples as one n request against N separate requests, alternating."""
    ids = (load.prompt() * args.group_prompt_tokens)[: args.group_prompt_tokens]
    runs: dict[str, list[dict[str, Any]]] = {"n_request": [], "separate": []}
    refused = None
    try:  # an engine without n > 1 (the embedded one before issue 23) refuses it: measure the rest
        await group_run(client, 1, 0, ids, args.group_n, 1, True)
    except EngineError as e:
        refused = str(e)
        del runs["n_request"]
    for k in range(args.rounds):
        for name in runs:
            r = await group_run(client, args.group_clients, args.seconds, ids, args.group_n, args.max_new_tokens,
                                name == "n_request")
            runs[name].append(r)
            log(f"round {k + 1}/{args.rounds} group {name:9} {len(r['latencies']):4} groups "
                f"{r['tokens'] / r['seconds']:8.1f} tok/s")
    out: dict[str, Any] = {name: summary(rs) for name, rs in runs.items()}
    if refused:
        out["n_request"] = {"refused": refused}
    else:
        out["speedup"] = round(out["n_request"]["tokens_per_s"] / out["separate"]["tokens_per_s"], 2)
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens"] / r["seconds"] for r in runs]
    lat = [x for r in runs for x in r["latencies"]]
    return {"tokens_per_s": round(statistics.median(rates), 1), "tokens_per_s_by_round": [round(x) for x in rates],
            "p50_ms": round(pct(lat, 0.5) * 1000, 1), "p99_ms": round(pct(lat, 0.99) * 1000, 1),
            "requests": len(lat)}


async def bench(args: argparse.Namespace, model_dir: Path, procs: list[Any]) -> dict[str, Any]:
    load = Load(model_dir / "tokenizer.json", args.max_new_tokens)
    engine, url = start_engine(model_dir, sys.stderr, args.engine_threads)  # stdout carries only the JSON result
    procs.append(engine)
    direct = SGLangClient(url)
    router = Router()
    procs.append(router)
    try:
        log(f"engine at {url}: waiting until healthy")
        await wait_engine(engine, direct)
        router.start()
        await router.add_worker(direct.base_url)
        log(f"router on {router.url}, the engine registered")
        paths = {"direct": direct, "router": router.client}
        log("warm-up")  # first calls, connections (ours and the router's), batches as large as measured
        for client in paths.values():
            await load.run(client, 1, 0)
            await load.run(client, max(CONCURRENCY), 0, max_new=8)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {p: {c: [] for c in CONCURRENCY} for p in paths}
        for k in range(args.rounds):
            for c in CONCURRENCY:
                for name, client in paths.items():
                    r = await load.run(client, c, args.seconds)
                    runs[name][c].append(r)
                    log(f"round {k + 1}/{args.rounds} {name:6} c={c:<3} {len(r['latencies']):4} requests "
                        f"{r['tokens'] / r['seconds']:8.1f} tok/s")
        group = await bench_group(args, load, direct) if args.group_n > 1 else None
    finally:
        await direct.close()
        await router.close()  # its client session, then the router process
        stop(engine)
    out: dict[str, Any] = {p: {f"c{c}": summary(runs[p][c]) for c in CONCURRENCY} for p in paths}
    rate = {p: {c: out[p][f"c{c}"]["tokens_per_s"] for c in CONCURRENCY} for p in paths}
    out["speedup_over_c1"] = {p: {f"c{c}": round(rate[p][c] / rate[p][1], 2) for c in CONCURRENCY[1:]}
                              for p in paths}
    if group is not None:
        out["group"] = group
    out["router_overhead"] = {f"c{c}": round(rate["direct"][c] / rate["router"][c], 3) for c in CONCURRENCY}
    out["router_overhead_by_round"] = {
        f"c{c}": [round((d["tokens"] / d["seconds"]) / (r["tokens"] / r["seconds"]), 3)
                  for d, r in zip(runs["direct"][c], runs["router"][c])] for c in CONCURRENCY}
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog=FIGURES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="model_kit preset (default tiny)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s measurements (under a minute on an idle box)")
    ap.add_argument("--rounds", type=int, help="alternating direct / router rounds (default 5, quick 2)")
    ap.add_argument("--seconds", type=float, help="length of one measurement (default 5, quick 2)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="torch threads of the engine (serve()'s default 1; torch's own default is one per core)")
    ap.add_argument("--group-n", type=int, default=8,
                    help="samples per group for the group row (default 8; 1 skips it)")
    ap.add_argument("--group-prompt-tokens", type=int, default=160,
                    help="prompt length of the group row (default 160: prefill matters, as with RL prompts; "
                         "with --max-new-tokens it must fit the model's context: 256 tiny, 512 small)")
    ap.add_argument("--group-clients", type=int, default=4,
                    help="groups in flight in the group row (default 4: 32 samples at --group-n 8)")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 5.0)
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on kill, too
    os.environ.setdefault("TQDM_DISABLE", "1")  # no weight-loading progress bars (here and in the engine)
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    (REPO / "runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine_throughput-", dir=REPO / "runs"))
    procs: list[Any] = []
    try:
        log(f"building the {args.preset} model in {work}")
        model_dir = init_model_dir(work / "model", preset=args.preset)
        params = param_count(model_dir)
        r = asyncio.run(bench(args, model_dir, procs))
    finally:  # again, in case bench never got to its own cleanup
        for p in reversed(procs):
            p.stop() if isinstance(p, Router) else stop(p)
        shutil.rmtree(work, ignore_errors=True)
    cfg = PRESETS[args.preset]
    result = {
        "benchmark": "engine_throughput", "quick": args.quick,
        **{k: r.pop(k) for k in ("router_overhead", "router_overhead_by_round", "speedup_over_c1")}, **r,
        "model": {"preset": args.preset, "parameters": params, "layers": cfg["num_hidden_layers"],
                  "hidden_size": cfg["hidden_size"]},
        "config": {"max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "seconds": args.seconds,
                   "engine_max_running": ENGINE_MAX_RUNNING, "router_policy": "round_robin",
                   "engine_threads": args.engine_threads, "group_n": args.group_n,
                   "group_prompt_tokens": args.group_prompt_tokens, "group_clients": args.group_clients},
        "git": git_rev(),
        "machine": machine(load0, ("torch", "transformers", "aiohttp", "sglang-router")),
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
