"""What one learner rank holds for the model and, per micro-batch token, its activations: its share of the parameters (tensor,
pipeline and expert parallel split them), the fp32 gradient buffer, the fp32 main copies (bf16) and
Adam's two moments (megatron's distributed optimizer splits those two over the data-parallel ranks), and
a reference model when the KL needs one. Pure: `streamrl plan RECIPE` (streamrl/tools/plan_memory.py)
reads the model's config and the recipe and prints it; tests/test_learner_memory.py checks the counts
against transformers' models and megatron's own buffers.

The bytes per parameter are the learner's (connectors/megatron/optimizer.py): weights in the learner's
dtype, gradients reduced in fp32, main copies fp32 (bf16 only: in fp32 the weights are the main copies),
Adam fp32. Megatron's vocabulary padding (to a multiple of 128 x tp) is left out (<0.1% at Qwen's sizes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ARCHS = ("qwen2", "qwen3", "qwen3_moe")
GB = 1e9


@dataclass(frozen=True)
class Shape:
    """The numbers of an HF config that size a Qwen2/Qwen3(-MoE) model."""

    arch: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0
    expert_ffn: int = 0
    sparse_layers: int = 0  # layers whose MLP is the experts'
    top_k: int = 0  # experts a token is routed to


def shape_of(config: Mapping[str, Any]) -> Shape:
    """`config`: an HF config.json as a dict (model_type qwen2, qwen3 or qwen3_moe)."""
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise ValueError(f"model_type {arch!r}: the memory plan knows {', '.join(ARCHS)}")
    h, heads, layers = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0) if arch == "qwen3_moe" else 0
    sparse = 0
    if experts:
        step, dense_only = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers") or ())
        sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return Shape(arch=arch, vocab=int(config["vocab_size"]), hidden=h, layers=layers, heads=heads,
                 kv_heads=int(config.get("num_key_value_heads", heads)),
                 head_dim=int(config.get("head_dim") or h // heads), ffn=int(config.get("intermediate_size", 0)),
                 tied=bool(config.get("tie_word_embeddings", False)),
                 qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)), qk_norm=arch != "qwen2",
                 experts=experts, expert_ffn=int(config.get("moe_intermediate_size", 0)), sparse_layers=sparse,
                 top_k=int(config.get("num_experts_per_tok", 0)) if experts else 0)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parameters by how parallelism splits them."""

    split: int  # attention, and a dense layer's MLP: over tp
    replicated: int  # norms, the router: whole on every tp rank
    experts: int  # a sparse layer's experts: whole experts over ep, each expert over tp


def layers(s: Shape) -> tuple[Layer, Layer]:
    """(a dense layer, a sparse layer) of `s`."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = s.hidden * q + 2 * s.hidden * kv + q * s.hidden + (q + 2 * kv if s.qkv_bias else 0)
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    return (Layer(split=attn + 3 * s.hidden * s.ffn, replicated=norms, experts=0),
            Layer(split=attn, replicated=norms + s.experts * s.hidden, experts=s.experts * 3 * s.hidden * s.expert_ffn))


def total_parameters(s: Shape) -> int:
    dense, sparse = layers(s)
    per = [(s.layers - s.sparse_layers, dense), (s.sparse_layers, sparse)]
    return (sum(n * (x.split + x.replicated + x.experts) for n, x in per) + s.vocab * s.hidden * (1 if s.tied else 2)
            + s.hidden)


def rank_parameters(s: Shape, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters on the fullest rank: a pipeline stage's share of the layers (the sparse
    ones in proportion) and the embedding on the first stage, the output layer and final norm on the last
    (with tied embeddings and pp > 1 the last stage holds a copy of the embedding, as megatron does)."""
    dense, sparse = layers(s)
    n_sparse, n_dense = s.sparse_layers / pp, (s.layers - s.sparse_layers) / pp
    body = n_dense * (dense.split / tp + dense.replicated) + n_sparse * (sparse.split / tp + sparse.replicated)
    experts = n_sparse * sparse.experts / (ep * tp)
    emb = s.vocab * s.hidden / tp
    ends = emb * (1 if s.tied else 2) + s.hidden if pp == 1 else emb + s.hidden  # pp > 1: the last stage
    return body + ends, experts


