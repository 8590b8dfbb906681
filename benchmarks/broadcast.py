#!/usr/bin/env python
"""Weight broadcast: how fast a new policy version reaches the engines, by each path, next to
this machine's memory-copy bandwidth measured in the same run (the limit).

For each model preset, starts the largest number of embedded engines asked for as processes
(streamrl.connectors.sglang.engine_actor.engine_command, as a run's engine actors do) on 127.0.0.1, each serving
the preset's model (seed 0). This process plays the learner: it holds a second set of weights
(the same preset, seed 1) as an HF state dict and pushes the two sets in turn, to the first 1,
2, 4 engines, by each path:

  distributed  the runtime's VersionBroadcaster over a gloo group (/init_weights_update_group
               once, then per push the learner's broadcast + /update_weights_from_distributed
               on every engine, load_format "flattened_bucket": one broadcast per bucket)
  distributed_per_tensor  the same with SGLang's default load_format (one broadcast per tensor,
               each into a fresh tensor on the engine): how `distributed` pushed before buckets
  disk         the runtime's VersionBroadcaster: the learner's export (HF safetensors written
               into a directory) then /update_weights_from_disk on every engine in parallel
  tensor       /update_weights_from_tensor on every engine in parallel, load_format
               "safetensors" (the embedded engine's no-pickle variant of SGLang's endpoint)

After every push each engine is checked: its weight_version is the pushed one and the log-probs
of a greedy generation equal those of the expected weights computed here (and differ from the
other set's). A push that did not land fails the benchmark. `--lora` adds LoRA adapter pushes next to the full
weights' (benchmarks/broadcast_lora.py: push_bytes / push_s / pause_s {full, lora} per preset).

Prints one JSON object on stdout (progress on stderr); every engine it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from streamrl.connectors.megatron.model_kit import build_model, build_tokenizer, init_model_dir  # noqa: E402
from streamrl.connectors.sglang.client import SGLangClient  # noqa: E402
from streamrl.connectors.sglang.weight_sync import pack  # noqa: E402
from streamrl.runtime.broadcast import VersionBroadcaster  # noqa: E402
from streamrl.runtime.learner import WeightSource  # noqa: E402
from streamrl.runtime.runlog import RunLog  # noqa: E402

from benchmarks import broadcast_lora  # noqa: E402
from benchmarks._common import emit, git_rev, log, machine, start_engine, stop  # noqa: E402

PATHS = ("distributed", "distributed_per_tensor", "disk", "tensor")

FIGURES = """
method: per (preset, engines N, path), one warm-up push (for distributed it forms the gloo
group) and then --repeats timed pushes with nothing in flight (VersionBroadcaster.publish with
interrupt=False, as lockstep does), then --repeats pushes as a stream run makes them
(publish(interrupt=True), policy in_place: /pause_generation on every engine, the push,
/continue_generation on every engine) while each engine has 4 long generate requests in
flight. Every push alternates the two weight sets and is verified on every engine.

figures (per preset, per engines N, per path):
  push_s_median / push_s_min   from the start of the push (the sender holds the weights as
                               tensors) until every engine answered success; disk includes
                               writing the export, tensor includes serialising it
  model_bytes                  bytes of the weights pushed (fp32; the tied lm_head is the
                               embedding and is not sent twice)
  gb_per_s                     model_bytes / push_s_median (1 GB = 1e9 bytes)
  ratio_to_limit               model_bytes / push_s_median / memcopy bytes/s: the fraction of
                               the memory-copy limit one engine's copy of the weights reaches
  aggregate_ratio_to_limit     N * model_bytes / push_s_median / memcopy bytes/s: every engine
                               receives its own copy, so this counts all N
  pause_s_median / pause_s_min the pause window: from /pause_generation sent until
                               /continue_generation answered on every engine, the push in between,
                               with 4 requests in flight on each engine
  disk_write_s_median          disk only: the export (safetensors + config written, fsynced,
                               renamed into place); disk_load_s_median = push - write (engines
                               reading it and copying it into the model)
  broadcast_s_median           distributed only: the learner's side of the push (the broadcasts)
  group_init_s                 distributed only: forming the gloo group (once per engine set)

memcopy (the limit): single-threaded torch `copy_` between two preallocated fp32 buffers,
best of --memcopy-repeats:
  large_buffer_gb_per_s        256 MiB buffers (DRAM-bound): the limit used in the ratios
  model_size_gb_per_s          buffers of each model's size (can sit in the caches: faster)
