"""Claims at the size of a real run: a claim writes only the narrow `claims` table, reads only
the rows written since the previous one, and reads as if the sample rows had been updated.
Real Lance tables in tmp_path."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import lancedb
import pyarrow as pa
import pytest

from streamrl.pools import LancePool, open_pool
from streamrl.pools.lance_pool import POOL_TABLE
from streamrl.pools.schema import ADMISSIONS_SCHEMA, POOL_SCHEMA, admissions_to_table, groups_to_table

from poolkit import admissions_for, assert_group_equal, group_status, make_group, partial_of

BIG = 10**6


def append_each(pool: LancePool, groups, *, admit: bool = True) -> None:
    for g in groups:
        pool.append([g], admit=admit)
        pool.flush()  # one commit per group
        time.sleep(0.001)  # created times strictly increase in list order


def table_version(pool: LancePool, name: str) -> int:
    return lancedb.connect(pool.uri).open_table(name).version


def test_a_claim_never_writes_sample_rows_and_reads_as_if_it_had(pool: LancePool) -> None:
    append_each(pool, [make_group(f"g{i}", n=3) for i in range(4)])
    before = table_version(pool, POOL_TABLE)
    b = pool.claim(step=5, learner_version=2, num_groups=2, max_staleness=BIG)
    assert [g.group_id for g in b.groups] == ["g0", "g1"]
    assert table_version(pool, POOL_TABLE) == before, "a claim wrote to the sample table"
    stored = pool.scan(["group_id", "status"], effective=False)
    assert set(stored["status"].to_pylist()) == {"complete"}
    assert group_status(pool) == {"g0": {"consumed"}, "g1": {"consumed"}, "g2": {"complete"}, "g3": {"complete"}}
    claims = pool.claims().sort_by("group_id")
    assert claims["group_id"].to_pylist() == ["g0", "g1"]
    assert claims["consumed_step"].to_pylist() == [5, 5] and claims["consumed_version"].to_pylist() == [2, 2]
    (g0,) = pool.groups(["g0"])
    assert (g0.status, g0.consumed_step, g0.consumed_version) == ("consumed", 5, 2)
    assert_group_equal(g0, make_group("g0", n=3), status="consumed")


def test_filters_on_what_claims_decide(pool: LancePool) -> None:
    append_each(pool, [make_group(f"f{i}", n=2, versions=(i,)) for i in range(5)])
    pool.claim(step=0, learner_version=3, num_groups=2, max_staleness=1, policy="drop")  # f0, f1 stale
    pool.claim(step=1, learner_version=3, num_groups=1, max_staleness=BIG)
    where = "status = 'consumed' AND consumed_step >= 0"
    got = pool.scan(["uid", "response_tokens"], where=where)
    assert sorted(got["uid"].to_pylist()) == ["f2/0", "f2/1", "f3/0", "f3/1", "f4/0", "f4/1"]
    assert pool.count(where) == 6 and pool.count("status = 'dropped' AND drop_reason = 'stale'") == 4
    assert pool.claim_stats()["stale_dropped"] == 2  # groups (2 rows each): what streaming admits again
    batches = list(pool.reader(["uid", "consumed_step"], where="consumed_step = 1", batch_rows=1))
    streamed = pa.Table.from_batches(batches)
    assert streamed.num_rows == 2 and streamed["consumed_step"].to_pylist() == [1, 1]
    assert max(b.num_rows for b in batches) == 1  # streamed, never the whole selection at once
    batches = list(pool.reader(["uid", "response_tokens"], where="min_version >= 2", batch_rows=3))
    assert sum(b.num_rows for b in batches) == 6 and max(b.num_rows for b in batches) <= 3
    assert pool.consumed_steps() == {0: ["f2", "f3"], 1: ["f4"]}
    with pytest.raises(ValueError, match="bad filter"):
        pool.scan(["uid"], where="status = = 'consumed'")


def test_a_claim_reads_only_the_rows_written_since_the_last_one(run_dir: Path) -> None:
    pool = LancePool(run_dir / "pool", compact_every=0)
    append_each(pool, [make_group(f"old{i}", n=4) for i in range(30)])
    assert pool.claim(step=0, learner_version=0, num_groups=20, max_staleness=BIG) is not None
    read = pool.claim_stats()["rows_read"]
    assert read == 30 * 4  # the first claim of this object reads what is complete
    append_each(pool, [make_group("new0", n=4), make_group("new1", n=4)])
    pool.compact()  # rewrites every row: none of them counts as new
    b = pool.claim(step=1, learner_version=0, num_groups=2, max_staleness=BIG)
    assert [x.group_id for x in b.groups] == ["old20", "old21"]  # oldest first
    assert pool.claim_stats()["rows_read"] - read == 2 * 4
    # A partial rollout that completes is new again, as complete rows.
    g = make_group("resumed", n=4, versions=(0, 1))
    pool.admit(admissions_for([g]))
    pool.save_partial([partial_of(g, 2, versions=(0,))])
    pool.append([g])
    read = pool.claim_stats()["rows_read"]
    b = pool.claim(step=2, learner_version=1, num_groups=11, max_staleness=BIG)
    assert [x.group_id for x in b.groups] == [f"old{i}" for i in range(22, 30)] + ["new0", "new1", "resumed"]
    assert pool.claim_stats()["rows_read"] - read == 4  # its rows once, as they are now: complete
    assert_group_equal(b.groups[-1], g, status="consumed")
    assert pool.ledger().balanced
    pool.close()


def test_a_restarted_learner_starts_reading_where_the_last_claim_said(run_dir: Path) -> None:
    with LancePool(run_dir / "pool", compact_every=0) as first:
        append_each(first, [make_group(f"a{i:02d}", n=2) for i in range(40)])
        for step in range(6):
            first.claim(step=step, learner_version=step, num_groups=5, max_staleness=BIG)
    with open_pool(str(run_dir)) as second:
        b = second.claim(step=6, learner_version=6, num_groups=10, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == [f"a{i:02d}" for i in range(30, 40)]
        assert second.claim_stats()["rows_read"] == 10 * 2  # not the 30 groups already claimed
        assert second.claim_stats()["rows_scanned"] == 10 * 2  # only the fragments made after the last frontier
        assert second.claim(step=7, learner_version=7, num_groups=1, max_staleness=BIG) is None
        assert second.ledger().consumed == 40


def test_a_claim_filters_only_the_fragments_added_since_the_last_one(run_dir: Path) -> None:
    import lance

    pool = LancePool(run_dir / "pool", compact_every=0)
    append_each(pool, [make_group(f"h{i:02d}", n=4) for i in range(30)])
    pool.claim(step=0, learner_version=0, num_groups=20, max_staleness=BIG)
    stats = pool.claim_stats()
    assert stats["rows_scanned"] == 30 * 4  # a learner's first claim filters every fragment
    append_each(pool, [make_group("n0", n=4), make_group("n1", n=4)])
    pool.claim(step=1, learner_version=0, num_groups=2, max_staleness=BIG)
    assert pool.claim_stats()["rows_scanned"] - stats["rows_scanned"] == 2 * 4  # not the 30 groups before

    uri = str(run_dir / "pool" / "pool.lance")
    before = max(f.fragment_id for f in lance.dataset(uri).get_fragments())
    pool.compact()
    after = [f.fragment_id for f in lance.dataset(uri).get_fragments()]
    assert min(after) > before  # what the claim relies on: a compaction's fragments come after every older one
    pool.append([make_group("n2", n=4)], admit=True)
    stats = pool.claim_stats()
    b = pool.claim(step=2, learner_version=0, num_groups=11, max_staleness=BIG)
    assert [g.group_id for g in b.groups] == [f"h{i}" for i in range(22, 30)] + ["n0", "n1", "n2"]
    assert pool.claim_stats()["rows_read"] - stats["rows_read"] == 4  # the rewritten rows are not new again
    assert pool.claim_stats()["rows_scanned"] - stats["rows_scanned"] == 33 * 4  # but were filtered once
    pool.append([make_group("n3", n=4)], admit=True)
    stats = pool.claim_stats()
    assert [g.group_id for g in pool.claim(step=3, learner_version=0, num_groups=1, max_staleness=BIG).groups] == ["n3"]
    assert pool.claim_stats()["rows_scanned"] - stats["rows_scanned"] == 4
    assert pool.ledger().balanced
    pool.close()


def test_a_restart_after_the_frontier_version_was_cleaned_up_reads_every_fragment(run_dir: Path) -> None:
    import lance

    with LancePool(run_dir / "pool", compact_every=0) as first:
        append_each(first, [make_group(f"c{i:02d}", n=2) for i in range(12)])
        first.claim(step=0, learner_version=0, num_groups=4, max_staleness=BIG)
    lance.dataset(str(run_dir / "pool" / "pool.lance")).cleanup_old_versions(older_than=timedelta(0))
    with LancePool(run_dir / "pool", compact_every=0) as second:
        b = second.claim(step=1, learner_version=1, num_groups=8, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == [f"c{i:02d}" for i in range(4, 12)]
        assert second.claim_stats()["rows_scanned"] == 12 * 2  # no version to bound it by: every fragment, once
        assert second.ledger().consumed == 12 and second.ledger().balanced


def test_a_group_stored_again_is_never_claimed_twice(pool: LancePool) -> None:
    append_each(pool, [make_group("once"), make_group("twice-ready")])
    assert [g.group_id for g in pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG).groups] == [
        "once"]
    pool.append([make_group("once"), make_group("twice-ready")])  # a producer's retry stores both again
    assert pool.claim(step=1, learner_version=0, num_groups=1, max_staleness=BIG) is None
    led = pool.ledger()
    assert led.duplicated == 2 and not led.balanced, led
    assert len(pool.claims()) == 1
    assert pool.claim_stats()["broken"] == 1


def _old_pool(uri: Path) -> None:
    """A pool as StreamRL wrote it before claims: no stable row ids, no claims table, a claim
    rewrote the rows' status."""
    db = lancedb.connect(uri)
    pool = db.create_table("pool", schema=POOL_SCHEMA, data_storage_version="2.0")
    adm = db.create_table("admissions", schema=ADMISSIONS_SCHEMA, data_storage_version="2.0")
    groups = [make_group(f"o{i}", n=2, created_at=1000 + i) for i in range(6)]
    adm.add(admissions_to_table(admissions_for(groups)))
    pool.add(groups_to_table(groups))
    pool.update(where="group_id IN ('o0', 'o1')", values={"status": "consumed", "consumed_step": 0, "consumed_version": 0})