def rank_bytes(s: Shape, dtype: str = "bf16", tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
               distributed_optimizer: bool = True, reference: bool = False) -> dict[str, float]:
    """Bytes on the fullest learner rank: weights (the learner's dtype), gradients (fp32), main copies
    (fp32, bf16 learners only), Adam (two fp32 moments), the reference model, and their total."""
    dense, experts = rank_parameters(s, tp, pp, ep)
    width = {"bf16": 2, "fp32": 4}[dtype]
    # the distributed optimizer splits main copies and moments over the ranks that hold the same slice:
    # dp for the dense parameters, dp / ep for the experts (megatron's expert data-parallel group)
    split_dense = dp if distributed_optimizer else 1
    split_experts = max(dp // ep, 1) if distributed_optimizer else 1
    held = dense / split_dense + experts / split_experts
    out = {"parameters": dense + experts, "weights": (dense + experts) * width, "gradients": (dense + experts) * 4.0,
           "main_fp32": held * 4.0 if dtype == "bf16" else 0.0, "adam": held * 8.0,
           "reference": (dense + experts) * width if reference else 0.0}
    out["total"] = sum(v for k, v in out.items() if k != "parameters")
    return out


# ---------------------------------------------------------------- activations


def activation_layout(s: Shape, seq: int, dtype: str = "bf16", tp: int = 1) -> tuple[float, float, float]:
    """Bytes one token keeps for the backward in (a dense layer, a sparse layer, the model's ends), on one tp
    rank, as the learner's megatron layers keep them: the local layer spec (no TransformerEngine, on CPU and
    GPU alike: connectors/megatron/model.py), no activation recompute, no sequence parallel. Counted from the
    tensors autograd saves (tests/test_learner_memory.py counts them in a forward of each model_kit preset,
    fp32 and bf16, and checks this against it); `seq` the micro-batch's padded length; w the dtype's width:
      each layer: its two norms' input and normalised input and 1/rms in fp32 (the norms compute in fp32)
      and the linear layer's input after each (2 x (8 h + 4 + w h)); rotary's cos and sin for q and k
      (4 head_dim); q, k and v as the unfused attention multiplies them (GQA's k and v expanded to every
      query head) and the attention's output (4 q); its probabilities, heads x seq, in fp32 and in bf16
      again for the product (the term flash attention would not keep); Qwen3's q/k norms (fp32); a dense
      MLP: fc1's output and the gated activation's three (5 ffn); a sparse one: per routed expert the
      token's copy, fc1's output and the activation's, the weighted output and the gate (2 h + 5 expert_ffn
      + 1), and the router's choices (20 bytes per choice + (1 + w) per expert);
      the ends: the final norm (8 h + 4) and the token ids (int64)."""
    w = {"bf16": 2, "fp32": 4}[dtype]
    q, kv, heads, kvh = s.heads * s.head_dim / tp, s.kv_heads * s.head_dim / tp, s.heads / tp, s.kv_heads / tp
    attn = 2 * (8 * s.hidden + 4 + w * s.hidden) + w * (4 * s.head_dim + 4 * q) + heads * seq * (4 + (w if w < 4 else 0))
    if s.qk_norm:
        attn += 4 * (2 * q + 2 * kv + heads + kvh) + (4 * (q + kv) if w == 4 else 0)
    dense = attn + w * 5 * s.ffn / tp
    sparse = attn + s.top_k * (w * (2 * s.hidden + 5 * s.expert_ffn / tp + 1) + 20) + s.experts * (1 + w)
    return dense, sparse, 8 * s.hidden + 4 + 8


LOGPROB_CHUNKS = 3 * 64 * 2**20  # the log-probs' fp32 logit slabs alive at once (connectors/megatron/vocab_parallel.py)


def activation_bytes(s: Shape, dtype: str, tokens: int, seq: int, tp: int = 1, pp: int = 1) -> dict[str, float]:
    """Bytes of activations on the fullest learner rank in a training step: `tokens` per micro-batch (padded,
    `seq` the longest), each kept as `activation_layout` counts, for the first stage's share of the layers and
    as many micro-batches as 1F1B keeps in flight there (pp), plus the log-probs' logit slabs."""
    dense, sparse, ends = activation_layout(s, seq, dtype, tp)
    # + the causal mask, one [seq, seq] bool a micro-batch: at most seq bytes a token (a micro-batch of one row)
    per_token = ((s.layers - s.sparse_layers) * dense + s.sparse_layers * sparse) / pp + ends + seq
    return {"per_token": per_token, "in_flight": float(pp), "activations": per_token * tokens * pp,
            "logprob_chunks": float(LOGPROB_CHUNKS)}
