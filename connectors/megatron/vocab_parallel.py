"""Log-probs and entropy of the chosen tokens from the last hidden states, the output layer applied a chunk of
tokens at a time on each tensor-parallel rank's shard of the vocabulary: no [tokens, vocab] tensor is ever whole.

Why: the plain computation (batch.logprobs_and_entropy on the model's logits, kept as the oracle the tests and
`benchmarks/learner_step.py --vocab V --reference` use) holds the logits, their fp32 log-softmax and its exp for
autograd, and megatron's own [s, b, v] -> [b, s, v] copies and their gradients: at Qwen's 151,936-token
vocabulary a 0.5B micro-batch of 16 x 1.3k tokens is ~12.6 GB per fp32 copy. Megatron's and slime's
vocab-parallel cross-entropy never gather the vocabulary; this does the same with a temperature and the
entropy, and goes one step further (as fused linear cross-entropy kernels do): the output layer runs inside.

Forward, per chunk of rows, on each TP rank (W its [V / tp, H] rows of the output layer):
    x = (h W^T).float() / T            the chunk's logits, in the model's dtype and then fp32 (as before)
    lse = m + log sum exp(x - m)       m = the max, both all-reduced over the TP group
    logp = x[target] - lse             the target's logit from the rank whose shard holds it
    H = lse - sum(p x)                 sum(exp(x - m) x) all-reduced with the rest
Kept for backward: h, W and per token lse and H. Backward recomputes x and p = exp(x - lse) per chunk:
    d logp / d x_j = [j = target] - p_j        d H / d x_j = -p_j (x_j - lse + H)
divides by T, casts to the model's dtype (where megatron's linear would have met it) and gives
dh = dx W (all-reduced over TP: every rank's shard adds to it, as megatron's ColumnParallelLinear
does) and dW += dx^T h (accumulated in fp32, cast once). The entropy's backward runs only when
the loss uses it (an entropy coefficient of 0 leaves its gradient None); its forward costs one
more product per chunk and gives the metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# fp32 bytes of one chunk's [rows, vocab shard] logits; a few such slabs are alive at once
CHUNK_BYTES = 64 << 20


def chunk_rows(vocab_shard: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab_shard))


def _logits(rows: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits / T in fp32, the matmul in the model's dtype (as megatron's output layer)."""
    return (rows @ weight.t()).float() / temperature


