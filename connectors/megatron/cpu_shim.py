"""megatron-core 0.16 on a machine without CUDA: the few spots that hard-code the GPU.

Applied by `apply()` only when CUDA is absent (and, for start-up time rather than correctness,
`eager_fusions()` before megatron-core's first import), so the same learner code runs unpatched on
GPU. Each patch names the megatron-core function it covers; `tests/test_megatron_cpu.py`
fails loudly if an upgrade moves or changes them (the version is pinned below).

Covered (FACTS.md, "megatron-core 0.16.1 on CPU"):
- RoPE `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`;
- `utils.GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`;
- `transformer.utils.get_default_causal_mask` builds its mask with device="cuda" (used by the
  fused softmax when no mask is passed);
- the tensor-parallel RNG tracker reads `torch.cuda.get_rng_state`: seed with
  `seed_cpu(seed)` (a tracker that forks nothing; the RL learner uses no dropout).
Pipeline parallelism (`get_forward_backward_func` with pp > 1) adds:
- `pipeline_parallel.schedules` counts tokens in `torch.zeros(..., device="cuda")`;
- `pipeline_parallel.p2p_communication` allocates receive buffers and shape messages on
  `torch.cuda.current_device()` and calls `torch.cuda.synchronize()` after batched p2p;
- `LanguageModule.setup_embeddings_and_output_layer` moves the last stage's copy of tied
  embeddings with `.cuda()` before the all-reduce that initialises it (once, at build);
- mbridge's `broadcast_from_megatron_pp` (its weight export across stages) allocates the
  receiving tensor on `torch.cuda.current_device()`.
Megatron's DistributedDataParallel and optimizer (`get_megatron_optimizer`, the distributed
optimizer included; connectors/megatron/optimizer.py) add:
- `distributed.param_and_grad_buffer` allocates the parameter / gradient buffers on
  `torch.cuda.current_device()`; `optimizer.optimizer` and `optimizer.clip_grads` make flags
  and norms with `torch.tensor(..., device="cuda")`, as does `utils.local_multi_tensor_l2_norm`
  (the fallback when neither Apex nor TransformerEngine is installed);
- the optimizers accept only tensors whose `.type()` is `torch.cuda.FloatTensor` & co
  (`DistributedOptimizer._build_model_and_main_param_groups`, `clip_grad_by_total_norm_fp32`):
  inside those two calls a CPU tensor's `.type()` answers with the CUDA name.
Mixture-of-experts layers (the alltoall token dispatcher, the router, the experts) add:
- `moe.token_dispatcher` makes a `torch.cuda.Stream()` for its device-to-host copies of the
  split sizes and waits on it (`current_stream`, `torch.cuda.stream`): one CPU stream, no waits;
  its `maybe_move_tensor_to_cpu` turns the split sizes into numpy only when they were on a GPU;
- `moe.router` / `moe.experts` / `moe.moe_utils` create their aux-loss and bias tensors on
  `torch.cuda.current_device()` / "cuda";
- `tensor_parallel.mappings` allocates the all-gather / reduce-scatter outputs of the expert
  token exchange (`gather_from_sequence_parallel_region` & co) on `torch.cuda.current_device()`;
- `moe_utils.RouterGatingLinearFunction` reads `te_general_gemm`, which that module defines
  only when TransformerEngine imports (NameError without it): None, i.e. torch's mm.
The bf16 learner (learner.dtype bf16: megatron's mixed precision) adds:
- `Float16OptimizerWithFloat16Params.__init__` sorts parameters into bf16 ones (which get fp32
  main copies) and fp32 ones by `.type()` against the CUDA names, and refuses anything else: the
  same `.type()` answer inside that call (its `found_inf` flag is made by `optimizer.torch`, above).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from importlib.metadata import version
from typing import Any

import torch

PINNED = "0.16"  # the megatron-core minor these patches were written against
_applied = False


class _CpuStream:
    """A CUDA stream on the CPU: everything runs in order on one stream, so waits are no-ops and
    every stream is the same one."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> _CpuStream:  # an event on it is waited on with .synchronize()
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    __hash__ = object.__hash__


