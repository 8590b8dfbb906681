"""Weight transfer over a torch.distributed process group of its own (gloo on CPU, NCCL on
GPU), as SGLang's `/init_weights_update_group` + `/update_weights_from_distributed` do:
the trainer is rank 0 and broadcasts each tensor; engine i joins as rank `rank_offset`.

The group is built from a TCPStore directly, so neither side needs (or disturbs) a default
process group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
           backend: str, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "nccl" and torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def join_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
               group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 60) -> Any:
    """Engine side: join as rank `rank_offset` (blocks until every rank has joined)."""
    return _group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s)


def create_group(master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 60) -> Any:
    """Trainer side: rank 0, hosting the store."""
    return _group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)


def _from_rank0() -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def broadcast(group: Any, tensors: list[torch.Tensor]) -> None:
    """Trainer side: send each tensor to every engine (same order as the names sent over HTTP)."""
    for t in tensors:
        group.broadcast([t.contiguous()], _from_rank0()).wait()


def receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors announced by `names/dtypes/shapes`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        if dt not in _DTYPES:
            raise ValueError(f"{name}: unsupported dtype {dt!r}")
        t = torch.empty(shape, dtype=_DTYPES[dt], device=device)
        group.broadcast([t], _from_rank0()).wait()
        out[name] = t
    return out
