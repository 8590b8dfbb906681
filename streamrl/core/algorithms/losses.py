"""Policy losses on token tensors [B, T] with a 0/1 loss mask [B, T].

policy_loss: PPO clipped surrogate with asymmetric clip [1 - eps_low, 1 + eps_high] and
optional dual clip c (for A < 0 the loss is capped at -c * A). The ratio is
exp(logp - prox_logp); `prox_logp` is the proximal policy: the learner's log-probs before this
step (decoupled PPO, AReaL) or, on-policy, the rollout policy's. An optional per-token
`weight` multiplies the loss: the off-policy correction's (offpolicy.py).

kl_penalty: estimators of KL(pi || pi_ref) per token, with d = ref_logp - logp:
    k1 = -d,   k2 = d^2 / 2,   k3 = exp(d) - d - 1   (Schulman's unbiased, non-negative one)

aggregate: token (mean over all unmasked tokens), seq (mean over sequences of each sequence's
token mean), group (mean over groups of each group's token mean); fully masked sequences or
groups are left out of the mean. `aggregation_units` counts what that mean divides by, so a step
split into micro-batches weights each one by its share of the units and sums to the full-batch value.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token", "seq", "group"]
KLEstimator = Literal["k1", "k2", "k3"]


def aggregate(x: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token",
              group_ids: torch.Tensor | None = None) -> torch.Tensor:
    m = mask.to(x.dtype)
    if how == "token":
        return (x * m).sum() / m.sum().clamp(min=1)
    per_seq_sum, per_seq_n = (x * m).sum(dim=1), m.sum(dim=1)
    # Sequences (groups) with no unmasked token take no part in the mean, rather than
    # counting as zeros that dilute it.
    if how == "seq":
        has = per_seq_n > 0
        return (per_seq_sum[has] / per_seq_n[has]).sum() / has.sum().clamp(min=1)
    if how == "group":
        if group_ids is None:
            raise ValueError("group aggregation needs group_ids (one id per sequence)")
        _, inv = torch.unique(group_ids, return_inverse=True)
        sums = torch.zeros(int(inv.max()) + 1, dtype=x.dtype, device=x.device).index_add(0, inv, per_seq_sum)
        counts = torch.zeros_like(sums).index_add(0, inv, per_seq_n)
        has = counts > 0
        return (sums[has] / counts[has]).sum() / has.sum().clamp(min=1)
    raise ValueError(f"unknown aggregation {how!r}")


def aggregation_units(mask: torch.Tensor, how: Aggregation = "token",
                      group_ids: torch.Tensor | None = None) -> float:
    """How many units `aggregate` averages over: unmasked tokens, sequences with at least one
    unmasked token, or groups with at least one."""
    per_seq = (mask > 0).sum(dim=1)
    if how == "token":
        return float(per_seq.sum())
    if how == "seq":
        return float((per_seq > 0).sum())
    if how == "group":
        if group_ids is None:
            raise ValueError("group aggregation needs group_ids (one id per sequence)")
        return float(len(set(group_ids[per_seq > 0].tolist())))
    raise ValueError(f"unknown aggregation {how!r}")


def policy_loss(logp: torch.Tensor, prox_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                weight: torch.Tensor | None = None, agg: Aggregation = "token",
                group_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(logp - prox_logp.detach())
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(surr, surr_clipped)
    clipped = (surr_clipped < surr).to(logp.dtype)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.minimum(loss, -dual_clip * adv)
        loss = torch.where(adv < 0, capped, loss)
    if weight is not None:
        loss = loss * weight
    m = mask.to(logp.dtype)
    stats = {
        "ratio_mean": aggregate(ratio.detach(), m),
        "ratio_max": (ratio.detach() * m).max() if m.any() else torch.ones(()),
        "clip_frac": aggregate(clipped, m),
    }
    return aggregate(loss, m, agg, group_ids), stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, agg: Aggregation = "token",
                  group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The loss term -coef * H (minimising it raises the entropy)."""
    return -coef * aggregate(entropy, mask, agg, group_ids)
