"""streamrl/core/weight_group.py: the weight group's ranks, against SGLang's formula (each engine
TP rank joins as rank_offset + tp_rank; the learner is rank 0). test_engine.py checks that the
sglang wheel still applies this formula."""

from __future__ import annotations

import pytest

from streamrl.core.weight_group import EngineOutcome, blame, weight_group


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


# ---------------------------------------------------------------- blame (a push that failed)

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
RELEASED = "Failed to receive weights: Connection closed by peer"


def test_blame_names_the_engine_that_stopped_answering_not_the_ones_released_after_it():
    """B was killed at bucket 3: the learner failed there; A and C answered failures after it (released)."""
    engines = {A: EngineOutcome(3, True, RELEASED), B: EngineOutcome(2, False, "ClientConnectorError: refused"),
               C: EngineOutcome(2, True, RELEASED)}
    b = blame(7, 5, (2, "RuntimeError: Connection reset by peer"), engines)
    assert (b.engine, b.bucket, b.gone) == (B, 2, (B,))
    assert b.message.startswith(f"weight push of version 7 failed at bucket 3 of 5: engine {B} did not answer")
    assert "the learner's side: RuntimeError: Connection reset by peer" in b.message
    assert f"{A} at bucket 4" in b.message and f"{C} at bucket 3" in b.message


def test_blame_an_engine_that_refused_a_bucket_while_the_learner_went_on():
    """A's load failed at bucket 1 (it answered); the learner sent everything: A is to blame, not gone."""
    b = blame(3, 4, None, {A: EngineOutcome(1, True, "Failed to update parameter online: bad shape")})
    assert (b.engine, b.bucket, b.gone) == (A, 1, ())
    assert "failed at bucket 2 of 4: engine " + A + " answered 'Failed to update" in b.message
    assert "learner" not in b.message


def test_blame_the_learner_alone_when_every_engine_failed_after_it():
    b = blame(2, 3, (0, "PushFailed: gathering failed"), {A: EngineOutcome(0, True, RELEASED)})
    assert (b.engine, b.bucket, b.gone) == (None, 0, ())
    assert b.message.startswith("weight push of version 2 failed at bucket 1 of 3; the learner's side: PushFailed")


def test_blame_prefers_the_earliest_engine_gone():
    engines = {A: EngineOutcome(4, False, "no answer within 30 s"), B: EngineOutcome(1, False, "ServerDisconnectedError")}
    b = blame(1, 6, (1, "RuntimeError: timed out"), engines)
    assert (b.engine, b.bucket, b.gone) == (B, 1, (B, A))