machine: cpus, 1-minute loadavg at start and end (anything above ~0 means other jobs compete), versions
"""

LOAD_PER_ENGINE = 4  # requests in flight on each engine during the pause measurements


def memcopy_bps(nbytes: int, repeats: int) -> float:
    """Best bytes/s of `copy_` between two preallocated fp32 buffers (torch threads: the caller's, 1)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


class Sender:
    """The learner's weight side (streamrl.runtime.learner.WeightSource) over two fixed weight sets; its
    methods are called as the broadcaster calls the learner actor's (`.remote(...)`, awaited),
    each on a thread, and timed."""

    def __init__(self, model_dir: Path, states: list[dict[str, Any]]) -> None:
        class Source(WeightSource):
            def hf_state_dict(inner) -> dict[str, Any]:
                return self.states[self.current]

        self.source = Source(str(model_dir))
        self.states, self.current = states, 0
        self.last_s: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.source, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.last_s[name] = time.perf_counter() - t

        return types.SimpleNamespace(remote=lambda *a, **kw: asyncio.to_thread(timed, *a, **kw))


def reference_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output], device=model.device)).logits[0].cpu()
    rows = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)].float(), -1)
    return rows[torch.arange(len(output)), torch.tensor(output)].tolist()


class Check:
    """Does an engine serve weight set k? Its version and the log-probs of a greedy generation."""

    PROMPT = [5, 17, 42, 99, 7, 3]

    def __init__(self, models: list[Any]) -> None:
        self.models = models

    async def __call__(self, client: Any, version: int, k: int) -> None:
        got = await client.weight_version()
        if got != str(version):
            raise RuntimeError(f"{client.base_url} serves weight_version {got!r} after pushing version {version}")
        r = await client.generate(self.PROMPT, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        errs = [max(abs(a - b) for a, b in zip(r.logprobs, reference_logprobs(m, self.PROMPT, r.output_ids)))
                for m in self.models]
        if not (errs[k] < 1e-3 < errs[1 - k]):
            raise RuntimeError(f"{client.base_url} does not serve the pushed weights (set {k}): log-prob error "
                               f"{errs[k]:.2e} against them, {errs[1 - k]:.2e} against the others")


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, procs: list[subprocess.Popen[bytes]]) -> None:
        self.args, self.work, self.procs = args, work, procs
        self.version = 0

    def start_engines(self, model_dir: Path, count: int) -> list[str]:
        urls = []
        for i in range(count):
            with open(self.work / f"engine-{model_dir.parent.name}-{i}.log", "ab") as out:
                proc, url = start_engine(model_dir, out)
            self.procs.append(proc)
            urls.append(url)
        return urls

    async def preset(self, preset: str) -> dict[str, Any]:
        model_dir = init_model_dir(self.work / preset / "model", preset, seed=0)
        tok = build_tokenizer()
        models = [build_model(tok, preset, seed).to(self.args.device) for seed in (0, 1)]
        # Laid out for the broadcast (weight_sync.pack), so a push sends without copying: the transfer
        # alone (the learner itself now gathers and copies each bucket as it pushes, streamrl/runtime/learner.py).
        states = [pack({k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}) for m in models]
        model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
        n_max = max(self.args.engines)
        log(f"{preset}: {model_bytes / 1e6:.1f} MB in {len(states[0])} tensors; starting {n_max} engines")
        urls = self.start_engines(model_dir, n_max)
        clients = [SGLangClient(u) for u in urls]
        try:
            await asyncio.gather(*(c.wait_healthy(180) for c in clients))
            check = Check(models)
            sender = Sender(model_dir, states)
            out: dict[str, Any] = {"model_bytes": model_bytes, "tensors": len(states[0]),
                                   "memcopy_model_size_gb_per_s": round(memcopy_bps(model_bytes, 20) / 1e9, 2)}
            for n in self.args.engines:
                workers = {u: c for u, c in zip(urls, clients[:n])}
                router = types.SimpleNamespace(workers=workers)  # all the broadcaster asks of the router
                run_dir = self.work / preset / f"run-{n}"
                bc = VersionBroadcaster(router, sender, "disk", "in_place", run_dir, RunLog(run_dir, echo=False))  # type: ignore[arg-type]
                bc.backend = self.args.backend or bc.backend
                out[f"engines_{n}"] = {p: await self.path(p, bc, sender, workers, check, states, model_bytes)
                                       for p in self.args.paths}
            if self.args.lora:  # adapters against the full weights' disk push, on the first engine count
                n = self.args.engines[0]
                out["lora"] = await broadcast_lora.measure(self.work / preset, models[0].cpu(), model_dir, clients[:n],
                                                           self.args.repeats, out[f"engines_{n}"]["disk"],
                                                           model_bytes, self.version)
                self.version = out["lora"]["last_version"]
                log(f"  lora rank {out['lora']['rank']}: {out['lora']['push_bytes']}, push_s {out['lora']['push_s']}, "
                    f"pause_s {out['lora']['pause_s']}")
            return out
        finally:
            for c in clients:
                await c.close()

    async def push(self, path: str, bc: Any, sender: Sender, workers: dict[str, Any], states: list[Any],
                   interrupt: bool) -> dict[str, Any]:
        """One publish of the next version (the other weight set); returns its timings."""
        self.version += 1
        k = self.version % 2
        sender.current = k
        if path != "tensor":
            bc.weight_sync = "disk" if path == "disk" else "distributed"
            bc.bucketed = path == "distributed"
            r = await bc.publish(self.version, step=self.version, interrupt=interrupt)
            went = "distributed" if r["path"] == "distributed" else "disk"  # disk: the export's directory
            if went != bc.weight_sync or r["failed_engines"]:
                raise RuntimeError(f"{path}: the push of version {self.version} went by {went} with "
                                   f"{r['failed_engines']} failed engines (see the run log in {bc.weights_dir.parent})")
            return r
        # The tensor path is the embedded engine's only; this mirrors publish() around it.
        t0 = time.perf_counter()
        if interrupt:
            await asyncio.gather(*(c.pause("in_place") for c in workers.values()))
        t_push = time.perf_counter()
        blob = save(states[k])

        async def one(c: Any) -> None:  # inside SGLang's session; in_place keeps requests, so no flush
            async with c.weight_update():
                await c.update_weights_from_tensor([blob], weight_version=self.version, flush_cache=not interrupt)

        await asyncio.gather(*(one(c) for c in workers.values()))
        push_s = time.perf_counter() - t_push
        if interrupt:
            await asyncio.gather(*(c.resume() for c in workers.values()))
        return {"push_s": push_s, "pause_s": time.perf_counter() - t0 if interrupt else 0.0}

    async def path(self, path: str, bc: Any, sender: Sender, workers: dict[str, Any], check: Check,
                   states: list[Any], model_bytes: int) -> dict[str, Any]:
        n = len(workers)
        t = time.perf_counter()
        await self.push(path, bc, sender, workers, states, False)  # warm-up (and the group, for distributed)
        group_s = time.perf_counter() - t
        await asyncio.gather(*(check(c, self.version, self.version % 2) for c in workers.values()))
        push, write, bcast = [], [], []
        for _ in range(self.args.repeats):
            r = await self.push(path, bc, sender, workers, states, False)
            push.append(r["push_s"])
            write.append(sender.last_s.get("export", 0.0))
            bcast.append(sender.last_s.get("push_weights", 0.0))
            await asyncio.gather(*(check(c, self.version, self.version % 2) for c in workers.values()))
        pause = []
        for _ in range(self.args.repeats):
            pause.append(await self.paused_push(path, bc, sender, workers, check, states))
        med = statistics.median(push)
        limit = self.args.memcopy_bps
        out = {"push_s_median": round(med, 5), "push_s_min": round(min(push), 5),
               "gb_per_s": round(model_bytes / med / 1e9, 3),
               "ratio_to_limit": round(model_bytes / med / limit, 3),
               "aggregate_ratio_to_limit": round(n * model_bytes / med / limit, 3),
               "pause_s_median": round(statistics.median(pause), 5), "pause_s_min": round(min(pause), 5)}
        if path == "disk":
            w = statistics.median(write)
            out |= {"disk_write_s_median": round(w, 5),
                    "disk_load_s_median": round(statistics.median(p - x for p, x in zip(push, write)), 5)}
        if path.startswith("distributed"):
            out |= {"broadcast_s_median": round(statistics.median(bcast), 5), "group_init_s": round(group_s, 3)}
        log(f"  engines={n} {path:22} push {med * 1e3:7.1f} ms  {model_bytes / med / 1e9:5.2f} GB/s  "
            f"ratio {out['ratio_to_limit']:.3f} (aggregate {out['aggregate_ratio_to_limit']:.3f})  "
            f"pause {out['pause_s_median'] * 1e3:7.1f} ms")
        return out

    async def paused_push(self, path: str, bc: Any, sender: Sender, workers: dict[str, Any], check: Check,
                          states: list[Any]) -> float:
        """A push with LOAD_PER_ENGINE long requests in flight on every engine; returns the pause window."""
        sp = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}
        tasks = [asyncio.create_task(c.generate([5 + i, 9, 11], sp)) for c in workers.values()
                 for i in range(LOAD_PER_ENGINE)]
        for c in workers.values():  # until every request is running (decoding) on its engine
            while (await c.server_info())["internal_states"][0]["num_requests"] < LOAD_PER_ENGINE:
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
        r = await self.push(path, bc, sender, workers, states, True)
        in_flight = sum(not t.done() for t in tasks)
        await asyncio.gather(*(c.abort() for c in workers.values()))
        await asyncio.gather(*tasks)
        if in_flight < len(tasks):
            log(f"  note: {len(tasks) - in_flight} of {len(tasks)} requests finished before the pause ended")
        await asyncio.gather(*(check(c, self.version, self.version % 2) for c in workers.values()))
        return r["pause_s"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog=FIGURES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repeats, engines 1,2 (under a minute on an idle box)")
    ap.add_argument("--presets", default="tiny,small", help="model_kit presets, comma-separated (default tiny,small)")
    ap.add_argument("--engines", help="engine counts, comma-separated (default 1,2,4; quick 1,2)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"paths, comma-separated (default {','.join(PATHS)})")
    ap.add_argument("--repeats", type=int, help="timed pushes per figure, each for push and pause (default 10, quick 3)")
    ap.add_argument("--memcopy-repeats", type=int, default=10, help="memory copies timed, best taken (default 10)")
    ap.add_argument("--backend", choices=("gloo", "nccl"),
                    help="the weight group's backend (default: nccl when torch sees a GPU, else gloo, as a run)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the sender (the learner) holds the weights (default cpu)")
    ap.add_argument("--lora", action="store_true",
                    help="also push LoRA adapters (benchmarks/broadcast_lora.py): push_bytes/push_s/pause_s {full, lora}; "
                         "needs the disk path")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    args.presets = args.presets.split(",")
    args.engines = [int(x) for x in (args.engines or ("1,2" if args.quick else "1,2,4")).split(",")]
    args.paths = args.paths.split(",")
    if bad := [p for p in args.paths if p not in PATHS]:
        ap.error(f"unknown paths {bad}; choose from {', '.join(PATHS)}")
    args.repeats = args.repeats or (3 if args.quick else 10)
    if args.lora and "disk" not in args.paths:
        ap.error("--lora compares against the disk path: include disk in --paths")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on kill, too
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(1)  # the learner's default (recipe learner.threads); engines run one too
    args.memcopy_bps = memcopy_bps(256 * 1024**2, args.memcopy_repeats)
    log(f"memcopy (256 MiB, single thread): {args.memcopy_bps / 1e9:.2f} GB/s")
    (REPO / "runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="broadcast-", dir=REPO / "runs"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bench = Bench(args, work, procs)

        async def run() -> dict[str, Any]:
            out = {}
            for p in args.presets:
                out[p] = await bench.preset(p)
                for proc in procs:
                    stop(proc)
            return out

        presets = asyncio.run(run())
    finally:
        for proc in procs:
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "broadcast", "quick": args.quick,
        "memcopy": {"large_buffer_gb_per_s": round(args.memcopy_bps / 1e9, 2), "large_buffer_bytes": 256 * 1024**2,
                    "model_size_gb_per_s": {p: presets[p].pop("memcopy_model_size_gb_per_s") for p in presets}},
        "target_small_1_engine": target(presets.get("small", {}).get("engines_1", {})),
        **presets,
        "config": {"presets": args.presets, "engines": args.engines, "paths": args.paths, "repeats": args.repeats,
                   "backend": args.backend or "auto", "device": args.device,
                   "load_per_engine": LOAD_PER_ENGINE, "engine_threads": 1, "pause_mode": "in_place",
                   "lora": args.lora},
        "git": git_rev(),
        "machine": machine(load0, ("torch", "safetensors", "aiohttp")),
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    emit(result, args.out)


def target(small: dict[str, Any]) -> dict[str, Any]:
    """The issue's target: disk or distributed on the small model to one engine reaches 50% of the limit."""
    ratios = {p: small[p]["ratio_to_limit"] for p in ("distributed", "disk") if p in small}
    return {"ratios": ratios, "met": any(r >= 0.5 for r in ratios.values())} if ratios else {}


if __name__ == "__main__":
    main()
