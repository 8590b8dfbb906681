"""Group commit: one writer thread per pool object turns many callers' writes into few Lance commits.

Callers convert their groups to Arrow in their own thread (so a group that cannot be encoded
fails its own caller, never the commit it would have shared). The thread takes everything
queued (up to `max_rows`), commits the admissions first and then the rows. By default a call
waits on a future until its rows are committed (the thread lingers `linger_s` for company when
callers overlap). With `write_ahead` (local pools, pools/wal.py) a call returns once its rows are
in this process's log, and the thread commits the log to Lance behind it in large commits.
It writes through pylance directly, in this thread, so a commit hands the GIL back and forth
once rather than through LanceDB's event-loop thread as well.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from streamrl.pools.errors import PoolError
from streamrl.pools.reads import quote
from streamrl.pools.wal import WriteAheadLog, dead_logs, read_segment

log = logging.getLogger(__name__)

_CONFLICT_RETRIES = 20
# How long a write waits out a store that refuses it for a while (S3 throttling or an outage, a full disk)
# before it fails: Lance's own retries give up after ~2.5 s (measured against S3's 503 SlowDown).
STORE_RETRY_S = 120.0
_TRANSIENT = ("SlowDown", "ServiceUnavailable", "Service Unavailable", "InternalError", "503 ", "500 Internal",
              "Connection refused", "Connection reset", "connection closed", "timed out", "error sending request",
              "No space left on device", "Broken pipe")
WAL_LINGER_S = 0.05  # how long the committer of a logged pool waits to fill a commit
HURRY = object()  # queued by sync(): commit what is there now


def retry_conflicts(fn: Callable[[], Any]) -> Any:
    """Run a Lance write, retrying when a concurrent commit (another process, compaction) wins."""
    for attempt in range(_CONFLICT_RETRIES):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - Lance raises plain errors for conflicts
            if "onflict" not in str(e) or attempt == _CONFLICT_RETRIES - 1:
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")


def transient(e: BaseException) -> bool:
    """A store error that may pass when the write is tried again (throttled, briefly down, full)."""
    text = str(e)
    return "onflict" not in text and any(m in text for m in _TRANSIENT)


def outlast_store(write: Callable[[bool], Any], what: str, budget_s: float | None = None) -> Any:
    """`write(False)`, then `write(True)` after each transient store error, for up to `budget_s`
    (STORE_RETRY_S). A write the store refused may still have landed (the error came after the commit), so
    `write(True)` must not repeat what is already there."""
    budget = STORE_RETRY_S if budget_s is None else budget_s
    t0, delay, again = time.monotonic(), 0.2, False
    while True:
        try:
            return write(again)
        except Exception as e:  # noqa: BLE001 - told apart by transient()
            waited = time.monotonic() - t0
            if not transient(e) or waited > budget:
                raise
            if not again:
                log.warning("the experience pool's store refused a %s (%s); trying again for up to %.0f s",
                            what, str(e).splitlines()[0][:200], budget)
            time.sleep(delay)
            delay, again = min(5.0, delay * 2), True


class Item:
    """One caller's write: `kind` admit | append | partial, its Arrow rows and group ids."""

    __slots__ = ("kind", "table", "group_ids", "future", "seq", "segment")

    def __init__(self, kind: str, table: pa.Table, group_ids: Sequence[str]) -> None:
        self.kind, self.table, self.group_ids = kind, table, group_ids
        self.future: cf.Future[None] = cf.Future()
        self.seq = self.segment = 0