class _ChosenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float,
                group: Any, with_entropy: bool, rows_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        b, t, _ = hidden.shape
        shard = weight.shape[0]
        flat = hidden.reshape(b * t, -1)
        offset = dist.get_rank(group) * shard if group is not None else 0
        # row (i, j) predicts ids[i, j + 1]; each sequence's last row predicts nothing (target 0, dropped)
        targets = torch.cat([ids[:, 1:], ids.new_zeros(b, 1)], dim=1).reshape(-1) - offset
        inside = (targets >= 0) & (targets < shard)
        local = targets.clamp(0, shard - 1)
        lse = torch.empty(b * t, dtype=torch.float32, device=hidden.device)
        logp, ent = torch.empty_like(lse), torch.empty_like(lse)
        for lo in range(0, b * t, rows_per_chunk):
            hi = min(lo + rows_per_chunk, b * t)
            x = _logits(flat[lo:hi], weight, temperature)
            m = x.max(-1).values
            if group is not None:
                dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
            e = torch.exp(x - m[:, None])
            picked = x.gather(-1, local[lo:hi, None]).squeeze(-1) * inside[lo:hi]
            ex = (e * x).sum(-1) if with_entropy else torch.zeros_like(m)
            sums = torch.stack([e.sum(-1), picked, ex])
            del x, e
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[lo:hi] = m + sums[0].log()
            logp[lo:hi] = sums[1] - lse[lo:hi]
            ent[lo:hi] = lse[lo:hi] - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, local, inside, lse, ent)
        ctx.temperature, ctx.rows, ctx.group = temperature, rows_per_chunk, group
        return logp.view(b, t)[:, :-1], ent.view(b, t)[:, :-1]

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, local, inside, lse, ent = ctx.saved_tensors
        b, t, _ = hidden.shape
        want_h, want_w = ctx.needs_input_grad[:2]
        d_hidden = torch.zeros_like(hidden) if want_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        if g_logp is not None or g_ent is not None:
            flat, temp = hidden.reshape(b * t, -1), ctx.temperature
            d_flat = d_hidden.view(b * t, -1) if d_hidden is not None else None

            def rows(g: torch.Tensor | None) -> torch.Tensor | None:  # [B, T-1] -> one per row, 0 on each last row
                return None if g is None else torch.cat([g.float(), g.new_zeros(b, 1, dtype=torch.float32)], 1).reshape(-1)

            gl, gh = rows(g_logp), rows(g_ent)
            for lo in range(0, b * t, ctx.rows):
                hi = min(lo + ctx.rows, b * t)
                x = _logits(flat[lo:hi], weight, temp)
                p = torch.exp(x - lse[lo:hi, None])
                g = torch.zeros_like(x)
                if gl is not None:
                    g -= p * gl[lo:hi, None]
                    g.scatter_add_(-1, local[lo:hi, None], (gl[lo:hi] * inside[lo:hi])[:, None])
                if gh is not None:
                    g -= gh[lo:hi, None] * p * (x - (lse[lo:hi] - ent[lo:hi])[:, None])
                del x, p
                g = (g / temp).to(hidden.dtype)
                if d_flat is not None:
                    d_flat[lo:hi] = g @ weight
                if d_weight is not None:
                    d_weight += (g.t() @ flat[lo:hi]).float()
        if d_hidden is not None and ctx.group is not None:
            dist.all_reduce(d_hidden, group=ctx.group)
        return (d_hidden, d_weight.to(weight.dtype) if d_weight is not None else None, None, None, None, None, None)


def chosen_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = True, group: Any = None,
                    rows_per_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What batch.logprobs_and_entropy gives for the logits `hidden @ weight.T` (log-prob of each next token
    under softmax(logits / T), and the entropy of that distribution; both [B, T-1]), from the last hidden states
    [B, T, H] and this rank's rows [V / tp, H] of the output layer in a TP `group` (None: the whole vocabulary
    here), holding no [B, T, V] tensor."""
    temperature = temperature if temperature > 0 else 1.0
    rows = rows_per_chunk or chunk_rows(weight.shape[0])
    logp, ent = _ChosenLogprobs.apply(hidden, weight, ids, temperature, group, with_entropy, rows)
    return logp, (ent if with_entropy else None)


# ---------------------------------------------------------------- megatron's GPTModel


def _unwrapped(model: Any) -> Any:
    while hasattr(model, "module"):  # DistributedDataParallel and friends
        model = model.module
    return model


def output_weight(model: Any) -> torch.Tensor:
    """The weight a (last-stage) GPTModel's output layer multiplies by: the tied embedding or its own."""
    m = _unwrapped(model)
    return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight


def defer_output_layer(model: Any) -> None:
    """Let `hidden_states(model)` make a last-stage GPTModel return its last hidden states [B, T, H] in place of
    its logits (its output layer passes its input through); elsewhere the model is as it was."""
    layer = _unwrapped(model).output_layer
    plain = layer.forward

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (hidden, None) if layer.deferred else plain(hidden, *args, **kwargs)

    layer.deferred = False
    layer.forward = forward


@contextmanager
def hidden_states(model: Any) -> Iterator[None]:
    """Inside: a model passed through defer_output_layer returns hidden states; other models are untouched."""
    layer = getattr(_unwrapped(model), "output_layer", None)
    if layer is None or not hasattr(layer, "deferred"):
        yield
        return
    layer.deferred = True
    try:
        yield
    finally:
        layer.deferred = False
