"""Token batches for the megatron learner: right-padded prompt+response rows, and per-token
log-probs / entropy of the response tokens.

Padding (not packing): each micro-batch is padded to its longest row. With right padding the
causal mask alone keeps pads from influencing real tokens, so one [1, 1, T, T] boolean mask
serves the whole batch; packing would need per-sequence masks or THD kernels that need
TransformerEngine. What keeps padding cheap instead is `plan_micro_batches`: rows of similar
length share a micro-batch, and a token budget caps rows x longest row (slime's and verl's
dynamic batch size, counted in padded tokens because that is what a padded step computes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class TokenBatch:
    """ids/positions [B, T]; `resp_mask` [B, T-1] marks targets (ids[:, 1:]) that are response tokens.
    With `routing` (one [prompt + response - 1, layers, top_k] expert-id array or None per row: the
    experts the engine routed each position to, MoE models), `routing` [B, T, layers, top_k] and
    `routing_known` [B, T] say which positions have them (connectors/megatron/routing.py)."""

    def __init__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0,
                 routing: Sequence[Any] | None = None) -> None:
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
        self.routing: torch.Tensor | None = None
        self.routing_known: torch.Tensor | None = None
        given = [(i, torch.tensor(x, dtype=torch.long)) for i, x in enumerate(routing or []) if x is not None]  # a copy:
        # the pool's arrays are read-only views
        if given:
            shape = given[0][1].shape[1:]
            self.routing = torch.zeros(len(rows), t, *shape, dtype=torch.long)
            self.routing_known = torch.zeros(len(rows), t, dtype=torch.bool)
            for i, x in given:
                if x.shape[1:] != shape or x.shape[0] != lens[i] - 1:
                    raise ValueError(f"row {i}: routing of shape {tuple(x.shape)}, expected "
                                     f"({lens[i] - 1}, {', '.join(map(str, shape))}): one entry per position but the last")
                self.routing[i, : len(x)] = x
                self.routing_known[i, : len(x)] = True
        self.routed_rows = len(given)

    def to(self, device: Any) -> TokenBatch:
        for name in ("ids", "resp_mask", "positions", "attn_mask", "routing", "routing_known"):
            if getattr(self, name) is not None:
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


def plan_micro_batches(lengths: Sequence[int], groups: Sequence[Any], max_rows: int,
                       max_tokens: int | None = None, whole_groups: bool = False) -> list[list[int]]:
    """Row indices per micro-batch. Rows are taken in order of length (ties by position:
    deterministic, so every rank and a replay plan alike); a micro-batch is closed before it
    would hold more than `max_rows` rows or, with `max_tokens`, more than `max_tokens` padded
    tokens (rows x its longest row). A row longer than the budget gets a micro-batch of its own.
    With `whole_groups` (group aggregation needs a group's rows together) the unit is a group,
    placed by its longest row, and a group larger than the limits is one micro-batch.
    Why: one padded micro-batch computes every row at the longest row's length; 64 long-tail rows
    of 21-221 tokens (mean 83) pad to 14.1k tokens in one micro-batch, to 6.1k sorted and capped
    at 1024 padded tokens (benchmarks/README.md, learner_step.py --longtail)."""
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"max_rows and max_tokens must be at least 1, got {max_rows} and {max_tokens}")
    units: dict[Any, list[int]] = {}
    for i, g in enumerate(groups if whole_groups else range(len(lengths))):
        units.setdefault(g, []).append(i)
    order = sorted(units.values(), key=lambda rows: (max(lengths[i] for i in rows), rows[0]))
    out: list[list[int]] = []
    longest = 0
    for rows in order:
        t = max(longest, *(lengths[i] for i in rows))
        fits = out and len(out[-1]) + len(rows) <= max_rows and (
            max_tokens is None or (len(out[-1]) + len(rows)) * t <= max_tokens)
        if fits:
            out[-1].extend(rows)
            longest = t
        else:
            out.append(list(rows))
            longest = max(lengths[i] for i in rows)
    return [sorted(mb) for mb in out]  # batch order inside: a batch that fits one micro-batch stays as it came


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
