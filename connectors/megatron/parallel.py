"""The megatron learner's parallel plumbing: process groups and megatron's parallel state,
Megatron's pipeline schedule around our forward and loss functions, and the gradient
reductions an optimizer step needs across tensor (TP), pipeline (PP) and data (DP) ranks.
Expert parallelism (EP, MoE models) lives inside DP: megatron's MoE layers exchange tokens over
the expert group and its DDP reduces expert gradients over the expert-data-parallel ranks.

Layout (megatron's order): ranks are grouped tp-fastest, then dp, then pp; world = tp * pp * dp.
- TP: the output layer is vocab-parallel; the log-probs are computed on each rank's shard with
  the softmax's max and sums all-reduced (vocab_parallel.py), so every TP rank computes the same
  loss and the gradient of a rank's shard is its slice.
- PP: `run_schedule` calls `get_forward_backward_func()` (1F1B for pp > 1, the plain loop for
  pp = 1) on this stage's GPTModel chunk. Only the last stage sees logits: it computes the loss
  and the log-probs, and `from_last_stage` hands tensors/numbers to the other stages so every
  rank takes the same decisions and reports the same metrics.
- DP: the batch is split by the learner; gradients are reduced by megatron's
  DistributedDataParallel and finalize_model_grads (connectors/megatron/optimizer.py), which also
  sums the gradients of tied embeddings over their two stages when pp > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from streamrl.connectors.megatron import cpu_shim
from streamrl.connectors.ports import LOOPBACK, tcp_store


def init_distributed(rank: int, world_size: int, tp: int = 1, pp: int = 1, seed: int = 0, *, ep: int = 1,
                     port: int = 0, listen_fd: int | None = None, host: str = LOOPBACK) -> None:
    """One learner rank: torch.distributed (gloo on CPU, NCCL on GPU), megatron parallel state
    with tensor parallel size `tp`, pipeline parallel size `pp` (data parallel = world_size /
    (tp * pp)), CPU patches, seeds. The store is on `host` (connectors/ports.py; 127.0.0.1 unless the
    ranks span nodes: then the starter's node address, `network.bind: node`): rank 0 serves
    it on a socket it inherited (`listen_fd`, bound to `port` by whoever started the ranks) or,
    given no port, on one of its own; otherwise every rank connects to `port` (a store the
    starter serves: the learner group's driver). `ep`: expert parallel size of a mixture-of-experts
    model, carved out of the data-parallel ranks as megatron does (each of ep ranks holds
    num_experts / ep experts, their tokens exchanged all-to-all); it must divide dp."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not a multiple of tp * pp = {tp} * {pp}")
    if ep < 1 or (world_size // (tp * pp)) % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the data-parallel size {world_size // (tp * pp)}")
    cpu_shim.apply()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = tcp_store(world_size, rank=rank, host=host, port=port, listen_fd=listen_fd,
                          serve=rank == 0 and (listen_fd is not None or not port))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_shim.seed_cpu(seed)


class Parallel:
    """This rank's place in the TP x PP x DP layout (from megatron's parallel state) and the
    collectives the learner needs. Every method is collective over the group it names."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as mpu

        self.tp, self.tp_group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()
        self.pp, self.pp_group = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_group()
        self.dp, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.dp_group = mpu.get_data_parallel_group()
        self.ep = mpu.get_expert_model_parallel_world_size()
        self.first_stage, self.last_stage = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        self.last_rank = mpu.get_pipeline_model_parallel_last_rank()  # global rank of our last stage
        self.rank = dist.get_rank()

    # ------------------------------------------------------------ forward

    def run_schedule(self, model: Any, batches: Sequence[Any], step: Callable[[Any, int], tuple[Any, Any]],
                     forward_only: bool) -> list[Any]:
        """Megatron's forward-backward schedule over `batches` (micro-batches with `.ids` [B, T];
        their lengths may differ). `step(chunk, i)` runs the chunk on micro-batch i and returns
        (output, loss_fn): on the last
        stage `loss_fn(output)` gives (loss, metrics) and the loss is back-propagated as it is
        (each loss is already weighted by its share of the step: the model config's
        `calculate_per_token_loss` keeps the schedule from dividing it by the number of
        micro-batches); with loss_fn None the output itself is collected.
        Returns, on the last stage, what was collected per micro-batch in order; elsewhere []."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(batches)
        if n == 0:
            return []

        def forward_step(data_iterator: Any, chunk: Any) -> tuple[Any, Any]:
            out, loss_fn = step(chunk, next(data_iterator))
            if loss_fn is None:
                return out, None

            def undivided(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                loss, metrics = loss_fn(output)
                return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

            return out, undivided

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(n)), model=[model], num_microbatches=n,
            seq_length=max(int(b.ids.shape[1]) for b in batches), micro_batch_size=max(int(b.ids.shape[0]) for b in batches),
            forward_only=forward_only)

    def from_last_stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The last stage's `tensors` on every stage of this pipeline (other stages pass
        tensors of the same shapes and dtype, e.g. zeros): one flat broadcast."""
        if self.pp == 1 or not tensors:
            return list(tensors)
        flat = _flatten_dense_tensors([t.contiguous() for t in tensors])
        dist.broadcast(flat, src=self.last_rank, group=self.pp_group)
        return list(_unflatten_dense_tensors(flat, list(tensors)))

    def floats_from_last_stage(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        return [float(x) for x in self.from_last_stage([t])[0]]

    # ------------------------------------------------------------ data parallel numbers

    def _device(self) -> Any:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def dp_sum(self, x: float) -> float:
        return self._dp_reduce(x, "sum")

    def dp_max(self, x: float) -> float:
        return self._dp_reduce(x, "max")

    def world_sum(self, xs: Sequence[float]) -> list[float]:
        """Each value summed over every rank of the world."""
        if dist.get_world_size() == 1:
            return list(xs)
        t = torch.tensor(list(xs), dtype=torch.float64, device=self._device())
        dist.all_reduce(t)
        return t.tolist()

    def _dp_reduce(self, x: float, op: str) -> float:
        if self.dp == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
        return float(t)
