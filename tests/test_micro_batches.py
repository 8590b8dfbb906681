"""How the learner cuts a batch into micro-batches (mcore_batch.plan_micro_batches): rows of
similar length together, at most `max_rows` rows and `max_tokens` padded tokens each, whole
groups when the loss aggregates by group; every row exactly once, the same plan every time.
That a step cut this way equals the whole batch in one micro-batch is
tests/test_mcore_learner.py::test_micro_batched_step_equals_the_whole_batch_with_an_empty_sample."""

from __future__ import annotations

import random

import pytest

from streamrl.connectors.megatron.batch import plan_micro_batches


def padded(plan: list[list[int]], lengths: list[int]) -> int:
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)


def longtail(n: int = 64, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    steps = range(2, 29)
    return [5 + 8 * rng.choices(steps, weights=[1 / k for k in steps])[0] for _ in range(n)]


def test_every_row_once_within_both_limits() -> None:
    lengths = longtail()
    plan = plan_micro_batches(lengths, [i // 8 for i in range(64)], max_rows=16, max_tokens=1024)
    assert sorted(i for mb in plan for i in mb) == list(range(64))
    for mb in plan:
        assert len(mb) <= 16
        assert len(mb) * max(lengths[i] for i in mb) <= 1024 or len(mb) == 1, mb
    assert plan == plan_micro_batches(lengths, [i // 8 for i in range(64)], max_rows=16, max_tokens=1024)


def test_similar_lengths_share_a_micro_batch() -> None:
    """Sorted by length, a long-tailed batch pads far less than in batch order."""
    lengths = longtail()
    in_order = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    plan = plan_micro_batches(lengths, list(range(64)), max_rows=8)
    assert [len(mb) for mb in plan] == [8] * 8
    longest = [max(lengths[i] for i in mb) for mb in plan]
    assert longest == sorted(longest)
    assert padded(plan, lengths) < 0.7 * padded(in_order, lengths), (padded(plan, lengths), padded(in_order, lengths))


def test_token_budget_cuts_long_rows_finer() -> None:
    lengths = [10] * 8 + [100] * 4 + [300]
    plan = plan_micro_batches(lengths, list(range(13)), max_rows=64, max_tokens=200)
    assert plan == [list(range(8)), [8, 9], [10, 11], [12]]  # 80 | 200 | 200 | one row over the budget alone
    assert plan_micro_batches(lengths, list(range(13)), max_rows=64) == [list(range(13))]  # no budget: rows decide


def test_group_aggregation_keeps_groups_whole() -> None:
    lengths = longtail(32, seed=1)
    groups = [i // 4 for i in range(32)]
    plan = plan_micro_batches(lengths, groups, max_rows=6, max_tokens=400, whole_groups=True)
    assert sorted(i for mb in plan for i in mb) == list(range(32))
    for mb in plan:
        gs = {groups[i] for i in mb}
        assert all(groups.count(g) == sum(groups[i] == g for i in mb) for g in gs), (mb, gs)  # every row of each group
    # a group larger than max_rows is one micro-batch, not split
    assert plan_micro_batches([5] * 6, [0] * 6, max_rows=2, whole_groups=True) == [list(range(6))]


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches([3], [0], max_rows=0)
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches([3], [0], max_rows=4, max_tokens=0)
    assert plan_micro_batches([], [], max_rows=4) == []
