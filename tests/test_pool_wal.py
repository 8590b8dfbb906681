"""The pool's write-ahead log (pools/wal.py): an append that returned is owed even when its writer
dies before committing it, a replay never duplicates, a live writer's log is left alone, and
the log cannot run ahead of Lance. Real processes killed with SIGKILL, real Lance tables."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from streamrl.pools import LancePool, PoolError
from streamrl.pools.committer import Item, _last_write_wins
from streamrl.pools.lance_pool import RECOVER_EVERY_S, WAL_DIR
from streamrl.pools.schema import admissions_to_table, groups_to_table
from streamrl.pools.wal import WriteAheadLog

from poolkit import admissions_for, assert_group_equal, group_status, make_group, partial_of, popen_python, \
    rows_per_group

BIG = 10**6

# A writer process whose committer is held back as the test says, then waits to be killed.
WRITER = r"""
import sys, threading
from streamrl.pools import LancePool
from streamrl.pools.committer import Committer
from streamrl.pools.wal import WriteAheadLog
from poolkit import admissions_for, make_group, partial_of
uri, count, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pool = LancePool(uri, create=False, write_ahead=True)
if mode == "never-commit":  # dies with every write still only in its log
    Committer._flush = lambda self, batch, ds, replay=False: threading.Event().wait()
else:  # "keep-segments": commits everything, dies before deleting the segments it committed
    WriteAheadLog.remove = lambda self, seq: None
    WriteAheadLog.close = lambda self, delete=True: None
for i in range(count):
    g = make_group(f"w{i:02d}", n=3, versions=(0, 1))
    if i % 2:  # the partial-rollout path: admit, save partial, finish
        pool.admit(admissions_for([g]))
        pool.save_partial([partial_of(g, 2, versions=(0,))])
        pool.append([g])
    else:
        pool.append([g], admit=True)
if mode == "keep-segments":
    pool.flush()
