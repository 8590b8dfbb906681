"""The LanceDB experience pool, against real Lance tables in tmp_path (no mocks).

Long file: the pool's whole contract (appends, claims, partials, ledger, compaction, crash recovery) on real tables.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pytest

from streamrl.core.types import Admission
from streamrl.pools import LancePool, PoolError, compaction, open_pool
from streamrl.pools.schema import POOL_SCHEMA

from poolkit import (
    admissions_for,
    assert_group_equal,
    column_by_group,
    expected_token_mask,
    group_status,
    make_group,
    partial_of,
    rows_per_group,
)

BIG = 10**6  # a staleness bound nothing exceeds


def append_each(pool: LancePool, groups, *, admit: bool = True) -> None:
    """One append and one commit per group, so created times strictly increase in list order
    and each group is a fragment of its own."""
    for g in groups:
        pool.append([g], admit=admit)
        pool.flush()
        time.sleep(0.001)


# ====================================================================== append / read back


def test_append_reads_back_exact_content_through_a_fresh_connection(pool, run_dir):
    groups = [
        make_group("g-a", n=4, num_tokens=7, versions=(0,)),
        make_group("g-b", n=2, num_tokens=9, versions=(1, 2, 3), prompt_len=11),
        make_group("g-c", n=3, spans=[(2, 0, 1), (5, 1, 4)], vary_lengths=False),
    ]
    groups[1].samples[1].failed = True
    groups[1].samples[1].error = "reward fn raised: ZeroDivisionError"
    pool.append(groups, admit=True)

    # Durable on return: a second, independent pool object on the same directory sees it.
    with open_pool(str(run_dir)) as other:
        got = {g.group_id: g for g in other.groups(["g-a", "g-b", "g-c"])}
        assert set(got) == {"g-a", "g-b", "g-c"}
        for want in groups:
            assert_group_equal(got[want.group_id], want)
        # Scalar columns derived from the groups.
        t = other.scan(["uid", "n_samples", "num_tokens", "min_version", "max_version", "status",
                        "consumed_step", "claimed_ns", "reward"])
        rows = {r["uid"]: r for r in t.to_pylist()}
        assert len(rows) == 9
        assert rows["g-b/1"] == {"uid": "g-b/1", "n_samples": 2, "num_tokens": 10, "min_version": 1,
                                 "max_version": 3, "status": "complete", "consumed_step": None,
                                 "claimed_ns": None, "reward": groups[1].samples[1].reward}
        assert rows["g-c/2"]["min_version"] == 2 and rows["g-c/2"]["max_version"] == 5
        assert rows["g-a/3"]["num_tokens"] == 10
        assert other.ledger().complete == 3 and other.ledger().balanced


def test_stored_arrow_types_are_the_schema(pool):
    pool.append([make_group("g", n=2)])
    t = pool.scan()
    assert t.schema.remove_metadata().equals(POOL_SCHEMA), t.schema
    assert t["response_tokens"].type == pa.list_(pa.int32())
    assert t["loss_mask"].type == pa.list_(pa.uint8())
    assert t["rollout_logprobs"].type == pa.list_(pa.float32())


def test_append_sets_created_time_and_keeps_an_explicit_one(pool):
    before = time.time_ns()
    g_auto = make_group("auto")
    g_fixed = make_group("fixed", created_at=123456789)
    pool.append([g_auto, g_fixed])
    created = column_by_group(pool, "created_ns")
    assert created["fixed"] == {123456789}
    (t_auto,) = created["auto"]
    assert before <= t_auto <= time.time_ns()


def test_scan_columns_and_where(pool):
    pool.append([make_group("x1", n=2), make_group("x2", n=3, producer_id="other")])
    t = pool.scan(["uid", "producer_id"], where="producer_id = 'other'")
    assert t.column_names == ["uid", "producer_id"]
    assert sorted(t["uid"].to_pylist()) == ["x2/0", "x2/1", "x2/2"]
    assert pool.scan(where="group_id = 'nope'").num_rows == 0
    assert pool.count_rows() == 5


def test_groups_by_id(pool):
    pool.append([make_group("a"), make_group("b"), make_group("it's")])  # a quote in an id
    assert [g.group_id for g in pool.groups(["b"])] == ["b"]
    assert pool.groups([]) == []
    assert pool.groups(["missing"]) == []
    (q,) = pool.groups(["it's"])
    assert_group_equal(q, make_group("it's"))


def test_append_after_close_raises_pool_error(run_dir):
    p = LancePool(run_dir / "pool")
    p.close()
    with pytest.raises(PoolError, match="closed"):
        p.append([make_group("late")])


def test_empty_pool_reads(pool):
    assert pool.scan().num_rows == 0
    assert pool.partial_groups() == []
    assert pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=0) is None
    led = pool.ledger()
    assert led.admitted == 0 and led.balanced


# ====================================================================== group commit / async


@pytest.mark.parametrize("write_ahead", [True, False], ids=["write-ahead", "commit-per-call"])
def test_concurrent_appends_share_commits(run_dir, write_ahead):
    n_threads = 16
    pool = LancePool(run_dir / "pool", commit_linger_ms=25, write_ahead=write_ahead)
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            pool.append([make_group(f"t{i:02d}", n=3)])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.flush()
    assert 1 <= pool.commits < n_threads, f"{pool.commits} commits for {n_threads} concurrent appends"
    rows = rows_per_group(pool)
    assert rows == {f"t{i:02d}": 3 for i in range(n_threads)}
    pool.close()


def test_concurrent_appends_with_admission_are_all_accounted(run_dir):
    pool = LancePool(run_dir / "pool", commit_linger_ms=25)
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        pool.append([make_group(f"w{i}-{k}", n=2) for k in range(3)], admit=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    led = pool.ledger()
    assert (led.admitted, led.complete) == (24, 24) and led.balanced, led
    assert pool.commits < 16  # 8 calls x (admissions + rows) would be 16 commits
    pool.close()


def test_append_async_coalesces_and_does_not_block_the_loop(run_dir):
    pool = LancePool(run_dir / "pool", commit_linger_ms=25)
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def main() -> None:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        await asyncio.gather(*(pool.append_async([make_group(f"as{i}", n=2)], admit=True) for i in range(10)))
        stop.set()
        await tick

    asyncio.run(main())
    assert ticks > 0, "append_async blocked the event loop"
    assert rows_per_group(pool) == {f"as{i}": 2 for i in range(10)}
    led = pool.ledger()
    assert led.admitted == 10 and led.complete == 10 and led.balanced
    assert pool.commits < 20
    for i in (0, 9):
        assert_group_equal(pool.groups([f"as{i}"])[0], make_group(f"as{i}", n=2))
    pool.close()


def test_an_unencodable_group_fails_its_append_and_the_pool_keeps_working(pool):
    bad = make_group("bad")
    bad.samples[0].rewards = {"acc": np.float32(1.0)}  # numpy scalar: not JSON-encodable
    with pytest.raises(TypeError):
        pool.append([bad], admit=True)
    assert pool.count_rows() == 0
    # Its admission may already be committed (admissions go first): then it is in flight.
    assert pool.ledger().balanced and pool.ledger().complete == 0
    pool.append([make_group("good")], admit=True)
    led = pool.ledger()
    assert led.complete == 1 and led.balanced and rows_per_group(pool) == {"good": 4}, led


def test_a_bad_group_does_not_fail_a_concurrent_good_append(run_dir):
    pool = LancePool(run_dir / "pool", commit_linger_ms=200)  # both calls land in one commit
    bad = make_group("bad")
    bad.samples[0].rewards = {"acc": np.float32(1.0)}
    results: dict[str, BaseException | None] = {}
    barrier = threading.Barrier(2)

    def run(name, g):
        barrier.wait()
        try:
            pool.append([g], admit=True)
            results[name] = None
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    threads = [threading.Thread(target=run, args=("good", make_group("good"))),
               threading.Thread(target=run, args=("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    assert isinstance(results["bad"], Exception)
    assert results["good"] is None, f"good append failed: {results['good']!r}"
    with LancePool(run_dir / "pool", create=False) as p:
        assert rows_per_group(p) == {"good": 4}


# ====================================================================== admission and ledger states


def test_ledger_counts_every_state(pool):
    g_inflight = make_group("s-inflight")
    g_partial = make_group("s-partial")
    g_consumed = make_group("s-consumed", versions=(4,))
    g_complete = make_group("s-complete")
    g_dropped = make_group("s-dropped", status="dropped", drop_reason="filter:zero_std")
    g_failed = make_group("s-failed", status="failed")
    g_stale = make_group("s-stale", versions=(0,))
    everything = [g_inflight, g_partial, g_consumed, g_complete, g_dropped, g_failed, g_stale]

    pool.admit(admissions_for(everything))
    led = pool.ledger()
    assert led.admitted == 7 and led.in_flight == 7 and led.balanced

    pool.save_partial([partial_of(g_partial, 3)])
    pool.append([g_stale])
    time.sleep(0.002)
    pool.append([g_consumed])
    # g_stale is the oldest and over the bound: dropped; g_consumed is taken.
    batch = pool.claim(step=0, learner_version=5, num_groups=1, max_staleness=3, policy="drop")
    assert batch is not None and [g.group_id for g in batch.groups] == ["s-consumed"]
    assert batch.dropped == ["s-stale"]
    pool.append([g_complete, g_dropped, g_failed])

    led = pool.ledger()
    assert (led.admitted, led.in_flight, led.partial, led.complete, led.consumed, led.dropped, led.failed) == (
        7, 1, 1, 1, 1, 2, 1), led
    assert (led.lost, led.duplicated, led.unadmitted) == (0, 0, 0)
    assert led.balanced
    assert group_status(pool) == {
        "s-partial": {"partial"}, "s-consumed": {"consumed"}, "s-complete": {"complete"},
        "s-dropped": {"dropped"}, "s-failed": {"failed"}, "s-stale": {"dropped"},
    }
    assert column_by_group(pool, "drop_reason")["s-dropped"] == {"filter:zero_std"}


def test_append_with_admit_records_admissions(pool):
    pool.append([make_group("ad1", n=3), make_group("ad2", n=5)], admit=True)
    adm = pool.scan(table="admissions")
    assert dict(zip(adm["group_id"].to_pylist(), adm["n"].to_pylist())) == {"ad1": 3, "ad2": 5}
    led = pool.ledger()
    assert led.admitted == 2 and led.complete == 2 and led.balanced


def test_failed_and_dropped_groups_are_never_claimed(pool):
    pool.append([make_group("f", status="failed"), make_group("d", status="dropped", drop_reason="filter")],
                admit=True)
    assert pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG) is None
    assert group_status(pool) == {"f": {"failed"}, "d": {"dropped"}}


# ====================================================================== ledger anomalies


def test_ledger_detects_a_group_appended_twice(pool):
    g = make_group("dup", n=3)
    pool.append([g], admit=True)
    pool.flush()  # two commits: in one, the later write of a group replaces the earlier
    pool.append([make_group("dup", n=3)])
    led = pool.ledger()
    assert led.duplicated == 1 and not led.balanced, led
    assert rows_per_group(pool) == {"dup": 6}


def test_ledger_detects_a_group_admitted_twice(pool):
    g = make_group("dup2", n=2)
    pool.append([g], admit=True)
    pool.flush()
    pool.append([make_group("dup2", n=2)], admit=True)
    led = pool.ledger()
    assert led.duplicated == 1 and not led.balanced, led


def test_ledger_detects_unadmitted_rows(pool):
    pool.append([make_group("ok")], admit=True)
    pool.append([make_group("sneaky")])
    led = pool.ledger()
    assert led.unadmitted == 1 and led.admitted == 1 and led.complete == 1 and not led.balanced, led


def test_ledger_detects_lost_rows(pool):
    pool.append([make_group(f"l{i}", n=4) for i in range(3)], admit=True)
    pool.flush()
    pool._pool.delete("uid IN ('l1/2', 'l1/3')")  # damage behind the pool's back
    led = pool.ledger()
    assert led.lost == 1 and led.complete == 2 and not led.balanced, led
    assert rows_per_group(pool) == {"l0": 4, "l1": 2, "l2": 4}


def test_ledger_detects_a_group_with_rows_in_mixed_states(pool):
    pool.append([make_group("m", n=3)], admit=True)
    pool.flush()
    pool._pool.update(where="uid = 'm/0'", values={"status": "consumed"})
    led = pool.ledger()
    assert led.lost == 1 and led.complete == 0 and led.consumed == 0 and not led.balanced, led


def test_ledger_detects_a_group_stored_with_fewer_samples_than_admitted(pool):
    pool.admit([Admission(group_id="short", prompt_id="p", n=4)])
    pool.append([make_group("short", n=3)])
    led = pool.ledger()
    assert led.lost == 1 and not led.balanced, led


# ====================================================================== partial rollouts


def test_partial_then_complete_replaces_rows_and_keeps_multi_version_spans(pool):
    final = make_group("pr", n=3, num_tokens=8, versions=(0, 1, 2))
    pool.admit(admissions_for([final]))
    part = partial_of(final, 3, versions=(0,))
    pool.save_partial([part])
    assert group_status(pool) == {"pr": {"partial"}}
    (stored_partial,) = pool.partial_groups()
    assert_group_equal(stored_partial, part)
    assert pool.ledger().partial == 1

    pool.append([final])
    assert rows_per_group(pool) == {"pr": 3}
    assert group_status(pool) == {"pr": {"complete"}}
    (got,) = pool.groups(["pr"])
    assert_group_equal(got, final)
    assert [len(s.spans) for s in got.samples] == [3, 3, 3]
    assert column_by_group(pool, "min_version")["pr"] == {0}
    assert column_by_group(pool, "max_version")["pr"] == {2}
    assert pool.partial_groups() == []
    led = pool.ledger()
    assert led.complete == 1 and led.partial == 0 and led.duplicated == 0 and led.balanced, led


def test_repeated_partial_saves_keep_only_the_latest(pool):
    final = make_group("rp", n=2, num_tokens=9, versions=(0, 1, 2))
    pool.admit(admissions_for([final]))
    for keep, vs in ((2, (0,)), (5, (0, 1)), (7, (0, 1, 2))):
        pool.save_partial([partial_of(final, keep, versions=vs)])
        assert rows_per_group(pool) == {"rp": 2}
        (p,) = pool.partial_groups()
        assert [s.num_tokens for s in p.samples] == [keep, keep]
        assert [len(s.spans) for s in p.samples] == [len(vs), len(vs)]
        assert pool.ledger().partial == 1 and pool.ledger().balanced
    pool.append([final])
    assert rows_per_group(pool) == {"rp": 2}
    assert_group_equal(pool.groups(["rp"])[0], final)
    assert pool.ledger().complete == 1 and pool.ledger().balanced


def test_partial_groups_filter_by_producer(pool):
    a = make_group("pa", producer_id="w0")
    b = make_group("pb", producer_id="w1")
    pool.admit(admissions_for([a, b]))
    pool.save_partial([partial_of(a, 2), partial_of(b, 2)])
    assert [g.group_id for g in pool.partial_groups("w1")] == ["pb"]
    assert sorted(g.group_id for g in pool.partial_groups()) == ["pa", "pb"]
    assert pool.partial_groups("nobody") == []


def test_partials_are_not_claimable(pool):
    g = make_group("pc")
    pool.admit(admissions_for([g]))
    pool.save_partial([partial_of(g, 2)])
    assert pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG) is None
    assert group_status(pool) == {"pc": {"partial"}}


def test_completing_a_partial_together_with_new_groups_in_one_commit(pool):
    """One append holding a replacement of a stored partial (upsert) and new groups (add)."""
    resumed = make_group("mix-resumed", n=3, versions=(0, 1))
    fresh = [make_group(f"mix-new{i}", n=3) for i in range(3)]
    pool.admit(admissions_for([resumed, *fresh]))
    pool.save_partial([partial_of(resumed, 2, versions=(0,))])
    pool.append([fresh[0], resumed, fresh[1], fresh[2]])
    assert rows_per_group(pool) == {g.group_id: 3 for g in (resumed, *fresh)}
    assert_group_equal(pool.groups(["mix-resumed"])[0], resumed)
    led = pool.ledger()
    assert led.complete == 4 and led.balanced, led


def test_resumed_partial_from_partial_groups_completes_in_a_new_pool_object(run_dir):
    """The resume path after a restart: read partials back, finish them, append."""
    final = make_group("resume", n=2, num_tokens=6, versions=(3, 4))
    with LancePool(run_dir / "pool") as p1:
        p1.admit(admissions_for([final]))
        p1.save_partial([partial_of(final, 2, versions=(3,))])
    with open_pool(str(run_dir)) as p2:
        (stored,) = p2.partial_groups()
        assert stored.status == "partial"
        p2.append([final])
        assert rows_per_group(p2) == {"resume": 2}
        assert_group_equal(p2.groups(["resume"])[0], final)
        assert p2.ledger().balanced


def test_complete_replaces_a_partial_saved_by_another_pool_object(run_dir):
    final = make_group("xproc", n=2, versions=(0, 1))
    with LancePool(run_dir / "pool") as writer_before_crash:
        writer_before_crash.admit(admissions_for([final]))
        writer_before_crash.save_partial([partial_of(final, 2, versions=(0,))])
    with open_pool(str(run_dir)) as after_restart:
        after_restart.append([final])
        assert rows_per_group(after_restart) == {"xproc": 2}
        assert group_status(after_restart) == {"xproc": {"complete"}}
        led = after_restart.ledger()
        assert led.complete == 1 and led.balanced, led


@pytest.mark.parametrize("finished", ["complete", "consumed"])
def test_a_late_partial_save_never_overwrites_a_finished_group(pool, finished):
    g = make_group("late", versions=(0, 1))
    pool.append([g], admit=True)
    if finished == "consumed":
        assert pool.claim(step=3, learner_version=1, num_groups=1, max_staleness=BIG) is not None
    try:
        pool.save_partial([partial_of(make_group("late", versions=(0, 1)), 2, versions=(0,))])
    except PoolError:
        pass  # refusing the stale snapshot is fine too
    assert group_status(pool) == {"late": {finished}}
    assert_group_equal(pool.groups(["late"])[0], g, status=finished)
    if finished == "consumed":
        assert column_by_group(pool, "consumed_step") == {"late": {3}}


def test_appending_a_group_object_after_saving_it_as_partial_stores_it_complete(pool):
    g = make_group("same-object", versions=(0,))
    pool.admit(admissions_for([g]))
    pool.save_partial([g])  # snapshot at a weight update; generation then finishes
    pool.append([g])
    assert group_status(pool) == {"same-object": {"complete"}}
    assert pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG) is not None


# ====================================================================== claims


def test_claim_takes_oldest_whole_groups_first_and_records_the_step(pool):
    # Creation order differs from id order and from sample counts.
    ids = ["g5", "g1", "g9", "g3", "g7", "g2"]
    groups = [make_group(gid, n=2 + i % 3) for i, gid in enumerate(ids)]
    append_each(pool, groups)

    b1 = pool.claim(step=10, learner_version=3, num_groups=2, max_staleness=BIG)
    assert b1 is not None and [g.group_id for g in b1.groups] == ["g5", "g1"]
    assert (b1.step, b1.learner_version, b1.dropped, b1.masked_tokens) == (10, 3, [], 0)
    for g, want in zip(b1.groups, groups[:2]):
        assert_group_equal(g, want, status="consumed")
        assert (g.consumed_step, g.consumed_version) == (10, 3)
    assert b1.num_samples == len(groups[0].samples) + len(groups[1].samples)

    b2 = pool.claim(step=11, learner_version=4, num_groups=2, max_staleness=BIG)
    assert [g.group_id for g in b2.groups] == ["g9", "g3"]

    # Only two left: asking for three returns None and claims nothing.
    assert pool.claim(step=12, learner_version=5, num_groups=3, max_staleness=BIG) is None
    assert group_status(pool)["g7"] == {"complete"} and group_status(pool)["g2"] == {"complete"}

    b3 = pool.claim(step=12, learner_version=5, num_groups=2, max_staleness=BIG)
    assert [g.group_id for g in b3.groups] == ["g7", "g2"]
    assert pool.claim(step=13, learner_version=6, num_groups=1, max_staleness=BIG) is None

    # Recorded in the pool, visible to scans and to a reader.
    steps = column_by_group(pool, "consumed_step")
    versions = column_by_group(pool, "consumed_version")
    assert steps == {"g5": {10}, "g1": {10}, "g9": {11}, "g3": {11}, "g7": {12}, "g2": {12}}
    assert versions == {"g5": {3}, "g1": {3}, "g9": {4}, "g3": {4}, "g7": {5}, "g2": {5}}
    assert all(s == {"consumed"} for s in group_status(pool).values())
    assert None not in {c for cs in column_by_group(pool, "claimed_ns").values() for c in cs}
    replay = pool.scan(["group_id"], where="consumed_step = 11")
    assert sorted(set(replay["group_id"].to_pylist())) == ["g3", "g9"]
    (g9,) = pool.groups(["g9"])
    assert (g9.status, g9.consumed_step, g9.consumed_version) == ("consumed", 11, 4)
    led = pool.ledger()
    assert led.consumed == 6 and led.balanced


def test_claim_select_keeps_some_groups_and_drops_the_rest_in_the_same_commit(pool):
    # Over-sampling: claim four, train on the two the selector keeps; the other two are
    # stored as dropped with the selector's reason.
    groups = [make_group(f"s{i}", n=2) for i in range(5)]
    append_each(pool, groups)
    seen: list[list[str]] = []

    def select(gs):
        seen.append([g.group_id for g in gs])
        return [gs[1], gs[3]], {gs[0].group_id: "over_sampling", gs[2].group_id: "it's odd"}

    b = pool.claim(step=7, learner_version=2, num_groups=4, max_staleness=BIG, select=select)
    assert seen == [["s0", "s1", "s2", "s3"]]
    assert [g.group_id for g in b.groups] == ["s1", "s3"]
    assert b.rejected == {"s0": "over_sampling", "s2": "it's odd"}
    st = group_status(pool)
    assert st == {"s0": {"dropped"}, "s1": {"consumed"}, "s2": {"dropped"}, "s3": {"consumed"}, "s4": {"complete"}}
    reasons = column_by_group(pool, "drop_reason")
    assert reasons["s0"] == {"over_sampling"} and reasons["s2"] == {"it's odd"} and reasons["s1"] == {None}
    assert column_by_group(pool, "consumed_step")["s1"] == {7}
    led = pool.ledger()
    assert (led.consumed, led.dropped, led.complete) == (2, 2, 1) and led.balanced


def test_claim_orders_by_created_time_not_by_append_order(pool):
    pool.append([make_group("late", created_at=2_000)], admit=True)
    pool.append([make_group("early", created_at=1_000)], admit=True)
    b = pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG)
    assert [g.group_id for g in b.groups] == ["early"]


def test_a_claimed_group_is_never_claimed_again(pool, run_dir):
    append_each(pool, [make_group(f"c{i:02d}", n=2) for i in range(9)])
    seen: list[str] = []
    step = 0
    while (b := pool.claim(step=step, learner_version=step, num_groups=2, max_staleness=BIG)) is not None:
        seen += [g.group_id for g in b.groups]
        assert all(len(g.samples) == 2 for g in b.groups)
        step += 1
    assert len(seen) == 8 and len(set(seen)) == 8
    # Another pool object (a restarted learner) sees the same state.
    with open_pool(str(run_dir)) as other:
        assert other.claim(step=99, learner_version=99, num_groups=2, max_staleness=BIG) is None
        b = other.claim(step=99, learner_version=99, num_groups=1, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == ["c08"] and "c08" not in seen


def test_claim_returns_each_group_with_all_its_samples(pool):
    append_each(pool, [make_group(f"w{i}", n=8, num_tokens=3) for i in range(3)])
    b = pool.claim(step=0, learner_version=0, num_groups=3, max_staleness=BIG)
    assert [len(g.samples) for g in b.groups] == [8, 8, 8]
    assert [[s.index for s in g.samples] for g in b.groups] == [list(range(8))] * 3


def test_claim_never_hands_out_a_group_with_missing_samples(pool):
    append_each(pool, [make_group("hole", n=4), make_group("whole", n=4)])
    pool._pool.delete("uid = 'hole/1'")
    b = pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG)
    assert b is not None and [g.group_id for g in b.groups] == ["whole"]


# ====================================================================== staleness policies


def _stale_setup(pool: LancePool) -> dict[str, object]:
    """Learner at version 6, bound 2 (oldest acceptable token version: 4)."""
    gs = {
        "old": make_group("old", n=2, versions=(1,)),  # staleness 5: all tokens stale
        "mixed": make_group("mixed", n=3, num_tokens=9, versions=(2, 3, 5)),  # staleness 4, 1/3 fresh
        "edge": make_group("edge", n=2, versions=(4, 6)),  # staleness == bound: within
        "fresh": make_group("fresh", n=2, versions=(6,)),
    }
    append_each(pool, gs.values())
    return gs


def test_staleness_drop(pool):
    gs = _stale_setup(pool)
    b = pool.claim(step=7, learner_version=6, num_groups=2, max_staleness=2, policy="drop")
    assert b is not None
    assert [g.group_id for g in b.groups] == ["edge", "fresh"]
    assert b.dropped == ["old", "mixed"]
    assert b.masked_tokens == 0
    assert_group_equal(b.groups[0], gs["edge"], status="consumed")
    st = group_status(pool)
    assert st["old"] == {"dropped"} and st["mixed"] == {"dropped"}
    reasons = column_by_group(pool, "drop_reason")
    assert reasons["old"] == {"stale"} and reasons["mixed"] == {"stale"}
    assert column_by_group(pool, "consumed_step")["old"] == {None}
    led = pool.ledger()
    assert (led.admitted, led.dropped, led.consumed, led.complete) == (4, 2, 2, 0) and led.balanced, led


def test_staleness_drop_when_too_few_fresh_groups_remain(pool):
    pool.append([make_group("s0", versions=(0,))], admit=True)
    pool.append([make_group("f0", versions=(9,))], admit=True)
    assert pool.claim(step=1, learner_version=9, num_groups=2, max_staleness=1, policy="drop") is None
    # The stale one is dropped for good, the fresh one still waits.
    assert group_status(pool) == {"s0": {"dropped"}, "f0": {"complete"}}
    b = pool.claim(step=1, learner_version=9, num_groups=1, max_staleness=1, policy="drop")
    assert [g.group_id for g in b.groups] == ["f0"] and b.dropped == []
    assert pool.ledger().balanced


def test_staleness_mask(pool):
    gs = _stale_setup(pool)
    b = pool.claim(step=7, learner_version=6, num_groups=4, max_staleness=2, policy="mask")
    assert b is not None and b.dropped == []
    assert [g.group_id for g in b.groups] == ["old", "mixed", "edge", "fresh"]
    by_id = {g.group_id: g for g in b.groups}
    expected_masked = 0
    for gid, want in gs.items():
        masks = {s.index: expected_token_mask(s, 6, 2) for s in want.samples}
        expected_masked += sum(int(((s.loss_mask == 1) & (masks[s.index] == 0)).sum()) for s in want.samples)
        # Everything but the loss mask is untouched; tokens within the bound keep their mask.
        assert_group_equal(by_id[gid], want, status="consumed", loss_masks=masks)
    assert expected_masked > 0
    assert b.masked_tokens == expected_masked
    # Spot checks, independent of the helper: all-stale group fully masked; fresh untouched.
    assert all(int(s.loss_mask.sum()) == 0 for s in by_id["old"].samples)
    for got, want in zip(by_id["fresh"].samples + by_id["edge"].samples,
                         gs["fresh"].samples + gs["edge"].samples):
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    for got, want in zip(by_id["mixed"].samples, gs["mixed"].samples):
        fresh_from = [sp for sp in want.spans if sp.version == 5][0].start
        np.testing.assert_array_equal(got.loss_mask[fresh_from:], want.loss_mask[fresh_from:])
        assert not got.loss_mask[:fresh_from].any()
    assert all(s == {"consumed"} for s in group_status(pool).values())


def test_staleness_mask_counts_only_tokens_that_were_trained_on(pool):
    g = make_group("tool", n=1, spans=[(0, 0, 6)])
    g.samples[0].loss_mask = np.array([1, 0, 0, 1, 1, 0], np.uint8)  # 3 tool-output tokens
    pool.append([g])
    b = pool.claim(step=0, learner_version=5, num_groups=1, max_staleness=1, policy="mask")
    assert b.masked_tokens == 3
    np.testing.assert_array_equal(b.groups[0].samples[0].loss_mask, np.zeros(6, np.uint8))


def test_staleness_keep(pool):
    gs = _stale_setup(pool)
    b = pool.claim(step=7, learner_version=6, num_groups=4, max_staleness=2, policy="keep")
    assert [g.group_id for g in b.groups] == ["old", "mixed", "edge", "fresh"]
    assert b.dropped == [] and b.masked_tokens == 0
    for g in b.groups:
        assert_group_equal(g, gs[g.group_id], status="consumed")
    assert column_by_group(pool, "consumed_step") == {gid: {7} for gid in gs}


def test_spans_of_a_resumed_rollout_decide_staleness_by_the_oldest_token(pool):
    g = make_group("resumed", n=1, spans=[(0, 0, 2), (7, 2, 10)])
    pool.append([g])
    b = pool.claim(step=0, learner_version=7, num_groups=1, max_staleness=6, policy="drop")
    assert b is None and group_status(pool) == {"resumed": {"dropped"}}


# ====================================================================== compaction


def _full_table(pool: LancePool) -> pa.Table:
    return pool.scan().sort_by("uid")


def test_compaction_keeps_data_and_ledger_and_claims_still_work(run_dir):
    pool = LancePool(run_dir / "pool", compact_every=0)  # only explicit compaction here
    groups = [make_group(f"k{i:02d}", n=3, versions=(i % 4,)) for i in range(24)]
    append_each(pool, groups)
    pool.claim(step=0, learner_version=3, num_groups=4, max_staleness=1, policy="drop")
    resumable = make_group("k-partial", n=3, versions=(2, 3))
    pool.admit(admissions_for([resumable]))
    pool.save_partial([partial_of(resumable, 2, versions=(2,))])
    frags_before = pool.fragments()
    assert frags_before >= 10  # one per append, minus fragments the claim's update emptied

    before_rows, before_ledger = _full_table(pool), pool.ledger()
    before_adm = pool.scan(table="admissions").sort_by("group_id")
    pool.compact()
    assert pool.fragments() < frags_before
    assert pool.fragments() <= 3
    assert _full_table(pool).equals(before_rows)
    assert pool.scan(table="admissions").sort_by("group_id").equals(before_adm)
    assert pool.ledger() == before_ledger and before_ledger.balanced

    # Everything still works on the compacted, indexed table.
    consumed_before = set(pool.scan(["group_id"], where="status = 'consumed'")["group_id"].to_pylist())
    b = pool.claim(step=1, learner_version=3, num_groups=3, max_staleness=BIG)
    assert b is not None and not ({g.group_id for g in b.groups} & consumed_before)
    pool.append([resumable])
    assert rows_per_group(pool)["k-partial"] == 3
    assert_group_equal(pool.groups(["k-partial"])[0], resumable)
    pool.append([make_group("k-after")], admit=True)
    pool.compact()  # second round, with indices present and updated rows
    led = pool.ledger()
    assert led.balanced and led.consumed == before_ledger.consumed + 3 and led.partial == 0, led
    all_claimed: list[str] = []
    step = 2
    while (b := pool.claim(step=step, learner_version=3, num_groups=1, max_staleness=BIG)) is not None:
        all_claimed += [g.group_id for g in b.groups]
        step += 1
    assert len(all_claimed) == len(set(all_claimed)) and "k-after" in all_claimed
    assert pool.ledger().complete == 0 and pool.ledger().balanced
    pool.close()


def test_claims_trigger_background_compaction(run_dir):
    pool = LancePool(run_dir / "pool", compact_every=8)
    append_each(pool, [make_group(f"bg{i:02d}", n=2) for i in range(12)])
    assert pool.fragments() >= 12
    b = pool.claim(step=0, learner_version=0, num_groups=2, max_staleness=BIG)
    assert b is not None
    pool.close()  # waits for the compaction thread
    with LancePool(run_dir / "pool", create=False) as p:
        assert p.fragments() < 12
        led = p.ledger()
        assert led.admitted == 12 and led.consumed == 2 and led.complete == 10 and led.balanced
        b = p.claim(step=1, learner_version=0, num_groups=10, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == [f"bg{i:02d}" for i in range(2, 12)]


def test_only_small_fragments_start_a_background_compaction(run_dir, monkeypatch):
    monkeypatch.setattr(compaction, "COMPACT_TARGET_ROWS", 8)  # a fragment of 8 rows is full
    pool = LancePool(run_dir / "pool", compact_every=4)
    append_each(pool, [make_group(f"full{i}", n=8) for i in range(6)])
    assert pool.fragments() == 6 and pool.small_fragments() == 0
    assert not pool.maybe_compact()  # a pool of full fragments has nothing to merge
    append_each(pool, [make_group(f"small{i}", n=2) for i in range(4)])
    assert pool.small_fragments() == 4
    assert pool.maybe_compact()
    pool.close()
    with LancePool(run_dir / "pool", create=False) as p:
        assert p.small_fragments() == 0 and p.fragments() == 7  # the 4 small ones merged into one full one
        assert p.ledger().complete == 10 and p.ledger().balanced


# ====================================================================== opening: errors


def test_open_missing_run_dir_is_a_pool_error(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(PoolError) as ei:
        open_pool(str(missing))
    assert str(missing) in str(ei.value) and "does not exist" in str(ei.value)
    assert not missing.exists(), "opening must not create anything"


def test_open_directory_without_a_pool_is_a_pool_error(tmp_path):
    with pytest.raises(PoolError, match="not an experience pool"):
        open_pool(str(tmp_path))


def test_open_pool_resolves_run_dir_and_pool_dir(pool, run_dir):
    pool.append([make_group("r")], admit=True)
    for where in (str(run_dir), str(run_dir / "pool")):
        with open_pool(where) as p:
            assert p.ledger().complete == 1


def test_open_pool_with_a_foreign_schema_is_a_pool_error(tmp_path):
    db = lancedb.connect(tmp_path / "pool")
    db.create_table("pool", pa.table({"x": [1, 2]}))
    db.create_table("admissions", pa.table({"group_id": ["a"]}))
    with pytest.raises(PoolError, match="schema"):
        open_pool(str(tmp_path))


def _populated(run_dir: Path) -> Path:
    with LancePool(run_dir / "pool") as p:
        for i in range(3):
            p.append([make_group(f"c{i}", n=2)], admit=True)
    return run_dir / "pool" / "pool.lance"


def _manifests(t: Path) -> list[Path]:
    return sorted((t / "_versions").glob("*.manifest"))


def _data_files(t: Path) -> list[Path]:
    return sorted((t / "data").glob("*.lance"))


def _garble(f: Path) -> None:
    f.write_bytes(b"\x00garbage\xff" * (max(f.stat().st_size, 40) // 10))


def _truncate(f: Path, size: int = 100) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(size)


_MANIFEST_DAMAGE = {
    "versions dir deleted": lambda t: shutil.rmtree(t / "_versions"),
    "all manifests deleted": lambda t: [m.unlink() for m in _manifests(t)],
    "latest manifest garbled": lambda t: _garble(_manifests(t)[0]),
    "all manifests garbled": lambda t: [_garble(m) for m in _manifests(t)],
    "latest manifest truncated": lambda t: _truncate(_manifests(t)[0]),
    "pool table deleted": lambda t: shutil.rmtree(t),
}

_DATA_DAMAGE = {
    "one data file deleted": lambda t: _data_files(t)[0].unlink(),
    "all data files deleted": lambda t: [f.unlink() for f in _data_files(t)],
    "data file garbled": lambda t: _garble(_data_files(t)[0]),
    "data file truncated": lambda t: _truncate(_data_files(t)[0], 1000),
}


def _assert_readable(e: PoolError, run_dir: Path) -> None:
    msg = str(e)
    assert str(run_dir / "pool") in msg, msg
    assert "\n" not in msg and len(msg) < 1000 and "Traceback" not in msg, msg
    assert e.__cause__ is None


@pytest.mark.parametrize("damage", list(_MANIFEST_DAMAGE), ids=list(_MANIFEST_DAMAGE))
def test_damaged_manifest_is_a_pool_error(run_dir, damage):
    _MANIFEST_DAMAGE[damage](_populated(run_dir))
    with pytest.raises(PoolError) as ei:
        open_pool(str(run_dir))
    _assert_readable(ei.value, run_dir)


@pytest.mark.parametrize("damage", list(_DATA_DAMAGE), ids=list(_DATA_DAMAGE))
def test_damaged_data_files_are_a_pool_error(run_dir, damage):
    _DATA_DAMAGE[damage](_populated(run_dir))
    with pytest.raises(PoolError) as ei:
        p = open_pool(str(run_dir))  # either here ...
        p.ledger()  # ... or at the first read
        p.groups(["c0", "c1", "c2"])
    _assert_readable(ei.value, run_dir)


def test_damaged_admissions_table_is_a_pool_error(run_dir):
    _populated(run_dir)
    adm = run_dir / "pool" / "admissions.lance"
    for m in _manifests(adm):
        _garble(m)
    with pytest.raises(PoolError) as ei:
        open_pool(str(run_dir))
    _assert_readable(ei.value, run_dir)
