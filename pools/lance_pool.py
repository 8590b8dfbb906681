"""The LanceDB experience pool: three tables (`pool`, `admissions`, `claims`) under one LanceDB URI.

- writes (`admit`, `append`, `save_partial`) go through one committer thread per pool object
  (pools/committer.py): concurrent calls share a Lance commit; each returns once committed. With
  `write_ahead` (local pools) each returns once its rows are in this process's write-ahead log
  (pools/wal.py), drained into Lance in large commits behind it: the object's own reads wait
  for that, other processes see the rows up to a commit later, and a dead writer's log is
  committed by the next process to open the pool or by the learner's next claim;
- `claim` (pools/claimer.py) records the learner's decisions in the narrow `claims` table in one
  commit and never rewrites sample rows; it costs what arrived since the last step, not what
  the pool holds;
- every read applies the claims to the stored rows (pools/reads.py), so `status`,
  `consumed_step`, ... read the same as if the rows had been updated;
- only the learner (the claimer) compacts, in a background thread (pools/compaction.py).

Tables are created with stable row ids (each row keeps the version that last wrote it, across
compactions), which is what lets the learner read only new rows.

Long file: the pool's whole API is this one class (writes, reads, the learner's side, time
travel); each part's work is done in the module it names (committer, reads, claimer,
compaction, asof).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lancedb
import msgspec
import pyarrow as pa

from streamrl.core.ledger import compute_ledger
from streamrl.core.types import Admission, Batch, ConsumptionPolicy, Ledger, SampleGroup
from streamrl.pools import asof, compaction, damage, reads
from streamrl.pools.errors import NoPool, PoolError
from streamrl.pools.claimer import Claimer, Select
from streamrl.pools.committer import Committer, Item, retry_conflicts
from streamrl.pools.reads import quote
from streamrl.pools.schema import (
    ADMISSIONS_SCHEMA,
    ADMISSIONS_TABLE,
    CLAIMS_SCHEMA,
    CLAIMS_TABLE,
    POOL_SCHEMA,
    POOL_TABLE,
    add_new_columns,
    added_columns,
    admissions_to_table,
    groups_to_table,
    table_to_groups,
)

SCHEMAS = {POOL_TABLE: POOL_SCHEMA, ADMISSIONS_TABLE: ADMISSIONS_SCHEMA, CLAIMS_TABLE: CLAIMS_SCHEMA}
WAL_DIR = "_wal"  # this pool's write-ahead logs (pools/wal.py)
RECOVER_EVERY_S = 2.0  # how often the learner's claims look for logs of writers that stopped
# New tables: Lance file format 2.0 (encodes list<int32> columns ~2x faster than 2.2 here) and
# stable row ids (the learner's claim reads only rows written since its last one).
log = logging.getLogger(__name__)
NEW_TABLE_OPTIONS = {"new_table_data_storage_version": "2.0", "new_table_enable_stable_row_ids": "true"}


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
        storage_options: dict[str, str] | None = None,
        write_ahead: bool = False,
        keep_versions: int = 1000,
    ) -> None:
        """`storage_options`: object-store settings (credentials, endpoint) for a URI such as
        s3://bucket/run/pool, passed to LanceDB and to every pylance dataset. `write_ahead`:
        writes return once in this process's write-ahead log rather than once committed (local
        directories only: an object store has no file locks). `keep_versions`: the compaction
        removes all but the newest this many versions of each table, and tagged ones (0: none)."""
        self.uri = str(uri)
        if write_ahead and "://" in self.uri:
            raise PoolError(f"pool.write_ahead needs a pool in a local directory, not {self.uri}: the log's "
                            "writers are told apart by file locks, which object stores do not have")
        self._storage_options = dict(storage_options or {})
        self.run_id = run_id
        self.compact_every = compact_every
        self.keep_versions = keep_versions
        self._warned_as_of = False
        self._compacting: threading.Thread | None = None
        if "://" not in self.uri and not create and not Path(self.uri).is_dir():
            raise NoPool(f"no experience pool at {self.uri}: the directory does not exist "
                            "(pass a run directory or its pool/ subdirectory)")
        self._tables: dict[str, Any] = {}
        try:
            self._db = lancedb.connect(self.uri, read_consistency_interval=timedelta(0),
                                       storage_options={**self._storage_options, **NEW_TABLE_OPTIONS})
            for name, schema in SCHEMAS.items():
                if create:
                    self._tables[name] = self._create(name, schema)
                elif name != CLAIMS_TABLE or name in self._db.list_tables().tables:
                    self._tables[name] = self._db.open_table(name)  # a pool from before claims has none
            first = self._tables[POOL_TABLE].to_lance()
            self._uris = {name: t.to_lance().uri for name, t in self._tables.items()}
            self._session = first.session()
            if not create:
                damage.check_files(self.uri, (t.to_lance() for t in self._tables.values()))
        except PoolError:
            raise
        except Exception as e:  # noqa: BLE001
            raise damage.open_error(self.uri, e, (POOL_TABLE, ADMISSIONS_TABLE)) from None
        self._pool, self._adm = self._tables[POOL_TABLE], self._tables[ADMISSIONS_TABLE]
        names = set(self._pool.schema.names)
        if added_columns(names):  # a pool from before them: add them, all null (metadata only)
            names = add_new_columns(lambda: self._open(POOL_TABLE))
        if names != set(POOL_SCHEMA.names):
            raise PoolError(f"{self.uri}: table 'pool' has columns {sorted(names ^ set(POOL_SCHEMA.names))} "
                            "that differ from this StreamRL version's schema (pools/schema.py)")
        self._claims = reads.ClaimsCache(lambda: self._open(CLAIMS_TABLE) if CLAIMS_TABLE in self._uris else None)
        wal_dir = Path(self.uri) / WAL_DIR if "://" not in self.uri else None  # also to commit logs of dead writers
        self._committer = Committer(self._open, self._stored_partials, commit_max_rows, commit_linger_ms / 1000,
                                    wal_dir, write_ahead)
        self._claimer = Claimer(self._open, self._claims.get)
        self._recovered_at = 0.0
        self.recover()

    def _open(self, name: str) -> Any:
        """A fresh pylance dataset of table `name` at its latest version (objects are not shared
        between threads; the session's caches are)."""
        import lance  # here, not at import: a process that loaded lance warns on every fork

        if name not in self._uris:  # a pool from before claims, opened read-only, claimed from
            self._tables[name] = self._create(name, SCHEMAS[name])
            self._uris[name] = self._tables[name].to_lance().uri
        return lance.dataset(self._uris[name], session=self._session, storage_options=self._storage_options or None)

    def _create(self, name: str, schema: pa.Schema) -> Any:
        try:
            return self._db.create_table(name, schema=schema, exist_ok=True)
        except Exception:  # noqa: BLE001 - another process created it first
            return self._db.open_table(name)

    # ------------------------------------------------------------ writes

    @property
    def commits(self) -> int:
        """Lance commits made by this object's committer (the group-commit metric)."""
        return self._committer.commits

    def admit(self, admissions: Sequence[Admission]) -> None:
        self._submit("admit", admissions_to_table(admissions), [a.group_id for a in admissions]).result()

    async def admit_async(self, admissions: Sequence[Admission]) -> None:
        await asyncio.wrap_future(self._submit("admit", admissions_to_table(admissions),
                                               [a.group_id for a in admissions]))

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
        ids = [g.group_id for g in groups]
        futs = []
        if admit:
            futs.append(self._submit("admit", admissions_to_table([
                Admission(group_id=g.group_id, prompt_id=g.prompt_id, n=len(g.samples),
                          producer_id=g.producer_id, version=g.min_version or 0, admitted_at=t)
                for g in groups]), ids))
        futs.append(self._submit(kind, table, ids))
        return futs

    def _submit(self, kind: str, table: pa.Table, group_ids: list[str]) -> cf.Future[None]:
        try:
            return self._committer.submit(Item(kind, table, group_ids))
        except RuntimeError:
            raise PoolError(f"pool {self.uri} is closed") from None

    def _stored_partials(self) -> set[str]:
        # Not through scan(): the committer thread calls this, and scan() waits for that thread.
        return set(reads.filtered(self._open(POOL_TABLE), ["group_id"], "status = 'partial'")["group_id"].to_pylist())

    def flush(self) -> None:
        """Wait until this object's writes so far are committed to the tables (other processes
        see them from then on). Reads through this object do it themselves."""
        self._committer.sync()

    def recover(self) -> int:
        """Commit the write-ahead logs of writers that stopped without committing them (their
        calls returned, so the rows are owed). Idempotent; returns the rows committed."""
        self._recovered_at = time.monotonic()
        rows = self._committer.recover()
        if rows:
            log.warning("experience pool %s: committed %d rows from the write-ahead logs of writers that stopped",
                        self.uri, rows)
        return rows

    # ------------------------------------------------------------ reads

    def snapshot(self) -> reads.Snapshot:
        """The pool table at its latest version, with the claims read just before: reads through
        one snapshot agree with each other (`scan`, `reader` and `count` each take a new one)."""
        self._committer.sync()
        claims = self._claims.get()  # before the rows: see pools/reads.py
        return reads.Snapshot(self._open(POOL_TABLE), claims)

    def scan(self, columns: list[str] | None = None, where: str | None = None, table: str = POOL_TABLE,
             *, effective: bool = True) -> pa.Table:
        """Rows of `table` (pool, admissions or claims). Pool rows read with the claims applied
        (`status` is `consumed` once a step trained on the group); `effective=False` reads them as stored."""
        with self.reading(where):
            if table != POOL_TABLE:
                if table not in self._uris:
                    return SCHEMAS[table].empty_table().select(columns or SCHEMAS[table].names)
                return self._open(table).to_table(columns=columns, filter=where)
            if not effective:
                return reads.filtered(self._open(POOL_TABLE), list(columns or POOL_SCHEMA.names), where)
            return self.snapshot().scan(columns, where)

    def reader(self, columns: list[str] | None = None, where: str | None = None,
               batch_rows: int = 1024) -> pa.RecordBatchReader:
        """Stream pool rows (one Lance version, claims applied) without loading them all."""
        with self.reading(where):
            return self.snapshot().batches(columns, where, batch_rows)

    def count(self, where: str | None = None) -> int:
        """Rows `where` selects (claims applied)."""
        with self.reading(where):
            return self.snapshot().count(where)

    def claims(self) -> pa.Table:
        """The claims table (one row per group the learner decided about)."""
        self._committer.sync()
        return self._claims.get()

    @contextlib.contextmanager
    def reading(self, where: str | None) -> Iterator[None]:
        """Lance read errors become a ValueError naming the filter (the caller's mistake) or a
        PoolError (damaged files), never a raw traceback. This object's own writes are committed first."""
        self._committer.sync()
        try:
            yield
        except ValueError as e:
            if str(e).startswith("bad filter"):
                raise
            raise self._read_error(e, where) from None
        except Exception as e:  # noqa: BLE001
            raise self._read_error(e, where) from None

    def _read_error(self, e: Exception, where: str | None) -> Exception:
        msg = str(e).splitlines()[0][:400]
        if any(k in msg for k in ("Schema error", "No field named", "Invalid user input", "parse")):
            return ValueError(f"bad filter {where!r}: {msg}")
        return PoolError(f"experience pool at {self.uri} is unreadable ({type(e).__name__}: {msg})")

    def partial_groups(self, producer_id: str | None = None) -> list[SampleGroup]:
        where = "status = 'partial'"  # claims never decide about partial groups: the stored status is it
        if producer_id is not None:
            where += f" AND producer_id = {quote([producer_id])}"
        return table_to_groups(self.scan(where=where, effective=False))

    def groups(self, group_ids: Sequence[str]) -> list[SampleGroup]:
        if not group_ids:
            return []
        return table_to_groups(self.scan(where=f"group_id IN ({quote(group_ids)})"))

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
        q = quote([producer_id])
        rows = self.scan(["group_id", "status"], where=f"producer_id = {q}")
        adm = self.scan(["group_id", "admitted_ns"], where=f"producer_id = {q}", table=ADMISSIONS_TABLE)
        status = dict(zip(rows["group_id"].to_pylist(), rows["status"].to_pylist()))
        return {g: (status.get(g), t) for g, t in zip(adm["group_id"].to_pylist(), adm["admitted_ns"].to_pylist())}

    def ledger(self) -> Ledger:
        # Claims, then rows, then admissions: a group claimed, or admitted and stored, between two
        # reads shows as it was a moment ago, never as claimed-without-rows or unadmitted.
        claims = self._claims.get()  # (the committer never writes claims; scan() waits for it)
        rows = self.scan(["group_id", "sample_index", "status"], effective=False)
        adm = self.scan(["group_id", "n"], table=ADMISSIONS_TABLE)
        return compute_ledger(adm, rows, claims)

    def count_rows(self) -> int:
        self._committer.sync()
        return self._open(POOL_TABLE).count_rows()

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
        """Claim the oldest `num_groups` whole complete groups for learner `step`, applying the
        consumption policy to groups over the staleness bound. `select(groups)` may pick which of
        them are trained on: it returns the kept groups and {group_id: reason} for the rest,
        which are stored as dropped with that reason (over-sampling). None if too few are ready
        (stale groups met on the way are dropped all the same)."""
        self._committer.sync()
        if time.monotonic() - self._recovered_at > RECOVER_EVERY_S:
            self.recover()  # a producer that died: what its calls returned for is owed to the learner
        batch = self._claimer.claim(step, learner_version, num_groups, max_staleness, policy, select)
        self.maybe_compact()
        return batch

    def claim_stats(self) -> dict[str, Any]:
        """How the claim keeps up: `rows_read` (rows read to track ready groups, in total),
        `rows_scanned` (rows in the fragments those reads filtered: what they cost),
        `ready` (complete groups waiting), `broken` (groups set aside, see ReadySet),
        `incremental` (False for a pool from before stable row ids: every claim reads it whole), `stale_dropped`."""
        c, r = self._claimer, self._claimer.ready
        return {"rows_read": c.rows_read, "rows_scanned": c.rows_scanned, "ready": 0 if r is None else len(r),
                "broken": 0 if r is None else len(r.broken), "incremental": c.stable, "stale_dropped": c.stale_dropped}

    def compact(self) -> None:
        """Compact every table (pools/compaction.py), then clean up versions by `keep_versions`."""
        for name in self._uris:
            compaction.compact_table(self._open, name, self.keep_versions)

    def cleanup(self, keep_versions: int | None = None, min_age: timedelta = asof.MIN_AGE) -> None:
        """Remove old versions of every table but tagged ones and the newest `keep_versions`
        (default: this pool's), and those younger than `min_age` (a reader may be scanning one)."""
        for name in self._uris:
            asof.cleanup(self._open(name), self.keep_versions if keep_versions is None else keep_versions, min_age)

    # ------------------------------------------------------------ time travel

    def as_of(self, step: int | None = None, version: int | str | None = None) -> asof.PoolView:
        """This pool as it was when learner `step` claimed its batch, or at pool-table `version`
        (a number, or a tag such as checkpoint-v000010): pools/asof.py. PoolError when it cannot be."""
        return asof.view(self, step=step, version=version, keep_versions=self.keep_versions)

    def step_groups(self, step: int, group_ids: Sequence[str]) -> list[SampleGroup]:
        """`group_ids` as learner `step` read them (what replay and resume train on again): rows
        appended or stored again since do not change them. Where the pool cannot be read as of
        that step (a pool from before steps recorded versions, or the version was cleaned up)
        they are read as stored now, and a warning says so once."""
        try:
            return self.as_of(step=step).groups(group_ids)
        except PoolError as e:
            if not self._warned_as_of:
                log.warning("experience pool %s: reading step %d's groups as stored now, not as the step read "
                            "them: %s", self.uri, step, e)
                self._warned_as_of = True
            return self.groups(group_ids)

    def versions(self) -> dict[str, int]:
        """{table: its latest version}: what a reader caching the pool checks to know it changed."""
        self._committer.sync()
        return {name: self._open(name).version for name in self._uris}

    def tag_checkpoint(self, policy_version: int, step: int) -> dict[str, int]:
        """Tag checkpoint-v<policy_version> on the versions learner `step` read (pools/asof.py)."""
        return asof.tag_checkpoint(self._open, list(self._uris), self.claims(), step, policy_version)

    def untag_checkpoints(self, kept: set[int]) -> list[str]:
        """Delete the checkpoint tags of policy versions not in `kept` (checkpoints pruned since)."""
        return asof.untag_checkpoints(self._open, list(self._uris), kept)

    def fragments(self, table: str = POOL_TABLE) -> int:
        return len(self._open(table).get_fragments()) if table in self._uris else 0

    def small_fragments(self, table: str = POOL_TABLE) -> int:
        """Fragments of `table` that a compaction would merge."""
        return compaction.small_fragments(self._open(table)) if table in self._uris else 0

    def maybe_compact(self) -> bool:
        """Start a background compaction when `compact_every` small fragments have accumulated in
        the pool or claims table (each claim adds one to the latter). Full ones do not count: a
        large pool is mostly full ones, and compacting after every claim would slow the claims."""
        if not self.compact_every or (self._compacting and self._compacting.is_alive()):
            return False
        if max(self.small_fragments(), self.small_fragments(CLAIMS_TABLE)) < self.compact_every:
            return False
        # Not a daemon: interpreter exit waits for it instead of killing Lance mid-write.
        self._compacting = threading.Thread(target=self.compact, name="pool-compact")
        self._compacting.start()
        return True

    # ------------------------------------------------------------ misc

    @property
    def tokenizer(self) -> str | None:
        return (self._open(POOL_TABLE).schema.metadata or {}).get(b"streamrl.tokenizer", b"").decode() or None

    def set_tokenizer(self, path: str) -> None:
        """Record the tokenizer (a directory or tokenizer.json) so `pool show` can decode text."""
        ds = self._open(POOL_TABLE)
        retry_conflicts(lambda: ds.update_schema_metadata({"streamrl.tokenizer": str(path)}))

    def close(self) -> None:
        self._committer.close()
        if self._compacting is not None:
            self._compacting.join()

    def __enter__(self) -> LancePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
