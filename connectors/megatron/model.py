"""A megatron-core GPTModel from an HF checkpoint directory (Llama / Qwen2 / Qwen3 / Qwen3-MoE)
through mbridge, and its weights back under HF names (for the broadcaster and `save_pretrained`).

On CPU (no TransformerEngine) the model uses megatron's local layer spec, whose layernorms
are separate modules (`input_layernorm`, `pre_mlp_layernorm`) instead of TE's fused
`layer_norm_weight`s: `_local_spec` adds those names to the bridge's mappings. The model is
built with the bridge's own provider rather than `bridge.get_model`, which moves it to CUDA.

Mixture-of-experts on CPU: the local spec's experts are a `SequentialMLP` (one MLP per local
expert, `mlp.experts.local_experts.<i>.linear_fc1.weight`), as megatron's grouped GEMMs need
TransformerEngine or the CUDA-only grouped_gemm package. mbridge knows TE's `GroupedMLP` names
(`mlp.experts.linear_fc1.weight<i>`), and keys its expert-parallel scatter and gather on them:
`_local_spec` renames the one into the other when it maps megatron names, so loading, the
weight export (which all-gathers the expert shards of the expert-parallel group into global
expert ids) and the HF names are mbridge's. The expert tensor-parallel size is megatron's
default (= tp), so an expert shard splits like any other TP shard.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _grouped_name(name: str, offset: int = 0) -> str:
    """SequentialMLP's expert name -> GroupedMLP's (mbridge's), the expert id shifted by `offset`."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.{m[2]}.weight{int(m[1]) + offset}", name)


def _local_spec(cls: type) -> type:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    class LocalSpecBridge(cls):  # type: ignore[misc, valid-type]
        _OTHER_MAPPING = {**cls._OTHER_MAPPING,
                          "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
        _MLP_MAPPING = {**cls._MLP_MAPPING,
                        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}

        def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
            return get_gpt_layer_local_spec(num_experts=self.config.num_moe_experts, moe_grouped_gemm=False,
                                            normalization="RMSNorm", qk_layernorm=self.config.qk_layernorm)

        def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            offset = 0
            if consider_ep and self.mpu.ep_size > 1:
                offset = self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank
            return {k: _grouped_name(v, offset) for k, v in names.items()}

    LocalSpecBridge.__name__ = f"LocalSpec{cls.__name__}"
    return LocalSpecBridge


# Megatron's own defaults (TransformerConfig), not mbridge's (which turns load balancing off and
# takes the HF config's router_aux_loss_coef): recipe learner.moe overrides them.
MOE_DEFAULTS = {"load_balancing": "aux_loss", "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}


def make_bridge(model_dir: str | Path, dtype: torch.dtype = torch.float32, moe: dict[str, Any] | None = None) -> Any:
    """An mbridge Bridge for the directory's architecture (megatron parallel state must exist).
    `moe`: the router's load-balancing loss type and coefficients (MOE_DEFAULTS), MoE models only."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    if getattr(hf, "rope_theta", None) is None:  # transformers 5 keeps it in rope_parameters
        hf.rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    cls = _MODEL_REGISTRY[hf.model_type]
    if not _has_te():
        cls = _local_spec(cls)
    bridge = cls(hf, dtype=dtype)
    cfg = bridge.config
    cfg.params_dtype, cfg.bf16, cfg.fp16 = dtype, dtype == torch.bfloat16, dtype == torch.float16
    cfg.use_cpu_initialization = not torch.cuda.is_available()
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    if not _has_te():
        cfg.sequence_parallel = False  # mbridge turns it on with TP; it needs TE/Apex norms
        cfg.moe_grouped_gemm = False  # SequentialMLP experts (module doc)
        cfg.persist_layer_norm = False  # an Apex kernel; the MoE bridges ask for it
        cfg.bias_activation_fusion = False
    if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
        # megatron's fused softmax (taken in bf16/fp16 past 16 tokens) imports this Apex-built
        # extension unconditionally; without it, torch's softmax
        cfg.masked_softmax_fusion = False
    # Losses come weighted by their share of the whole step over all ranks: the schedule must not
    # divide them by the number of micro-batches, nor DDP average gradients over DP.
    cfg.calculate_per_token_loss = True
    if cfg.num_moe_experts:
        m = MOE_DEFAULTS | (moe or {})
        cfg.moe_router_load_balancing_type = m["load_balancing"]
        cfg.moe_aux_loss_coeff = m["aux_loss_coeff"]
        cfg.moe_z_loss_coeff = m["z_loss_coeff"] or None  # megatron: None = no z-loss
    cfg.variable_seq_lengths = True  # micro-batches are padded to their own longest row: pipeline
    # stages exchange each activation's shape before it (only pp > 1 sends anything)
    return bridge


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               moe: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(GPTModel with the directory's weights in `dtype`, bridge). Needs megatron's parallel state."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    bridge = make_bridge(model_dir, dtype, moe)
    model = bridge._model_provider([])(pre_process=mpu.is_pipeline_first_stage(),
                                       post_process=mpu.is_pipeline_last_stage())
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if p.dtype != dtype:  # the local spec's torch norms ignore params_dtype (TE's follow it): one dtype throughout
            p.data = p.data.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    bridge.load_weights([model], str(model_dir))
    return model, bridge


def hf_weights(model: Any, bridge: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's weights under HF names, one tensor at a time, on every rank: mbridge's
    export gathers TP shards and broadcasts each PP stage's tensors to the other stages, so every
    rank of the model-parallel group must take every item. A tensor is on the model's device in
    the model's dtype and may be the parameter itself (tp = 1): use it before the weights change.
    With tied embeddings and pp > 1 the last stage's copy of the embedding comes under the same HF
    name as the first stage's (equal values: their gradients are summed). Without grad: mbridge
    broadcasts the parameters themselves, an in-place op autograd refuses on a leaf that requires
    grad whenever the backend copies (gloo with CUDA tensors); no_grad around each step only, as
    the caller's code runs between them."""
    items = bridge.export_weights([model])
    while True:
        with torch.no_grad():
            item = next(items, None)
        if item is None:
            return
        yield item[0], item[1].detach()


def hf_state_dict(model: Any, bridge: Any) -> dict[str, torch.Tensor]:
    """`hf_weights` as a dict in host memory (a whole copy: tests, the HF export)."""
    return {name: t.to("cpu", copy=True) for name, t in hf_weights(model, bridge)}
