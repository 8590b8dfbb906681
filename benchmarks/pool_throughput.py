#!/usr/bin/env python
"""Experience-pool throughput: LancePool appends and claims against raw Arrow IPC files.

Prints one JSON object on stdout (progress on stderr); what each figure means is listed below.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

import lancedb  # noqa: E402

from streamrl.core.types import Sample, SampleGroup, VersionSpan  # noqa: E402
from streamrl.pools import LancePool  # noqa: E402
from streamrl.pools.schema import groups_to_table  # noqa: E402

from benchmarks._report import emit, git_rev, machine  # noqa: E402

GROUP = 64  # samples per group (GRPO n); one append call stores one group
VOCAB = 151_936  # Qwen2 vocabulary: ids need 18 bits, so int encodings see realistic values
BATCH_GROUPS = 4  # a claim takes 4 groups = 256 samples
IPC_GROUPS = 4  # groups per file of the Arrow IPC baseline: about what 8 producers share a commit with

FIGURES = """
figures (all rates are wall-clock, data generation excluded):
  append_single      one producer thread, one 64-sample group per append(admit=True) call
  append_concurrent  --producers threads doing the same at once (their calls share commits)
    rows_per_s / tokens_per_s / mb_per_s  samples, response tokens, Arrow bytes stored per second
    seconds / drain_s  producers released -> every row committed (pool.flush() timed) / of that, after
                       the last call returned (--write-ahead: rows still only in the log)
    p50_ms / p99_ms    one call: until committed (--write-ahead: until in the log; nothing fsyncs)
    commits / rows_per_commit  Lance commits (rows + admissions tables) / rows per rows-table commit
  arrow_ipc          the same groups, converted by groups_to_table (exactly the tables the pool
                     writes), one IPC file per --ipc-groups groups (fixed: a 23-group file measured
                     2-2.4x slower per row here), by one thread; each file closed inside the timing
    rows_per_s         conversion + write; write_only_rows_per_s excludes the conversion
  pool_vs_arrow_ipc  append_concurrent rows/s / arrow_ipc rows/s (both include groups_to_table); _write_only
                     divides by the write-only rate. Pool and IPC alternate in --rounds rounds over the
                     same groups (load hits both; _by_round: each round). compact_every=0: fragments
                     pile up, so a falling _by_round series is the pool slowing as they do
  compact_s          pool.compact(): optimize plus scalar indices, at --rows rows
  claim              pool.claim of 4 groups (256 samples) at --rows rows (mostly consumed, a complete
                     backlog, compacted and indexed, then fresh fragments); before each claim 4 more
                     groups are appended and at --claim-compact-at fragments it compacts (untimed)
    p50_ms / p99_ms / rows_per_s  claim latency and claimed samples per second
    first_10_p50_ms    median of the first 10 claims (right after compaction, fewest fragments)
    fragments_min/max  Lance fragments in the pool table seen by the claims
    rows_scanned_per_claim_p50/max  rows in the fragments filtered to find new groups (flat in size)
  ledger_balanced    pool.ledger() accounts for every group afterwards (a correctness check)
  data               pool_mb / ipc_mb on disk (_at_end: with versions kept 10 min); arrow_mb in memory
  machine            loadavg_1m_at_start: other jobs running on the box make every figure noisy
  targets            the issue's goals: pool >= 50% of IPC rows/s, 256-sample claim p50 < 50 ms, p99 < 100 ms
