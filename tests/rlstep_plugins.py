"""User functions for the RL step's plug-in points, as a recipe names them
(`learner.advantage: rlstep_plugins:no_baseline`); tests/test_rl_step.py uses them."""

from __future__ import annotations

import torch

from streamrl.core.algorithms import aggregate
from streamrl.core.algorithms.step import ppo


def no_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE without a baseline: the reward is the advantage."""
    return rewards.clone()


def half_ppo(logp, inputs, cfg):
    loss, stats = ppo(logp, inputs, cfg)
    return 0.5 * loss, stats


def reinforce(logp, inputs, cfg):
    """-A log pi, aggregated as the recipe says; no stats (the step fills the ratio ones)."""
    return aggregate(-(logp * inputs.adv), inputs.mask, cfg.loss_agg, inputs.groups)


def half_weight(prox, behav, mask):
    nothing = torch.zeros_like(mask, dtype=torch.bool)
    return 0.5 * mask, mask, nothing, nothing


def per_group_sum(rewards: torch.Tensor) -> torch.Tensor:
    """The wrong shape: one value per group."""
    return rewards.sum(dim=1)


def weight_only(prox, behav, mask):
    return torch.ones_like(mask)


def vector_loss(logp, inputs, cfg):
    return -(logp * inputs.adv)
