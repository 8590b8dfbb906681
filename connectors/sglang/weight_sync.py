"""Weight transfer over a torch.distributed process group of its own (gloo on CPU, NCCL on
GPU), as SGLang's `/init_weights_update_group` + `/update_weights_from_distributed` do:
the trainer is rank 0 and broadcasts, each engine TP rank joins as `rank_offset + tp_rank`
(streamrl/core/weight_group.py).

Tensors travel in buckets: SGLang's `load_format="flattened_bucket"` (0.5.23,
`FlattenedTensorBucket`), one broadcast of the tensors' bytes laid end to end in the order
of `names`, instead of one broadcast per tensor (each costs a round of latency; the small
model has 40+ tensors). One `/update_weights_from_distributed` request per bucket; buckets
are capped in size because the receiver allocates a bucket's buffer whole.

The group lives on the store keys SGLang joins on. SGLang's `init_custom_process_group`
(srt/utils/common.py) wraps the rendezvous store in `PrefixStore(group_name)` and hands it to
torch's `_new_process_group_helper`, which adds `{group_name}/` and then `{device}/` (`cpu/` for
gloo, `cuda/` for NCCL) before the backend's own keys; slime's trainer side runs the same code.
`group_store` builds that same chain and `_group` the backend on it, without the helper: the
helper registers each group by name in a per-process registry, so one process could hold one
rank of a group, while the embedded engine stands for several TP ranks in one process and tests
put both sides in one. tests/test_weight_group_sglang.py joins SGLang's own function (from the
sglang wheel) to ours, both ways. The trainer opens the store first (`open_store`: a port the
kernel chose) and tells the engines its port; neither side needs a default process group.

Failures. The group's timeout (`timeout_s`, recipe `engines.push_timeout_s`) bounds each operation:
the rendezvous and each bucket. The sender waits for each bucket to arrive before it sends the next
(on NCCL too, where a collective's timeout runs from when it is queued: queuing a 30B model's ~120
buckets at once would time out the last ones however well they moved), so a push of any size passes
while each bucket moves. A bucket that fails raises `PushFailed` naming it; the sender then drops its
end of the group (`WeightSource.push_weights`), which closes its connections, and every engine still
waiting in that group's broadcast fails at once instead of at its own timeout (gloo: "Connection
closed by peer"; SGLang answers the update with success false and keeps serving).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from streamrl.connectors.ports import tcp_store

BUCKET_FORMAT = "flattened_bucket"
BUCKET_BYTES = 512 * 1024**2  # an engine holds one bucket next to its weights while receiving
TIMEOUT_S = 600.0  # per operation (one bucket): long enough for a 512 MiB bucket over a slow link and its load


class PushFailed(RuntimeError):
    """A push stopped at `bucket` (0-based; the tensors' index when unbucketed)."""

    def __init__(self, bucket: int, cause: BaseException | str) -> None:
        self.bucket, self.reason = bucket, cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"bucket {bucket + 1}: {self.reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # Ray sends it back to the driver: rebuild it from its fields
        return PushFailed, (self.bucket, self.reason)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, dt: str) -> torch.dtype:
    if dt not in _DTYPES:
        raise ValueError(f"{name}: unsupported dtype {dt!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[dt]


def tensor_bytes(name: str, dt: str, shape: list[int]) -> int:
    """Bytes of an announced tensor (`name` for the error on an unsupported dtype)."""
    return math.prod(shape) * _dtype(name, dt).itemsize


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """`store` as a group named `group_name` sees it when SGLang joins it (module docstring)."""
    if not group_name:
        raise ValueError("group_name must not be empty (SGLang refuses it)")
    device = "cuda" if backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def _group(store: Any, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float) -> Any:
    keys = group_store(store, group_name, backend)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl" and torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(keys, rank, world_size, opts)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    return dist.ProcessGroupGloo(keys, rank, world_size, timeout)


def open_store(world_size: int, host: str = "127.0.0.1", timeout_s: float = TIMEOUT_S) -> Any:
    """Trainer side, first: the group's TCPStore on `host`, on a port the kernel chose
    (`store.port`, which the engines are told); connectors/ports.py."""
    return tcp_store(world_size, host=host, timeout_s=timeout_s)


def create_group(store: Any, world_size: int, group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = TIMEOUT_S) -> Any:
    """Trainer side: rank 0 of the group over `open_store`'s store (blocks until every rank has joined)."""
    return _group(store, 0, world_size, group_name, backend, timeout_s)


def join_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
               group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = TIMEOUT_S) -> Any:
    """Engine side: join as rank `rank_offset` (blocks until every rank has joined)."""
    store = tcp_store(world_size, rank=rank_offset, host=master_address, port=master_port, timeout_s=timeout_s)
    return _group(store, rank_offset, world_size, group_name, backend, timeout_s)


def _from_rank0() -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


# ---------------------------------------------------------------- buckets


def _starts_bucket(size: int, n: int, item: int, max_bytes: int) -> bool:
    """Whether a tensor of `n` bytes (elements of `item` bytes) must open a new bucket after
    `size` bytes (> 0) in the current one: too large, or it would land unaligned (SGLang's
    receiver refuses unaligned tensors)."""
    return size + n > max_bytes or size % item != 0


