"""Rank arithmetic of the weight-update process group (the learner broadcasts, every engine
rank receives).

SGLang joins each engine's TP ranks as `rank = rank_offset + tp_rank`
(sglang 0.5.23, srt/model_executor/model_runner_components/weight_updater.py,
`init_weights_update_group`; the `rank_offset` and `world_size` it is sent are used as given).
So an engine of tensor-parallel size `tp` holds `tp` consecutive ranks, the learner is rank 0,
and the group has `1 + sum(tp)` ranks. Giving each engine one rank (`rank_offset = i + 1`,
`world_size = engines + 1`) collides ranks and undersizes the group as soon as any tp > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEARNER_RANK = 0


@dataclass(frozen=True)
class WeightGroup:
    world_size: int
    rank_offsets: tuple[int, ...]  # engine i's rank_offset (/init_weights_update_group)
    tps: tuple[int, ...]

    def engine_ranks(self, i: int) -> range:
        """The ranks engine i's TP ranks take: SGLang's rank_offset + tp_rank."""
        return range(self.rank_offsets[i], self.rank_offsets[i] + self.tps[i])


def weight_group(tps: Sequence[int]) -> WeightGroup:
    """The group for engines of these TP sizes, in the order given: the learner is rank 0, engine
    i's ranks follow engine i-1's. Raises ValueError naming the engine whose tp is not an int >= 1."""
    offsets, nxt = [], LEARNER_RANK + 1
    for i, tp in enumerate(tps):
        if type(tp) is not int or tp < 1:
            raise ValueError(f"engine {i}: tp must be an int >= 1, got {tp!r}")
        offsets.append(nxt)
        nxt += tp
    return WeightGroup(world_size=nxt, rank_offsets=tuple(offsets), tps=tuple(tps))
