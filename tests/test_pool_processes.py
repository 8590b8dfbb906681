"""The experience pool across OS processes: concurrent producers and a claimer, and producers
killed with SIGKILL in the middle of appends. Real processes, real Lance tables."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrl.pools import LancePool

from poolkit import assert_group_equal, make_group, popen_python, rows_per_group

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------- child programs

PRODUCER = r"""
import sys, time
from streamrl.pools import LancePool
from poolkit import make_group
uri, prefix, count, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pool = LancePool(uri, create=False)
i = 0
while i < count:
    k = min(1 + i % 3, count - i)  # 1, 2 or 3 groups per call
    pool.append([make_group(f"{prefix}{j:03d}", n=n, producer_id=prefix) for j in range(i, i + k)], admit=True)
    i += k
pool.close()
print("done", count, flush=True)
"""

CLAIMER = r"""
import json, sys, time
from streamrl.pools import LancePool
uri, expected, per_step, deadline_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
pool = LancePool(uri, create=False, compact_every=16)  # background compaction while producers write
deadline = time.monotonic() + deadline_s
step = claimed = nones = 0
while claimed < expected and time.monotonic() < deadline:
    b = pool.claim(step, learner_version=step, num_groups=per_step, max_staleness=10**6, policy="drop")
    if b is None:
        nones += 1
        time.sleep(0.01)
        continue
    print(json.dumps({"step": b.step, "groups": [g.group_id for g in b.groups],
                      "sizes": [len(g.samples) for g in b.groups],
                      "indices_ok": all([s.index for s in g.samples] == list(range(len(g.samples)))
                                        for g in b.groups)}), flush=True)
    claimed += len(b.groups)
    step += 1
pool.close()
print(json.dumps({"claimed": claimed, "nones": nones, "fragments": pool.fragments()}), flush=True)
"""

KILLABLE = r"""
import os, sys
from streamrl.pools import LancePool
from poolkit import admissions_for, make_group, partial_of
uri, side, prefix, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
write_ahead = len(sys.argv) > 5 and sys.argv[5] == "write_ahead"  # returns once in the log, commits behind
pool = LancePool(uri, create=False, commit_linger_ms=1, write_ahead=write_ahead)
with open(side, "a") as f:
    i = 0
    while True:
        gs = [make_group(f"{prefix}-{i:04d}-{k}", n=n, num_tokens=12, versions=(0, 1), producer_id=prefix)
              for k in range(1 + i % 3)]
        if i % 2 == 0:
            pool.append(gs, admit=True)  # admissions commit first, then rows
        else:  # the partial-rollout path: admit, save partial, complete (replaces the partial)
            pool.admit(admissions_for(gs))
            pool.save_partial([partial_of(g, 4, versions=(0,)) for g in gs])
            pool.append(gs)
        f.write("".join(g.group_id + "\n" for g in gs))
        f.flush()
        os.fsync(f.fileno())
        i += 1
"""


def _finish(proc, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except Exception:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child timed out\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"child exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return out, err


# ---------------------------------------------------------------- (1) two producers + a claimer


@pytest.mark.parametrize("store", ["disk", "s3"])
def test_two_producer_processes_and_a_claimer_process(tmp_path: Path, store: str, request):
    """On S3 the processes meet only through Lance's commits (conditional writes): the same rules hold."""
    uri = tmp_path / "run" / "pool" if store == "disk" else request.getfixturevalue("s3_server").new_uri()
    LancePool(uri).close()  # create the tables before the children race to open them
    per_producer, n, per_step = 40, 3, 4
    total = 2 * per_producer

    claimer = popen_python(CLAIMER, uri, total, per_step, 90)
    producers = [popen_python(PRODUCER, uri, prefix, per_producer, n) for prefix in ("pa-", "pb-")]
    for p in producers:
        out, _ = _finish(p, 90)
        assert out.strip() == f"done {per_producer}"
    out, err = _finish(claimer, 100)
    print("claimer:", out.splitlines()[-1])
    assert "Exception in thread" not in err and "Traceback" not in err, err[-3000:]

    lines = [json.loads(line) for line in out.splitlines()]
    summary, batches = lines[-1], lines[:-1]
    assert summary["claimed"] == total, f"claimer stopped early: {summary}"
    claimed = [gid for b in batches for gid in b["groups"]]
    assert len(claimed) == total
    repeats = [gid for gid, c in Counter(claimed).items() if c > 1]
    assert not repeats, f"groups claimed more than once: {repeats}"
    everyone = {f"{p}{j:03d}" for p in ("pa-", "pb-") for j in range(per_producer)}
    assert set(claimed) == everyone
    assert all(b["sizes"] == [n] * per_step and b["indices_ok"] for b in batches), "a group was split"
    assert [b["step"] for b in batches] == list(range(len(batches)))

    with LancePool(uri, create=False) as pool:
        led = pool.ledger()
        assert led.balanced and led.lost == 0 and led.duplicated == 0 and led.unadmitted == 0, led
        assert led.admitted == total and led.consumed == total and led.complete == 0, led
        assert rows_per_group(pool) == {gid: n for gid in everyone}
        t = pool.scan(["group_id", "consumed_step", "status"])
        steps: dict[str, set] = {}
        for gid, step, status in zip(*(t[c].to_pylist() for c in ("group_id", "consumed_step", "status"))):
            assert status == "consumed"
            steps.setdefault(gid, set()).add(step)
        assert all(len(s) == 1 and None not in s for s in steps.values()), "a group has several consumed steps"
        # The step recorded in the pool is the batch that returned the group.
        step_of = {gid: b["step"] for b in batches for gid in b["groups"]}
        assert {gid: next(iter(s)) for gid, s in steps.items()} == step_of
        # Each producer's groups were claimed in the order it wrote them (oldest first).
        for prefix in ("pa-", "pb-"):
            mine = [gid for gid in claimed if gid.startswith(prefix)]
            assert [step_of[g] for g in mine] == sorted(step_of[g] for g in mine)