class _CpuCuda:
    """Stands in for `torch.cuda` inside a patched module: the "current device" is the CPU."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Nothing to wait for: CPU collectives complete before they return."""

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 (torch.cuda.Stream)
        return _CpuStream()

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def stream(s: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _torch_on_cpu() -> types.ModuleType:
    """A view of `torch` whose `.cuda.current_device()` is "cpu" (and whose tensor factories put
    a tensor asked for on "cuda" on the CPU), for module globals."""
    proxy = types.ModuleType("torch_on_cpu")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    proxy.cuda = _CpuCuda()  # type: ignore[attr-defined]

    def on_cpu(factory: Any) -> Any:
        def make(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
            return factory(*args, device="cpu" if str(device).startswith("cuda") else device, **kw)
        return make

    for name in ("zeros", "ones", "tensor", "empty", "full"):
        setattr(proxy, name, on_cpu(getattr(torch, name)))
    return proxy


class _TensorCudaIsCpu(torch.overrides.TorchFunctionMode):
    """`tensor.cuda()` returns the tensor itself and `tensor.type()` names the CUDA type. Active
    only around a patched call, never around a forward or backward (a mode sees every op)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not out.startswith("torch.cuda."):
            return out.replace("torch.", "torch.cuda.", 1)  # the type check megatron's optimizers make
        return out


def _cuda_is_cpu(fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _TensorCudaIsCpu():
            return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu converts to numpy only what it moves off a GPU; the
    alltoall dispatcher passes the result to all_to_all_single as split sizes, which must be a
    sequence of ints, not a tensor."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)  # True = masked, as megatron expects


def eager_fusions() -> None:
    """Before megatron-core is first imported, on a machine without CUDA: import it with its fusions
    left as plain functions. megatron.core.jit sets `jit_fuser = torch.compile` at import and about 20
    fusions are decorated with it, and the first decoration imports TorchDynamo and Inductor: about 1 s
    of every learner process's start-up here, for functions the CPU learner never calls (the model
    turns the fusions off; TORCH_LOGS=dynamo shows no frame traced in a step). megatron's own
    `disable_jit_fuser` comes too late: importing megatron.core.jit imports every decorated module.
    A no-op with CUDA, or when megatron-core was imported already."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _eager  # type: ignore[assignment] # what megatron.core.jit keeps as jit_fuser
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


def _eager(model: Any = None, **_: Any) -> Any:
    """torch.compile's signature, compiling nothing: `@torch.compile` and `@torch.compile(...)` alike."""
    return model if model is not None else (lambda fn: fn)


def check_version() -> str:
    v = version("megatron-core")
    if not v.startswith(PINNED + "."):
        raise RuntimeError(f"connectors/megatron/cpu_shim.py was written for megatron-core {PINNED}.x, found {v}: "
                           "re-check each patched spot (tests/test_megatron_cpu.py) and update PINNED")
    return v


def apply(force: bool = False) -> bool:
    """Patch megatron-core for CPU; a no-op when CUDA is present (unless `force`). Idempotent."""
    global _applied
    if _applied or (torch.cuda.is_available() and not force):
        return _applied
    check_version()
    import mbridge.core.util as mbridge_util
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.transformer.moe.experts as experts
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.router as router
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.utils as tutils
    import megatron.core.utils as mutils
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cpu_torch = _torch_on_cpu()
    rope.torch = cpu_torch  # get_emb: inv_freq.to(torch.cuda.current_device())
    mutils.torch = cpu_torch  # GlobalMemoryBuffer.get_tensor: torch.empty(device=current_device())
    tutils.get_default_causal_mask = _causal_mask_cpu
    fused_softmax.get_default_causal_mask = _causal_mask_cpu  # imported by name there
    schedules.torch = cpu_torch  # total_num_tokens = torch.zeros([], ..., device="cuda")
    p2p.torch = cpu_torch  # receive buffers on current_device(); synchronize() after batched p2p
    mbridge_util.torch = cpu_torch  # broadcast_from_megatron_pp: torch.empty(device=current_device())
    for moe_module in (token_dispatcher, router, experts, moe_utils, mappings):  # streams, current_device() (module doc)
        moe_module.torch = cpu_torch
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host  # imported by name there
    if not hasattr(moe_utils, "te_general_gemm"):  # the router's gemm tests it; set only when TE imports
        moe_utils.te_general_gemm = None
    LanguageModule.setup_embeddings_and_output_layer = _cuda_is_cpu(  # weight.data.cuda() (pp > 1, tied)
        LanguageModule.setup_embeddings_and_output_layer)
    _patch_ddp_and_optimizer(cpu_torch)
    _applied = True
    return True


def _patch_ddp_and_optimizer(cpu_torch: types.ModuleType) -> None:
    import megatron.core.distributed.finalize_model_grads as finalize
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer

    for module in (buffers, finalize, optimizer, clip_grads, distrib_optimizer):
        module.torch = cpu_torch  # type: ignore[attr-defined]
    build = distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups
    distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups = classmethod(  # type: ignore[method-assign]
        _cuda_is_cpu(build.__func__))
    # The mixed-precision optimizer (bf16 model, fp32 main params) checks each parameter's .type().
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _cuda_is_cpu(f16.__init__)  # type: ignore[method-assign]
    clip = _cuda_is_cpu(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there


def seed_cpu(seed: int) -> None:
    """Seed torch and install megatron's no-op RNG tracker (no CUDA RNG state exists here)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