def test_a_pool_from_before_claims_reads_and_claims(run_dir: Path) -> None:
    _old_pool(run_dir / "pool")
    with open_pool(str(run_dir)) as ro:
        assert ro.claims().num_rows == 0 and ro.fragments("claims") == 0
        led = ro.ledger()
        assert (led.consumed, led.complete) == (2, 4) and led.balanced, led
    assert not (run_dir / "pool" / "claims.lance").exists(), "reading an old pool changed it"
    with LancePool(run_dir / "pool") as rw:  # the learner of a resumed run
        b = rw.claim(step=1, learner_version=1, num_groups=2, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == ["o2", "o3"]
        assert rw.claim_stats()["incremental"] is False
        b = rw.claim(step=2, learner_version=2, num_groups=2, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == ["o4", "o5"]
        assert rw.consumed_steps() == {0: ["o0", "o1"], 1: ["o2", "o3"], 2: ["o4", "o5"]}
        led = rw.ledger()
        assert led.consumed == 6 and led.balanced, led


def test_a_claim_on_a_pool_from_before_claims_opened_read_only(run_dir: Path) -> None:
    _old_pool(run_dir / "pool")
    with open_pool(str(run_dir)) as pool:  # create=False, as tools and test children open pools
        b = pool.claim(step=1, learner_version=1, num_groups=4, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == ["o2", "o3", "o4", "o5"]
        assert pool.ledger().consumed == 6 and pool.ledger().balanced


def test_a_pool_at_a_uri_rather_than_a_path(tmp_path: Path) -> None:
    """Everything goes through Lance's object store: a file:// URI stands in for s3:// here."""
    uri = f"file://{tmp_path}/somewhere/pool"
    with LancePool(uri, compact_every=2) as pool:
        append_each(pool, [make_group(f"u{i}") for i in range(6)])
        assert [g.group_id for g in pool.claim(step=0, learner_version=0, num_groups=2, max_staleness=BIG).groups] == [
            "u0", "u1"]
        pool.compact()
        b = pool.claim(step=1, learner_version=0, num_groups=4, max_staleness=BIG)
        assert [g.group_id for g in b.groups] == ["u2", "u3", "u4", "u5"]
        assert pool.claim_stats()["rows_read"] == 6 * 4
    with open_pool(uri) as pool:
        led = pool.ledger()
        assert led.consumed == 6 and led.balanced, led
        assert pool.consumed_steps() == {0: ["u0", "u1"], 1: ["u2", "u3", "u4", "u5"]}