"""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_groups(n: int, rng: np.random.Generator, tag: str, consumed: int, resp: tuple[int, int] = (200, 2000),
                first: int = 0) -> list[SampleGroup]:
    """n groups of GROUP samples with `resp` response tokens each, ids `tag:first..`; the first
    `consumed` of them stored as consumed by a learner step (as pools before claims did).

    All arrays are views into three big buffers, so generating 100k rows takes about a second."""
    resp_len = rng.integers(resp[0], resp[1] + 1, size=(n, GROUP))
    prompt_len = rng.integers(50, 201, size=n)
    tokens = rng.integers(0, VOCAB, size=int(resp_len.sum()), dtype=np.int32)
    logprobs = -rng.standard_exponential(size=tokens.size, dtype=np.float32)
    prompts = rng.integers(0, VOCAB, size=int(prompt_len.sum()), dtype=np.int32)
    groups: list[SampleGroup] = []
    t = p = 0
    for i in range(first, first + n):
        version = i // 16  # a new policy version every 4 steps of 4 groups
        samples: list[Sample] = []
        for j, k in enumerate(resp_len[i - first].tolist()):
            samples.append(Sample(index=j, response_tokens=tokens[t : t + k], rollout_logprobs=logprobs[t : t + k],
                                  spans=[VersionSpan(version, 0, k)], reward=float(j % 2), finish_reason="stop"))
            t += k
        done = i - first < consumed
        groups.append(SampleGroup(group_id=f"{tag}:{i}", prompt_id=f"p{i}",
                                  prompt_tokens=prompts[p : p + prompt_len[i - first]],
                                  samples=samples, producer_id=tag, status="consumed" if done else "complete",
                                  consumed_step=i // BATCH_GROUPS if done else None,
                                  consumed_version=version if done else None))
        p += int(prompt_len[i - first])
    return groups


def pct(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2),
            "mean_ms": round(float(a.mean()), 2), "max_ms": round(float(a.max()), 2)}


def rates(groups: Sequence[SampleGroup], seconds: float) -> dict[str, float]:
    rows = sum(len(g.samples) for g in groups)
    tokens = sum(s.num_tokens for g in groups for s in g.samples)
    return {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds, 1),
            "tokens_per_s": round(tokens / seconds), "mb_per_s": round(arrow_bytes(groups) / seconds / 1e6, 1)}


def arrow_bytes(groups: Sequence[SampleGroup]) -> int:
    # Column payload the pool writes: tokens, log-probs, masks and prompts dominate.
    return sum(g.prompt_tokens.nbytes * len(g.samples) + sum(s.num_tokens * 9 for s in g.samples) for g in groups)


def dir_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 1)


class Store:
    """Where the pool lives: a directory under --dir, or (--s3-local) a prefix on a local S3 server."""

    def __init__(self, work: Path, s3: Any = None) -> None:
        self.s3, self.uri = s3, s3.new_uri() if s3 else str(work / "pool")
        self.options = s3.storage_options if s3 else {}

    def table_version(self) -> int:
        # A separate connection, so the pool's own objects are left alone.
        return lancedb.connect(self.uri, storage_options=self.options or None).open_table("pool").version

    def mb(self) -> float:
        if self.s3 is None:
            return dir_mb(Path(self.uri))
        return round(sum(o["Size"] for o in self.s3.objects(self.uri.split("/", 3)[3])) / 1e6, 1)


def append_phase(pool: LancePool, store: Store, groups: list[SampleGroup], producers: int) -> dict[str, Any]:
    """`producers` threads, each appending its share one group per call, released together."""
    shares = [groups[i::producers] for i in range(producers)]
    lat: list[list[float]] = [[] for _ in range(producers)]
    errors: list[BaseException] = []
    start = threading.Barrier(producers + 1)

    def work(k: int) -> None:
        start.wait()
        try:
            for g in shares[k]:
                t0 = time.perf_counter()
                pool.append([g], admit=True)
                lat[k].append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(producers)]
    for th in threads:
        th.start()
    commits0, version0 = pool.commits, store.table_version()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    returned = time.perf_counter() - t0
    pool.flush()  # the rates count rows committed to Lance, not only in the write-ahead log
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"groups": groups, "seconds": seconds, "drain_s": seconds - returned, "lat": [x for ls in lat for x in ls],
            "commits": pool.commits - commits0, "row_commits": store.table_version() - version0}


def append_summary(runs: list[dict[str, Any]], producers: int) -> dict[str, Any]:
    groups = [g for r in runs for g in r["groups"]]
    row_commits = sum(r["row_commits"] for r in runs)
    out = {"producers": producers, **rates(groups, sum(r["seconds"] for r in runs)),
           **pct([x for r in runs for x in r["lat"]]), "drain_s": round(sum(r["drain_s"] for r in runs), 3),
           "commits": sum(r["commits"] for r in runs),
           "row_commits": row_commits}
    out["rows_per_commit"] = round(out["rows"] / max(row_commits, 1), 1)
    return out


def ipc_phase(groups: list[SampleGroup], chunk_groups: int, out_dir: Path) -> dict[str, Any]:
    """One thread converts a chunk, writes it and closes the file: with the GIL on 2 cores, more
    threads would not convert faster, and the pool's commits are serial too."""
    out_dir.mkdir(exist_ok=True)
    convert = write = 0.0
    chunks = [groups[i : i + chunk_groups] for i in range(0, len(groups), chunk_groups)]
    for chunk in chunks:
        t0 = time.perf_counter()
        table = groups_to_table(chunk)
        t1 = time.perf_counter()
        path = out_dir / f"{chunk[0].group_id.replace(':', '-')}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        t2 = time.perf_counter()
        convert, write = convert + t1 - t0, write + t2 - t1
    return {"groups": groups, "files": len(chunks), "convert": convert, "write": write}


