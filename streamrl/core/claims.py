"""Claims: what a learner step decided about stored groups, and the groups it may still claim.

A claim never rewrites sample rows. It appends one narrow row per group it decided about
(consumed by step s at version v, or dropped with a reason) to the pool's `claims` table, so a
group's state is its stored status unless a claim overrides it (`apply_claims`). The learner
keeps the complete, unclaimed groups in a `ReadySet` fed only with the rows each commit adds,
so a claim costs the same at 10k rows as at 10M.

Pure: inputs are Arrow tables read by the pool, so the simulator and tests use the same rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

# Columns of a sample row that a claim decides; everything else is fixed when the row is stored.
CLAIM_COLUMNS: tuple[str, ...] = ("status", "drop_reason", "claimed_ns", "consumed_step", "consumed_version")
# What the ready set needs from each new row, besides `row_id` (to read the group back) and
# `version` (the pool-table version that wrote it).
READY_COLUMNS: tuple[str, ...] = ("group_id", "sample_index", "n_samples", "status", "created_ns", "min_version")


def apply_claims(rows: pa.Table, claims: pa.Table) -> pa.Table:
    """`rows` (with `group_id`) as the claims say they are now: for a claimed group, each claim
    column present in `rows` takes the claim's value. Row order is kept. A group claimed twice
    (an anomaly the ledger reports) reads as its first claim."""
    present = [c for c in CLAIM_COLUMNS if c in rows.column_names]
    if not present or claims.num_rows == 0 or rows.num_rows == 0:
        return rows
    idx = pc.index_in(rows["group_id"], value_set=claims["group_id"])
    hit = pc.is_valid(idx)
    if not pc.any(hit).as_py():
        return rows
    for col in present:
        claimed = claims[col].combine_chunks().take(idx)
        stored = rows[col].combine_chunks()
        merged = pc.if_else(hit, claimed.cast(stored.type), stored)
        rows = rows.set_column(rows.column_names.index(col), col, merged)
    return rows


def group_summary(rows: pa.Table) -> pa.Table:
    """One row per group of `rows` (group_id, sample_index, n_samples, status, ...): whether it is
    whole (exactly n_samples rows, indices 0..n-1 once each, one status) and its claim-order keys."""
    aggs = [("sample_index", "count"), ("sample_index", "count_distinct"), ("sample_index", "min"),
            ("sample_index", "max"), ("n_samples", "max"), ("status", "count_distinct"), ("status", "min")]
    for col, fn in (("created_ns", "min"), ("min_version", "min"), ("version", "max"), ("row_id", "list")):
        if col in rows.column_names:
            aggs.append((col, fn))
    t = rows.group_by("group_id", use_threads=False).aggregate(aggs)
    n = t["n_samples_max"]
    whole = pc.and_(pc.and_(pc.equal(t["sample_index_count"], n), pc.equal(t["sample_index_count_distinct"], n)),
                    pc.and_(pc.and_(pc.equal(t["sample_index_min"], 0), pc.equal(t["sample_index_max"], pc.subtract(n, 1))),
                            pc.equal(t["status_count_distinct"], 1)))
    return t.append_column("whole", pc.fill_null(whole, False))


@dataclass
class _Ready:
    created_ns: int
    min_version: int | None
    version: int  # pool-table version that stored its rows
    row_ids: list[int]


class ReadySet:
    """Complete groups no claim has decided about yet, in claim order (oldest first).

    Feed it every row a commit adds or updates (`add_rows`: READY_COLUMNS, `row_id`, `version`);
    rows of other states are ignored. A group is ready when one commit stored it whole; rows of
    a group seen again (stored twice) or a group found damaged when read back make it `broken`:
    never claimed, and the ledger reports it."""

    def __init__(self, claimed: Iterable[str] = ()) -> None:
        self.ready: dict[str, _Ready] = {}
        self.claimed: set[str] = set(claimed)
        self.broken: set[str] = set()
        self._order: list[tuple[str, int | None]] | None = None

    def __len__(self) -> int:
        return len(self.ready)

    def add_rows(self, rows: pa.Table) -> None:
        rows = rows.filter(pc.equal(rows["status"], "complete"))
        if rows.num_rows == 0:
            return
        s = group_summary(rows)
        cols = {c: s[c].to_pylist() for c in ("group_id", "whole", "created_ns_min", "min_version_min", "version_max",
                                              "row_id_list")}
        for gid, whole, created, minv, version, row_ids in zip(*cols.values()):
            if gid in self.claimed or gid in self.broken:
                continue
            if gid in self.ready or not whole:  # stored again, or not as one whole group
                self.ready.pop(gid, None)
                self.broken.add(gid)
            else:
                self.ready[gid] = _Ready(created, minv, version, row_ids)
        self._order = None

    def candidates(self) -> list[tuple[str, int | None]]:
        """(group id, oldest token version) of every ready group, oldest created first."""
        if self._order is None:
            keyed = sorted(self.ready.items(), key=lambda kv: (kv[1].created_ns, kv[0]))
            self._order = [(gid, r.min_version) for gid, r in keyed]
        return self._order

    def row_ids(self, group_ids: Iterable[str]) -> list[int]:
        return [r for gid in group_ids for r in self.ready[gid].row_ids]

    def mark_claimed(self, group_ids: Iterable[str]) -> None:
        for gid in group_ids:
            self.claimed.add(gid)
            self.ready.pop(gid, None)
        self._order = None

    def mark_broken(self, group_ids: Iterable[str]) -> None:
        for gid in group_ids:
            self.broken.add(gid)
            self.ready.pop(gid, None)
        self._order = None

    def frontier(self, seen_version: int) -> int:
        """A pool-table version such that every group that may still be claimed was stored after
        it: a restarted learner reads only the rows written since (claims record it)."""
        return min((r.version for r in self.ready.values()), default=seen_version + 1) - 1


def not_whole(rows: pa.Table, group_ids: Iterable[str]) -> set[str]:
    """Of `group_ids`, those whose rows in `rows` (read back for training by row id) are not
    exactly one whole, complete group: a row was deleted or replaced since they became ready."""
    wanted = set(group_ids)
    s = group_summary(rows)
    ok = {gid for gid, whole, st in zip(s["group_id"].to_pylist(), s["whole"].to_pylist(), s["status_min"].to_pylist())
          if whole and st == "complete"}
    return wanted - ok


def claim_columns(decisions: list[tuple[str, str, str | None]], step: int, learner_version: int) -> dict[str, list]:
    """Column values of the claim rows for `decisions` [(group id, 'consumed'|'dropped', reason)]:
    consumed groups carry the step as `consumed_step`, every decision the step and the learner version."""
    return {
        "step": [step] * len(decisions),
        "group_id": [g for g, _, _ in decisions],
        "status": [s for _, s, _ in decisions],
        "drop_reason": [r for _, _, r in decisions],
        "consumed_step": [step if s == "consumed" else None for _, s, _ in decisions],
        "consumed_version": [learner_version] * len(decisions),
    }

