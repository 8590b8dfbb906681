"""streamrl/core/weight_group.py: the weight group's ranks, against SGLang's formula (each engine
TP rank joins as rank_offset + tp_rank; the learner is rank 0). test_engine.py checks that the
sglang wheel still applies this formula."""

from __future__ import annotations

import pytest

from streamrl.core.weight_group import weight_group


def sglang_ranks(rank_offset: int, tp: int) -> list[int]:
    """The ranks SGLang's TP ranks of one engine join as (sglang 0.5.23 weight_updater.py)."""
    return [rank_offset + tp_rank for tp_rank in range(tp)]


@pytest.mark.parametrize("tps,world,offsets", [((1, 1), 3, (1, 2)), ((2, 2), 5, (1, 3)), ((1, 2, 4), 8, (1, 2, 4)),
                                               ((4,), 5, (1,)), ((), 1, ())])
def test_world_and_offsets(tps, world, offsets):
    g = weight_group(tps)
    assert (g.world_size, g.rank_offsets) == (world, offsets)
    ranks = [0] + [r for off, tp in zip(g.rank_offsets, tps) for r in sglang_ranks(off, tp)]
    assert len(set(ranks)) == len(ranks), f"ranks collide: {ranks}"
    assert sorted(ranks) == list(range(g.world_size))
    assert [list(g.engine_ranks(i)) for i in range(len(tps))] == [sglang_ranks(o, t) for o, t in zip(offsets, tps)]


def test_one_rank_per_engine_collides_for_tp_2():
    """What the broadcaster did before: rank_offset i + 1, world engines + 1."""
    tps = (2, 2)
    old = [r for i, tp in enumerate(tps) for r in sglang_ranks(i + 1, tp)]
    assert len(set(old)) < len(old) and max(old) >= len(tps) + 1
    assert weight_group(tps).world_size == 5


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2"])
def test_bad_tp_names_the_engine(bad):
    with pytest.raises(ValueError, match=rf"engine 1: tp must be an int >= 1, got {bad!r}"):
        weight_group([1, bad])
