"""Token batches for the megatron learner: right-padded prompt+response rows, and per-token
log-probs / entropy of the response tokens.

Padding (not packing): each micro-batch is padded to its longest row. With right padding the
causal mask alone keeps pads from influencing real tokens, so one [1, 1, T, T] boolean mask
serves the whole batch; packing would need per-sequence masks or THD kernels that need
TransformerEngine, and saves little at the tiny/small model sizes this runs on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class TokenBatch:
    """ids/positions [B, T]; `resp_mask` [B, T-1] marks targets (ids[:, 1:]) that are response tokens."""

    def __init__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0) -> None:
        if not rows:
            raise ValueError("empty batch")
        lens = [len(p) + len(r) for p, r in rows]
        t = max(lens)
        self.ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
        self.resp_mask = torch.zeros(len(rows), t - 1)
        for i, (p, r) in enumerate(rows):
            self.ids[i, : lens[i]] = torch.tensor([*p, *r], dtype=torch.long)
            self.resp_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1  # target j is token j + 1
        self.positions = torch.arange(t).expand(len(rows), t)
        self.attn_mask = torch.ones(1, 1, t, t, dtype=torch.bool).triu(1)  # True = masked
        self.prompt_lens = [len(p) for p, _ in rows]
        self.resp_lens = [len(r) for _, r in rows]

    def to(self, device: Any) -> TokenBatch:
        for name in ("ids", "resp_mask", "positions", "attn_mask"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def response_values(self, per_target: torch.Tensor) -> list[torch.Tensor]:
        """[B, T-1] values -> one 1-D tensor of response-token values per row."""
        return [per_target[i, p - 1 : p - 1 + r] for i, (p, r) in enumerate(zip(self.prompt_lens, self.resp_lens))]

    def scatter(self, per_sample: Sequence[Sequence[float]]) -> torch.Tensor:
        """One value list per row (e.g. rollout log-probs) -> [B, T-1] aligned with targets."""
        out = torch.zeros_like(self.resp_mask)
        for i, (p, vals) in enumerate(zip(self.prompt_lens, per_sample)):
            out[i, p - 1 : p - 1 + len(vals)] = torch.as_tensor(vals, dtype=out.dtype)
        return out


def logprobs_and_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token under softmax(logits / temperature), as the engine reports
    it, and the entropy of that distribution. logits [B, T, V] -> both [B, T-1]."""
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def balanced_split(weights: Sequence[float], parts: int) -> list[int]:
    """The part (0..parts-1) of each item, balancing the summed weights: items largest first
    (ties by position), each onto the part with the least weight so far (ties: the lowest
    part). Deterministic, so every data-parallel rank computes the same assignment."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    load = [0.0] * parts
    out = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        part = min(range(parts), key=lambda p: (load[p], p))
        out[i] = part
        load[part] += weights[i]
    return out
