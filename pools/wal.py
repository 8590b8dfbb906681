"""Write-ahead log of a local pool: an append is durable once its Arrow rows are in its writer's log.

Why: a Lance commit has a fixed cost of ~1.5-2 ms (manifest, transaction, threads waking) that a
64-row append pays twice (admissions, rows), while the same rows written to an Arrow IPC stream
cost ~0.3 ms. So a write goes to this process's log (the kernel has it: like a Lance commit,
durable against a process crash, not a power cut) and returns; the committer thread drains the
log into Lance in large commits, where Lance costs about what IPC does per row.

Layout under `<pool>/_wal/`: `<writer>.lock`, held with flock(LOCK_EX) while its writer lives,
and segments `<writer>.<seq>.admissions.arrow` / `<writer>.<seq>.rows.arrow` (IPC streams; each
rows batch carries its kind, `append` or `partial`, as metadata). A segment is deleted once every
write in it is committed. A log whose lock can be taken belongs to a dead writer: whoever opens
the pool next (or the learner's next claim) commits what it holds, skipping what is already in
the tables, so a crash between a commit and the deletion of its segment duplicates nothing.
Local directories only: object stores have no flock (those pools commit on every call).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

SEGMENT_BYTES = 64 << 20  # a segment this large is closed and a new one started
STREAMS = ("admissions", "rows")


def stream_of(kind: str) -> str:
    return "admissions" if kind == "admit" else "rows"


class WriteAheadLog:
    """This process's log. Not thread-safe: the committer calls it under its lock."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.writer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = directory / f"{self.writer}.lock"
        self._fd = os.open(self._lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new name: nobody else holds it
        self.seq = 0  # the segment new writes go to
        self._out: dict[str, tuple[pa.NativeFile, pa.ipc.RecordBatchStreamWriter]] = {}
        self._bytes = 0

    def path(self, seq: int, stream: str) -> Path:
        return self.dir / f"{self.writer}.{seq:08d}.{stream}.arrow"

    def write(self, kind: str, table: pa.Table) -> int:
        """Write `table` (kind admit | append | partial) to the current segment; returns its seq.
        Every byte has reached the kernel when this returns."""
        if self._bytes >= SEGMENT_BYTES:
            self.rotate()
        stream = stream_of(kind)
        if stream not in self._out:
            sink = pa.OSFile(str(self.path(self.seq, stream)), "wb")
            self._out[stream] = (sink, pa.ipc.new_stream(sink, table.schema))
        writer = self._out[stream][1]
        meta = {"kind": kind}
        for batch in table.to_batches():
            writer.write_batch(batch, custom_metadata=meta)
        self._bytes += table.nbytes
        return self.seq

    def rotate(self) -> None:
        """Close the current segment; later writes go to the next one."""
        for sink, writer in self._out.values():
            writer.close()
            sink.close()
        self._out.clear()
        self.seq += 1
        self._bytes = 0

    def remove(self, seq: int) -> None:
        """Delete segment `seq` (every write in it is committed)."""
        for stream in STREAMS:
            self.path(seq, stream).unlink(missing_ok=True)

    def close(self, delete: bool = True) -> None:
        """Release the log; `delete` it when everything in it is committed (otherwise the next
        opener of the pool finds it unlocked and commits what it holds)."""
        self.rotate()
        if delete:
            for f in self.dir.glob(f"{self.writer}.*.arrow"):
                f.unlink(missing_ok=True)
            self._lock.unlink(missing_ok=True)
        os.close(self._fd)


def read_segment(path: Path) -> Iterator[tuple[str, pa.RecordBatch]]:
    """(kind, batch) of each write in one segment stream, stopping at a torn tail (a write that
    was cut off never returned to its caller, so it is not owed)."""
    try:
        reader = pa.ipc.open_stream(pa.OSFile(str(path), "rb"))
    except (OSError, pa.ArrowInvalid):
        return
    while True:
        try:
            batch, meta = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            return
        except (OSError, pa.ArrowInvalid):
            return
        yield (meta or {}).get(b"kind", b"append").decode(), batch


def dead_logs(directory: Path) -> Iterator[tuple[str, list[Path]]]:
    """(writer, its segment files in write order) of each log whose writer is gone, locked by
    this process while the caller handles it; the caller deletes the files it has committed."""
    if not directory.is_dir():
        return
    for lock in sorted(directory.glob("*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            if not lock.exists():
                continue  # closed or replayed by someone else since we listed it
            writer = lock.name[: -len(".lock")]
            yield writer, sorted(directory.glob(f"{writer}.*.arrow"))
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
