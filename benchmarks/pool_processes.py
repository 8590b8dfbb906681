#!/usr/bin/env python
"""Appends from producer *processes*, the way rollout workers write: each process has its own pool
object (so no group commit across them) and appends its share of groups one per call, with and
without the write-ahead log (recipe pool.write_ahead), against pool_throughput.py's Arrow IPC
baseline (4-group files, one thread) on the same groups. Prints one JSON object on stdout.

    .venv/bin/python benchmarks/pool_processes.py [--producers 8] [--groups 240] [--runs 3]

rows_per_s counts from the release of the producers (all started, pool open) until every process
has its rows committed (`flush()`); modes alternate within each run, so load hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

from streamrl.pools import LancePool  # noqa: E402

from benchmarks._common import emit, gather, git_rev, log, machine  # noqa: E402
from benchmarks._pool import GROUP, IPC_GROUPS, ipc_phase, make_groups  # noqa: E402

MODES = ("commit", "write_ahead")


def _producer(uri: str, k: int, args: argparse.Namespace, write_ahead: bool, ready: Any, go: Any, done: Any) -> None:
    groups = make_groups(args.groups, np.random.default_rng(args.seed), "p", consumed=0, resp=args.response_tokens)
    pool = LancePool(uri, create=False, compact_every=0, write_ahead=write_ahead)
    ready.put(k)
    go.wait()
    for g in groups[k :: args.producers]:
        pool.append([g], admit=True)
    pool.flush()
    done.put(time.perf_counter())  # CLOCK_MONOTONIC: comparable across processes
    pool.close()


def one(args: argparse.Namespace, work: Path, mode: str) -> dict[str, Any]:
    uri = str(work / mode / "pool")
    LancePool(uri).close()
    ctx = mp.get_context("spawn")
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    # Daemons, and gathered by gather(): a producer's failure, or this process's, ends them all at once.
    procs = [ctx.Process(target=_producer, args=(uri, k, args, mode == "write_ahead", ready, go, done), daemon=True)
             for k in range(args.producers)]
    for p in procs:
        p.start()
    gather(ready, procs, timeout=300)
    t0 = time.perf_counter()
    go.set()
    end = max(gather(done, procs, timeout=600))
    for p in procs:
        p.join(timeout=60)
    with LancePool(uri, create=False) as pool:
        led = pool.ledger()
    rows = args.groups * GROUP
    return {"rows_per_s": round(rows / (end - t0)), "seconds": round(end - t0, 3), "balanced": led.balanced,
            "complete_groups": led.complete}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producers", type=int, default=8, help="producer processes (8)")
    ap.add_argument("--groups", type=int, default=240, help="64-sample groups in all, per run and mode (240)")
    ap.add_argument("--runs", type=int, default=3, help="runs, each of both modes and the IPC baseline (3)")
    ap.add_argument("--response-tokens", type=lambda v: tuple(map(int, v.split(","))), default=(200, 2000),
                    metavar="LO,HI", help="response tokens per sample (200,2000)")
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench", help="parent of the temporary data directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    args.dir.mkdir(parents=True, exist_ok=True)
    groups = make_groups(args.groups, np.random.default_rng(args.seed), "p", consumed=0, resp=args.response_tokens)
    runs: list[dict[str, Any]] = []
    for r in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="pool_processes-", dir=args.dir))
        try:
            run: dict[str, Any] = {}
            for mode in MODES:
                log(f"run {r + 1}/{args.runs}: {args.producers} producer processes, {mode}")
                run[mode] = one(args, work, mode)
            os.sync()
            ipc = ipc_phase(groups, IPC_GROUPS, work / "ipc")
            run["arrow_ipc_rows_per_s"] = round(args.groups * GROUP / (ipc["convert"] + ipc["write"]))
            runs.append(run)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def med(values: list[float]) -> dict[str, float]:
        return {"median": round(float(np.median(values)), 3), "min": round(min(values), 3), "max": round(max(values), 3)}

    result = {"benchmark": "pool_processes",
              **{mode: {"rows_per_s": med([r[mode]["rows_per_s"] for r in runs]),
                        "vs_arrow_ipc": med([r[mode]["rows_per_s"] / r["arrow_ipc_rows_per_s"] for r in runs]),
                        "ledger_balanced": all(r[mode]["balanced"] and r[mode]["complete_groups"] == args.groups
                                               for r in runs)} for mode in MODES},
              "write_ahead_vs_commit": med([r["write_ahead"]["rows_per_s"] / r["commit"]["rows_per_s"] for r in runs]),
              "arrow_ipc_rows_per_s": med([r["arrow_ipc_rows_per_s"] for r in runs]), "runs": runs,
              "config": {"producers": args.producers, "groups": args.groups, "group_size": GROUP,
                         "response_tokens": list(args.response_tokens), "ipc_groups_per_file": IPC_GROUPS},
              "git": git_rev(), "machine": machine(load0, ("lancedb", "pylance", "pyarrow", "numpy")),
              "wall_s": round(time.perf_counter() - wall0, 1)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
