"""Length prediction, rank correlation, chunk ordering and the tail share (streamrl/core/lengths.py)
against hand-computed values."""

from __future__ import annotations

import random

import pytest

from streamrl.core import lengths


def test_history_is_an_exponentially_weighted_mean_of_group_means_and_unseen_prompts_get_the_mean():
    h = lengths.LengthHistory(decay=0.5)
    assert h.predict("a") == 0.0 and not h.known("a")
    h.observe("a", [10, 30])          # group mean 20
    h.observe("a", [60, 40])          # 0.5 * 20 + 0.5 * 50
    h.observe("b", [100])
    h.observe("c", [])                # nothing to learn from an empty group
    assert h.predict("a") == pytest.approx(35.0)
    assert h.predict("b") == 100.0 and h.groups == {"a": 2, "b": 1} and not h.known("c")
    assert h.predict("never") == pytest.approx((10 + 30 + 60 + 40 + 100) / 5)
    assert lengths.LengthHistory(decay=0.0).predict("x") == 0.0
    with pytest.raises(ValueError, match="decay"):
        lengths.LengthHistory(decay=1.0)


def test_sibling_estimate_is_at_least_the_longest_finished_and_what_runs_has_written():
    assert lengths.sibling_estimate([12, 30]) == 30.0
    assert lengths.sibling_estimate([12, 30], running_so_far=[5, 50]) == pytest.approx((30 + 50) / 2)
    with pytest.raises(ValueError, match="finished"):
        lengths.sibling_estimate([])


def test_spearman_against_hand_computed_ranks_and_undefined_cases():
    # ranks (1,2,3,4) vs (1,3,2,4): rho = 1 - 6*(0+1+1+0)/(4*15) = 0.8
    assert lengths.spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert lengths.spearman([4, 3, 2, 1], [1, 2, 3, 4]) == pytest.approx(-1.0)
    assert list(lengths.ranks([5, 1, 5, 3])) == [3.5, 1.0, 3.5, 2.0]
    assert lengths.spearman([7, 7, 7], [1, 2, 3]) is None  # a predictor that ties everything ranks nothing
    assert lengths.spearman([1], [1]) is None
    with pytest.raises(ValueError, match="predictions"):
        lengths.spearman([1, 2], [1])


def test_order_by_schedule():
    items, pred = list("abcdefgh"), [5, 80, 5, 20, 90, 5, 40, 5]
    assert lengths.order(items, pred, "fifo") == items
    assert lengths.order(items, pred, "longest_first") == list("ebgdacfh")  # ties keep the drawn order
    # tail_batching: the longest quarter (e, b) go to the end, longest first; the rest keep their order
    assert lengths.order(items, pred, "tail_batching") == list("acdfgheb")
    assert lengths.order(items, pred, "tail_batching", tail_fraction=0.5) == list("acfhebgd")
    # no information (every prompt ties): nothing moves
    assert lengths.order(items, [3] * 8, "tail_batching") == items
    assert lengths.order(items, [3] * 8, "longest_first") == items
    with pytest.raises(ValueError, match="unknown schedule 'sjf'"):
        lengths.order(items, pred, "sjf")
    with pytest.raises(ValueError, match="tail_fraction"):
        lengths.order(items, pred, "tail_batching", tail_fraction=1.0)


def test_every_schedule_is_a_permutation_of_its_chunk():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 12)
        items, pred = list(range(n)), [rng.choice([1, 2, 3, 50]) for _ in range(n)]
        for s in lengths.SCHEDULES:
            assert sorted(lengths.order(items, pred, s)) == items


def test_tail_share():
    # 10 requests started at 0; 9 end by t=2, the last at t=10: 8 of the 10 s are the tail
    assert lengths.tail_share([([0.0] * 10, [1.0] * 8 + [2.0, 10.0])]) == pytest.approx(0.8)
    # two batches: (8 of 10 s) and (0 of 4 s: all end together) -> 8 / 14
    both = [([0.0] * 10, [1.0] * 8 + [2.0, 10.0]), ([0.0] * 10, [4.0] * 10)]
    assert lengths.tail_share(both) == pytest.approx(8 / 14)
    # 64 requests: the last 10% is 6 requests, the tail starts when the 58th ends
    ends = [float(i) for i in range(1, 65)]
    assert lengths.tail_share([([0.0] * 64, ends)]) == pytest.approx((64 - 58) / 64)
    assert lengths.tail_share([]) is None and lengths.tail_share([([], [])]) is None


def test_rank_quality_replays_the_predictors_in_run_order():
    groups = [("a", [10, 12]), ("b", [50, 54]), ("c", [30, 30]),  # epoch 1: all new
              ("a", [11, 13]), ("b", [52, 60]), ("c", [29, 35])]  # epoch 2: history ranks a < c < b
    q = lengths.rank_quality(groups)
    assert q["n_history"] == 3 and q["n_fallback"] == 3 and q["n_siblings"] == 6
    assert q["history"] == pytest.approx(1.0)
    # the fallback of epoch 1 is the running mean (0, then 11, then 31.5): vs means 11, 52, 30 -> ranks agree
    # only partly: predicted ranks (1, 2, 3) vs actual (1, 3, 2) -> rho 0.5
    assert q["fallback"] == pytest.approx(0.5)
    # siblings: shortest 10, 50, 30, 11, 52, 29 (ranks 1 5 4 2 6 3) vs the other's 12, 54, 30, 13, 60, 35
    # (ranks 1 5 3 2 6 4): rho = 1 - 6 * 2 / (6 * 35)
    assert q["siblings"] == pytest.approx(1 - 12 / 210)
    # a history that reverses: the prompt that ran long now runs short
    flipped = groups[:3] + [("a", [90, 90]), ("b", [5, 5]), ("c", [40, 40])]
    assert lengths.rank_quality(flipped)["history"] == pytest.approx(-1.0)
