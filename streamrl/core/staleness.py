"""Staleness rules: rollout-side admission control and learner-side consumption policy.

Pure functions (no Ray, HTTP or clock) shared by the runtime, the pool and the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from streamrl.core.types import ConsumptionPolicy, SampleGroup, VersionSpan

Decision = Literal["take", "drop", "mask"]


def mode_bound(mode: str, max_staleness: int) -> int:
    """The staleness bound a run mode trains under: lockstep is on-policy, one-step-off one
    version behind, stream the recipe's `staleness.max_staleness`."""
    return {"lockstep": 0, "one_step_off": 1}.get(mode, max_staleness)


def claimed_per_step(groups_per_step: int, over_sampling: float = 1.0) -> int:
    """Groups the learner claims per step: `groups_per_step`, or more with over-sampling (it trains
    on `groups_per_step` of them and drops the rest). Production is sized by this: admission
    capacity grows by it per version, lockstep generates it per step."""
    return math.ceil(groups_per_step * over_sampling)


def run_budget(steps: int, per_step: int) -> int:
    """Groups a run of `steps` learner steps consumes: streaming admits no more (groups nobody
    trains on are generation wasted at the end of every run) unless the learner drops some."""
    return steps * per_step


def admission_capacity(learner_version: int, max_staleness: int, groups_per_step: int) -> int:
    """How many groups may have been started by the time the learner is at `learner_version`.

    Groups are consumed `groups_per_step` at a time, so a group started while this holds is
    consumed at most `max_staleness` versions after the one it was started under."""
    return (learner_version + max_staleness + 1) * groups_per_step


def capacity_share(total: int, index: int, shares: int) -> int:
    """Producer `index`'s part of `total` admission capacity split `shares` ways (the first
    `total % shares` producers get one more), so the parts always sum to `total`."""
    return total // shares + (1 if index < total % shares else 0)


def capacity_shares(workers: int, external: bool) -> int:
    """Admission capacity is split between the rollout workers and, when external producers are
    enabled (producer_api), one more share for them: the last one, index `workers`."""
    return workers + (1 if external else 0)


def handed_over_share(total: int, workers: int, external: bool, reserved: int, live_index: int, live: int) -> int:
    """A live rollout worker's part of `total` admission capacity once lost workers were handed
    over: the external producers keep their share (`capacity_share` of `workers + 1`), the lost
    workers keep the `reserved` groups they had started, and the `live` workers split the rest, so
    the parts still sum to `total`. Each live part is at least the one it had before (a lost
    worker had started at most its own share)."""
    ext = capacity_share(total, workers, workers + 1) if external else 0
    return capacity_share(max(0, total - ext - reserved), live_index, live)


def may_start(started_groups: int, learner_version: int, max_staleness: int, groups_per_step: int) -> bool:
    """True while one more group may start (counting it, `started_groups + 1` stays within capacity)."""
    return started_groups + 1 <= admission_capacity(learner_version, max_staleness, groups_per_step)


def staleness(learner_version: int, min_token_version: int) -> int:
    return learner_version - min_token_version


def decide(learner_version: int, min_token_version: int, max_staleness: int, policy: ConsumptionPolicy) -> Decision:
    """What the learner does with a group: `take` it as is, `drop` it, or take it with stale
    tokens masked. `keep` takes over-bound groups whole: the learner's off-policy correction
    (`learner.off_policy`; by default tis whenever the bound is above 0) reweights their tokens."""
    if staleness(learner_version, min_token_version) <= max_staleness or policy == "keep":
        return "take"
    return "drop" if policy == "drop" else "mask"


def select_groups(candidates: Iterable[tuple[str, int | None]], learner_version: int, num_groups: int,
                  max_staleness: int, policy: ConsumptionPolicy) -> tuple[list[str], set[str], list[str]]:
    """Which complete groups a claim trains on. `candidates` are (group id, oldest token version)
    in claim order (oldest started first); the first `num_groups` the policy takes are taken, the
    ones before them it drops are dropped. Returns (take, the taken ones to mask, drop); fewer
    than `num_groups` taken means the batch is not ready (the drops still stand)."""
    take: list[str] = []
    mask: set[str] = set()
    drop: list[str] = []
    for gid, minv in candidates:
        if len(take) == num_groups:
            break
        decision = decide(learner_version, learner_version if minv is None else minv, max_staleness, policy)
        if decision == "drop":
            drop.append(gid)
        else:
            take.append(gid)
            if decision == "mask":
                mask.add(gid)
    return take, mask, drop


def stale_token_mask(spans: Sequence[VersionSpan], learner_version: int, max_staleness: int) -> np.ndarray:
    """1 for tokens within the bound, 0 for tokens older than it."""
    n = spans[-1].end if spans else 0
    keep = np.ones(n, np.uint8)
    oldest_ok = learner_version - max_staleness
    for sp in spans:
        if sp.version < oldest_ok:
            keep[sp.start : sp.end] = 0
    return keep


def mask_stale_tokens(group: SampleGroup, learner_version: int, max_staleness: int) -> int:
    """Zero the loss mask of tokens older than the bound (policy `mask`); returns how many were masked."""
    masked = 0
    for s in group.samples:
        keep = stale_token_mask(s.spans, learner_version, max_staleness)
        masked += int(((s.loss_mask == 1) & (keep == 0)).sum())
        s.loss_mask = s.loss_mask * keep
    return masked
