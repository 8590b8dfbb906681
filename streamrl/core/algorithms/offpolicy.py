"""Off-policy corrections: how the learner weights and masks tokens that an older policy sampled.

Every correction compares the proximal policy (the learner's log-probs before this batch's
first optimizer step, `prox`) with the behaviour policy (the rollout engine's log-probs,
`behav`) through the per-token log-ratio d = prox - behav, clamped to [-20, 20] so that a weight
is never inf (slime and SkyRL clamp the same way). The PPO ratio itself is taken against `prox`
(policy_loss), so the clip is a trust region around the recent policy and the correction below
only accounts for the gap between the policy that sampled and the proximal one (decoupled PPO,
Hilton et al. 2022, used for staleness by AReaL). Tokens with loss mask 0 never contribute.

A correction returns the weight each token's policy loss is multiplied by (no gradient flows
through it), the loss mask after it (MIS takes tokens out of the aggregation), and which tokens
it truncated (`capped`) or took out (`dropped`) for the step's metrics.

    none       w = 1                               rollout log-probs unused (on-policy)
    tis        w = min(exp(d), C)                  token TIS (Yao et al. 2025; slime --use-tis,
                                                   verl rollout_is token/truncate), C = tis_cap
    tis_seq    w_s = min(exp(D_s), C)              every token of sequence s, with D_s the geometric
                                                   mean mean_t(d) (default; GSPO's length-normalised
                                                   ratio) or the product sum_t(d) (`seq_ratio: product`,
                                                   unbiased but its variance grows with length)
    mis        w = exp(d) (or exp(D_s)); tokens (or whole sequences, mis_level: sequence) whose
               weight lies outside [mis_low, mis_high] get loss mask 0: they leave the aggregation,
               so the mean runs over the tokens kept (slime mis.py, mis_mode: mask)
    decoupled  w = exp(d), untruncated (AReaL's behaviour weight); with decoupled_cap c, tokens with
               w > c get weight 0 but stay in the aggregation's denominator (AReaL behav_imp_weight_cap)
    icepop     w = exp(d) inside [icepop_low, icepop_high], else 0: IcePop's M(k) (Ring-1T, 2025), whose
               1/|y| normalisation keeps masked tokens in the denominator
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from streamrl.core.corrections import SeqRatio  # which correction and its settings: there, without torch

LOG_RATIO_BOUND = 20.0


class Correction(NamedTuple):
    weight: torch.Tensor | None  # [B, T] multiplier of each token's policy loss; None = 1
    mask: torch.Tensor  # [B, T] loss mask after the correction
    capped: torch.Tensor  # [B, T] bool: tokens whose weight was truncated
    dropped: torch.Tensor  # [B, T] bool: tokens taken out (loss mask 0 or weight 0)


def log_ratio(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """d = prox - behav on tokens in the loss (0 elsewhere, whatever `behav` holds there), clamped."""
    d = torch.where(mask > 0, (prox - behav).detach(), torch.zeros_like(prox))
    return d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def sequence_log_ratio(d: torch.Tensor, mask: torch.Tensor, how: SeqRatio = "geometric") -> torch.Tensor:
    """[B, 1]: the sum of a sequence's token log-ratios (product of ratios) or their mean (geometric)."""
    m = (mask > 0).to(d.dtype)
    total = (d * m).sum(dim=1, keepdim=True)
    if how == "product":
        return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if how == "geometric":
        return total / m.sum(dim=1, keepdim=True).clamp(min=1)
    raise ValueError(f"unknown sequence ratio {how!r} (geometric or product)")