def plan_buckets(dtypes: list[str], shapes: list[list[int]], max_bytes: int = BUCKET_BYTES) -> list[range]:
    """Split tensors (in order) into buckets of at most `max_bytes` (a larger tensor travels
    alone), as `buckets` cuts them: what the engines are told to expect."""
    out: list[range] = []
    start, size = 0, 0
    for i, (dt, shape) in enumerate(zip(dtypes, shapes)):
        n = tensor_bytes(f"tensor {i}", dt, shape)
        if i > start and _starts_bucket(size, n, _DTYPES[dt].itemsize, max_bytes):
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if len(dtypes) > start:
        out.append(range(start, len(dtypes)))
    return out


def buckets(tensors: Iterable[torch.Tensor], max_bytes: int = BUCKET_BYTES) -> Iterator[list[torch.Tensor]]:
    """The tensors in `plan_buckets`' buckets, each bucket as soon as it is complete: the learner
    gathers its weights one tensor at a time and holds one bucket of them, not the model."""
    part: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if part and _starts_bucket(size, n, t.element_size(), max_bytes):
            yield part
            part, size = [], 0
        part.append(t)
        size += n
    if part:
        yield part


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end (uint8), as SGLang's FlattenedTensorBucket lays them out;
    without a copy when they already lie so in one storage (`pack`)."""
    t0 = tensors[0]
    start, end = t0.data_ptr(), t0.data_ptr()
    packed = True
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
            packed = False
            break
        end += t.numel() * t.element_size()
    if packed:
        offset = start - t0.untyped_storage().data_ptr()
        return torch.empty(0, dtype=torch.uint8, device=t0.device).set_(t0.untyped_storage(), offset, (end - start,))
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def pack(state: dict[str, torch.Tensor], max_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """A copy of `state` laid out as `broadcast` sends it (one buffer per bucket, the tensors
    views into it), so the broadcast sends it without copying it again (benchmarks: the host
    copy the learner used to keep after every step, `learner_step.py --snapshot`)."""
    names, tensors = list(state), list(state.values())
    out: dict[str, torch.Tensor] = {}
    for b in plan_buckets([dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], max_bytes):
        part = [tensors[i] for i in b]
        buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in part])
        out |= unflatten(buf, names[b.start:b.stop], [dtype_name(t.dtype) for t in part], [list(t.shape) for t in part])
    return out


def unflatten(buf: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """Views into `buf` (uint8) for each announced tensor; raises when the layout does not fit."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: they must match")
    layout, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = _dtype(name, dt)
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not aligned to {dt} ({dtype.itemsize} bytes)")
        n = math.prod(shape) * dtype.itemsize
        layout.append((name, dtype, shape, offset, n))
        offset += n
    if offset != buf.numel():
        raise ValueError(f"the bucket has {buf.numel()} bytes but names/dtypes/shapes describe {offset}")
    return {name: buf[o: o + n].view(dtype).view(shape) for name, dtype, shape, o, n in layout}


# ---------------------------------------------------------------- transfer


def broadcast(group: Any, tensors: Iterable[torch.Tensor], bucketed: bool = False,
              max_bytes: int = BUCKET_BYTES) -> None:
    """Trainer side: send the tensors to every engine, in the order of the names sent over HTTP,
    as they come (the learner gathers them one at a time): one broadcast each (SGLang's default
    load_format) or, `bucketed`, one per `plan_buckets` bucket (the receivers were sent
    load_format BUCKET_FORMAT). Sender and receivers must agree: gloo aborts the process on a
    size mismatch. An NCCL group sends device memory, gloo host memory: a bucket moves over
    when it is on the other side. Each bucket has arrived before the next is sent (module doc).
    Raises `PushFailed` naming the bucket that failed."""
    nccl = isinstance(group, getattr(dist, "ProcessGroupNCCL", ()))
    device = "cuda" if nccl else "cpu"
    parts = buckets(tensors, max_bytes) if bucketed else ([t] for t in tensors)
    for k, part in enumerate(parts):
        buf = flatten(part).to(device) if bucketed else part[0].contiguous().to(device)
        try:
            group.broadcast([buf], _from_rank0()).wait()
            if nccl:  # wait() only orders the stream: the host waits, so the next bucket is queued after
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses of their own
            raise PushFailed(k, e) from None


def receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
            load_format: str | None = None, buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors announced by `names/dtypes/shapes`: one broadcast each,
    or (load_format BUCKET_FORMAT) one broadcast of them all, into `buf` (uint8, resized to fit;
    reusing one saves faulting in fresh pages on every update) or a new buffer. The tensors
    returned are views into it: done with them before `buf` is used again. They land on `buf`'s
    device (the engine's), else the GPU when there is one."""
    device = buf.device if buf is not None else "cuda" if torch.cuda.is_available() else "cpu"
    if load_format == BUCKET_FORMAT:
        total = sum(tensor_bytes(n, d, s) for n, d, s in zip(names, dtypes, shapes))
        buf = torch.empty(total, dtype=torch.uint8, device=device) if buf is None else buf.resize_(total)
        views = unflatten(buf, names, dtypes, shapes)  # checks the layout before anything is received
        group.broadcast([buf], _from_rank0()).wait()
        return views
    if load_format is not None:
        raise ValueError(f"load_format {load_format!r} is not supported (None or {BUCKET_FORMAT!r})")
    out = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=_dtype(name, dt), device=device)
        group.broadcast([t], _from_rank0()).wait()
        out[name] = t
    return out
