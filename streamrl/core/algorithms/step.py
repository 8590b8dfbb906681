"""The RL step in one place: scored samples -> advantages -> off-policy correction -> loss.

The learner driver (streamrl/runtime/learner.py) and the megatron learner
(connectors/megatron/learner.py) only move data in and out of these functions:

    scored(group)                  the samples that take part: not failed, rewarded, non-empty
    sample_advantages(rewards, a)  one advantage per scored sample               learner.advantage
    loss_inputs(cfg, ...)          loss mask, correction weights, token advantages  learner.off_policy
    micro_batch_loss(...)          policy loss + KL + entropy of one micro-batch  learner.loss

Each of the three recipe keys names a built-in or a user function `pkg.mod:fn` (imported when the
recipe is loaded; RLConfig.from_recipe resolves it). Built-ins are entries of the same tables
(ADVANTAGES, LOSSES, CORRECTIONS) and are called through the same door (`pick`) with the same
arguments as a user's function. The contracts (B sequences, T response tokens, float32 unless said):

learner.advantage: fn(rewards) -> advantages
    rewards     [G, n] the scalar rewards of G groups of n scored samples each (one GRPO group a row)
    returns     [G, n] one advantage per sample; it is spread over the sample's response tokens.
    Called once per batch when every group has the same number of scored samples, so an estimator
    may normalise over the whole batch (reinforce_pp does); otherwise once per group as [1, k]. A
    group left with one scored sample gets dr_grpo's r - mean = 0 (nothing to compare it with),
    whatever the estimator. Built-ins: grpo, dr_grpo, rloo, reinforce_pp (advantages.py).

learner.off_policy: fn(prox, behav, mask) -> Correction(weight, mask, capped, dropped)
    prox        [B, T] the learner's log-probs before the batch's first optimizer step (no grad)
    behav       [B, T] the rollout engine's log-probs (arbitrary where mask is 0)
    mask        [B, T] the loss mask (1 = trained on)
    returns     offpolicy.Correction or any 4-tuple of [B, T] tensors: weight (multiplies each
                token's policy loss, no gradient; None = 1), the loss mask after the correction
                (tokens set to 0 leave the aggregation), and bools capped / dropped (metrics only).
    Called once per micro-batch before training on the batch. Built-ins (tis, tis_seq, mis,
    decoupled, icepop) also get their recipe settings as keywords (corrections.USES); a user
    function gets none. Every correction but `none` needs the rollout log-probs.

learner.loss: fn(logp, inputs, cfg) -> loss or (loss, stats)
    logp        [B, T] the learner's log-probs of the response tokens (with grad)
    inputs      objective.LossInputs: mask (after the correction), adv [B, T], prox [B, T],
                weight [B, T] or None, groups [B] group ids, ref (the KL's business, not the loss's)
    cfg         objective.RLConfig: eps_clip_low/high, dual_clip, loss_agg, ...
    returns     the policy term as a scalar: a mean over this micro-batch's units of
                cfg.loss_agg (losses.aggregate(per_token, inputs.mask, cfg.loss_agg,
                inputs.groups) does it), because the learner weights each micro-batch by its
                share of the step's units. `stats` (scalar tensors) may hold ratio_mean,
                ratio_max and clip_frac; missing ones are computed here (clip_frac 0).
    The KL and entropy terms are added after it (learner.kl_coef, learner.entropy_coef).
    Built-in: ppo (losses.policy_loss: PPO clip with asymmetric clip and dual clip, times weight).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from streamrl.core.algorithms.advantages import group_advantages, tokens_from_samples
from streamrl.core.algorithms.losses import aggregate, entropy_bonus, kl_penalty, policy_loss
from streamrl.core.algorithms.objective import Choice, LossInputs, RLConfig
from streamrl.core.algorithms.offpolicy import CORRECTIONS, Correction, sums
from streamrl.core.corrections import CHOICES
from streamrl.core.types import Sample, SampleGroup


def ppo(logp: torch.Tensor, x: LossInputs, cfg: RLConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The built-in policy loss: PPO's clipped surrogate against the proximal policy, times the correction's weight."""
    return policy_loss(logp, x.prox, x.adv, x.mask, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip,
                       x.weight, cfg.loss_agg, x.groups)  # type: ignore[arg-type]


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    name: partial(group_advantages, method=name) for name in CHOICES["advantage"]}
LOSSES: dict[str, Callable[..., Any]] = {"ppo": ppo}
BUILTINS: dict[str, Mapping[str, Callable[..., Any]]] = {
    "advantage": ADVANTAGES, "loss": LOSSES, "off_policy": CORRECTIONS}


def pick(key: str, choice: Choice) -> Callable[..., Any]:
    """The function `learner.<key>` chose: a built-in by name, or the user's function itself."""
    if callable(choice):
        return choice
    table = BUILTINS[key]
    if choice in table:
        return table[choice]
    raise ValueError(f"unknown learner.{key} {choice!r}: one of {', '.join(table)}, or a function "
                     "(RLConfig.from_recipe imports a `pkg.mod:fn` path)")


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ------------------------------------------------------------------ rows -> advantages


def scored(group: SampleGroup) -> list[Sample]:
    """The samples of a group a step trains on: not failed, rewarded, with at least one token."""
    return [s for s in group.samples if not s.failed and s.reward is not None and s.num_tokens > 0]


