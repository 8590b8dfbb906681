"""LoRA adapters on megatron-core's linear layers, keeping their tensor-parallel split
(recipe learner.lora; names and the PEFT form in streamrl/core/lora.py; docs/lora.md).

Each adapted layer y = W x gets y + s B A x (s = alpha / r; A [r, in], B [out, r], B = 0 at the
start, so the adapted model starts as the base). The adapter is an `Adapter` module registered
beside the layer (`self_attention.linear_qkv_lora`), its output added by a forward hook on the
layer, so the layer itself, its name and mbridge's weight mapping stay as they are.

Tensor parallelism (x is replicated over the TP ranks: no sequence parallel):
- column-parallel (linear_qkv, linear_fc1: each rank holds rows of W): A whole on every rank, B
  split by rows like W. h = A x is the same on every rank; its gradient is the sum over the
  ranks' B shards, so h passes megatron's copy-to-TP-region (identity forward, all-reduce of the
  gradient backward): A's gradient and x's come out whole and equal on every rank.
- row-parallel (linear_proj, linear_fc2: each rank holds columns of W and its shard of x; the
  layer all-reduces its output): A split by columns like W, B whole on every rank. A x is a
  partial sum per rank, all-reduced (reduce-from-TP-region: all-reduce forward, identity
  backward) before B; B's gradient is then whole and equal on every rank.
A's initial values come from a generator seeded by the run's seed and the layer, drawn whole and
then sliced, so every TP layout starts from the same adapter. Replicated halves carry megatron's
tensor_model_parallel = False, so the gradient norm counts them once.

Only adapter parameters require grad: megatron's DistributedDataParallel and optimizer take
what requires grad when they are built, so gradient buffers and Adam's state hold the adapters
alone (connectors/megatron/optimizer.py, built after `attach`). Checkpoints hold the adapters as
sharded tensors of their own (`Adapter.sharded_state_dict`: B of a column layer split by rows,
A of a row layer by columns; linear_fc1's B with megatron's gate/up factory like its weight), so
they load across TP layouts. The publishing forms: `merged` (W + s B A in place of each W while
mbridge exports the HF weights: a full push, the HF export) and `adapter_state` (PEFT tensors:
the version push to engines, RUN_DIR/adapter, which `streamrl model merge-lora` merges into a base).

megatron-core is imported inside the functions, as in the other modules of this package: the
driver process imports the learner's modules without paying megatron's 5 s import.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from streamrl.core import lora as names

SUFFIX = "_lora"  # the adapter of layer `linear_qkv` is the module `linear_qkv_lora` beside it


class Adapter(nn.Module):
    """A ([r, in] or its column shard) and B ([out, r] or its row shard) of one linear layer."""

    def __init__(self, kind: str, layer: str, layer_number: int, in_features: int, out_features: int, rank: int,
                 alpha: float, dropout: float, gated: bool, seed: int, dtype: torch.dtype, device: Any) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        super().__init__()
        self.kind, self.layer, self.layer_number, self.gated = kind, layer, layer_number, gated
        self.rank, self.scale = rank, names.scaling(rank, alpha)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        # peft's default: A ~ kaiming-uniform (a = sqrt(5): bound 1/sqrt(in)), B = 0; drawn whole, then sliced
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_number * 31 + list(names.FUSED).index(layer))
        a = (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) / math.sqrt(in_features)
        if kind == "row":
            a = a.chunk(tp, dim=1)[tp_rank]
        rows = out_features // tp if kind == "column" else out_features
        self.A = nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
        self.B = nn.Parameter(torch.zeros(rows, rank, dtype=dtype, device=device))
        split, whole = (self.B, self.A) if kind == "column" else (self.A, self.B)
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """s B A x for this rank's part of the layer's output (module doc)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        h = nn.functional.linear(self.drop(x), self.A)
        h = copy_to_tensor_model_parallel_region(h) if self.kind == "column" else \
            reduce_from_tensor_model_parallel_region(h)
        return nn.functional.linear(h, self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """s B A in the layer weight's (shard) shape, fp32."""
        return self.scale * (self.B.detach().float() @ self.A.detach().float())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = {"A": self.A, "B": self.B}
        axis = {"B": 0} if self.kind == "column" else {"A": 1}
        out = make_sharded_tensors_for_checkpoint(sd, prefix, axis, sharded_offsets)  # megatron's TP/DP groups
        if self.gated:  # [gate shard; up shard] per rank, as linear_fc1.weight: megatron's factory stores it whole
            out[f"{prefix}B"] = apply_swiglu_sharded_factory(out[f"{prefix}B"], sharded_offsets)
        return out


def _hook(adapter: Adapter) -> Any:
    def hook(_module: Any, args: tuple[Any, ...], out: Any) -> Any:
        return (out[0] + adapter(args[0]), *out[1:])  # megatron's linears return (output, bias)
    return hook


def attach(model: Any, rank: int, alpha: float, dropout: float, layers: list[str], seed: int = 0) -> list[Adapter]:
    """Put an adapter on every decoder layer's `layers` (megatron names) of `model` (this
    pipeline stage's), freeze everything else; returns the adapters."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = model.config
    tp = mpu.get_tensor_model_parallel_world_size()
    if cfg.sequence_parallel:
        raise ValueError("LoRA needs the layers' input whole on every TP rank: sequence parallel is not supported")
    adapters = []
    for tl in model.decoder.layers:
        for name in layers:
            parent = tl.self_attention if name in names.ATTENTION else tl.mlp
            lin = getattr(parent, name, None)
            if isinstance(lin, RowParallelLinear):
                kind = "row"
            elif isinstance(lin, ColumnParallelLinear) and not hasattr(lin, "layer_norm_weight"):
                kind = "column"
            else:  # MoE experts have no mlp.linear_fc1; TE's layer-norm-fused linears take the un-normed input
                raise ValueError(f"decoder layer {tl.layer_number}: {name} is {type(lin).__name__}, "
                                 "not a plain megatron column/row-parallel linear LoRA can adapt")
            out_local, in_local = lin.weight.shape
            a = Adapter(kind, name, tl.layer_number, in_local * tp if kind == "row" else in_local,
                        out_local * tp if kind == "column" else out_local, rank, alpha, dropout,
                        gated=name == "linear_fc1" and cfg.gated_linear_unit, seed=seed,
                        dtype=lin.weight.dtype, device=lin.weight.device)
            parent.add_module(name + SUFFIX, a)
            lin.register_forward_hook(_hook(a))
            a.base = [lin]  # a list: not a submodule (the layer is its parent's)
            adapters.append(a)
    own = {id(p) for a in adapters for p in a.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in own)
    return adapters


@contextlib.contextmanager
def detached(model: Any) -> Iterator[None]:
    """Take the adapters out of the module tree for a while: mbridge maps every named parameter
    of the model to an HF name and knows none of theirs."""
    taken = []
    for m in model.modules():
        for k, child in list(m._modules.items()):
            if isinstance(child, Adapter):
                taken.append((m, k, child))
                del m._modules[k]
    try:
        yield
    finally:
        for m, k, child in taken:
            m._modules[k] = child


@contextlib.contextmanager
def merged(model: Any, adapters: list[Adapter]) -> Iterator[None]:
    """Each adapted weight W reads W + s B A (this rank's shard of it, in W's dtype) and the
    adapters are out of the module tree; afterwards W is exactly the tensor it was."""
    saved = []
    try:
        with torch.no_grad():
            for a in adapters:
                w = a.base[0].weight
                saved.append((w, w.data))
                w.data = (w.data.float() + a.delta()).to(w.dtype)
        with detached(model):
            yield
    finally:
        for w, data in saved:
            w.data = data


def merged_weights(model: Any, adapters: list[Adapter], weights: Iterator[Any]) -> Iterator[Any]:
    """`weights` (an mbridge export of `model`, not yet started) taken while `merged`."""
    with merged(model, adapters):
        yield from weights


def base_weights(model: Any, weights: Iterator[Any]) -> Iterator[Any]:
    """`weights` (an mbridge export of `model`, not yet started) of the base alone: the adapters
    out of the module tree, W as it is."""
    with detached(model):
        yield from weights


def _gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Every TP rank's `t` (collective over the tensor-parallel group)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _split_rows(a: Adapter, b: torch.Tensor, shards: int, hf: Any) -> list[torch.Tensor]:
    """Whole B of a fused layer (TP shards concatenated) -> B of each HF module, in FUSED order."""
    if a.layer == "linear_qkv":
        groups, heads = hf.num_key_value_heads, hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        per = b.view(groups, -1, b.shape[-1])  # megatron: per query group, its q heads, then k, then v
        q_len = head_dim * heads // groups
        return [per[:, :q_len].reshape(-1, b.shape[-1]), per[:, q_len:q_len + head_dim].reshape(-1, b.shape[-1]),
                per[:, q_len + head_dim:].reshape(-1, b.shape[-1])]
    if a.layer == "linear_fc1" and a.gated:  # each shard is [gate part; up part]
        parts = [s.chunk(2) for s in b.chunk(shards)]
        return [torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])]
    return [b]


def adapter_state(adapters: list[Adapter], hf_config: Any) -> dict[str, torch.Tensor]:
    """The adapters as PEFT tensors (HF module names, whole matrices, the model's dtype) on
    every rank; collective over the TP group. A fused layer's A is shared by its HF modules."""
    out: dict[str, torch.Tensor] = {}
    for a in adapters:
        with torch.no_grad():
            if a.kind == "column":
                shards = _gather(a.B.detach(), 0)
                A, Bs = a.A.detach(), _split_rows(a, torch.cat(shards), len(shards), hf_config)
            else:
                A, Bs = torch.cat(_gather(a.A.detach(), 1), dim=1), [a.B.detach()]
        for module, b in zip(names.FUSED[a.layer], Bs):
            out[names.peft_name(a.layer_number - 1, module, "A")] = A.to("cpu", copy=True)
            out[names.peft_name(a.layer_number - 1, module, "B")] = b.to("cpu", copy=True).contiguous()
    return out


def write_peft_dir(tensors: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str | Path) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), what peft's
    `save_pretrained` writes and SGLang's /load_lora_adapter reads; written beside and renamed into
    place, so a reader never sees half of it."""
    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
