"""The learner's state as megatron `dist_checkpointing` sharded state: model parameters and
Adam moments as ShardedTensors with each parameter's global shape and offset, so a state
saved with one tensor/pipeline/data-parallel layout loads into another. Used by
connectors/megatron/checkpoint.py, which owns the directory protocol around it.

- Model: `model.sharded_state_dict()` (megatron GPTModel: keys carry global layer numbers,
  TP shards their offsets, replicas a `replica_id`, so one rank writes each shard). A plain
  torch module has no sharding: its tensors are saved whole, by rank 0.
- Optimizer: Adam's `exp_avg` / `exp_avg_sq` of a parameter (whole, however the distributed
  optimizer slices them over data-parallel ranks: connectors/megatron/optimizer.py) get that
  parameter's sharding, under megatron's key names (`optimizer.state.<key>.<parameter key>`);
  `step` is common (Adam steps all parameters together), as in megatron's own optimizer.
  The optimizer's hyper-parameters are saved for the record and come from the recipe on load.
- `_extra_state` ShardedObjects are left out: the local (non-TE) layers keep None there, and
  torch_dist would store objects as pickles that load with `torch.load(weights_only=False)`.
  A non-empty one (TransformerEngine FP8 metadata) is refused at save time.
- Writing: megatron's torch_dist format through torch's synchronous `FileSystemWriter` (one
  `__<rank>_0.distcp` per rank, fsynced). Megatron's default writer forks writer processes,
  starts a spawn `multiprocessing.Manager`, and calls `torch.cuda.current_device()` when it
  finalises, which fails without CUDA; the synchronous one writes the same format in-process.
- Reading: torch.distributed.checkpoint reads its `.metadata` with `pickle.load`.
  `check_dcp_metadata` reads it first with an unpickler that admits only the classes DCP's
  metadata is made of (no callables), and refuses BytesStorage entries (DCP loads those with
  `torch.load(weights_only=False)`); megatron's `common.pt` is checked with
  `torch.load(weights_only=True)`. So a tampered (and re-signed) run directory cannot run
  code on load; the manifest's sha256 only catches accidental damage, as anyone able to
  write the files can rewrite the manifest too. (Megatron then reads the same files again: a
  process rewriting them during the load is outside this guard.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import pickle
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OPT_PREFIX = "optimizer.state"


def layout() -> dict[str, int]:
    """This process's place: world size, rank, and the tensor/pipeline/data/expert-parallel sizes."""
    if not (dist.is_available() and dist.is_initialized()):
        return {"world": 1, "rank": 0, "tp": 1, "pp": 1, "dp": 1, "ep": 1}
    out = {"world": dist.get_world_size(), "rank": dist.get_rank(), "tp": 1, "pp": 1, "dp": dist.get_world_size(), "ep": 1}
    try:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            out |= {"tp": mpu.get_tensor_model_parallel_world_size(),
                    "pp": mpu.get_pipeline_model_parallel_world_size(), "dp": mpu.get_data_parallel_world_size(),
                    "ep": mpu.get_expert_model_parallel_world_size()}
    except ImportError:
        pass
    return out


def _walk(d: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, Any]]:
    for k, v in list(d.items()):
        if isinstance(v, dict):
            yield from _walk(v)
        else:
            yield d, k, v