def _advantages(fn: Callable[..., Any], rewards: torch.Tensor) -> list[list[float]]:
    out = fn(rewards)
    if not isinstance(out, torch.Tensor) or out.shape != rewards.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"advantage function {_name(fn)} returned {got} for rewards of shape "
                         f"{tuple(rewards.shape)}; it must return a tensor of that shape")
    return out.tolist()


def sample_advantages(rewards: Sequence[Sequence[float]], advantage: Choice) -> list[list[float]]:
    """One advantage per scored sample, group by group (`rewards[g]`: the scored rewards of group
    g, empty when none was scored)."""
    fn = pick("advantage", advantage)
    sizes = {len(r) for r in rewards if r}
    if len(sizes) == 1:  # every group complete: one tensor, so batch-level estimators (reinforce_pp) are exact
        adv = iter(_advantages(fn, torch.tensor([list(r) for r in rewards if r], dtype=torch.float32)))
        return [next(adv) if r else [] for r in rewards]
    # Groups with failed samples: each group's scored samples alone.
    return [_advantages(fn if len(r) > 1 else ADVANTAGES["dr_grpo"], torch.tensor([list(r)], dtype=torch.float32))[0]
            if r else [] for r in rewards]


# ------------------------------------------------------------------ the off-policy correction


def correct(cfg: RLConfig, prox: torch.Tensor, behav: torch.Tensor | None, mask: torch.Tensor) -> Correction:
    """The correction `cfg.off_policy` of one micro-batch's tokens (offpolicy.py has the built-ins)."""
    fn = pick("off_policy", cfg.off_policy)
    if behav is None and fn is not CORRECTIONS["none"]:
        what = cfg.off_policy if isinstance(cfg.off_policy, str) else _name(fn)
        raise ValueError(f"off-policy correction {what!r} needs the rollout (behaviour) log-probs")
    out = fn(prox, behav, mask, **cfg.correction)
    if not isinstance(out, tuple | list) or len(out) != 4:
        raise ValueError(f"off-policy correction {_name(fn)} returned {type(out).__name__}, not "
                         "(weight, mask, capped, dropped)")
    c = Correction(*out)
    for part, t in zip(Correction._fields, c):
        if (t is not None or part != "weight") and (not isinstance(t, torch.Tensor) or t.shape != mask.shape):
            raise ValueError(f"off-policy correction {_name(fn)}: its {part} must be a tensor of the mask's shape "
                             f"{tuple(mask.shape)}")
    return c


def loss_inputs(cfg: RLConfig, prox: torch.Tensor, resp_mask: torch.Tensor, loss_mask: torch.Tensor,
                behav: torch.Tensor | None, advantages: torch.Tensor, groups: torch.Tensor,
                ref: torch.Tensor | None = None) -> tuple[LossInputs, dict[str, float]]:
    """One micro-batch's loss inputs, taken before the batch's first optimizer step, and the
    correction's counts for the step's metrics (offpolicy.sums). `prox`, `ref`, `behav` are
    [B, T] log-probs, `resp_mask` marks response tokens, `loss_mask` the ones a sample trains on,
    `advantages` [B] one per sample, `groups` [B] group ids."""
    prox = prox * resp_mask
    ref = ref * resp_mask if ref is not None else None
    mask = resp_mask * loss_mask
    c = correct(cfg, prox, behav, mask)
    adv = tokens_from_samples(advantages, resp_mask)
    x = LossInputs(mask=c.mask, adv=adv, prox=prox, groups=groups, share=0.0, weight=c.weight, ref=ref)
    return x, sums(prox, behav, mask, c)


# ------------------------------------------------------------------ the loss

RATIO_STATS = ("ratio_mean", "ratio_max", "clip_frac")


def _policy_term(logp: torch.Tensor, x: LossInputs, cfg: RLConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    fn = pick("loss", cfg.loss)
    out = fn(logp, x, cfg)
    loss, stats = (out, {}) if isinstance(out, torch.Tensor) else out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss function {_name(fn)} must return a scalar tensor (or one with a dict of stats)")
    if not set(RATIO_STATS) <= stats.keys():  # what the step's metrics report, for any loss
        m = x.mask.to(logp.dtype)
        ratio = torch.exp(logp.detach() - x.prox.detach())
        stats = {"ratio_mean": aggregate(ratio, m),
                 "ratio_max": (ratio * m).max() if m.any() else torch.ones(()),
                 "clip_frac": torch.zeros((), device=logp.device), **stats}
    return loss, stats


def micro_batch_loss(logp: torch.Tensor, entropy: torch.Tensor, x: LossInputs,
                     cfg: RLConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch from the log-probs and entropy the model's logits give for its
    tokens: (the loss to back-propagate, already multiplied by the micro-batch's share so the
    micro-batches of an optimizer step sum to the full mini-batch's aggregate; unweighted parts
    for the metrics: loss, pg_loss, kl, entropy, ratio_mean, ratio_max, clip_frac). It holds no
    model and no state, so a Megatron forward-step function can call it unchanged."""
    agg: Any = cfg.loss_agg
    pg, stats = _policy_term(logp, x, cfg)
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