def ipc_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    groups = [g for r in runs for g in r["groups"]]
    write = sum(r["write"] for r in runs)
    out = {"files": sum(r["files"] for r in runs), **rates(groups, write + sum(r["convert"] for r in runs))}
    out["write_only_seconds"] = round(write, 3)
    out["write_only_rows_per_s"] = round(out["rows"] / write, 1)
    return out


def claim_phase(pool: LancePool, feed: list[SampleGroup], claims: int, top_version: int,
                compact_at: int) -> dict[str, Any]:
    lat: list[float] = []
    frags: list[int] = []
    compact_s: list[float] = []
    rows0, read, scanned = pool.count_rows(), [], []
    backlog0 = pool.count("status = 'complete'")
    for step in range(claims):
        if compact_at and pool.fragments() >= compact_at:
            # What LancePool(compact_every=64) would start in the background; here synchronous and
            # untimed, so the figure is the claim itself.
            t0 = time.perf_counter()
            pool.compact()
            compact_s.append(time.perf_counter() - t0)
        pool.append(feed[step * BATCH_GROUPS : (step + 1) * BATCH_GROUPS], admit=True)  # producers keep going
        pool.flush()  # with --write-ahead, the producers' rows are committed before the claim is timed
        frags.append(pool.fragments())
        before = pool.claim_stats()
        t0 = time.perf_counter()
        # A bound wider than any version spread: the measured path is take, not drop.
        batch = pool.claim(step, top_version, BATCH_GROUPS, max_staleness=10**6, policy="drop")
        lat.append(time.perf_counter() - t0)
        after = pool.claim_stats()
        read.append(after["rows_read"] - before["rows_read"])
        scanned.append(after["rows_scanned"] - before["rows_scanned"])
        if batch is None or batch.num_samples != BATCH_GROUPS * GROUP:
            raise RuntimeError(f"claim {step} returned {batch and batch.num_samples} samples, expected 256")
    return {"pool_rows_at_start": rows0, "pool_rows_at_end": pool.count_rows(), "complete_rows_at_start": backlog0,
            "fragments_min": min(frags), "fragments_max": max(frags), "claims": claims,
            "samples_per_claim": BATCH_GROUPS * GROUP, **pct(lat),
            "first_10_p50_ms": pct(lat[:10])["p50_ms"], "rows_per_s": round(claims * BATCH_GROUPS * GROUP / sum(lat), 1),
            "rows_read_per_claim_max": max(read[1:], default=None), "rows_read_first_claim": read[0],
            "rows_scanned_per_claim_p50": int(np.median(scanned[1:])) if claims > 1 else None,
            "rows_scanned_per_claim_max": max(scanned[1:], default=None),
            "compact_at_fragments": compact_at, "compactions": len(compact_s),
            "compact_s_mean": round(float(np.mean(compact_s)), 2) if compact_s else None}


