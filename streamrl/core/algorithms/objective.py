"""What one RL step reads besides the model: its settings (`RLConfig`, the recipe's `learner:`
section) and one micro-batch's batch tensors (`LossInputs`). The step itself, from scored samples
to the loss, is step.py.

The objective of a micro-batch (step.micro_batch_loss):

    loss = policy loss                           learner.loss (ppo: PPO-clip(logp / prox, adv) * weight)
         + kl_coef * KL(logp || ref)             aggregated (kl_penalty)
         - entropy_coef * H                      aggregated (entropy_bonus)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from streamrl.core.corrections import CHOICES, DEFAULTS, is_fn_path, params, resolve

# A built-in name, or the user's function itself (resolved from its `pkg.mod:fn` path).
Choice = str | Callable[..., Any]


@dataclass
class RLConfig:
    """The objective and the learner's schedule per claimed batch; mirrors the recipe's
    `learner:` keys (streamrl/recipe/schema.py LearnerCfg) with `auto` and unset keys resolved.
    `advantage`, `loss` and `off_policy` hold a built-in name or a function (step.py says how
    each is called)."""

    advantage: Choice = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp (advantages.py) | a function
    loss: Choice = "ppo"  # ppo (losses.policy_loss) | a function
    loss_agg: str = "token"
    negative_credit: str = "sequence"  # sequence | first_error (streamrl/core/credit.py)
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    off_policy: Choice = "none"  # none | tis | tis_seq | mis | decoupled | icepop (offpolicy.py) | a function
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
    def from_recipe(cls, learner: Any, temperature: float, max_staleness: int = 0,
                    resolve_fn: Callable[[str], Callable[..., Any]] | None = None) -> RLConfig:
        """From a recipe's `learner:` section (streamrl.recipe.LearnerCfg), the rollout temperature
        and the staleness bound the run trains under (Recipe.max_staleness), which `off_policy: auto`
        depends on. Keys left unset (None) take corrections.DEFAULTS. A function path is imported
        with `resolve_fn` (streamrl.recipe.resolve_fn; the core itself imports no user code)."""
        kw = {f: getattr(learner, f) for f in cls.__dataclass_fields__ if f != "temperature" and hasattr(learner, f)}
        kw = {k: v for k, v in kw.items() if v is not None}
        kw["off_policy"] = resolve(learner.off_policy, max_staleness)
        for key in CHOICES:
            if is_fn_path(kw.get(key)):
                if resolve_fn is None:
                    raise ValueError(f"learner.{key} names a function ({kw[key]}): pass resolve_fn to import it")
                kw[key] = resolve_fn(kw[key])
        return cls(**kw, temperature=temperature)

    @property
    def correction(self) -> dict[str, Any]:
        """The keyword arguments of the chosen correction: a built-in's settings, none for a function."""
        return params(self.off_policy, self) if isinstance(self.off_policy, str) else {}


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
