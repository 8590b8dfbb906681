"""Partial-rollout state of one response, across the engine calls that produce it.

A version update can interrupt a generation (SGLang answers `finish_reason: abort`). With
`abort_resume` the tokens and their log-probs are kept and the next call sends prompt +
tokens so far to the new weights (the engine recomputes the KV cache); with `restart` they are
discarded; with `in_place` the engine itself keeps generating across the update, so the
response arrives in one call with several version spans; `finish_old` lets the engines run on the
old weights for `staleness.finish_window_s` first (what finishes then is single-version), then
aborts and resumes the rest as `abort_resume` does. Pure state transitions: the rollout
worker drives them, the cluster simulator reuses them. A MoE response's routed experts are
stitched across the calls by the rule in streamrl/core/routing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streamrl.core import routing
from streamrl.core import spans as sp
from streamrl.core.types import PartialRolloutPolicy, Sample, VersionSpan

FINISHED = ("stop", "length")
ENGINE_RETRIES = 30  # consecutive failed calls for one response before the sample is marked failed


@dataclass
class Trajectory:
    """One response in the making. `spans` tile `tokens` with the policy version of each."""

    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    finish: str = ""  # "" while unfinished, then stop | length
    calls: int = 0  # engine calls made for it
    interruptions: int = 0  # calls that ended in an abort (version update, engine failure)
    discarded: int = 0  # generated tokens thrown away (restart)
    error: str | None = None  # generation gave up (the sample is stored as failed)
    routed: np.ndarray | None = None  # routed experts of positions [0, prompt + tokens - 1) (core/routing.py)

    @property
    def done(self) -> bool:
        return self.finish in FINISHED or self.error is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


def next_request(t: Trajectory) -> tuple[list[int], int]:
    """Input ids and max_new_tokens of the next engine call (prompt + what exists so far)."""
    if t.done:
        raise ValueError("the trajectory is finished; nothing to request")
    return t.prompt + t.tokens, t.remaining


def routed_start(t: Trajectory) -> int:
    """routed_experts_start_len of the next engine call (streamrl/core/routing.py)."""
    return routing.start_len(len(t.prompt), len(t.tokens))


def absorb(t: Trajectory, output_ids: Sequence[int], logprobs: Sequence[float],
           segment_spans: Sequence[VersionSpan], finish_type: str,
           policy: PartialRolloutPolicy = "abort_resume", routed_experts: np.ndarray | None = None) -> Trajectory:
    """The trajectory after one engine call. `segment_spans` cover `output_ids` (positions
    relative to this call). An `abort` keeps the tokens (`abort_resume`, `in_place`, `finish_old`)
    or drops everything generated so far (`restart`: counted in `discarded`). `routed_experts`:
    what the call returned for positions from `routed_start(t)` on (asked before this call)."""
    if len(output_ids) != len(logprobs):
        raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} log-probs")
    if len(output_ids) > t.remaining:
        raise ValueError(f"the engine returned {len(output_ids)} tokens; only {t.remaining} were requested")
    t.calls += 1
    aborted = finish_type == "abort" or finish_type not in FINISHED
    if aborted and policy == "restart":
        t.discarded += len(t.tokens) + len(output_ids)
        t.tokens, t.logprobs, t.spans, t.routed = [], [], [], None
        t.interruptions += 1
        return t
    out = list(t.spans)
    for s in segment_spans:
        out = sp.extend(out, s.version, s.end - s.start)
    covered = (out[-1].end if out else 0) - len(t.tokens)
    if covered != len(output_ids):
        raise ValueError(f"version spans cover {covered} of {len(output_ids)} new tokens")
    routed = routing.stitch(t.routed, routed_experts, routed_start(t), len(t.prompt) + len(t.tokens) + len(output_ids) - 1)
    t.tokens += list(map(int, output_ids))
    t.routed = routed
    t.logprobs += list(map(float, logprobs))
    t.spans = out
    if aborted:
        t.interruptions += 1
        if t.remaining == 0:
            t.finish = "length"
    else:
        t.finish = finish_type
    return t


def to_sample(t: Trajectory, index: int) -> Sample:
    """The stored form (finish_reason "abort" marks a sample still in the making)."""
    return Sample(index=index, response_tokens=np.asarray(t.tokens, np.int32),
                  rollout_logprobs=np.asarray(t.logprobs, np.float32), spans=list(t.spans),
                  finish_reason=t.finish or "abort", metadata={"calls": t.calls, "interruptions": t.interruptions},
                  routed_experts=t.routed)


def from_sample(s: Sample, prompt: list[int], max_new_tokens: int) -> Trajectory:
    """Resume a stored (partial) sample."""
    t = Trajectory(prompt=list(prompt), max_new_tokens=max_new_tokens, tokens=s.response_tokens.tolist(),
                   logprobs=s.rollout_logprobs.tolist(), spans=list(s.spans),
                   calls=int(s.metadata.get("calls", 0)), interruptions=int(s.metadata.get("interruptions", 0)),
                   routed=s.routed_experts)
    if s.finish_reason in FINISHED:
        t.finish = s.finish_reason
    return t
