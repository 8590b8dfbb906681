"""The claim rules (streamrl.core.claims) and the ledger with claims, on plain Arrow tables."""

from __future__ import annotations

import pyarrow as pa
import pytest

from streamrl.core.claims import ReadySet, apply_claims, claim_columns, not_whole
from streamrl.core.ledger import compute_ledger

_ids = iter(range(10**6))


def rows(gid: str, n: int, *, status: str = "complete", created: int = 0, minv: int | None = 0, version: int = 1,
         indices: list[int] | None = None) -> pa.Table:
    idx = list(range(n)) if indices is None else indices
    return pa.table({"group_id": [gid] * len(idx), "sample_index": pa.array(idx, pa.int32()),
                     "n_samples": pa.array([n] * len(idx), pa.int32()), "status": [status] * len(idx),
                     "created_ns": pa.array([created] * len(idx), pa.int64()),
                     "min_version": pa.array([minv] * len(idx), pa.int32()),
                     "row_id": pa.array([next(_ids) for _ in idx], pa.int64()),
                     "version": pa.array([version] * len(idx), pa.int64())})


def claims_table(*decisions: tuple[str, str, str | None], step: int = 3, version: int = 7) -> pa.Table:
    cols = claim_columns(list(decisions), step, version)
    return pa.table({**cols, "consumed_step": pa.array(cols["consumed_step"], pa.int32()),
                     "consumed_version": pa.array(cols["consumed_version"], pa.int32()),
                     "claimed_ns": pa.array([99] * len(decisions), pa.int64())})


# ---------------------------------------------------------------- apply_claims


def test_apply_claims_overrides_claimed_groups_and_keeps_row_order() -> None:
    stored = pa.table({"group_id": ["b", "a", "c", "a"], "status": ["complete", "complete", "dropped", "complete"],
                       "drop_reason": [None, None, "filter:zero_std", None],
                       "consumed_step": pa.array([None] * 4, pa.int32()), "reward": [1.0, 2.0, 3.0, 4.0]})
    got = apply_claims(stored, claims_table(("a", "consumed", None), ("b", "dropped", "stale")))
    assert got.column_names == stored.column_names
    assert got["group_id"].to_pylist() == ["b", "a", "c", "a"]
    assert got["status"].to_pylist() == ["dropped", "consumed", "dropped", "consumed"]
    assert got["drop_reason"].to_pylist() == ["stale", None, "filter:zero_std", None]
    assert got["consumed_step"].to_pylist() == [None, 3, None, 3]
    assert got["reward"].to_pylist() == [1.0, 2.0, 3.0, 4.0]


def test_apply_claims_without_claim_columns_or_claims_is_the_identity() -> None:
    stored = pa.table({"group_id": ["a"], "reward": [1.0]})
    assert apply_claims(stored, claims_table(("a", "consumed", None))).equals(stored)
    stored = pa.table({"group_id": ["a"], "status": ["complete"]})
    assert apply_claims(stored, claims_table()).equals(stored)


# ---------------------------------------------------------------- ReadySet


def test_ready_set_orders_whole_complete_groups_by_creation() -> None:
    r = ReadySet()
    r.add_rows(pa.concat_tables([rows("late", 2, created=30, minv=4), rows("early", 3, created=10, minv=2),
                                 rows("tie-b", 2, created=20), rows("tie-a", 2, created=20),
                                 rows("part", 2, status="partial"), rows("fail", 2, status="failed")]))
    assert r.candidates() == [("early", 2), ("tie-a", 0), ("tie-b", 0), ("late", 4)]
    assert len(r.row_ids(["early"])) == 3


def test_ready_set_sets_aside_groups_that_are_not_whole_or_stored_twice() -> None:
    r = ReadySet()
    r.add_rows(pa.concat_tables([rows("short", 3, indices=[0, 1]), rows("gap", 3, indices=[0, 2, 3]),
                                 rows("ok", 2), rows("twice", 2)]))
    r.add_rows(rows("twice", 2, version=2))  # the same group stored again by a later commit
    assert [g for g, _ in r.candidates()] == ["ok"]
    assert r.broken == {"short", "gap", "twice"}
    r.add_rows(rows("gap", 3, version=3))  # a broken group stays out
    assert [g for g, _ in r.candidates()] == ["ok"]


def test_ready_set_ignores_claimed_groups_even_when_their_rows_come_again() -> None:
    r = ReadySet(claimed=["old"])
    r.add_rows(rows("old", 2))
    assert r.candidates() == []
    r.add_rows(rows("new", 2))
    r.mark_claimed(["new"])
    r.add_rows(rows("new", 2, version=5))
    assert r.candidates() == [] and "new" not in r.broken


def test_frontier_is_just_before_the_oldest_ready_group() -> None:
    r = ReadySet()
    assert r.frontier(seen_version=9) == 9
    r.add_rows(pa.concat_tables([rows("a", 1, version=4), rows("b", 1, version=6)]))
    assert r.frontier(seen_version=9) == 3
    r.mark_claimed(["a"])
    assert r.frontier(seen_version=9) == 5
    r.mark_broken(["b"])
    assert r.frontier(seen_version=9) == 9


def test_not_whole_names_groups_missing_rows_or_not_complete() -> None:
    back = pa.concat_tables([rows("a", 2), rows("b", 3, indices=[0, 2]), rows("c", 2, status="partial")])
    assert not_whole(back, ["a", "b", "c", "gone"]) == {"b", "c", "gone"}


# ---------------------------------------------------------------- ledger with claims


def _stored(*groups: tuple[str, int, str]) -> pa.Table:
    return pa.concat_tables([rows(g, n, status=st).select(["group_id", "sample_index", "status"]) for g, n, st in groups])


def _admitted(*groups: tuple[str, int]) -> pa.Table:
    return pa.table({"group_id": [g for g, _ in groups], "n": pa.array([n for _, n in groups], pa.int32())})


def test_ledger_takes_the_state_of_a_claimed_group_from_its_claim() -> None:
    adm = _admitted(("c", 2), ("d", 2), ("k", 2), ("f", 2), ("in", 2))
    stored = _stored(("c", 2, "complete"), ("d", 2, "complete"), ("k", 2, "complete"), ("f", 2, "dropped"))
    led = compute_ledger(adm, stored, claims_table(("c", "consumed", None), ("d", "dropped", "stale")))
    assert (led.consumed, led.dropped, led.complete, led.in_flight) == (1, 2, 1, 1) and led.balanced, led


@pytest.mark.parametrize("case", ["claimed twice", "claim without rows", "claim on a partial group"])
def test_ledger_reports_claims_that_do_not_add_up(case: str) -> None:
    adm = _admitted(("g", 2), ("h", 2))
    stored = _stored(("g", 2, "complete"), ("h", 2, "partial"))
    claims = {"claimed twice": claims_table(("g", "consumed", None), ("g", "consumed", None)),
              "claim without rows": claims_table(("gone", "consumed", None)),
              "claim on a partial group": claims_table(("h", "consumed", None))}[case]
    if case == "claim without rows":
        adm = _admitted(("g", 2), ("h", 2), ("gone", 2))
    led = compute_ledger(adm, stored, claims)
    assert not led.balanced, led
    if case == "claimed twice":
        assert led.duplicated == 1 and led.consumed == 1
    else:
        assert led.lost == 1 and led.in_flight == 0
