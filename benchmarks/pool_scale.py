"""`pool_throughput.py --scale`: the experience pool at 10k, 100k and 1M rows (the growth curve).

For each size a pool is built as a run leaves it: HISTORY rows appended by 8 producer threads
and consumed (their claims written in bulk, as the learner's claims would have written them,
without reading the rows back), then a backlog of complete groups. At each size the same
long-token groups (200-2000 response tokens) are then appended and claimed, so only the pool's
size differs between sizes:

  append             8 producers and 1 producer (blocking, one 64-sample group per call) vs an
                     Arrow IPC write of the same batches (the same tables, one file per commit /
                     per call), alternating in --rounds rounds
  claim              a learner opened on the pool (a restart: `first_claim_ms` reads from the last
                     claim's frontier), then --claims claims of 4 groups (256 samples), 4 new groups
                     appended before each (untimed), with the pool's own background compaction
                     (compact_every 64) running as in a run; `rows_read_per_claim_max` is what a
                     claim read to find ready groups
  stats_s, query_s   `pool stats` (every row's small columns) and a typical `pool query`
                     (reward by version over consumed groups), on a pool object opened for it
  show_ms            `pool show`'s lookup of one group by id
  bytes_per_row      bytes of the data files the pool's tables use now over its rows (tokens
                     dominate); disk_mb is the directory, with the versions pool.keep_versions keeps

History rows of sizes above --long-up-to have shorter responses (--short-tokens, default
50-400) so 1M rows fit in ~2.5 GB; the measured appends and claims always use long ones.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lance
import numpy as np
from matplotlib.figure import Figure

from benchmarks._common import log
from benchmarks._pool import (
    BATCH_GROUPS, GROUP, IPC_GROUPS, Store, append_phase, append_summary, claim_phase, dir_mb, ipc_phase, ipc_summary,
    make_groups)
from streamrl.core.claims import claim_columns
from streamrl.pools import LancePool
from streamrl.pools.queries import pool_query, pool_stats
from streamrl.pools.schema import claims_to_table

BUILD_CHUNK = 256  # groups generated and appended at a time (bounded memory at any size)
BACKLOG_GROUPS = 64
MULTI_GROUPS, SINGLE_GROUPS = 48, 16  # groups appended per round by 8 producers, by 1
QUERY = ("SELECT max_version, count(DISTINCT group_id) AS groups, avg(reward) AS reward FROM pool "
         "WHERE status = 'consumed' GROUP BY 1 ORDER BY 1")


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--scale (the growth curve)")
    g.add_argument("--scale", action="store_true", help="build pools of --sizes rows and measure each (see below)")
    g.add_argument("--sizes", default="10000,100000,1000000", help="pool sizes in rows (default 10000,100000,1000000)")
    g.add_argument("--long-up-to", type=int, default=100_000,
                   help="history of pools up to this size has 200-2000-token responses (default 100000)")
    g.add_argument("--short-tokens", default="50-400", help="response tokens of larger pools' history (default 50-400)")
    g.add_argument("--png", type=Path, help="growth-curve plot (default: next to --out, else runs/bench/pool_scale.png)")


def history(pool: LancePool, n_groups: int, resp: tuple[int, int], rng: np.random.Generator) -> float:
    """Append n_groups consumed groups with 8 producers, then write their claims in bulk; seconds."""
    t0 = time.perf_counter()
    for first in range(0, n_groups, BUILD_CHUNK):
        chunk = make_groups(min(BUILD_CHUNK, n_groups - first), rng, "hist", consumed=0, resp=resp, first=first)
        append_phase(pool, Store(pool.uri), chunk, 8)
        if first and first % (BUILD_CHUNK * 16) == 0:
            log(f"  history: {first * GROUP} rows")
    pool.compact()  # what the learner's background compaction would have done meanwhile
    # The claims a learner would have committed, step by step, written in bulk (the benchmark's
    # only shortcut past the pool's API: claiming 1M rows one batch at a time would read them all).
    # The last claim came after the last compaction and had claimed every history group: it
    # recorded the version it had read as its frontier.
    frontier = pool._open("pool").version  # noqa: SLF001 - every group after this one is still claimable
    claims = pool._open("claims")  # noqa: SLF001
    for first in range(0, n_groups, 8192):
        ids = [f"hist:{i}" for i in range(first, min(first + 8192, n_groups))]
        step = first // BATCH_GROUPS
        claims.insert(claims_to_table(claim_columns([(g, "consumed", None) for g in ids], step, step),
                                      time.time_ns(), frontier))
    return time.perf_counter() - t0


def _appends(pool: LancePool, feed: list[Any], rounds: int, work: Path) -> dict[str, Any]:
    """8 producers and 1 producer against Arrow IPC of the same batches, alternating in rounds."""
    multi, single, ipc_m, ipc_s = [], [], [], []
    per = MULTI_GROUPS + SINGLE_GROUPS
    for k in range(rounds):
        part = feed[k * per:k * per + MULTI_GROUPS]
        multi.append(append_phase(pool, Store(pool.uri), part, 8))
        ipc_m.append(ipc_phase(part, IPC_GROUPS, work / "ipc"))
        part = feed[k * per + MULTI_GROUPS:(k + 1) * per]
        single.append(append_phase(pool, Store(pool.uri), part, 1))
        ipc_s.append(ipc_phase(part, 1, work / "ipc"))
        shutil.rmtree(work / "ipc", ignore_errors=True)
    m, s = append_summary(multi, 8), append_summary(single, 1)
    im, is_ = ipc_summary(ipc_m), ipc_summary(ipc_s)
    return {"producers_8": m, "producers_1": s, "arrow_ipc_8": im, "arrow_ipc_1": is_,
            "pool_vs_arrow_ipc_8": round(m["rows_per_s"] / im["rows_per_s"], 3),
            "pool_vs_arrow_ipc_1": round(s["rows_per_s"] / is_["rows_per_s"], 3)}


def one_size(rows: int, args: argparse.Namespace, work: Path, rng: np.random.Generator) -> dict[str, Any]:
    n_groups = max(rows // GROUP, BACKLOG_GROUPS + 1)
    short = tuple(int(x) for x in args.short_tokens.split("-"))
    resp = (200, 2000) if rows <= args.long_up_to else (short[0], short[1])
    uri = work / f"pool-{rows}"
    out: dict[str, Any] = {"rows": rows, "history_response_tokens": list(resp)}
    n_hist = n_groups - BACKLOG_GROUPS
    log(f"{rows} rows: building ({n_hist} consumed groups, {BACKLOG_GROUPS} complete)")
    with LancePool(uri, compact_every=0) as pool:
        out["build_s"] = round(history(pool, n_hist, resp, rng), 1)
        backlog = make_groups(BACKLOG_GROUPS, rng, "backlog", consumed=0, first=n_hist)
        append_phase(pool, Store(uri), backlog, 8)
        n_append = args.rounds * (MULTI_GROUPS + SINGLE_GROUPS)
        feed = make_groups(n_append + args.claims * BATCH_GROUPS, rng, "feed", consumed=0, first=n_hist + BACKLOG_GROUPS)
        log(f"{rows} rows: appends")
        out["append"] = _appends(pool, feed[:n_append], args.rounds, work)
    log(f"{rows} rows: claims")
    top = max(g.max_version or 0 for g in feed)
    with LancePool(uri) as pool:  # a learner (re)starting on this pool: background compaction on
        t0 = time.perf_counter()
        first = pool.claim(0, top, BATCH_GROUPS, max_staleness=10**6)
        out["first_claim_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        out["first_claim_rows_read"] = pool.claim_stats()["rows_read"]
        out["first_claim_rows_scanned"] = pool.claim_stats()["rows_scanned"]
        assert first is not None and first.num_samples == BATCH_GROUPS * GROUP
        out["claim"] = claim_phase(pool, feed[n_append:], args.claims, top, compact_at=0)
        out["ledger_balanced"] = pool.ledger().balanced
    log(f"{rows} rows: stats, query, show")
    with LancePool(uri, create=False) as pool:
        t0 = time.perf_counter()
        stats = pool_stats(pool)
        out["stats_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        q = pool_query(pool, QUERY)
        out["query_s"], out["query_rows"] = round(time.perf_counter() - t0, 3), q.num_rows
        t0 = time.perf_counter()
        assert len(pool.groups([f"hist:{n_hist // 2}"])) == 1
        out["show_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        total = pool.count_rows()
    out["pool_rows"], out["stats_rows"] = total, stats["rows"]
    out["disk_mb"] = dir_mb(uri)  # with the versions compaction keeps (pool.keep_versions)
    out["bytes_per_row"] = round(live_bytes(uri) / total)
    shutil.rmtree(uri, ignore_errors=True)
    return out


def live_bytes(uri: Path) -> int:
    """Bytes of the data files the latest version of each table uses (what stays after cleanup)."""
    return sum(df.file_size_bytes or 0 for t in ("pool", "admissions", "claims")
               for frag in lance.dataset(str(uri / f"{t}.lance")).get_fragments() for df in frag.data_files())


def plot(sizes: list[dict[str, Any]], path: Path) -> None:
    x = [s["rows"] for s in sizes]
    fig = Figure(figsize=(11, 8))
    (a, b), (c, d) = fig.subplots(2, 2)
    a.plot(x, [s["claim"]["p50_ms"] for s in sizes], "o-", label="claim p50")
    a.plot(x, [s["claim"]["p99_ms"] for s in sizes], "s-", label="claim p99")
    a.plot(x, [s["first_claim_ms"] for s in sizes], "^--", label="first claim after (re)start")
    a.axhline(50, color="gray", ls=":", label="p50 target 50 ms")
    a.axhline(100, color="gray", ls="--", label="p99 target 100 ms")
    a.set(title="claim of 256 samples", ylabel="ms")
    b.plot(x, [s["append"]["producers_8"]["rows_per_s"] for s in sizes], "o-", label="pool, 8 producers")
    b.plot(x, [s["append"]["arrow_ipc_8"]["rows_per_s"] for s in sizes], "o--", label="Arrow IPC, same batches")
    b.plot(x, [s["append"]["producers_1"]["rows_per_s"] for s in sizes], "s-", label="pool, 1 producer")
    b.plot(x, [s["append"]["arrow_ipc_1"]["rows_per_s"] for s in sizes], "s--", label="Arrow IPC, same batches")
    b.set(title="durable appends", ylabel="rows/s")
    c.plot(x, [s["stats_s"] for s in sizes], "o-", label="pool stats")
    c.plot(x, [s["query_s"] for s in sizes], "s-", label="pool query (reward by version)")
    c.plot(x, [s["show_ms"] / 1000 for s in sizes], "^-", label="pool show (one group)")
    c.set(title="inspection", ylabel="s")
    d.plot(x, [s["bytes_per_row"] for s in sizes], "o-")
    d.set(title="disk per row (history token lengths differ by size)", ylabel="bytes")
    for ax in (a, b, c, d):
        ax.set_xscale("log")
        ax.set_xlabel("rows in the pool")
        ax.grid(alpha=0.3)
        if ax is not d:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pool_scale-", dir=args.dir))
    rng = np.random.default_rng(args.seed)
    try:
        sizes = [one_size(int(r), args, work, rng) for r in args.sizes.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    png = args.png or (args.out.with_suffix(".png") if args.out else args.dir / "pool_scale.png")
    plot(sizes, png)
    base, top = sizes[0]["claim"], sizes[-1]["claim"]
    return {
        "targets": {
            "claim_p50_under_50ms": all(s["claim"]["p50_ms"] < 50 for s in sizes),
            "claim_p99_under_100ms": all(s["claim"]["p99_ms"] < 100 for s in sizes),
            "largest_within_2x_of_smallest": top["p50_ms"] <= 2 * base["p50_ms"] and top["p99_ms"] <= 2 * base["p99_ms"],
            "append_8_producers_at_least_half_of_ipc": all(s["append"]["pool_vs_arrow_ipc_8"] >= 0.5 for s in sizes),
            "append_1_producer_at_least_half_of_ipc": all(s["append"]["pool_vs_arrow_ipc_1"] >= 0.5 for s in sizes),
        },
        "sizes": sizes, "png": str(png),
    }
