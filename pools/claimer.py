"""The learner's claim: whole groups, oldest first, recorded in the `claims` table in one commit.

What a claim needs (complete groups nobody claimed yet) lives in a `ReadySet` in memory. Every
claim after the first reads only the pool-table fragments added since the one before (Lance
numbers fragments in the order they are made and never reuses a number; an append or a
compaction adds fragments, nothing adds rows to an existing one), and of those only the rows
written since (Lance's stable row ids keep each row's last-updated version, so the rows a
compaction rewrote are not read as new): its cost follows how much arrived since the last step,
not how much the pool holds. A learner that starts fills the set from the claims table and the
rows stored after the last claim's `ready_after_version`, found the same way from that version's
fragments while Lance still keeps it (pools/asof.py: the newest pool.keep_versions; then every
fragment is filtered, once). Pools created before claims had stable row ids (old pools) are
read whole every time instead: correct, and as slow as before.

The chosen groups are read back by row id and checked whole again (a group whose rows were
deleted or replaced since is never handed out; one stored twice was already set aside when its
second copy was read). The decision about every
group (consumed, or dropped as stale or by `select`) is one append to `claims`: a learner
killed mid-claim either claimed the whole batch or nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core import staleness
from streamrl.core.claims import READY_COLUMNS, ReadySet, claim_columns, not_whole
from streamrl.core.types import Batch, ConsumptionPolicy, SampleGroup
from streamrl.pools.committer import outlast_store, retry_conflicts
from streamrl.pools.reads import by_row_id
from streamrl.pools.schema import POOL_SCHEMA, claims_to_table, table_to_groups

Select = Callable[[list[SampleGroup]], tuple[list[SampleGroup], dict[str, str]]]
_VERSION_COL = "_row_last_updated_at_version"


def _made_after(ds: Any, fragments: list[Any], version: int) -> list[Any] | None:
    """Of `fragments` (of `ds`), those made after pool-table `version`: every row written after
    it is in one of them. None when Lance no longer keeps that version (then any may hold one)."""
    try:
        old = ds.checkout_version(version)
    except OSError:  # cleaned up (or never made): not found
        return None
    last = max((f.fragment_id for f in old.get_fragments()), default=-1)
    return [f for f in fragments if f.fragment_id > last]


class Claimer:
    """`open_table(name)`: a fresh pylance dataset at its latest version; `claims()`: the claims table."""

    def __init__(self, open_table: Callable[[str], Any], claims: Callable[[], pa.Table]) -> None:
        self._open, self._claims = open_table, claims
        self._lock = threading.Lock()
        self.ready: ReadySet | None = None
        self.seen = -1  # pool-table version whose rows the ready set holds
        self.last_fragment = -1  # highest pool-table fragment id at version `seen`
        self.stable = False  # the pool table has stable row ids (each row knows the version that wrote it)
        self.rows_read = 0  # rows read to keep the ready set up to date, since this object was made
        self.rows_scanned = 0  # rows in the fragments those reads filtered (what they cost)
        self.stale_dropped = 0  # groups this object dropped as stale (streaming admits as many more)
        self._claims_ds: Any = None

    def _rows(self, ds: Any, where: str, fragments: list[Any] | None = None) -> pa.Table:
        """READY_COLUMNS, row id and version of the rows `where` selects, in `fragments` (None: all)."""
        stable = ds.has_stable_row_ids
        t = ds.scanner(columns=[*READY_COLUMNS, *([_VERSION_COL] if stable else [])], filter=where, with_row_id=True,
                       fragments=fragments).to_table()
        version = t[_VERSION_COL].cast(pa.int64()) if stable else pa.repeat(pa.scalar(ds.version, pa.int64()), t.num_rows)
        self.rows_read += t.num_rows
        self.rows_scanned += sum(f.physical_rows for f in (ds.get_fragments() if fragments is None else fragments))
        return (t.select(list(READY_COLUMNS)).append_column("row_id", t["_rowid"].cast(pa.int64()))
                .append_column("version", version))

    def sync(self, ds: Any) -> None:
        """Bring the ready set up to `ds`'s version."""
        self.stable = ds.has_stable_row_ids
        fragments = ds.get_fragments() if self.stable else []
        if self.ready is None or not self.stable:
            claims = self._claims()
            self.ready = ReadySet(claims["group_id"].to_pylist())
            where, scan = "status = 'complete'", None
            after = pc.max(claims["ready_after_version"]).as_py() if self.stable and claims.num_rows else None
            if after is not None:
                where += f" AND {_VERSION_COL} > {int(after)}"
                scan = _made_after(ds, fragments, int(after))
            if scan != []:
                self.ready.add_rows(self._rows(ds, where, scan))
        elif ds.version > self.seen:
            new = [f for f in fragments if f.fragment_id > self.last_fragment]
            if new:
                self.ready.add_rows(self._rows(ds, f"{_VERSION_COL} > {self.seen}", new))
        self.seen = ds.version
        self.last_fragment = max((f.fragment_id for f in fragments), default=self.last_fragment)

    def claim(self, step: int, learner_version: int, num_groups: int, max_staleness: int,
              policy: ConsumptionPolicy = "drop", select: Select | None = None) -> Batch | None:
        with self._lock:
            ds = self._open("pool")
            self.sync(ds)
            assert self.ready is not None
            while True:
                take, mask, drop = staleness.select_groups(self.ready.candidates(), learner_version, num_groups,
                                                           max_staleness, policy)
                if len(take) < num_groups:
                    self._commit([(g, "dropped", "stale") for g in drop], step, learner_version, ds.version)
                    return None
                # By row id: a take, where a filter on group_id scans (10x slower here).
                rows = by_row_id(ds, POOL_SCHEMA.names, self.ready.row_ids(take))
                damaged = not_whole(rows, take)
                if not damaged:
                    break
                self.ready.mark_broken(damaged)
            by_id = {g.group_id: g for g in table_to_groups(rows)}
            rejected: dict[str, str] = {}
            if select is not None:
                kept, rejected = select([by_id[g] for g in take])
                take = [g.group_id for g in kept]
            self._commit([(g, "dropped", "stale") for g in drop] + [(g, "dropped", r) for g, r in rejected.items()]
                         + [(g, "consumed", None) for g in take], step, learner_version, ds.version)
        groups, masked = [], 0
        for gid in take:
            g = by_id[gid]
            g.status, g.consumed_step, g.consumed_version = "consumed", step, learner_version
            if gid in mask:
                masked += staleness.mask_stale_tokens(g, learner_version, max_staleness)
            groups.append(g)
        return Batch(step=step, learner_version=learner_version, groups=groups, dropped=drop, masked_tokens=masked,
                     rejected=rejected)

    def _commit(self, decisions: list[tuple[str, str, str | None]], step: int, learner_version: int,
                pool_version: int) -> None:
        """One append to `claims`; its rows record `pool_version` (the pool table the decisions were
        made on) and the admissions table's version, so the pool can be read as of this step."""
        if not decisions:
            return
        assert self.ready is not None
        self.ready.mark_claimed(g for g, _, _ in decisions)
        after = self.ready.frontier(self.seen) if self.stable else None
        read = (pool_version, self._open("admissions").version)
        table = claims_to_table(claim_columns(decisions, step, learner_version), time.time_ns(), after, read)
        if self._claims_ds is None:
            self._claims_ds = self._open("claims")
        # A claims table from before time travel lacks its columns: its claims are stored without them.
        table = table.select([c for c in table.column_names if c in self._claims_ds.schema.names])
        stamp = table["claimed_ns"][0].as_py()

        def insert(again: bool) -> None:
            if again:  # the store refused it: it may have landed all the same
                self._claims_ds = self._open("claims")
                if self._claims_ds.count_rows(filter=f"claimed_ns = {stamp}"):
                    return
            retry_conflicts(lambda: self._claims_ds.insert(table))

        try:
            outlast_store(insert, "claim")
        except BaseException:
            self.ready = None  # not committed: read the truth again at the next claim
            raise
        self.stale_dropped += sum(reason == "stale" for _, _, reason in decisions)