def parse_args() -> argparse.Namespace:
    from benchmarks import pool_scale

    ap = argparse.ArgumentParser(description=__doc__, epilog=FIGURES + "\n" + (pool_scale.__doc__ or ""),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k rows and fewer claims (under 2 minutes on 2 cores)")
    ap.add_argument("--s3-local", action="store_true",
                    help="the pool on a local S3-compatible server (moto, started here; the Arrow IPC baseline "
                         "stays on local disk): what the object-store protocol costs, not what real S3 gives")
    ap.add_argument("--rows", type=int, help="rows in the pool when claims are measured (default 100000, quick 20000)")
    ap.add_argument("--producers", type=int, default=8, help="concurrent producer threads (default 8)")
    ap.add_argument("--single-groups", type=int, help="groups appended by the single producer (default 150, quick 40)")
    ap.add_argument("--backlog-rows", type=int, default=4096, help="complete (unclaimed) rows before claims (4096)")
    ap.add_argument("--fresh-fragments", type=int, default=8, help="un-compacted fragments appended after compact (8)")
    ap.add_argument("--claims", type=int, help="timed claims (default 100, quick 30)")
    ap.add_argument("--claim-compact-at", type=int, default=64,
                    help="during claims, compact (untimed) once the pool has this many fragments, as "
                         "LancePool's default compact_every does; 0 = never (64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating pool / IPC rounds (3)")
    ap.add_argument("--commit-max-rows", type=int, default=8192, help="LancePool commit_max_rows (8192)")
    ap.add_argument("--commit-linger-ms", type=float, default=2.0, help="LancePool commit_linger_ms (2.0)")
    ap.add_argument("--response-tokens", type=lambda v: tuple(map(int, v.split(","))), default=(200, 2000),
                    metavar="LO,HI", help="response tokens per sample, uniform in [LO, HI] (200,2000)")
    ap.add_argument("--ipc-groups", type=int, default=IPC_GROUPS, help="groups per IPC file in the baseline (4)")
    ap.add_argument("--write-ahead", action="store_true", help="LancePool(write_ahead=True): recipe pool.write_ahead")
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench",
                    help="parent of the temporary data directory; the disk under test (default runs/bench)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    pool_scale.add_args(ap)
    args = ap.parse_args()
    args.rows = args.rows or (20_000 if args.quick else 100_000)
    args.single_groups = args.single_groups if args.single_groups is not None else (40 if args.quick else 150)
    args.claims = args.claims or (30 if args.quick else 100)
    return args


def run(args: argparse.Namespace, work: Path, store: Store) -> dict[str, Any]:
    n_groups = max(args.rows // GROUP, args.single_groups + 1)
    backlog = min(max(1, -(-args.backlog_rows // GROUP)), n_groups - args.single_groups)
    n_fresh = args.fresh_fragments + args.claims * BATCH_GROUPS
    log(f"generating {n_groups} groups ({n_groups * GROUP} rows) + {n_fresh} to feed the claims")
    rng = np.random.default_rng(args.seed)
    # Consumed groups first, the complete backlog last: claims then take the newest bulk rows.
    bulk = make_groups(n_groups, rng, "bulk", consumed=n_groups - backlog, resp=args.response_tokens)
    fresh = make_groups(n_fresh, rng, "fresh", consumed=0, resp=args.response_tokens)
    single_groups, multi_groups = bulk[: args.single_groups], bulk[args.single_groups :]
    r: dict[str, Any] = {}
    with LancePool(store.uri, commit_max_rows=args.commit_max_rows, commit_linger_ms=args.commit_linger_ms,
                   compact_every=0, storage_options=store.options, write_ahead=args.write_ahead) as pool:
        # Flush dirty pages before each timed phase, so no phase pays for the previous one's writeback.
        os.sync()
        log(f"single producer: {len(single_groups)} groups")
        r["append_single"] = append_summary([append_phase(pool, store, single_groups, 1)], 1)
        # Pool and IPC alternate in rounds over the same groups, so load from other jobs on a shared
        # machine hits both sides alike; the ratio of the summed rates is the headline.
        pool_runs: list[dict[str, Any]] = []
        ipc_runs: list[dict[str, Any]] = []
        for k in range(args.rounds):
            part = multi_groups[k :: args.rounds]
            os.sync()
            log(f"round {k + 1}/{args.rounds}: {args.producers} producers, {len(part)} groups")
            pool_runs.append(append_phase(pool, store, part, args.producers))
            os.sync()
            log(f"round {k + 1}/{args.rounds}: arrow ipc, {args.ipc_groups} groups per file")
            ipc_runs.append(ipc_phase(part, args.ipc_groups, work / "ipc"))
        pool_mb, ipc_mb, pool_frags = store.mb(), dir_mb(work / "ipc"), pool.fragments()
        shutil.rmtree(work / "ipc")
        r["append_concurrent"] = conc = append_summary(pool_runs, args.producers)
        r["arrow_ipc"] = ipc = ipc_summary(ipc_runs)
        r["pool_vs_arrow_ipc"] = round(conc["rows_per_s"] / ipc["rows_per_s"], 3)
        r["pool_vs_arrow_ipc_write_only"] = round(conc["rows_per_s"] / ipc["write_only_rows_per_s"], 3)
        r["pool_vs_arrow_ipc_by_round"] = [
            round((i["convert"] + i["write"]) / p["seconds"], 3) for p, i in zip(pool_runs, ipc_runs)]

        os.sync()
        log("compact")
        t0 = time.perf_counter()
        pool.compact()
        r["compact_s"] = round(time.perf_counter() - t0, 2)
        for g in fresh[: args.fresh_fragments]:
            pool.append([g], admit=True)  # one commit each: fragments the compaction has not seen
        log(f"claims: {args.claims} x {BATCH_GROUPS * GROUP} samples")
        top_version = max(g.max_version or 0 for g in bulk + fresh)
        r["claim"] = claim_phase(pool, fresh[args.fresh_fragments :], args.claims, top_version, args.claim_compact_at)
        r["ledger_balanced"] = pool.ledger().balanced
    every = bulk + fresh
    r["data"] = {"groups": len(every), "rows": sum(len(g.samples) for g in every),
                 "response_tokens": sum(s.num_tokens for g in every for s in g.samples),
                 "arrow_mb": round(arrow_bytes(every) / 1e6, 1), "pool_mb_after_appends": pool_mb,
                 "pool_fragments_after_appends": pool_frags, "ipc_mb": ipc_mb, "pool_mb_at_end": store.mb()}
    r["data_storage_version"] = lancedb.connect(store.uri, storage_options=store.options or None).open_table(
        "pool").to_lance().data_storage_version
    return r


def main() -> None:
    args = parse_args()
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]  # other jobs on the box skew every figure
    if args.scale:
        from benchmarks.pool_scale import run_scale

        result = {"benchmark": "pool_throughput --scale", **run_scale(args),
                  "config": {"sizes": args.sizes, "long_up_to": args.long_up_to, "short_tokens": args.short_tokens,
                             "claims": args.claims, "rounds": args.rounds, "group_size": GROUP, "dir": str(args.dir)},
                  "git": git_rev(), "machine": machine(load0, ("lancedb", "pylance", "pyarrow", "numpy")),
                  "wall_s": round(time.perf_counter() - wall0, 1)}
        emit(result, args.out)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pool_throughput-", dir=args.dir))
    s3 = None
    try:
        if args.s3_local:
            from benchmarks._s3 import start_s3

            s3 = start_s3(work / "moto.log")
            os.environ.update(s3.env)  # credentials from the environment, as a user sets them
            log(f"pool on a local S3 server (moto) at {s3.url}")
        r = run(args, work, Store(work, s3))
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    storage_version = r.pop("data_storage_version")
    result = {
        "benchmark": "pool_throughput", "quick": args.quick,
        "targets": {"pool_at_least_half_of_ipc": r["pool_vs_arrow_ipc"] >= 0.5,
                    "claim_p50_under_50ms": r["claim"]["p50_ms"] < 50,
                    "claim_p99_under_100ms": r["claim"]["p99_ms"] < 100},
        **{k: r.pop(k) for k in ("pool_vs_arrow_ipc", "pool_vs_arrow_ipc_write_only", "pool_vs_arrow_ipc_by_round")},
        **r,
        "config": {"rows": args.rows, "group_size": GROUP, "response_tokens": list(args.response_tokens), "prompt_tokens": [50, 200],
                   "producers": args.producers, "rounds": args.rounds, "commit_max_rows": args.commit_max_rows,
                   "commit_linger_ms": args.commit_linger_ms, "write_ahead": args.write_ahead,
                   "ipc_groups_per_file": args.ipc_groups,
                   "data_storage_version": storage_version, "dir": str(args.dir),
                   "pool_store": "s3 (moto server on 127.0.0.1)" if args.s3_local else "local disk"},
        "git": git_rev(),  # which pool code was measured
        "machine": machine(load0, ("lancedb", "pylance", "pyarrow", "numpy")),
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
