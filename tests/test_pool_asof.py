"""Time travel: the pool read as of a learner step or a table version (streamrl/core/asof.py decides
which versions, pools/asof.py reads them), checkpoint tags, and the version cleanup policy."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pyarrow as pa
import pytest

from streamrl.core.asof import AsOf, AsOfError, claims_as_of, recorded_steps, resolve_step, resolve_version
from streamrl.pools import LancePool, PoolError
from streamrl.pools.queries import pool_query, pool_stats

from poolkit import make_group


def claims(*rows: tuple[str, int | None, int | None, int | None]) -> pa.Table:
    """Claim rows (group id, step, pool_version, admissions_version)."""
    return pa.table({"group_id": [r[0] for r in rows], "step": pa.array([r[1] for r in rows], pa.int32()),
                     "pool_version": pa.array([r[2] for r in rows], pa.int64()),
                     "admissions_version": pa.array([r[3] for r in rows], pa.int64())})


# ---------------------------------------------------------------- the pure rules


def test_a_step_reads_the_versions_its_last_claim_read() -> None:
    c = claims(("a", 0, 5, 3), ("b", 1, 7, 4), ("stale", 2, 8, 4), ("c", 2, 11, 6), ("d", 3, 12, 6))
    assert recorded_steps(c) == (0, 3)
    at = resolve_step(c, 2)  # a waiting claim dropped `stale` at version 8; the batch was formed at 11
    assert at == AsOf(11, 6, through_step=2)
    assert claims_as_of(c, at)["group_id"].to_pylist() == ["a", "b", "stale", "c"]
    assert resolve_step(c, 0) == AsOf(5, 3, through_step=0)


def test_a_step_outside_the_run_names_the_runs_steps() -> None:
    c = claims(("a", 0, 5, 3), ("b", 4, 7, 4))
    with pytest.raises(AsOfError, match=r"step 99999 is outside this run: .* 0\.\.4"):
        resolve_step(c, 99999)
    with pytest.raises(AsOfError, match="step 2 made no claim"):
        resolve_step(c, 2)
    with pytest.raises(AsOfError, match="record no table versions"):
        resolve_step(claims(("old", None, None, None)), 0)


def test_a_bare_version_applies_the_claims_that_read_it_or_older() -> None:
    c = claims(("old", None, None, None), ("a", 0, 5, 3), ("b", 1, 7, 4))
    at = resolve_version(c, 6)
    assert at == AsOf(6, 3, through_version=6)
    assert claims_as_of(c, at)["group_id"].to_pylist() == ["old", "a"]  # claims from before steps were recorded apply


# ---------------------------------------------------------------- a real pool


def _pool_with_three_steps(pool: LancePool) -> dict[int, list[str]]:
    """Steps 0-2 each claim 2 groups, with appends between them and after; then a compaction."""
    trained = {}
    pool.append([make_group(f"a{i}", n=2) for i in range(3)], admit=True)
    for step, more in enumerate(("b", "c", "d")):
        b = pool.claim(step=step, learner_version=step, num_groups=2, max_staleness=10)
        assert b is not None
        trained[step] = sorted(g.group_id for g in b.groups)
        pool.append([make_group(f"{more}{i}", n=2) for i in range(3)], admit=True)
    pool.compact()
    return trained


def test_as_of_step_reads_exactly_what_the_step_read_after_appends_and_a_compaction(pool) -> None:
    trained = _pool_with_three_steps(pool)
    now = pool.count()
    for step, groups in trained.items():
        past = pool.as_of(step=step)
        got = pool_query(past, f"SELECT DISTINCT group_id FROM pool WHERE consumed_step = {step} ORDER BY 1")
        assert got["group_id"].to_pylist() == groups
        # Later steps' groups read as not yet claimed, later appends not at all.
        later = [g for s, gs in trained.items() if s > step for g in gs]
        st = dict(zip(*pool_query(past, "SELECT group_id, any_value(status) FROM pool GROUP BY 1").columns))
        assert {st[g].as_py() for g in later if g in st} <= {"complete"}
        assert past.count() == 6 * (step + 1) < now  # 3 groups of 2 before step 0, 3 more before each later step
        assert [g.group_id for g in past.groups(groups)] == groups
        stats = pool_stats(past)
        assert stats["groups_by_status"]["consumed"] == 2 * (step + 1) and stats["ledger"]["balanced"], stats


def test_step_groups_are_what_the_step_read_even_when_a_group_is_stored_again(pool) -> None:
    trained = _pool_with_three_steps(pool)
    again = make_group(trained[0][0], n=2)
    pool.append([again])  # a producer's retry stores a consumed group a second time
    assert len(pool.groups([again.group_id])[0].samples) == 4
    (g,) = pool.step_groups(0, [again.group_id])
    assert [s.index for s in g.samples] == [0, 1] and g.consumed_step == 0


def test_a_tagged_version_survives_a_cleanup_and_an_untagged_one_does_not(pool) -> None:
    trained = _pool_with_three_steps(pool)
    step0 = pool.as_of(step=0).at
    assert pool.tag_checkpoint(1, step=0)["pool"] == step0.pool_version  # a checkpoint of step 0
    pool.cleanup(keep_versions=1, min_age=timedelta(0))
    past = pool.as_of(step=0)  # tagged: still there
    assert sorted(pool_query(past, "SELECT DISTINCT group_id FROM pool WHERE consumed_step = 0")["group_id"]
                  .to_pylist()) == trained[0]
    assert pool.as_of(version="checkpoint-v000001").at.pool_version == step0.pool_version
    with pytest.raises(PoolError, match=r"no version .*keep_versions.* checkpoint-v000001"):
        pool.as_of(step=1)  # not tagged, not the newest: cleaned up, and the error says so


def test_the_compaction_keeps_the_newest_versions_by_policy(run_dir) -> None:
    with LancePool(run_dir / "pool", keep_versions=2, compact_every=0) as pool:
        for i in range(5):
            pool.append([make_group(f"g{i}", n=2)], admit=True)
        pool.cleanup(min_age=timedelta(0))
        assert len(pool._open("pool").versions()) == 2
        pool.cleanup(keep_versions=0, min_age=timedelta(0))  # 0: keep everything
        assert len(pool._open("pool").versions()) == 2


def test_a_checkpoint_tag_names_the_versions_its_step_read(pool) -> None:
    _pool_with_three_steps(pool)
    versions = pool.tag_checkpoint(3, step=1)  # step 2 has claimed since: the tag is still step 1's
    assert versions["pool"] == pool.as_of(step=1).at.pool_version != pool.as_of(step=2).at.pool_version
    assert pool.as_of(version="checkpoint-v000003").at.pool_version == versions["pool"]
    assert pool.untag_checkpoints({5}) == ["checkpoint-v000003"] * 3
    assert "checkpoint-v000003" not in pool._open("pool").tags.list()


@pytest.mark.slow
def test_the_cli_reads_the_pool_as_of_a_step_and_refuses_one_beyond_the_run(pool, run_dir) -> None:
    trained = _pool_with_three_steps(pool)
    pool.close()
    cli = [sys.executable, "-m", "streamrl", "pool"]
    q = subprocess.run([*cli, "query", str(run_dir), "--as-of-step", "1", "--json",
                        "SELECT DISTINCT group_id FROM pool WHERE consumed_step = 1 ORDER BY 1"],
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    assert [r["group_id"] for r in json.loads(q.stdout)] == trained[1]
    assert "as of step 1" in q.stderr
    st = subprocess.run([*cli, "stats", str(run_dir), "--as-of-step", "0", "--json"], capture_output=True, text=True,
                        timeout=120)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["rows"] == 6
    bad = subprocess.run([*cli, "query", str(run_dir), "--as-of-step", "99999", "SELECT 1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "0..2" in bad.stderr, bad.stderr
    sh = subprocess.run([*cli, "show", str(run_dir), trained[0][0], "--version", "1"], capture_output=True, text=True,
                        timeout=120)
    assert sh.returncode == 2 and f"no group {trained[0][0]!r}" in sh.stderr, sh.stderr  # version 1: empty table
