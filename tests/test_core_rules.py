"""Pure core rules: token-version spans, staleness (admission + consumption), the ledger."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from streamrl.core import spans, staleness
from streamrl.core.ledger import compute_ledger
from streamrl.core.types import GROUP_STATES, Ledger, VersionSpan, check_spans

V = VersionSpan

# ================================================================ spans


def test_extend_from_empty():
    assert spans.extend([], 0, 3) == [V(0, 0, 3)]
    assert spans.extend([], 5, 1) == [V(5, 0, 1)]


def test_extend_same_version_merges():
    assert spans.extend([V(2, 0, 3)], 2, 4) == [V(2, 0, 7)]
    assert spans.extend([V(0, 0, 2), V(2, 2, 3)], 2, 4) == [V(0, 0, 2), V(2, 2, 7)]


def test_extend_new_version_appends_span():
    assert spans.extend([V(0, 0, 3)], 1, 2) == [V(0, 0, 3), V(1, 3, 5)]
    # versions may skip (a resumed rollout lands on a much newer engine)
    assert spans.extend([V(0, 0, 3)], 4, 1) == [V(0, 0, 3), V(4, 3, 4)]


def test_extend_nothing_new_is_a_copy():
    before = [V(1, 0, 2)]
    out = spans.extend(before, 1, 0)
    assert out == before and out is not before
    assert spans.extend([], 3, 0) == []
    assert spans.extend(before, 2, -1) == before


def test_extend_does_not_mutate_input():
    before = [V(0, 0, 2)]
    spans.extend(before, 0, 5)
    spans.extend(before, 1, 5)
    assert before == [V(0, 0, 2)]


def test_extend_version_going_backwards_raises():
    with pytest.raises(ValueError, match="version went backwards: 3 -> 2"):
        spans.extend([V(1, 0, 2), V(3, 2, 4)], 2, 1)
    with pytest.raises(ValueError, match="backwards"):
        spans.extend([V(1, 0, 2)], 0, 5)


def test_extend_chain_builds_valid_spans():
    s: list[VersionSpan] = []
    for version, n in [(0, 3), (0, 2), (1, 0), (1, 4), (3, 1), (3, 1)]:
        s = spans.extend(s, version, n)
    assert s == [V(0, 0, 5), V(1, 5, 9), V(3, 9, 11)]
    check_spans(s, 11)  # tiles the response as Sample requires


def test_from_versions():
    assert spans.from_versions([]) == []
    assert spans.from_versions(np.array([], np.int32)) == []
    assert spans.from_versions([7]) == [V(7, 0, 1)]
    assert spans.from_versions([0, 0, 1, 1, 1, 3]) == [V(0, 0, 2), V(1, 2, 5), V(3, 5, 6)]
    assert spans.from_versions(np.array([2, 2, 2], np.int32)) == [V(2, 0, 3)]


def test_from_versions_returns_python_ints():
    (sp,) = spans.from_versions(np.array([4, 4], np.int64))
    assert all(type(x) is int for x in (sp.version, sp.start, sp.end))


def test_to_versions():
    out = spans.to_versions([V(0, 0, 2), V(1, 2, 5), V(3, 5, 6)])
    assert out.dtype == np.int32
    assert out.tolist() == [0, 0, 1, 1, 1, 3]
    assert spans.to_versions([V(0, 0, 2)], num_tokens=2).tolist() == [0, 0]
    assert spans.to_versions([]).size == 0
    assert spans.to_versions([], num_tokens=0).size == 0


def test_to_versions_checks_length():
    with pytest.raises(ValueError, match="spans cover 2 tokens, the response has 3"):
        spans.to_versions([V(0, 0, 2)], num_tokens=3)
    with pytest.raises(ValueError, match="spans cover 0 tokens, the response has 1"):
        spans.to_versions([], num_tokens=1)


@pytest.mark.parametrize("seed", range(5))
def test_from_to_versions_round_trip(seed):
    rng = np.random.default_rng(seed)
    versions = np.sort(rng.integers(0, 6, rng.integers(1, 60)))
    s = spans.from_versions(versions)
    check_spans(s, len(versions))
    assert len(s) == len(np.unique(versions))
    np.testing.assert_array_equal(spans.to_versions(s, len(versions)), versions)
    assert spans.min_version(s) == versions.min() and spans.max_version(s) == versions.max()


def test_min_max_version():
    s = [V(1, 0, 4), V(2, 4, 5), V(6, 5, 9)]
    assert spans.min_version(s) == 1
    assert spans.max_version(s) == 6
    assert spans.min_version([]) is None and spans.max_version([]) is None


def test_from_versions_going_backwards_raises():
    with pytest.raises(ValueError):
        spans.from_versions([1, 1, 0])


def test_to_versions_rejects_spans_with_a_gap():
    with pytest.raises(ValueError):
        spans.to_versions([V(0, 2, 4)], num_tokens=4)


# ================================================================ staleness


@pytest.mark.parametrize(
    "version, eta, gps, expected",
    [
        (0, 1, 4, 8),
        (0, 0, 4, 4),
        (1, 0, 4, 8),
        (3, 2, 5, 30),
        (10, 1, 1, 12),
    ],
)
def test_admission_capacity(version, eta, gps, expected):
    assert staleness.admission_capacity(version, eta, gps) == expected


@pytest.mark.parametrize("gps, over, per_step", [(4, 1.0, 4), (4, 1.5, 6), (16, 1.1, 18), (3, 1.01, 4)])
def test_a_step_claims_groups_per_step_times_over_sampling_rounded_up(gps, over, per_step):
    assert staleness.claimed_per_step(gps, over) == per_step
    assert staleness.run_budget(10, staleness.claimed_per_step(gps, over)) == 10 * per_step


def test_may_start_boundary_at_version_0():
    # groups_per_step=4, max_staleness=1, version 0: capacity 8
    assert staleness.may_start(0, 0, 1, 4)  # the 1st group
    assert staleness.may_start(7, 0, 1, 4)  # the 8th group may start (7 already started)
    assert not staleness.may_start(8, 0, 1, 4)  # the 9th may not
    assert not staleness.may_start(20, 0, 1, 4)
    # one published version later, 4 more
    assert staleness.may_start(8, 1, 1, 4)
    assert staleness.may_start(11, 1, 1, 4)
    assert not staleness.may_start(12, 1, 1, 4)


def test_may_start_on_policy():
    # eta = 0: exactly one step's worth of groups per version (lockstep)
    assert staleness.may_start(3, 0, 0, 4) and not staleness.may_start(4, 0, 0, 4)


@pytest.mark.parametrize("gps, eta", [(1, 0), (4, 0), (4, 1), (3, 2), (8, 3)])
def test_admission_control_bounds_staleness(gps, eta):
    """Groups consumed oldest-first, gps per step: a group started under admission control
    is consumed at most eta versions after the version it started under, and the bound is reached."""
    worst = 0
    for k in range(1, 20 * gps + 1):  # the k-th group to start (1-based)
        started = k - 1
        # earliest learner version at which it may start
        v = next(v for v in range(0, 100) if staleness.may_start(started, v, eta, gps))
        if v > 0:
            assert not staleness.may_start(started, v - 1, eta, gps)
        consumed_at = math.ceil(k / gps) - 1  # learner version of the step that takes it
        s = staleness.staleness(consumed_at, v)
        assert s <= eta, (k, v, consumed_at)
        worst = max(worst, s)
    assert worst == eta


def test_staleness_value():
    assert staleness.staleness(5, 3) == 2
    assert staleness.staleness(5, 5) == 0


@pytest.mark.parametrize(
    "learner, min_v, eta, expected",
    [
        # within the bound: everyone takes it
        (5, 5, 1, {"drop": "take", "mask": "take", "keep": "take"}),
        (5, 4, 1, {"drop": "take", "mask": "take", "keep": "take"}),
        # one over
        (5, 3, 1, {"drop": "drop", "mask": "mask", "keep": "take"}),
        # on-policy
        (5, 5, 0, {"drop": "take", "mask": "take", "keep": "take"}),
        (5, 4, 0, {"drop": "drop", "mask": "mask", "keep": "take"}),
        # far over
        (10, 0, 2, {"drop": "drop", "mask": "mask", "keep": "take"}),
        # tokens newer than the learner (cannot happen, but is not stale)
        (2, 3, 0, {"drop": "take", "mask": "take", "keep": "take"}),
    ],
)
def test_decide(learner, min_v, eta, expected):
    got = {p: staleness.decide(learner, min_v, eta, p) for p in ("drop", "mask", "keep")}
    assert got == expected


def test_stale_token_mask():
    s = [V(0, 0, 2), V(1, 2, 5), V(3, 5, 6)]
    m = staleness.stale_token_mask(s, learner_version=3, max_staleness=1)  # oldest allowed: 2
    assert m.dtype == np.uint8
    assert m.tolist() == [0, 0, 0, 0, 0, 1]
    assert staleness.stale_token_mask(s, 3, 2).tolist() == [0, 0, 1, 1, 1, 1]  # oldest allowed: 1
    assert staleness.stale_token_mask(s, 3, 3).tolist() == [1, 1, 1, 1, 1, 1]
    assert staleness.stale_token_mask(s, 10, 0).tolist() == [0, 0, 0, 0, 0, 0]
    assert staleness.stale_token_mask([], 3, 1).size == 0


@pytest.mark.parametrize("learner", range(0, 7))
@pytest.mark.parametrize("eta", [0, 1, 2])
def test_decide_and_mask_agree(learner, eta):
    s = [V(1, 0, 3), V(2, 3, 4), V(4, 4, 8)]
    mask = staleness.stale_token_mask(s, learner, eta)
    d = staleness.decide(learner, spans.min_version(s), eta, "mask")
    if d == "take":
        assert mask.all()
    else:
        assert d == "mask" and not mask.all()


def test_select_groups_takes_the_oldest_within_the_bound():
    cands = [("a", 1), ("b", 4), ("c", 2), ("d", 5), ("e", 5)]  # claim order, oldest token version
    take, mask, drop = staleness.select_groups(cands, learner_version=5, num_groups=2, max_staleness=2,
                                               policy="drop")
    assert take == ["b", "d"] and drop == ["a", "c"] and mask == set()  # "e" is not looked at
    take, mask, drop = staleness.select_groups(cands, 5, 2, 2, "mask")
    assert take == ["a", "b"] and mask == {"a"} and drop == []
    take, mask, drop = staleness.select_groups(cands, 5, 3, 2, "keep")
    assert take == ["a", "b", "c"] and mask == set() and drop == []


def test_select_groups_not_enough_keeps_the_drops():
    take, mask, drop = staleness.select_groups([("a", 0), ("b", 3), ("c", None)], 3, 5, 1, "drop")
    assert take == ["b", "c"] and drop == ["a"]  # None (no token yet) counts as current
    assert staleness.select_groups([], 3, 1, 1, "drop") == ([], set(), [])


# ================================================================ ledger


def _tables(admissions, rows):
    adm = pa.table(
        {"group_id": pa.array([g for g, _ in admissions], pa.string()), "n": pa.array([n for _, n in admissions], pa.int32())}
    )
    rws = pa.table(
        {
            "group_id": pa.array([r[0] for r in rows], pa.string()),
            "sample_index": pa.array([r[1] for r in rows], pa.int32()),
            "status": pa.array([r[2] for r in rows], pa.string()),
        }
    )
    return adm, rws


def _full(gid, n, status):
    return [(gid, i, status) for i in range(n)]


def _ledger(admissions, rows) -> Ledger:
    return compute_ledger(*_tables(admissions, rows))


def _expect(led: Ledger, **nonzero) -> None:
    for field in Ledger.__struct_fields__:
        assert getattr(led, field) == nonzero.get(field, 0), (field, led)


def test_empty_ledger():
    led = _ledger([], [])
    _expect(led)
    assert led.balanced


def test_all_admitted_in_flight():
    led = _ledger([("a", 2), ("b", 4)], [])
    _expect(led, admitted=2, in_flight=2)
    assert led.balanced


def test_each_stored_state_is_counted():
    stored = ["partial", "complete", "consumed", "dropped", "failed"]
    admissions = [(f"g{i}", 3) for i in range(len(stored))] + [("flying", 3)]
    rows = [r for i, st in enumerate(stored) for r in _full(f"g{i}", 3, st)]
    led = _ledger(admissions, rows)
    _expect(led, admitted=6, in_flight=1, partial=1, complete=1, consumed=1, dropped=1, failed=1)
    assert led.balanced
    assert sum(getattr(led, s) for s in GROUP_STATES) == led.admitted


def test_counts_several_groups_per_state():
    admissions = [(f"c{i}", 2) for i in range(3)] + [(f"d{i}", 1) for i in range(2)]
    rows = [r for i in range(3) for r in _full(f"c{i}", 2, "consumed")] + _full("d0", 1, "dropped") + _full("d1", 1, "dropped")
    led = _ledger(admissions, rows)
    _expect(led, admitted=5, consumed=3, dropped=2)
    assert led.balanced


def test_row_order_and_extra_columns_do_not_matter():
    adm, rws = _tables([("a", 3), ("b", 2)], _full("b", 2, "complete")[::-1] + _full("a", 3, "consumed")[::-1])
    rws = rws.append_column("reward", pa.array([0.5] * rws.num_rows))
    adm = adm.append_column("producer_id", pa.array(["p"] * adm.num_rows))
    led = compute_ledger(adm, rws)
    _expect(led, admitted=2, complete=1, consumed=1)


def test_lost_missing_sample():
    led = _ledger([("a", 3), ("b", 2)], [("a", 0, "complete"), ("a", 2, "complete")] + _full("b", 2, "complete"))
    _expect(led, admitted=2, complete=1, lost=1)
    assert not led.balanced


def test_lost_wrong_indices():
    # two rows for n=2, but indices 1 and 2: sample 0 is missing, 2 is out of range
    led = _ledger([("a", 2)], [("a", 1, "complete"), ("a", 2, "complete")])
    _expect(led, admitted=1, lost=1)
    assert not led.balanced


def test_lost_extra_sample():
    led = _ledger([("a", 2)], _full("a", 3, "complete"))
    _expect(led, admitted=1, lost=1)


def test_lost_mixed_statuses():
    led = _ledger([("a", 3), ("b", 1)], [("a", 0, "consumed"), ("a", 1, "consumed"), ("a", 2, "partial")] + _full("b", 1, "failed"))
    _expect(led, admitted=2, failed=1, lost=1)
    assert not led.balanced


def test_duplicated_admitted_twice():
    led = _ledger([("a", 2), ("a", 2), ("b", 2)], _full("a", 2, "complete"))
    assert led.admitted == 2  # distinct prompt instances
    assert led.duplicated == 1
    assert led.complete == 1 and led.in_flight == 1
    assert led.lost == 0 and led.unadmitted == 0
    assert not led.balanced


def test_duplicated_admitted_twice_in_flight():
    led = _ledger([("a", 2), ("a", 2)], [])
    assert led.duplicated == 1 and led.admitted == 1 and led.in_flight == 1
    assert not led.balanced


def test_duplicated_sample_row():
    led = _ledger([("a", 2), ("b", 1)], [("a", 0, "complete"), ("a", 0, "complete"), ("a", 1, "complete")] + _full("b", 1, "complete"))
    assert led.duplicated == 1
    assert led.admitted == 2 and led.unadmitted == 0
    assert not led.balanced


def test_duplicated_sample_row_with_missing_sample_is_also_lost():
    led = _ledger([("a", 2)], [("a", 0, "complete"), ("a", 0, "complete")])
    assert led.duplicated == 1 and led.lost == 1
    assert not led.balanced


def test_unadmitted_rows():
    led = _ledger([("a", 1)], _full("a", 1, "consumed") + _full("ghost", 2, "complete") + _full("ghost2", 1, "partial"))
    _expect(led, admitted=1, consumed=1, unadmitted=2)
    assert not led.balanced


def test_balanced_mixture_then_one_fault_unbalances():
    admissions = [("a", 2), ("b", 2), ("c", 2), ("d", 2)]
    rows = _full("a", 2, "consumed") + _full("b", 2, "partial") + _full("c", 2, "dropped")
    assert _ledger(admissions, rows).balanced
    assert not _ledger(admissions, rows[:-1]).balanced  # c lost a sample
    assert not _ledger(admissions, rows + [("a", 1, "consumed")]).balanced  # duplicate row
    assert not _ledger(admissions, rows + [("z", 0, "complete")]).balanced  # unadmitted
    assert not _ledger(admissions + [("a", 2)], rows).balanced  # admitted twice


def test_int64_columns_are_accepted():
    adm = pa.table({"group_id": ["a"], "n": pa.array([2], pa.int64())})
    rws = pa.table({"group_id": ["a", "a"], "sample_index": pa.array([0, 1], pa.int64()), "status": ["consumed"] * 2})
    _expect(compute_ledger(adm, rws), admitted=1, consumed=1)
