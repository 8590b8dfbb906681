"""slime-style user functions for the end-to-end tests (tests/test_slime_e2e.py), written in
slime's documented signatures and return types (--custom-rm-path, --group-rm,
--dynamic-sampling-filter-path) as a slime user has them. slime is not installed, so
DynamicFilterOutput is a local dataclass of the same shape; everything else is slime's contract:
`args` is slime's argument namespace, `sample(s)` are slime Samples."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


def _digits(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def reward_func(args, sample, **kwargs):
    """Per-sample reward returning a dict read at args.reward_key (slime's --reward-key)."""
    await asyncio.sleep(0)
    assert sample.tokens[-sample.response_length:] == sample.tokens[len(sample.tokens) - sample.response_length:]
    assert args.n_samples_per_prompt >= 1 and args.rollout_max_response_len >= sample.response_length
    return {"score": _digits(sample.response), "response_length": float(sample.response_length),
            "pred": sample.response}


async def group_reward(args, samples, **kwargs):
    """--group-rm: one call per group, one reward per sample."""
    assert len(samples) == args.n_samples_per_prompt
    return [_digits(s.response) for s in samples]


def check_reward_nonzero_std(args, samples, **kwargs):
    """slime's DAPO filter: drop groups whose rewards are all equal, with the reason."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float64).std() > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def broken_filter(args, samples, **kwargs):
    """A filter with a bug: it raises on every group."""
    return DynamicFilterOutput(keep=samples[0].no_such_field > 0)