# ---------------------------------------------------------------- (2) SIGKILL mid-append


def _wait_for_lines(path: Path, proc, at_least: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"producer died on its own ({proc.returncode}):\n{err[-3000:]}")
        if path.exists() and path.read_text().count("\n") >= at_least:
            return
        time.sleep(0.005)
    raise AssertionError(f"producer wrote fewer than {at_least} groups in {timeout}s")


def _check_after_kill(uri: Path, side: Path, prefixes: list[str], n: int) -> dict[str, int]:
    acknowledged = [line for line in side.read_text().splitlines() if line]
    assert len(acknowledged) == len(set(acknowledged))
    segments = len(list((uri / "_wal").glob("*.arrow")))  # a write-ahead writer's log, committed on opening
    with LancePool(uri, create=False) as pool:
        rows = rows_per_group(pool)
        half = {gid: c for gid, c in rows.items() if c != n}
        assert not half, f"groups stored with a wrong number of rows (half-visible or duplicated): {half}"
        t = pool.scan(["group_id", "sample_index", "status"])
        status_of: dict[str, set[str]] = {}
        for gid, idx, st in zip(*(t[c].to_pylist() for c in ("group_id", "sample_index", "status"))):
            status_of.setdefault(gid, set()).add(st)
        assert all(len(s) == 1 for s in status_of.values()), "a group has rows in mixed states"
        assert {next(iter(s)) for s in status_of.values()} <= {"partial", "complete"}

        missing = [gid for gid in acknowledged if status_of.get(gid) != {"complete"}]
        assert not missing, f"acknowledged appends not durable/complete after SIGKILL: {missing[:5]}"
        for gid in random.Random(len(acknowledged)).sample(acknowledged, min(15, len(acknowledged))):
            (g,) = pool.groups([gid])
            assert_group_equal(g, make_group(gid, n=n, num_tokens=12, versions=(0, 1), producer_id=g.producer_id))

        admitted = set(pool.scan(["group_id"], table="admissions")["group_id"].to_pylist())
        assert set(rows) <= admitted, "rows stored for a group that was never admitted"
        led = pool.ledger()
        assert led.lost == 0 and led.duplicated == 0 and led.unadmitted == 0, led
        assert led.balanced, led
        assert led.in_flight == len(admitted - set(rows)), led  # admitted, nothing stored yet
        return {"acknowledged": len(acknowledged), "stored": len(rows), "in_flight": led.in_flight,
                "partial": led.partial, "complete": led.complete, "log_segments": segments}


@pytest.mark.parametrize("mode", ["commit", "write_ahead"])
def test_sigkill_mid_append_loses_nothing_acknowledged(tmp_path: Path, mode: str):
    uri = tmp_path / "run" / "pool"
    LancePool(uri).close()
    side = tmp_path / "acknowledged.txt"
    n = 3
    rng = random.Random(20240611)
    # Kill moments: right after the first acknowledged append, then later and later.
    delays = [0.0, rng.uniform(0.005, 0.03), rng.uniform(0.03, 0.1), rng.uniform(0.1, 0.25),
              rng.uniform(0.25, 0.5), rng.uniform(0.5, 0.8)]
    prefixes: list[str] = []
    history = []
    for round_, delay in enumerate(delays):
        prefix = f"k{round_}"
        prefixes.append(prefix)
        before = side.read_text().count("\n") if side.exists() else 0
        proc = popen_python(KILLABLE, uri, side, prefix, n, mode)
        _wait_for_lines(side, proc, before + 1, timeout=60)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"producer exited {proc.returncode} before the kill"
        history.append(_check_after_kill(uri, side, prefixes, n))

    assert history[-1]["acknowledged"] > history[0]["acknowledged"]
    if mode == "write_ahead":  # some kills left appends that had returned only in the log
        assert any(h["log_segments"] for h in history), history
    assert not list((uri / "_wal").glob("*")), "a dead writer's log was left behind"
    # The reused pool keeps working after the kills: claim every complete group once.
    with LancePool(uri, create=False) as pool:
        complete = pool.ledger().complete
        b = pool.claim(step=0, learner_version=1, num_groups=complete, max_staleness=1)
        assert b is not None and len({g.group_id for g in b.groups}) == complete
        assert all(len(g.samples) == n for g in b.groups)
        pool.compact()
        led = pool.ledger()
        assert led.balanced and led.consumed == complete and led.complete == 0, led
    print("kill history:", history, "fsync'd side file:", os.path.getsize(side), "bytes")


