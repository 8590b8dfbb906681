"""The LanceDB experience pool: two tables (`pool`, `admissions`) under one LanceDB URI.

Writes go through one committer thread per pool object: concurrent `append`/`admit`/
`save_partial` calls from many threads or asyncio tasks are gathered into one Lance commit
(a commit costs 5-20 ms here whatever its size), and each call returns once its rows are
committed. Claims update the `status` column in one commit, so a batch is all-or-nothing.
Only the learner (the claimer) compacts.

Long file: one class implements the pool's contract (group commit, claims, partials, ledger) on two Lance tables.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lancedb
import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core import staleness
from streamrl.core.ledger import compute_ledger
from streamrl.core.types import Admission, Batch, ConsumptionPolicy, Ledger, SampleGroup
from streamrl.pools.base import PoolError
from streamrl.pools.schema import (
    ADMISSIONS_SCHEMA,
    POOL_SCHEMA,
    admissions_to_table,
    groups_to_table,
    table_to_groups,
)

POOL_TABLE, ADMISSIONS_TABLE = "pool", "admissions"
Select = Callable[[list[SampleGroup]], tuple[list[SampleGroup], dict[str, str]]]
_CONFLICT_RETRIES = 20
COMPACT_TARGET_ROWS = 16384


def _quote(values: Sequence[str]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)


def _retry_conflicts(fn: Any) -> Any:
    """Run a Lance write, retrying when a concurrent commit (another process, compaction) wins."""
    for attempt in range(_CONFLICT_RETRIES):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - Lance raises plain errors for conflicts
            if "onflict" not in str(e) or attempt == _CONFLICT_RETRIES - 1:
                raise
            time.sleep(0.005 * (attempt + 1))


class _Item:
    """One caller's write, already converted to Arrow in the caller's thread, so a group that
    cannot be encoded fails its own caller and never the commit it would have shared."""

    __slots__ = ("kind", "table", "future")

    def __init__(self, kind: str, table: pa.Table) -> None:
        self.kind, self.table = kind, table
        self.future: cf.Future[None] = cf.Future()


class LancePool:
    """ExperiencePool on LanceDB. `uri` is a directory (RUN_DIR/pool) or any LanceDB URI."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        create: bool = True,
        run_id: str = "",
        commit_max_rows: int = 8192,
        commit_linger_ms: float = 2.0,
        compact_every: int = 64,
    ) -> None:
        self.uri = str(uri)
        self.run_id = run_id
        self.commit_max_rows = commit_max_rows
        self.commit_linger_s = commit_linger_ms / 1000
        self.compact_every = compact_every
        self.commits = 0  # Lance commits made by this object's committer (group-commit metric)
        self._partial_ids: set[str] | None = None  # stored partial groups; loaded on first write
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._compacting: threading.Thread | None = None
        self._closed = False
        if "://" not in self.uri and not create and not Path(self.uri).is_dir():
            raise PoolError(f"no experience pool at {self.uri}: the directory does not exist "
                            "(pass a run directory or its pool/ subdirectory)")
        try:
            self._db = lancedb.connect(self.uri, read_consistency_interval=timedelta(0))
            if create:
                self._pool = self._create(POOL_TABLE, POOL_SCHEMA)
                self._adm = self._create(ADMISSIONS_TABLE, ADMISSIONS_SCHEMA)
            else:
                self._pool = self._db.open_table(POOL_TABLE)
                self._adm = self._db.open_table(ADMISSIONS_TABLE)
                self._check_files()
        except PoolError:
            raise
        except Exception as e:  # noqa: BLE001
            raise PoolError(self._explain_open_error(e)) from None
        names = set(self._pool.schema.names)
        if names != set(POOL_SCHEMA.names):
            raise PoolError(f"{self.uri}: table 'pool' has columns {sorted(names ^ set(POOL_SCHEMA.names))} "
                            "that differ from this StreamRL version's schema (pools/schema.py)")

    def _check_files(self) -> None:
        """Every data file the manifests name is there with its recorded size (local pools), so
        a damaged pool is reported when it is opened rather than halfway through a query."""
        for tbl in (self._pool, self._adm):
            ds = tbl.to_lance()
            if "://" in ds.uri and not ds.uri.startswith("file://"):
                continue
            root = Path(ds.uri.removeprefix("file://")) / "data"
            for frag in ds.get_fragments():
                for df in frag.data_files():
                    f = root / df.path
                    size = getattr(df, "file_size_bytes", None)
                    if not f.is_file() or (size and f.stat().st_size != size):
                        raise PoolError(f"experience pool at {self.uri} is damaged: data file {f} is "
                                        f"{'missing' if not f.is_file() else 'truncated or replaced'}")

    def _create(self, name: str, schema: pa.Schema) -> Any:
        try:
            # Lance file format 2.0 encodes list<int32> columns ~2x faster than 2.2 here.
            return self._db.create_table(name, schema=schema, exist_ok=True, data_storage_version="2.0")
        except Exception:  # noqa: BLE001 - another process created it first
            return self._db.open_table(name)

    def _explain_open_error(self, e: Exception) -> str:
        msg = str(e).splitlines()[0][:300]
        lance_dirs = [Path(self.uri) / f"{t}.lance" for t in (POOL_TABLE, ADMISSIONS_TABLE)]
        missing = "not found" in msg.lower() or "does not exist" in msg.lower()
        if missing and not any(d.exists() for d in lance_dirs):
            return (f"{self.uri} is not an experience pool (no '{POOL_TABLE}' and '{ADMISSIONS_TABLE}' "
                    f"tables): {msg}")
        return (f"experience pool at {self.uri} is unreadable ({type(e).__name__}: {msg}); its manifest "
                "or data files are damaged or were written by an incompatible Lance version")

    # ------------------------------------------------------------ writes

    def admit(self, admissions: Sequence[Admission]) -> None:
        self._submit("admit", admissions_to_table(admissions)).result()

    async def admit_async(self, admissions: Sequence[Admission]) -> None:
        await asyncio.wrap_future(self._submit("admit", admissions_to_table(admissions)))

    async def save_partial_async(self, groups: Sequence[SampleGroup]) -> None:
        await asyncio.wrap_future(self._submit_groups("partial", groups, False)[-1])

    def append(self, groups: Sequence[SampleGroup], *, admit: bool = False) -> None:
        """Store finished groups. `admit=True` also records their admission (for producers that
        do not admit separately); admissions commit before the rows, so a crash in between
        leaves the groups in flight, never unadmitted."""
        for fut in self._submit_groups("append", groups, admit):
            fut.result()

    async def append_async(self, groups: Sequence[SampleGroup], *, admit: bool = False) -> None:
        await asyncio.gather(*(asyncio.wrap_future(f) for f in self._submit_groups("append", groups, admit)))

    def save_partial(self, groups: Sequence[SampleGroup]) -> None:
        """Store in-flight groups as `partial` (the caller's objects are not changed). A partial
        never overwrites a group that has finished meanwhile."""
        self._submit_groups("partial", groups, False)[-1].result()

    def _submit_groups(self, kind: str, groups: Sequence[SampleGroup], admit: bool) -> list[cf.Future[None]]:
        t = time.time_ns()
        for i, g in enumerate(groups):
            if not g.created_at:
                g.created_at = t + i  # keeps the caller's order as the oldest-first order
        stored = [msgspec.structs.replace(g, status="partial") for g in groups] if kind == "partial" else groups
        table = groups_to_table(stored, self.run_id)
        futs = []
        if admit:
            futs.append(self._submit("admit", admissions_to_table([
                Admission(group_id=g.group_id, prompt_id=g.prompt_id, n=len(g.samples),
                          producer_id=g.producer_id, version=g.min_version or 0, admitted_at=t)
                for g in groups])))
        futs.append(self._submit(kind, table))
        return futs

    def _submit(self, kind: str, table: pa.Table) -> cf.Future[None]:
        item = _Item(kind, table)
        with self._lock:
            if self._closed:
                raise PoolError(f"pool {self.uri} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._commit_loop, name="pool-committer", daemon=True)
                self._thread.start()
            self._queue.put(item)
        return item.future

    def _commit_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, rows, stop = [first], first.table.num_rows, False
            deadline = time.monotonic() + self.commit_linger_s
            while rows < self.commit_max_rows:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
                rows += item.table.num_rows
            try:
                self._flush(batch)
            except Exception as e:  # noqa: BLE001 - every waiting caller sees the failure
                for it in batch:
                    it.future.set_exception(e)
            else:
                for it in batch:
                    it.future.set_result(None)
            if stop:
                return

    def _flush(self, batch: list[_Item]) -> None:
        admissions = [it.table for it in batch if it.kind == "admit"]
        if admissions:
            table = pa.concat_tables(admissions)
            _retry_conflicts(lambda: self._adm.add(table))
            self.commits += 1
        # The last write of a group in this flush wins; earlier ones never reach the disk.
        seen: set[str] = set()
        writes: list[tuple[str, pa.Table, set[str]]] = []
        for it in reversed([it for it in batch if it.kind != "admit"]):
            t = it.table
            if seen:
                t = t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(list(seen), pa.string()))))
            ids = set(t["group_id"].to_pylist())
            seen |= ids
            writes.append((it.kind, t, ids))
        if not writes:
            return
        # A finished group replaces the partial stored before it, also by an earlier process
        # (before a restart): the partials in the pool are read once, then tracked here.
        if self._partial_ids is None:
            self._partial_ids = set(self.scan(["group_id"], where="status = 'partial'")["group_id"].to_pylist())
        stored_partial = pa.array(list(self._partial_ids & seen), pa.string())
        plain, upsert = [], []
        for kind, t, _ in writes:
            replaces = pc.is_in(t["group_id"], value_set=stored_partial)
            if kind == "partial":
                upsert.append(t)
            else:
                plain.append(t.filter(pc.invert(replaces)))
                upsert.append(t.filter(replaces))
        plain_t = pa.concat_tables(plain) if plain else None
        upsert_t = pa.concat_tables(upsert) if upsert else None
        if plain_t is not None and plain_t.num_rows:
            _retry_conflicts(lambda: self._pool.add(plain_t))
            self.commits += 1
        if upsert_t is not None and upsert_t.num_rows:
            # Only partial rows are replaced: a late partial of a finished group is ignored.
            _retry_conflicts(lambda: self._pool.merge_insert("uid")
                             .when_matched_update_all(where="target.status = 'partial'")
                             .when_not_matched_insert_all().execute(upsert_t))
            self.commits += 1
        for kind, _, ids in writes:
            if kind == "partial":
                self._partial_ids |= ids
            else:
                self._partial_ids -= ids

    # ------------------------------------------------------------ reads

    def scan(self, columns: list[str] | None = None, where: str | None = None, table: str = POOL_TABLE) -> pa.Table:
        tbl = self._pool if table == POOL_TABLE else self._adm
        q = tbl.search()
        if where:
            q = q.where(where)
        if columns:
            q = q.select(columns)
        with self._reading(where):
            return q.limit(None).to_arrow()

    def reader(self, columns: list[str] | None = None, where: str | None = None) -> pa.RecordBatchReader:
        """Stream pool rows (one Lance version) without loading them all."""
        with self._reading(where):
            return self._pool.to_lance().scanner(columns=columns, filter=where).to_reader()

    @contextlib.contextmanager
    def _reading(self, where: str | None) -> Iterator[None]:
        """Lance read errors become a ValueError naming the filter (the caller's mistake) or a
        PoolError (damaged files), never a raw traceback."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:400]
            if any(k in msg for k in ("Schema error", "No field named", "Invalid user input", "parse")):
                raise ValueError(f"bad filter {where!r}: {msg}") from None
            raise PoolError(f"experience pool at {self.uri} is unreadable ({type(e).__name__}: {msg})") from None

    def partial_groups(self, producer_id: str | None = None) -> list[SampleGroup]:
        where = "status = 'partial'"
        if producer_id is not None:
            where += f" AND producer_id = {_quote([producer_id])}"
        return table_to_groups(self.scan(where=where))

    def groups(self, group_ids: Sequence[str]) -> list[SampleGroup]:
        if not group_ids:
            return []
        return table_to_groups(self.scan(where=f"group_id IN ({_quote(group_ids)})"))

    def consumed_steps(self, first: int = 0, last: int | None = None) -> dict[int, list[str]]:
        """{learner step: ids of the groups it trained on} for steps first..last: what a resumed run
        re-trains after its checkpoint and what `streamrl replay` re-trains."""
        where = f"status = 'consumed' AND consumed_step >= {int(first)}"
        if last is not None:
            where += f" AND consumed_step <= {int(last)}"
        t = self.scan(["group_id", "consumed_step"], where=where)
        out: dict[int, set[str]] = {}
        for gid, step in zip(t["group_id"].to_pylist(), t["consumed_step"].to_pylist()):
            out.setdefault(int(step), set()).add(gid)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def producer_groups(self, producer_id: str) -> dict[str, tuple[str | None, int]]:
        """{group id: (status, admitted ns)} of every group `producer_id` admitted; status None for a
        group admitted but not stored yet (it was in flight when the run stopped)."""
        q = _quote([producer_id])
        adm = self.scan(["group_id", "admitted_ns"], where=f"producer_id = {q}", table=ADMISSIONS_TABLE)
        rows = self.scan(["group_id", "status"], where=f"producer_id = {q}")
        status = dict(zip(rows["group_id"].to_pylist(), rows["status"].to_pylist()))
        return {g: (status.get(g), t) for g, t in zip(adm["group_id"].to_pylist(), adm["admitted_ns"].to_pylist())}

    def ledger(self) -> Ledger:
        # Rows before admissions: a group admitted and stored between the two reads then
        # shows as admitted-and-in-flight (true a moment ago), never as unadmitted.
        rows = self.scan(["group_id", "sample_index", "status"])
        adm = self.scan(["group_id", "n"], table=ADMISSIONS_TABLE)
        return compute_ledger(adm, rows)

    def count_rows(self) -> int:
        return self._pool.count_rows()

    # ------------------------------------------------------------ learner side

    def claim(
        self,
        step: int,
        learner_version: int,
        num_groups: int,
        max_staleness: int,
        policy: ConsumptionPolicy = "drop",
        select: Select | None = None,
    ) -> Batch | None:
        """`select(groups)` may pick which of the claimed groups are trained on: it returns the
        kept groups and {group_id: reason} for the rest, which are stored as dropped with that
        reason (over-sampling)."""
        cand = self.scan(["group_id", "created_ns", "min_version", "n_samples", "sample_index"],
                         where="status = 'complete'")
        firsts = cand.group_by("group_id").aggregate(
            [("created_ns", "min"), ("min_version", "min"), ("n_samples", "max"), ("sample_index", "count_distinct"),
             ("sample_index", "count")])
        # Whole groups only: a group missing rows is `lost` in the ledger, never trained on.
        whole = pc.and_(pc.equal(firsts["sample_index_count_distinct"], firsts["n_samples_max"]),
                        pc.equal(firsts["sample_index_count"], firsts["n_samples_max"]))
        firsts = firsts.filter(whole)
        order = pc.sort_indices(firsts, [("created_ns_min", "ascending"), ("group_id", "ascending")])
        firsts = firsts.take(order)
        take, mask, drop = staleness.select_groups(
            zip(firsts["group_id"].to_pylist(), firsts["min_version_min"].to_pylist()),
            learner_version, num_groups, max_staleness, policy)
        t = time.time_ns()
        if drop:
            _retry_conflicts(lambda: self._pool.update(
                where=f"status = 'complete' AND group_id IN ({_quote(drop)})",
                values={"status": "dropped", "drop_reason": "stale", "claimed_ns": t,
                        "consumed_version": learner_version}))
        self.maybe_compact()
        if len(take) < num_groups:
            return None
        rows = self.scan(where=f"group_id IN ({_quote(take)})")
        by_id = {g.group_id: g for g in table_to_groups(rows)}
        rejected: dict[str, str] = {}
        if select is not None:
            kept, rejected = select([by_id[g] for g in take])
            take = [g.group_id for g in kept]
        # Rejected first: a crash between the two commits leaves the kept groups complete, to
        # be claimed again; no group is ever both trained on and dropped.
        for reason in sorted(set(rejected.values())):
            ids = [g for g, r in rejected.items() if r == reason]
            _retry_conflicts(lambda: self._pool.update(
                where=f"status = 'complete' AND group_id IN ({_quote(ids)})",
                values={"status": "dropped", "drop_reason": reason, "claimed_ns": t,
                        "consumed_version": learner_version}))
        if take:
            _retry_conflicts(lambda: self._pool.update(
                where=f"status = 'complete' AND group_id IN ({_quote(take)})",
                values={"status": "consumed", "consumed_step": step, "consumed_version": learner_version,
                        "claimed_ns": t}))
        groups, masked = [], 0
        for gid in take:
            g = by_id[gid]
            g.status, g.consumed_step, g.consumed_version = "consumed", step, learner_version
            if gid in mask:
                masked += staleness.mask_stale_tokens(g, learner_version, max_staleness)
            groups.append(g)
        return Batch(step=step, learner_version=learner_version, groups=groups, dropped=drop, masked_tokens=masked,
                     rejected=rejected)

    def compact(self) -> None:
        """Merge small fragments into ~16k-row ones (bounded, so a big fragment is not
        rewritten every time), drop versions older than 10 minutes, and keep the scalar
        indices that make claims fast up to date."""
        from lancedb.index import Bitmap, BTree

        for tbl, indexed in ((self._pool, {"group_id": BTree(), "status": Bitmap(), "uid": BTree()}),
                             (self._adm, {"group_id": BTree()})):
            if tbl.count_rows() == 0:
                continue
            _retry_conflicts(lambda: tbl.to_lance().optimize.compact_files(
                target_rows_per_fragment=COMPACT_TARGET_ROWS, materialize_deletions_threshold=0.1))
            have = {c for idx in tbl.list_indices() for c in idx.columns}
            for col, cfg in indexed.items():
                if col not in have:
                    _retry_conflicts(lambda: tbl.create_index(col, config=cfg))
            _retry_conflicts(lambda: tbl.to_lance().optimize.optimize_indices())
            tbl.to_lance().cleanup_old_versions(older_than=timedelta(minutes=10))

    def fragments(self) -> int:
        return len(self._pool.to_lance().get_fragments())

    def maybe_compact(self) -> bool:
        """Start a background compaction when `compact_every` fragments have accumulated."""
        if not self.compact_every or (self._compacting and self._compacting.is_alive()):
            return False
        if self.fragments() < self.compact_every:
            return False
        # Not a daemon: interpreter exit waits for it instead of killing Lance mid-write.
        self._compacting = threading.Thread(target=self.compact, name="pool-compact")
        self._compacting.start()
        return True

    # ------------------------------------------------------------ misc

    @property
    def tokenizer(self) -> str | None:
        return (self._pool.to_lance().schema.metadata or {}).get(b"streamrl.tokenizer", b"").decode() or None

    def set_tokenizer(self, path: str) -> None:
        """Record the tokenizer (a directory or tokenizer.json) so `pool show` can decode text."""
        ds = self._pool.to_lance()
        _retry_conflicts(lambda: ds.update_schema_metadata({"streamrl.tokenizer": str(path)}))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()
        if self._compacting is not None:
            self._compacting.join()

    def __enter__(self) -> LancePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