class Committer:
    """The writer thread. `open_table(name)` gives a fresh pylance dataset of table `name`;
    `stored_partials()` the ids of the groups stored as partial (read once, then tracked);
    `wal_dir` where write-ahead logs go (local pools: dead writers' logs are committed from
    there); with `write_ahead` this process's writes return once logged, not once committed."""

    def __init__(self, open_table: Callable[[str], Any], stored_partials: Callable[[], set[str]],
                 max_rows: int, linger_s: float, wal_dir: Path | None = None, write_ahead: bool = False) -> None:
        self._open, self._stored_partials = open_table, stored_partials
        self.max_rows, self.linger_s = max_rows, linger_s
        self.commits = 0  # Lance commits made (the group-commit metric)
        self._partial_ids: set[str] | None = None
        self._queue: queue.Queue[Any] = queue.Queue()  # Items, HURRY, None (close)
        self._lock = threading.Condition()
        self._flushing = threading.Lock()  # the thread's flushes and replays take turns
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ds: dict[str, Any] = {}
        self._wal_dir, self._wal = wal_dir, None
        self._logged = write_ahead and wal_dir is not None
        self._submitted = self._done = 0  # items queued / committed, in queue order
        self._pending_rows = 0  # in the log, not yet committed: bounded, so the log cannot outrun Lance
        self._in_segment: Counter[int] = Counter()
        self.failed: BaseException | None = None

    def submit(self, item: Item) -> cf.Future[None]:
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            self._raise_failed()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pool-committer", daemon=True)
                self._thread.start()
            if self._logged:
                while self._pending_rows >= self.max_rows and self.failed is None:
                    self._lock.wait()
                self._raise_failed()
                if self._wal is None:
                    self._wal = WriteAheadLog(self._wal_dir)
                item.segment = self._wal.write(item.kind, item.table)
                self._in_segment[item.segment] += 1
                self._pending_rows += item.table.num_rows
                item.future.set_result(None)  # durable: in the log
            self._submitted += 1
            item.seq = self._submitted
            self._queue.put(item)
        return item.future

    def _raise_failed(self) -> None:
        if self.failed is not None:
            raise PoolError(f"committing the pool's writes failed ({type(self.failed).__name__}: "
                            f"{str(self.failed)[:300]}); the rows already returned to their callers are "
                            f"kept in {self._wal_dir} and committed when the pool is next opened")

    def sync(self) -> None:
        """Wait until every write submitted before this call is committed (read-your-writes)."""
        with self._lock:
            target = self._submitted
            if self._done < target:
                self._queue.put(HURRY)  # the committer stops lingering for company
            while self._done < target and self.failed is None:
                self._lock.wait()
            self._raise_failed()

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
        if self._wal is not None:  # a failed log stays for the next opener to commit
            self._wal.close(delete=self.failed is None)

    def replay(self, items: list[Item]) -> None:
        """Commit a dead writer's log, skipping what is already in the tables (a crash may come
        between a commit and the deletion of its segment)."""
        with self._flushing:
            self._flush(items, {}, replay=True)

    def recover(self) -> int:
        """Commit the logs of writers that died (pools/wal.py); returns the rows committed."""
        if self._wal_dir is None:
            return 0
        rows = 0
        for writer, files in dead_logs(self._wal_dir):
            segments: dict[str, list[Path]] = {}
            for f in files:  # <writer>.<seq>.<stream>.arrow, admissions before rows
                segments.setdefault(f.name[len(writer) + 1 :].split(".")[0], []).append(f)
            for seq in sorted(segments):
                items = [Item(kind, t, t["group_id"].to_pylist())
                         for f in segments[seq] for kind, b in read_segment(f) for t in [pa.Table.from_batches([b])]]
                try:
                    self.replay(items)
                except Exception as e:  # noqa: BLE001
                    raise PoolError(f"cannot commit {segments[seq][0]}, the write-ahead log of a writer that stopped "
                                    f"({type(e).__name__}: {str(e)[:300]}); move the files of writer {writer} out of "
                                    f"{self._wal_dir} to open the pool without them (their rows are then lost)") from None
                rows += sum(it.table.num_rows for it in items if it.kind != "admit")
                for f in segments[seq]:
                    f.unlink(missing_ok=True)
        return rows

    def _gather(self, first: Item, linger_s: float, target_rows: int) -> tuple[list[Item], bool]:
        """`first` and what is queued behind it, waiting up to `linger_s` for more until the batch
        holds `target_rows` (a sync() cuts the wait short). Returns the batch and whether close()
        was asked for."""
        batch, rows = [first], first.table.num_rows
        deadline = time.monotonic() + linger_s
        while rows < target_rows:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return batch, True
            if item is HURRY:
                linger_s = 0.0
                deadline = time.monotonic()
                continue
            batch.append(item)
            rows += item.table.num_rows
        return batch, False

    def _loop(self) -> None:
        concurrent = True  # did the last commit share its batch: callers overlap, lingering pays
        while True:
            first = self._queue.get()
            if first is None:
                return
            if first is HURRY:
                continue
            if self._logged:
                # Nobody waits for the commit, so it waits for company: a few large commits cost
                # Lance far less than many small ones (its fixed cost is ~1.5-2 ms a commit).
                batch, stop = self._gather(first, WAL_LINGER_S, self.max_rows // 4)
            else:
                # Whatever queued up during the last commit goes in at once. Only a lone write of
                # a pool whose callers overlapped waits a moment for company: a single caller that
                # waits for each commit would only lose the linger every time.
                batch, stop = self._gather(first, 0.0, self.max_rows)
                if len(batch) == 1 and concurrent and not stop:
                    batch, stop = self._gather(first, self.linger_s, self.max_rows)
                concurrent = len(batch) > 1
            error: BaseException | None = None
            try:
                with self._flushing:  # tried again as a replay: what landed before an error is not repeated
                    outlast_store(lambda again: self._flush(batch, self._fresh() if again else self._ds, replay=again),
                                  "write of the pool's rows")
            except Exception as e:  # noqa: BLE001 - every waiting caller sees the failure
                error = e
            self._settle(batch, error)
            if stop:
                return

    def _settle(self, batch: list[Item], error: BaseException | None) -> None:
        if not self._logged:
            for it in batch:
                if error is None:
                    it.future.set_result(None)
                else:
                    it.future.set_exception(error)
        with self._lock:
            self._done = batch[-1].seq
            if self._wal is not None:
                self.failed = self.failed or error
                self._pending_rows -= sum(it.table.num_rows for it in batch)
                for it in batch:
                    self._in_segment[it.segment] -= 1
                if self.failed is None:  # a failed batch's segment stays for the next opener
                    if self._pending_rows == 0:
                        self._wal.rotate()  # everything is committed: the current segment can go too
                    for seg in [s for s, n in self._in_segment.items() if n == 0 and s < self._wal.seq]:
                        self._wal.remove(seg)
                        del self._in_segment[seg]
            self._lock.notify_all()

    def _fresh(self) -> dict[str, Any]:
        """The tables opened again (after a failed write, their handles may not know what landed)."""
        self._ds.clear()
        return self._ds

    def _table(self, name: str, ds: dict[str, Any]) -> Any:
        if name not in ds:
            ds[name] = self._open(name)
        return ds[name]

    def _insert(self, name: str, table: pa.Table, ds: dict[str, Any]) -> None:
        d = self._table(name, ds)
        retry_conflicts(lambda: d.insert(table))
        self.commits += 1

    def _flush(self, batch: list[Item], ds: dict[str, Any], replay: bool = False) -> None:
        admissions = [it.table for it in batch if it.kind == "admit" and it.table.num_rows]
        adm = pa.concat_tables(admissions) if admissions else None
        if adm is not None and replay:
            ids = list(set(adm["group_id"].to_pylist()))
            have = self._table("admissions", ds).to_table(columns=["group_id"], filter=f"group_id IN ({quote(ids)})")
            adm = adm.filter(pc.invert(pc.is_in(adm["group_id"], value_set=have["group_id"])))
        if adm is not None and adm.num_rows:  # before the rows: a crash in between leaves groups in flight, never unadmitted
            self._insert("admissions", adm, ds)
        writes = _last_write_wins([it for it in batch if it.kind != "admit"])
        if not writes:
            return
        # A finished group replaces the partial stored before it, also by an earlier process
        # (before a restart): the partials in the pool are read once, then tracked here.
        if self._partial_ids is None:
            self._partial_ids = self._stored_partials()
        written = {g for _, _, ids in writes for g in ids}
        # A replay upserts everything: rows committed before the crash are left as they are.
        replacing = written if replay else self._partial_ids & written
        plain = [t for kind, t, _ in writes if kind == "append"]
        upsert = [t for kind, t, _ in writes if kind == "partial"]
        if replacing:  # finished groups whose partial is stored go through the upsert as well
            value_set = pa.array(list(replacing), pa.string())
            upsert += [t.filter(pc.is_in(t["group_id"], value_set=value_set)) for t in plain]
            plain = [t.filter(pc.invert(pc.is_in(t["group_id"], value_set=value_set))) for t in plain]
        plain_t = pa.concat_tables(plain) if plain else None
        if plain_t is not None and plain_t.num_rows:
            self._insert("pool", plain_t, ds)
        upsert_t = pa.concat_tables(upsert) if upsert else None
        if upsert_t is not None and upsert_t.num_rows:
            d = self._table("pool", ds)
            # Only partial rows are replaced: a late partial of a finished group is ignored.
            retry_conflicts(lambda: d.merge_insert("uid").when_matched_update_all("target.status = 'partial'")
                            .when_not_matched_insert_all().execute(upsert_t))
            d.checkout_latest()
            self.commits += 1
        for kind, _, ids in writes:
            if kind == "partial":
                self._partial_ids |= set(ids)
            else:
                self._partial_ids -= set(ids)


def _last_write_wins(items: list[Item]) -> list[tuple[str, pa.Table, Sequence[str]]]:
    """(kind, rows, group ids) per item, keeping only the last write of a group in this flush
    (earlier ones never reach the disk), except that a partial never beats an earlier finish:
    a late partial save of a finished group is ignored, as it is against the stored rows."""
    finished: set[str] = set()
    writes = []
    for it in items:
        t, ids = it.table, list(it.group_ids)
        if it.kind == "partial" and finished.intersection(ids):
            t, ids = _without(t, finished), [g for g in ids if g not in finished]
        elif it.kind != "partial":
            finished.update(ids)
        writes.append((it.kind, t, ids))
    seen: set[str] = set()
    out = []
    for kind, t, ids in reversed(writes):
        if seen.intersection(ids):
            t, ids = _without(t, seen), [g for g in ids if g not in seen]
        seen.update(ids)
        out.append((kind, t, ids))
    out.reverse()
    return out


def _without(t: pa.Table, groups: set[str]) -> pa.Table:
    return t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(list(groups), pa.string()))))