def _nothing(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


def _band(w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    if not low < high:
        raise ValueError(f"the band needs low < high, got [{low}, {high}]")
    return (w >= low) & (w <= high)


def none(prox: torch.Tensor, behav: torch.Tensor | None, mask: torch.Tensor) -> Correction:
    return Correction(None, mask, _nothing(mask), _nothing(mask))


def tis(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, tis_cap: float = 2.0) -> Correction:
    w = torch.exp(log_ratio(prox, behav, mask))
    on = mask > 0
    return Correction(w.clamp(max=tis_cap) * mask, mask, (w > tis_cap) & on, _nothing(mask))


def tis_seq(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, tis_cap: float = 2.0,
            seq_ratio: SeqRatio = "geometric") -> Correction:
    ws = torch.exp(sequence_log_ratio(log_ratio(prox, behav, mask), mask, seq_ratio))
    on = mask > 0
    return Correction(ws.clamp(max=tis_cap) * mask, mask, (ws > tis_cap) & on, _nothing(mask))


def mis(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, mis_level: str = "token",
        mis_low: float = 0.5, mis_high: float = 2.0, seq_ratio: SeqRatio = "geometric") -> Correction:
    d = log_ratio(prox, behav, mask)
    if mis_level == "token":
        w = torch.exp(d)
    elif mis_level == "sequence":
        w = torch.exp(sequence_log_ratio(d, mask, seq_ratio)).expand_as(d)
    else:
        raise ValueError(f"unknown mis level {mis_level!r} (token or sequence)")
    keep = _band(w, mis_low, mis_high)
    on = mask > 0
    kept = mask * keep.to(mask.dtype)
    return Correction(w * kept, kept, _nothing(mask), on & ~keep)


def decoupled(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor,
              decoupled_cap: float | None = None) -> Correction:
    w = torch.exp(log_ratio(prox, behav, mask))
    on = mask > 0
    if decoupled_cap is None:
        return Correction(w * mask, mask, _nothing(mask), _nothing(mask))
    over = (w > decoupled_cap) & on
    return Correction(torch.where(over, torch.zeros_like(w), w) * mask, mask, _nothing(mask), over)


def icepop(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, icepop_low: float = 0.5,
           icepop_high: float = 5.0) -> Correction:
    w = torch.exp(log_ratio(prox, behav, mask))
    keep = _band(w, icepop_low, icepop_high)
    return Correction(torch.where(keep, w, torch.zeros_like(w)) * mask, mask, _nothing(mask), (mask > 0) & ~keep)


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "none": none, "tis": tis, "tis_seq": tis_seq, "mis": mis, "decoupled": decoupled, "icepop": icepop}


def correct(off_policy: str, prox: torch.Tensor, behav: torch.Tensor | None, mask: torch.Tensor,
            **kw: Any) -> Correction:
    """Apply the named correction (`none`, `tis`, ...) with its parameters `kw` (see `corrections.params`)."""
    if off_policy not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {off_policy!r} (one of {', '.join(CORRECTIONS)})")
    if off_policy != "none" and behav is None:
        raise ValueError(f"off-policy correction {off_policy!r} needs the rollout (behaviour) log-probs")
    return CORRECTIONS[off_policy](prox, behav, mask, **kw)


# ------------------------------------------------------------------ metrics

SUM_KEYS = ("tokens", "seqs", "ratio_sum", "gap_sum", "weight_sum", "weighted_tokens", "capped_tokens",
            "dropped_tokens", "capped_seqs", "dropped_seqs")
MAX_KEYS = ("ratio_max", "weight_max")


def sums(prox: torch.Tensor, behav: torch.Tensor | None, mask: torch.Tensor, c: Correction) -> dict[str, float]:
    """Additive counts of one micro-batch (SUM_KEYS add up over micro-batches and ranks, MAX_KEYS
    take the max) from which `metrics` forms the step's figures."""
    on = mask > 0
    seq_on = on.any(dim=1)
    out = dict.fromkeys(SUM_KEYS, 0.0) | dict.fromkeys(MAX_KEYS, 0.0)
    out["tokens"], out["seqs"] = float(on.sum()), float(seq_on.sum())
    if behav is not None and on.any():
        lr = log_ratio(prox, behav, mask)[on]
        r = torch.exp(lr)
        out["ratio_sum"], out["ratio_max"], out["gap_sum"] = float(r.sum()), float(r.max()), float(lr.abs().sum())
    kept = on & ~c.dropped
    w = (c.weight if c.weight is not None else torch.ones_like(mask))[kept]
    if w.numel():
        out["weight_sum"], out["weighted_tokens"], out["weight_max"] = float(w.sum()), float(w.numel()), float(w.max())
    out["capped_tokens"], out["dropped_tokens"] = float(c.capped.sum()), float(c.dropped.sum())
    out["capped_seqs"] = float((c.capped.any(dim=1) & seq_on).sum())
    out["dropped_seqs"] = float((c.dropped.any(dim=1) & seq_on).sum())
    return out


def metrics(s: dict[str, float], with_ratio: bool = True) -> dict[str, float]:
    """The step's correction figures from summed counts:

    is_ratio_mean/max    exp(prox - behav) over loss tokens, before the correction (how off-policy)
    logprob_gap          mean |prox - behav| over loss tokens: the learner's log-prob of a sampled
                         token against the engine's (staleness, kernels and, for MoE, routing)
    is_weight_mean/max   the weight applied, over the tokens still trained on
    is_capped_tokens     fraction of loss tokens whose weight was truncated (tis, tis_seq)
    is_masked_tokens     fraction of loss tokens taken out (mis, decoupled over its cap, icepop)
    is_capped_seqs, is_masked_seqs   fraction of sequences with at least one such token
    """
    tok, seq = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
    out = {"is_weight_mean": s["weight_sum"] / max(s["weighted_tokens"], 1.0), "is_weight_max": s["weight_max"],
           "is_capped_tokens": s["capped_tokens"] / tok, "is_masked_tokens": s["dropped_tokens"] / tok,
           "is_capped_seqs": s["capped_seqs"] / seq, "is_masked_seqs": s["dropped_seqs"] / seq}
    if with_ratio:
        out |= {"is_ratio_mean": s["ratio_sum"] / tok, "is_ratio_max": s["ratio_max"], "logprob_gap": s["gap_sum"] / tok}
    return out
