"""The RL objective of one micro-batch, as a function of tensors only.

`micro_batch_loss(logp, entropy, inputs, cfg)` takes the log-probs and entropy the model's
logits give for the micro-batch's tokens, the batch tensors (`LossInputs`: loss mask after the
off-policy correction, advantages, proximal and reference log-probs, correction weights, group
ids, and the micro-batch's share of the step's aggregation units) and the objective's settings,
and returns the loss to back-propagate (already multiplied by the share, so the micro-batches of
an optimizer step sum to the full mini-batch's aggregate) with its parts for the metrics. It
holds no model and no state, so a Megatron forward-step function can call it unchanged.

    loss = PPO-clip(logp / prox, adv) * weight   aggregated (policy_loss)
         + kl_coef * KL(logp || ref)             aggregated (kl_penalty)
         - entropy_coef * H                      aggregated (entropy_bonus)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streamrl.core.algorithms.losses import aggregate, entropy_bonus, kl_penalty, policy_loss
from streamrl.core.corrections import DEFAULTS, params, resolve


@dataclass
class RLConfig:
    """The objective and the learner's schedule per claimed batch; mirrors the recipe's
    `learner:` keys (streamrl/recipe.py LearnerCfg) with `auto` and unset keys resolved."""

    loss_agg: str = "token"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    off_policy: str = "none"  # none | tis | tis_seq | mis | decoupled | icepop (offpolicy.py)
    tis_cap: float = DEFAULTS["tis_cap"]
    seq_ratio: str = DEFAULTS["seq_ratio"]
    mis_level: str = DEFAULTS["mis_level"]
    mis_low: float = DEFAULTS["mis_low"]
    mis_high: float = DEFAULTS["mis_high"]
    decoupled_cap: float | None = DEFAULTS["decoupled_cap"]
    icepop_low: float = DEFAULTS["icepop_low"]
    icepop_high: float = DEFAULTS["icepop_high"]
    mini_batches: int = 1  # optimizer steps per pass over a claimed batch (whole groups each)
    epochs: int = 1  # passes over a claimed batch
    temperature: float = 1.0  # rollout temperature: log-probs are of softmax(logits / T)

    @classmethod
    def from_recipe(cls, learner: Any, temperature: float, staleness_bound: int = 0) -> RLConfig:
        """From a recipe's `learner:` section (streamrl.recipe.LearnerCfg), the rollout temperature
        and the run mode's staleness bound (core.staleness.mode_bound), which `off_policy: auto`
        depends on. Keys left unset (None) take corrections.DEFAULTS."""
        kw = {f: getattr(learner, f) for f in cls.__dataclass_fields__ if f != "temperature" and hasattr(learner, f)}
        kw = {k: v for k, v in kw.items() if v is not None}
        kw["off_policy"] = resolve(learner.off_policy, staleness_bound)
        return cls(**kw, temperature=temperature)

    @property
    def correction(self) -> dict[str, Any]:
        """The keyword arguments of the chosen correction (offpolicy.correct)."""
        return params(self.off_policy, self)


@dataclass
class LossInputs:
    """One micro-batch's batch tensors, [B, T] aligned with the log-probs."""

    mask: torch.Tensor  # loss mask after the off-policy correction
    adv: torch.Tensor  # advantages on the tokens
    prox: torch.Tensor  # proximal log-probs (the learner's before the batch's first step)
    groups: torch.Tensor  # [B] group id per sequence
    share: float  # this micro-batch's part of the optimizer step's aggregation units
    weight: torch.Tensor | None = None  # the correction's per-token weights
    ref: torch.Tensor | None = None  # reference-model log-probs (KL), None without a KL term


def micro_batch_loss(logp: torch.Tensor, entropy: torch.Tensor, x: LossInputs,
                     cfg: RLConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(share-weighted loss to back-propagate, unweighted parts: loss, pg_loss, kl, entropy,
    ratio_mean, ratio_max, clip_frac)."""
    agg: Any = cfg.loss_agg
    pg, stats = policy_loss(logp, x.prox, x.adv, x.mask, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip,
                            x.weight, agg, x.groups)
    loss = pg
    kl = torch.zeros((), device=logp.device)
    if x.ref is not None:
        kl = aggregate(kl_penalty(logp, x.ref, cfg.kl_estimator), x.mask, agg, x.groups)  # type: ignore[arg-type]
        loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef:
        loss = loss + entropy_bonus(entropy, x.mask, cfg.entropy_coef, agg, x.groups)
    parts = {"loss": loss.detach(), "pg_loss": pg.detach(), "kl": kl.detach(),
             "entropy": aggregate(entropy.detach(), x.mask, agg, x.groups), **stats}
    return loss * x.share, parts