# ---------------------------------------------------------------- (3) SIGKILL the learner mid-claim

CLAIMER_KILLABLE = r"""
import json, os, sys, time
from streamrl.pools import LancePool
uri, log, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
pool = LancePool(uri, create=False, compact_every=6)  # compactions in the background get killed too
with open(log, "a") as f:
    while True:
        b = pool.claim(step, learner_version=step, num_groups=2, max_staleness=10**6)
        if b is None:
            time.sleep(0.002)
            continue
        # Written only after claim() returned: a claim committed just before the kill is in the
        # pool but not here, as with a learner killed before it trained on the batch.
        f.write(json.dumps({"step": step, "groups": [g.group_id for g in b.groups],
                            "whole": all(len(g.samples) == 3 for g in b.groups)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
        step += 1
"""


def _next_step(uri: Path) -> int:
    with LancePool(uri, create=False) as pool:
        steps = pool.claims()["consumed_step"].to_pylist()
    return max((s for s in steps if s is not None), default=-1) + 1


def test_sigkill_of_the_learner_mid_claim_and_a_writer_mid_append(tmp_path: Path):
    """Producers and the learner die with SIGKILL at random moments, again and again: every
    append that returned is stored whole, every batch a claim returned is recorded under its
    step, no group is ever claimed twice, and the ledger balances after each round."""
    uri = tmp_path / "run" / "pool"
    LancePool(uri).close()
    side, claimed_log, n = tmp_path / "acknowledged.txt", tmp_path / "claimed.jsonl", 3
    rng = random.Random(20261124)
    for round_ in range(6):
        before = side.read_text().count("\n") if side.exists() else 0
        producer = popen_python(KILLABLE, uri, side, f"w{round_}", n)
        claimer = popen_python(CLAIMER_KILLABLE, uri, claimed_log, _next_step(uri))
        _wait_for_lines(side, producer, before + 4, timeout=60)
        time.sleep(rng.uniform(0.2, 1.5))
        victims = [claimer] if round_ % 2 else [claimer, producer]  # the learner always, the writer every other round
        for p in victims:
            p.send_signal(signal.SIGKILL)
        for p in victims:
            p.communicate(timeout=30)
            assert p.returncode == -signal.SIGKILL, f"a child exited {p.returncode} before the kill"
        if producer not in victims:
            producer.send_signal(signal.SIGKILL)
            producer.communicate(timeout=30)

        acknowledged = [g for g in side.read_text().splitlines() if g]
        batches = [json.loads(line) for line in claimed_log.read_text().splitlines()] if claimed_log.exists() else []
        with LancePool(uri, create=False) as pool:
            claims = pool.claims()
            twice = [g for g, c in Counter(claims["group_id"].to_pylist()).items() if c > 1]
            assert not twice, f"round {round_}: groups claimed twice: {twice[:5]}"
            step_of = dict(zip(claims["group_id"].to_pylist(), claims["consumed_step"].to_pylist()))
            for b in batches:
                assert b["whole"], b
                assert all(step_of.get(g) == b["step"] for g in b["groups"]), f"returned but not recorded: {b}"
            status = {g: s for g, s in zip(*(pool.scan(["group_id", "status"])[c].to_pylist()
                                             for c in ("group_id", "status")))}
            missing = [g for g in acknowledged if status.get(g) not in ("complete", "consumed")]
            assert not missing, f"round {round_}: acknowledged appends not stored: {missing[:5]}"
            assert rows_per_group(pool) == {g: n for g in status}, "a group stored with a wrong number of rows"
            led = pool.ledger()
            assert led.balanced and led.lost == 0 and led.duplicated == 0, (round_, led)

    assert len(batches) > 0
    # A last learner takes everything left; every stored group ends consumed exactly once.
    with LancePool(uri, create=False) as pool:
        left = pool.ledger().complete
        b = pool.claim(_next_step(uri), learner_version=99, num_groups=left, max_staleness=10**6) if left else None
        assert left == 0 or (b is not None and len(b.groups) == left)
        claims = pool.claims()["group_id"].to_pylist()
        assert len(claims) == len(set(claims))
        led = pool.ledger()
        assert led.balanced and led.complete == 0 and led.consumed == len(claims), led
    print("batches returned:", len(batches), "claims:", len(claims), "acknowledged appends:", len(acknowledged))
