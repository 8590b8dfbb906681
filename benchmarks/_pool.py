"""The experience-pool workload the pool benchmarks share (pool_throughput.py, its --scale curve in
pool_scale.py, pool_processes.py): synthetic groups, the timed phases (producer appends, the
Arrow IPC baseline, claims) and their summaries."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from benchmarks._s3 import S3Server
from streamrl.core.types import Sample, SampleGroup, VersionSpan
from streamrl.pools import LancePool
from streamrl.pools.schema import groups_to_table

GROUP = 64  # samples per group (GRPO n); one append call stores one group
VOCAB = 151_936  # Qwen2 vocabulary: ids need 18 bits, so int encodings see realistic values
BATCH_GROUPS = 4  # a claim takes 4 groups = 256 samples
IPC_GROUPS = 4  # groups per file of the Arrow IPC baseline: about what 8 producers share a commit with
BARRIER_S = 120.0  # producers wait this long for their release at most (the main thread died otherwise)


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
    """Where a pool lives, `uri`: a directory, or a prefix on a local S3 server `s3` (benchmarks/_s3.py)."""

    def __init__(self, uri: str | Path, s3: S3Server | None = None) -> None:
        self.uri, self.s3 = str(uri), s3
        self.options = s3.storage_options if s3 else {}

    def table_version(self) -> int:
        # A separate connection, so the pool's own objects are left alone.
        return lancedb.connect(self.uri, storage_options=self.options or None).open_table("pool").version

    def mb(self) -> float:
        if self.s3 is None:
            return dir_mb(Path(self.uri))
        return round(sum(o["Size"] for o in self.s3.objects(self.uri.split("/", 3)[3])) / 1e6, 1)


def append_phase(pool: LancePool, store: Store, groups: list[SampleGroup], producers: int) -> dict[str, Any]:
    """`producers` threads, each appending its share one group per call, released together.

    Fails fast: if this thread fails before the release, the barrier is aborted and the
    producers (daemons) end; a producer's error is raised here after the others finish."""
    shares = [groups[i::producers] for i in range(producers)]
    lat: list[list[float]] = [[] for _ in range(producers)]
    errors: list[BaseException] = []
    start = threading.Barrier(producers + 1, timeout=BARRIER_S)

    def work(k: int) -> None:
        try:
            start.wait()
            for g in shares[k]:
                t0 = time.perf_counter()
                pool.append([g], admit=True)
                lat[k].append(time.perf_counter() - t0)
        except threading.BrokenBarrierError:
            pass  # the main thread failed (or timed out) before the release: it raises
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(producers)]
    for th in threads:
        th.start()
    try:
        commits0, version0 = pool.commits, store.table_version()
        start.wait()
    except BaseException:
        start.abort()
        raise
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    returned = time.perf_counter() - t0
    if errors:
        raise errors[0]
    pool.flush()  # the rates count rows committed to Lance, not only in the write-ahead log
    seconds = time.perf_counter() - t0
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