print("appended", flush=True)
threading.Event().wait()
"""


def write_then_die(uri: Path, count: int, mode: str) -> None:
    proc = popen_python(WRITER, uri, count, mode)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "appended", proc.stderr.read()[-3000:] if proc.poll() is not None else line
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        proc.kill()


def log_files(uri: Path) -> list[str]:
    return sorted(p.name for p in (uri / WAL_DIR).iterdir()) if (uri / WAL_DIR).is_dir() else []


def assert_all_there(pool: LancePool, count: int) -> None:
    assert rows_per_group(pool) == {f"w{i:02d}": 3 for i in range(count)}
    assert group_status(pool) == {f"w{i:02d}": {"complete"} for i in range(count)}
    for i in (0, count - 1):
        assert_group_equal(pool.groups([f"w{i:02d}"])[0], make_group(f"w{i:02d}", n=3, versions=(0, 1)),
                           status="complete")
    led = pool.ledger()
    assert led.admitted == count and led.complete == count and led.balanced, led


@pytest.fixture
def uri(tmp_path: Path) -> Path:
    LancePool(tmp_path / "pool").close()
    return tmp_path / "pool"


def test_appends_that_returned_are_committed_by_the_next_opener_after_the_writer_dies(uri):
    write_then_die(uri, 6, "never-commit")
    assert any(f.endswith(".rows.arrow") for f in log_files(uri))
    with LancePool(uri, create=False) as pool:
        assert_all_there(pool, 6)
    assert log_files(uri) == []  # committed, then deleted


def test_replaying_a_log_that_was_already_committed_duplicates_nothing(uri):
    write_then_die(uri, 6, "keep-segments")
    assert any(f.endswith(".rows.arrow") for f in log_files(uri))
    with LancePool(uri, create=False) as pool:
        assert pool.recover() == 0  # the open already replayed it
        assert_all_there(pool, 6)
        assert pool.ledger().duplicated == 0
    assert log_files(uri) == []


@pytest.mark.slow
def test_a_live_writers_log_is_left_alone_and_the_learner_picks_up_a_dead_ones(uri):
    learner = LancePool(uri, create=False)  # without a log of its own: every pool object takes over dead logs
    proc = popen_python(WRITER, uri, 4, "never-commit")
    try:
        assert proc.stdout.readline().strip() == "appended"
        assert learner.recover() == 0  # its writer holds the log: nothing to take over
        assert learner.claim(0, 0, num_groups=4, max_staleness=BIG) is None
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + RECOVER_EVERY_S + 10
    batch = None
    while batch is None and time.monotonic() < deadline:  # the claims look for dead logs now and then
        batch = learner.claim(0, 0, num_groups=4, max_staleness=BIG)
        time.sleep(0.05)
    assert batch is not None and sorted(g.group_id for g in batch.groups) == [f"w{i:02d}" for i in range(4)]
    assert learner.ledger().balanced
    learner.close()


def test_a_torn_last_write_is_not_replayed_and_the_rest_is(uri):
    first, second = make_group("torn-0", n=3), make_group("torn-1", n=3)
    wal = WriteAheadLog(uri / WAL_DIR)
    wal.write("admit", admissions_to_table(admissions_for([first, second])))
    wal.write("append", groups_to_table([first]))
    wal.write("append", groups_to_table([second]))
    rows = wal.path(wal.seq, "rows")
    os.truncate(rows, rows.stat().st_size - 200)  # the process died in the middle of the last write
    os.close(wal._fd)  # ... and its lock went with it
    with LancePool(uri, create=False) as pool:
        assert rows_per_group(pool) == {"torn-0": 3}
        led = pool.ledger()  # the torn group's call never returned: it is in flight, as after any crash
        assert led.admitted == 2 and led.complete == 1 and led.in_flight == 1 and led.balanced, led


def test_a_failed_commit_fails_later_calls_and_keeps_the_log_for_the_next_opener(uri):
    pool = LancePool(uri, create=False, write_ahead=True)

    def broken(batch, ds, replay=False):
        raise OSError("No space left on device")

    pool._committer._flush = broken
    pool.append([make_group("kept", n=2)], admit=True)  # in the log: returns
    with pytest.raises(PoolError, match="No space left on device.*_wal.*next opened"):
        pool.flush()
    with pytest.raises(PoolError, match="committing the pool's writes failed"):
        pool.append([make_group("refused", n=2)], admit=True)
    pool.close()
    with LancePool(uri, create=False) as again:
        assert rows_per_group(again) == {"kept": 2}
        assert again.ledger().balanced
    assert log_files(uri) == []


def test_the_log_cannot_run_more_than_a_commit_ahead_of_lance(uri):
    pool = LancePool(uri, create=False, commit_max_rows=8, write_ahead=True)
    release, flush = threading.Event(), pool._committer._flush

    def held(batch, ds, replay=False):
        release.wait(30)
        flush(batch, ds, replay)

    pool._committer._flush = held
    returned: list[str] = []

    def produce() -> None:
        for i in range(4):  # 3 rows each: the fourth call finds 9 rows pending, over max_rows
            pool.append([make_group(f"bp{i}", n=3)], admit=True)
            returned.append(f"bp{i}")

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(0.5)
    assert len(returned) < 4, "appends ran on while nothing was committed"
    release.set()
    t.join(30)
    assert returned == [f"bp{i}" for i in range(4)]
    assert rows_per_group(pool) == {f"bp{i}": 3 for i in range(4)}
    pool.close()


def test_a_late_partial_in_the_same_commit_as_the_finish_is_ignored(uri):
    g = make_group("late", n=3, versions=(0, 1))
    items = [Item("append", groups_to_table([g]), ["late"]),
             Item("partial", groups_to_table([partial_of(g, 2, versions=(0,))]), ["late"])]
    kept = _last_write_wins(items)
    assert [(kind, ids) for kind, _, ids in kept] == [("append", ["late"]), ("partial", [])]
    assert kept[1][1].num_rows == 0
    # And through a pool whose committer takes both in one batch.
    pool = LancePool(uri, create=False, write_ahead=True)
    release, flush = threading.Event(), pool._committer._flush
    pool._committer._flush = lambda batch, ds, replay=False: (release.wait(30), flush(batch, ds, replay))
    pool.append([make_group("first", n=1)], admit=True)  # the committer holds this one ...
    pool.admit(admissions_for([g]))
    pool.append([g])  # ... while these three queue up behind it
    pool.save_partial([partial_of(g, 2, versions=(0,))])
    release.set()
    assert group_status(pool)["late"] == {"complete"} and rows_per_group(pool)["late"] == 3
    pool.close()


def test_segments_are_deleted_once_committed_and_the_log_goes_with_close(uri):
    pool = LancePool(uri, create=False, write_ahead=True)
    for i in range(5):
        pool.append([make_group(f"s{i}", n=2)], admit=True)
    pool.flush()
    files = log_files(uri)
    assert [f for f in files if f.endswith(".arrow")] == [] and len(files) == 1  # only the lock
    pool.close()
    assert log_files(uri) == []


def test_write_ahead_on_an_object_store_is_refused_before_anything_is_opened():
    with pytest.raises(PoolError, match="write_ahead needs a pool in a local directory.*s3://bucket/run/pool"):
        LancePool("s3://bucket/run/pool", write_ahead=True)