def model_sharded(model: torch.nn.Module) -> dict[str, Any]:
    """The model's sharded state dict (parameters themselves, not copies), objects removed."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if not hasattr(model, "sharded_state_dict"):
        rank = layout()["rank"]
        return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=rank)
                for k, v in model.state_dict(keep_vars=True).items()}
    sd = model.sharded_state_dict()
    for parent, k, v in _walk(sd):
        if isinstance(v, ShardedObject):
            if not _empty_extra_state(v.data):
                raise NotImplementedError(f"model state {k!r} holds a non-empty extra state (TransformerEngine "
                                          "FP8 metadata?): sharded checkpoints store tensors only")
            del parent[k]
    return sd


def _empty_extra_state(data: Any) -> bool:
    """None, nothing, or (older TransformerEngine without FP8) a torch.save of None."""
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
        if not raw:
            return True
        try:
            return torch.load(io.BytesIO(raw), weights_only=True) is None
        except Exception:  # noqa: BLE001 - anything else is real state
            return False
    return data is None or data == b""


def optimizer_common(opt: Any) -> dict[str, Any]:
    """What is the same on every rank: the common Adam `step` (None before the first), the
    state's tensor keys, and the param groups' hyper-parameters (without their parameters).
    Collective over DP with the distributed optimizer."""
    step = opt.step_count()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"step": step, "state_keys": opt.state_keys() if step is not None else [], "param_groups": groups}


def optimizer_sharded(opt: Any, model_sd: dict[str, Any], common: dict[str, Any],
                      template: bool = False) -> dict[int, dict[str, Any]]:
    """{param index: {state key: ShardedTensor}} with each parameter's sharding. `template`:
    fresh tensors to load into (the optimizer itself is not touched); else collective over DP
    with the distributed optimizer."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor)

    if not common["state_keys"]:
        return {}
    params = opt.params
    states = {} if template else opt.param_states()
    by_id = get_param_id_to_sharded_param_map(model_sd, params)
    out: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        if i not in by_id:
            raise ValueError(f"optimizer parameter {i} {tuple(p.shape)} is not in the model's sharded state")
        out[i] = {k: make_sharded_optimizer_tensor(by_id[i], torch.empty_like(p, dtype=torch.float32) if template
                                                   else states[p][k],
                                                   prefix=f"{OPT_PREFIX}.{k}")
                  for k in common["state_keys"]}
    return out


def detach_template(sd: dict[str, Any]) -> dict[str, Any]:
    """The same sharded state dict with fresh tensors in place of the model's parameters, so
    loading reads into them and leaves the model alone until everything is read."""

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for parent, k, v in _walk(sd):
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            parent[k] = dataclasses.replace(v, data=torch.empty_like(v.data))
    return sd


def load_optimizer(opt: Any, loaded: dict[Any, dict[str, torch.Tensor]], common: dict[str, Any]) -> None:
    """Give `opt` the moments read into `optimizer_sharded(..., template=True)`'s tensors."""
    opt.load_param_states({p: loaded[i] for i, p in enumerate(opt.params) if i in loaded}, common["step"])


def save_strategy() -> Any:
    """megatron's torch_dist save strategy, written synchronously in this process."""
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: Any) -> None:
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(sd, False),
                     storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1, sync_files=True),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return SyncTorchDistSave("torch_dist", 1)


# ---------------------------------------------------------------- safe reading of DCP metadata

_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                         "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension")
# Each only builds a value from its arguments: a size, a path (the checkpoint id), a layout by name.
_ALLOWED_GLOBALS = {("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and enums, torch sizes / dtypes / layouts / memory
    formats, and nothing that could run code (the restricted `find_class` of Python's pickle docs)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format))):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module in _DCP_METADATA_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def check_dcp_metadata(path: Path) -> None:
    """Read a torch.distributed.checkpoint `.metadata` without running code; raise ValueError
    for anything else than tensor metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    with open(path, "rb") as f:
        meta = _MetadataUnpickler(f).load()
    if not isinstance(meta, Metadata):
        raise ValueError(f"holds {type(meta).__name__}, not torch.distributed.checkpoint Metadata")
    objects = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if objects:
        raise ValueError(f"holds pickled objects {objects[:4]}, which this format never writes")


# ---------------------------------------------------------------- per-rank RNG


def rng_state() -> dict[str, Any]:
    """This process's RNGs: python, numpy, torch CPU (+ CUDA and megatron's tracker on GPU)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
        with contextlib.suppress(Exception):
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
            if all(isinstance(v, torch.Tensor) for v in tracker.values()):
                state["megatron_tracker"] = {k: v.cpu() for k, v in tracker.items()}
    return state


def set_rng_state(state: dict[str, Any], process_only: bool = False) -> None:
    """Restore `rng_state()`; `process_only`: the python / numpy / torch CPU generators alone
    (another rank's state, when the layout changed: device and model-parallel RNGs do not map)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if process_only or not torch.cuda.is_available() or "cuda" not in state:
        return
    cuda = state["cuda"]
    if len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    else:
        warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda)} devices, this process sees "
                      f"{torch.cuda.device_count()}: CUDA RNG not restored", stacklevel=3)
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
