"""Routing replay (R3) in the megatron learner: each MoE layer routes a token to the experts the
engine routed it to, where the sample carries that routing (per token and layer, from the pool).

Why: the engine and the learner run different kernels and, in a stream, often a different policy
version, so left alone they pick different experts for the same token and the learner's log-prob
of a sampled token is the log-prob of another network (the importance ratios blow up).

How: megatron's top-k routing (moe_utils.topk_routing_with_score_function) asks the router's
`router_replay` object for its top-k (megatron-core's RouterReplay: RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD over whole micro-batches). `RowReplay` answers the same call per token: where
the token's routing is known it returns those experts and the router's own scores for them (so
the gate still gets gradients); elsewhere (the last token of a row, which no engine forward
processed; padding; a sample sent without routing) the learner's own top-k. Megatron's replay
needs the indices of every token of the micro-batch, which mixed rows do not have. The
learner's own choice is computed either way, so the layer also counts how many known tokens it
would have routed elsewhere (`mismatched` / `known`, per token as a set of experts).

Token order: megatron's layers see [seq, batch, hidden] and the router flattens it, so token
s * B + b is row b's position s. No recomputation runs in the learner (activation
recompute is off), so a backward never routes again and REPLAY_BACKWARD is not needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from streamrl.connectors.megatron.cpu_shim import eager_fusions

eager_fusions()  # before megatron-core's first import in a learner process (CPU only; see cpu_shim)

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402


class RowReplay:
    """The `router_replay` of one MoE layer (module doc)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # 0-based global layer index into a sample's routing [positions, layers, top_k]
        self.target: torch.Tensor | None = None  # [tokens, top_k] expert ids, megatron's token order
        self.known: torch.Tensor | None = None  # [tokens] bool
        self.enabled = True
        self.mismatched = 0  # known tokens whose own top-k differs from the target (as sets)
        self.used_mismatched = 0  # known tokens routed elsewhere than the target (0 when replaying)
        self.known_tokens = 0

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None or self.known is None or not bool(self.known.any()):
            return probs, own
        target, known = self.target.to(own.device), self.known.to(own.device)
        if target.shape != own.shape:
            raise ValueError(f"layer {self.layer}: routing for {tuple(target.shape)} (tokens, top_k), "
                             f"the micro-batch routes {tuple(own.shape)}")
        want = target.sort(dim=1).values
        self.mismatched += int(((own.sort(dim=1).values != want).any(dim=1) & known).sum())
        self.known_tokens += int(known.sum())
        if self.enabled:
            probs, idx = scores.gather(1, (idx := torch.where(known[:, None], target, own))), idx
        else:
            idx = own
        self.used_mismatched += int(((idx.sort(dim=1).values != want).any(dim=1) & known).sum())
        return probs, idx


def install(model: Any) -> list[RowReplay]:
    """A RowReplay in every MoE router of `model` (this pipeline stage's layers)."""
    out = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            if m.config.moe_router_fusion:
                raise ValueError("routing replay needs moe_router_fusion off (the fused kernel takes no replay)")
            m.router_replay = RowReplay(m.layer_number - 1)
            out.append(m.router_replay)
    return out


def set_batch(replays: list[RowReplay], routing: torch.Tensor | None, known: torch.Tensor | None) -> None:
    """Point every layer at a micro-batch's routing: `routing` [B, T, layers, top_k] and `known`
    [B, T] (TokenBatch.routing / routing_known), or None for a batch without routing."""
    for r in replays:
        if routing is None or known is None:
            r.target = r.known = None
            continue
        b, t, _, k = routing.shape
        r.target = routing[:, :, r.layer].transpose(0, 1).reshape(t * b, k)
        r.known = known.transpose(0, 1).reshape(t * b)


def take_counts(replays: list[RowReplay]) -> tuple[int, int, int]:
    """(own choice mismatched, routed mismatched, known) token-layer counts since the last call,
    and reset them."""
    out = (sum(r.mismatched for r in replays), sum(r.used_mismatched for r in replays),
           sum(r.known_tokens for r in replays))
    for r in replays:
        r.mismatched = r.used_mismatched = r.known_tokens = 0
    return out
