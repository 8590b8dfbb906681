"""Group commit: one writer thread per pool object turns many callers' writes into few Lance commits.

Callers convert their groups to Arrow in their own thread (so a group that cannot be encoded
fails its own caller, never the commit it would have shared) and wait on a future. The thread
takes everything queued (up to `max_rows`, lingering `linger_s` for more), commits the
admissions first and then the rows, and resolves every future: a call returns once its rows are
committed. It writes through pylance directly, in this thread, so a commit hands the GIL back
and forth once rather than through LanceDB's event-loop thread as well: with producers
converting groups on the other core, every handoff can wait a full GIL switch interval.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

_CONFLICT_RETRIES = 20


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


class Item:
    """One caller's write: `kind` admit | append | partial, its Arrow rows and group ids."""

    __slots__ = ("kind", "table", "group_ids", "future")

    def __init__(self, kind: str, table: pa.Table, group_ids: Sequence[str]) -> None:
        self.kind, self.table, self.group_ids = kind, table, group_ids
        self.future: cf.Future[None] = cf.Future()


class Committer:
    """The writer thread. `open_table(name)` gives a fresh pylance dataset of table `name`;
    `stored_partials()` the ids of the groups stored as partial (read once, then tracked)."""

    def __init__(self, open_table: Callable[[str], Any], stored_partials: Callable[[], set[str]],
                 max_rows: int, linger_s: float) -> None:
        self._open, self._stored_partials = open_table, stored_partials
        self.max_rows, self.linger_s = max_rows, linger_s
        self.commits = 0  # Lance commits made (the group-commit metric)
        self._partial_ids: set[str] | None = None
        self._queue: queue.Queue[Item | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ds: dict[str, Any] = {}

    def submit(self, item: Item) -> cf.Future[None]:
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pool-committer", daemon=True)
                self._thread.start()
            self._queue.put(item)
        return item.future

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

    def _gather(self, first: Item, linger: bool) -> tuple[list[Item], bool]:
        """`first` and what is queued behind it (up to max_rows); with `linger`, wait up to
        linger_s for more. Returns the batch and whether close() was asked for."""
        batch, rows = [first], first.table.num_rows
        deadline = time.monotonic() + (self.linger_s if linger else 0.0)
        while rows < self.max_rows:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic())) if linger \
                    else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
            rows += item.table.num_rows
        return batch, False

    def _loop(self) -> None:
        concurrent = True  # did the last commit share its batch: callers overlap, lingering pays
        while True:
            first = self._queue.get()
            if first is None:
                return
            # Whatever queued up during the last commit goes in at once. Only a lone write of a
            # pool whose callers overlapped waits a moment for company: a single caller that
            # waits for each commit would only lose the linger every time.
            batch, stop = self._gather(first, linger=False)
            if len(batch) == 1 and concurrent and not stop:
                batch, stop = self._gather(first, linger=True)
            concurrent = len(batch) > 1
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

    def _table(self, name: str) -> Any:
        if name not in self._ds:
            self._ds[name] = self._open(name)
        return self._ds[name]

    def _insert(self, name: str, table: pa.Table) -> None:
        ds = self._table(name)
        retry_conflicts(lambda: ds.insert(table))
        self.commits += 1

    def _flush(self, batch: list[Item]) -> None:
        admissions = [it.table for it in batch if it.kind == "admit" and it.table.num_rows]
        if admissions:  # before the rows: a crash in between leaves groups in flight, never unadmitted
            self._insert("admissions", pa.concat_tables(admissions))
        writes = _last_write_wins([it for it in batch if it.kind != "admit"])
        if not writes:
            return
        # A finished group replaces the partial stored before it, also by an earlier process
        # (before a restart): the partials in the pool are read once, then tracked here.
        if self._partial_ids is None:
            self._partial_ids = self._stored_partials()
        written = {g for _, _, ids in writes for g in ids}
        replacing = self._partial_ids & written
        plain = [t for kind, t, _ in writes if kind == "append"]
        upsert = [t for kind, t, _ in writes if kind == "partial"]
        if replacing:  # finished groups whose partial is stored go through the upsert as well
            value_set = pa.array(list(replacing), pa.string())
            upsert += [t.filter(pc.is_in(t["group_id"], value_set=value_set)) for t in plain]
            plain = [t.filter(pc.invert(pc.is_in(t["group_id"], value_set=value_set))) for t in plain]
        plain_t = pa.concat_tables(plain) if plain else None
        if plain_t is not None and plain_t.num_rows:
            self._insert("pool", plain_t)
        upsert_t = pa.concat_tables(upsert) if upsert else None
        if upsert_t is not None and upsert_t.num_rows:
            ds = self._table("pool")
            # Only partial rows are replaced: a late partial of a finished group is ignored.
            retry_conflicts(lambda: ds.merge_insert("uid").when_matched_update_all("target.status = 'partial'")
                            .when_not_matched_insert_all().execute(upsert_t))
            ds.checkout_latest()
            self.commits += 1
        for kind, _, ids in writes:
            if kind == "partial":
                self._partial_ids |= set(ids)
            else:
                self._partial_ids -= set(ids)


def _last_write_wins(items: list[Item]) -> list[tuple[str, pa.Table, Sequence[str]]]:
    """(kind, rows, group ids) per item, keeping only the last write of a group in this flush:
    earlier ones never reach the disk."""
    seen: set[str] = set()
    out = []
    for it in reversed(items):
        t, ids = it.table, it.group_ids
        if seen.intersection(ids):
            t = t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(list(seen), pa.string()))))
            ids = [g for g in ids if g not in seen]
        seen.update(ids)
        out.append((it.kind, t, ids))
    out.reverse()
    return out
