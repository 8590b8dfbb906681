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


# ---------------------------------------------------------------- a push that failed


@dataclass(frozen=True)
class EngineOutcome:
    """How one engine's part of a push ended: `bucket` (0-based) is the one it failed at, `answered`
    whether it answered that request (it is up: it failed to receive or to load) or not (a dropped
    connection, a refused one, no answer in time: it died or hangs)."""

    bucket: int
    answered: bool
    reason: str


@dataclass(frozen=True)
class PushBlame:
    engine: str | None  # the engine the push failed on (None: the learner's side alone)
    bucket: int  # 0-based
    gone: tuple[str, ...]  # engines that did not answer: leave them out of the disk fall-back
    message: str


def blame(version: int, buckets: int, learner: tuple[int, str] | None, engines: dict[str, EngineOutcome]) -> PushBlame:
    """One error for a push that failed. `learner`: the bucket and reason its side failed with (None:
    it sent everything); `engines`: those whose part failed. When the learner's side fails, every
    engine still in the group fails after it (released: its connections closed), so the engine to
    blame is one that did not answer, else one that failed before the learner did, else none."""
    gone = tuple(sorted((u for u, o in engines.items() if not o.answered), key=lambda u: (engines[u].bucket, u)))
    lb = learner[0] if learner is not None else buckets
    early = sorted((o.bucket, u) for u, o in engines.items() if o.answered and o.bucket < lb)
    culprit = gone[0] if gone else early[0][1] if early else None
    bucket = engines[culprit].bucket if culprit else lb if learner is not None else 0
    head = f"weight push of version {version} failed at bucket {bucket + 1} of {buckets}"
    if culprit:
        o = engines[culprit]
        head += f": engine {culprit} {'answered ' + repr(o.reason) if o.answered else 'did not answer (' + o.reason + ')'}"
    parts = [head]
    if learner is not None:
        parts.append(f"the learner's side: {learner[1]}")
    others = sorted(u for u in engines if u != culprit)
    if others:
        parts.append("then " + ", ".join(f"{u} at bucket {engines[u].bucket + 1}" for u in others))
    return PushBlame(engine=culprit, bucket=bucket, gone=gone, message="; ".join(parts))
