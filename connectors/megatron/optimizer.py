"""The learner's optimizer: megatron's DistributedDataParallel around the model and megatron's
optimizer (`get_megatron_optimizer`: Adam), with the distributed optimizer (ZeRO-1: each
data-parallel rank keeps and updates only its slice of Adam's moments, gradients are
reduce-scattered and parameters all-gathered) when there is more than one DP rank.

A bf16 model (learner.dtype bf16) trains in megatron's mixed precision: the optimizer keeps fp32
main copies of the bf16 parameters (`Float16OptimizerWithFloat16Params`, or the distributed
optimizer's fp32 shards), Adam updates those and copies them back to the model; gradients are
accumulated and reduced in fp32 (`grad_reduce_in_fp32`). Without loss scaling: bf16 has fp32's range.

- Losses come pre-weighted by their share of the whole step over all ranks, so DDP sums
  gradients over DP instead of averaging them (`calculate_per_token_loss`, set on the model
  config by mcore_model.make_bridge; the schedule then leaves each loss undivided).
- `finish_grads` reduces (DP; tied embeddings over the first and last pipeline stage, as
  megatron's finalize_model_grads does) and returns the global gradient norm; `step` clips to
  `grad_clip` and updates. A caller that finds the norm not finite calls `zero_grad` instead,
  and nothing moves (weights, moments, the warm-up position).
- LR: linear warm-up over `warmup_steps` optimizer steps, then constant (`last_epoch` counts the
  steps taken, as torch's LR schedulers do; `scheduler_state` / `load_scheduler_state`).
- `param_states` / `load_param_states`: Adam's moments per model parameter, in the parameter's
  own (tensor-parallel shard) shape whatever the data-parallel layout, so a checkpoint written
  with one layout loads with another (connectors/megatron/checkpoint.py). With the distributed
  optimizer each rank contributes its slice and the slices are summed over DP (collective).
  MoE expert parameters are a separate optimizer part (megatron's chained optimizer) sliced over the
  expert-data-parallel ranks (dp / ep): each parameter is assembled over its own part's group.
  In mixed precision they carry the fp32 main parameter too (`main_param`): the bf16 model
  weights alone would round away what Adam's small steps accumulated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

STATE_KEYS = ("exp_avg", "exp_avg_sq")
MAIN = "main_param"  # mixed precision: the fp32 copy of a bf16 parameter, kept with the moments


class Optimizer:
    def __init__(self, model: Any, lr: float, grad_clip: float, weight_decay: float = 0.0, warmup_steps: int = 0,
                 adam_eps: float = 1e-8, distributed: bool = True) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        assert model.config.calculate_per_token_loss, "the model config must sum gradients over DP (make_bridge)"
        self.dp, self.dp_group = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group()
        self.distributed = distributed and self.dp > 1
        self.model = model
        self.ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.distributed), model)
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.999, adam_eps=adam_eps,
            clip_grad=grad_clip, use_distributed_optimizer=self.distributed, bf16=model.config.bf16, fp16=False),
            [self.ddp])
        self.parts = list(getattr(self.opt, "chained_optimizers", [self.opt]))
        self.grad_clip, self.base_lr, self.warmup_steps = grad_clip, lr, warmup_steps
        self.last_epoch = 0
        self._owner = {p: part for part in self.parts for p in _model_params(part)}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._set_lr()

    # ------------------------------------------------------------ steps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.optimizer.param_groups]

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def _set_lr(self) -> None:
        scale = min(1.0, (self.last_epoch + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        self.set_lr(self.base_lr * scale)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def finish_grads(self) -> float:
        """Reduce this step's gradients over the ranks that share them; the global L2 norm."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        self.opt.prepare_grads()
        return float(self.opt.get_grad_norm())

    def step(self, norm: float) -> None:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in self.parts:
            params = part.get_parameters()
            if params and self.grad_clip > 0:
                clip_grad_by_total_norm_fp32(params, max_norm=self.grad_clip, total_norm=norm)
        self.opt.step_with_ready_grads()
        self.zero_grad()
        self.last_epoch += 1
        self._set_lr()

    def reset(self, lr: float) -> None:
        """Forget Adam's moments and the warm-up position; `lr` becomes the base LR."""
        for part in self.parts:
            part.optimizer.state.clear()
        self.base_lr, self.last_epoch = lr, 0
        self._set_lr()

    # ------------------------------------------------------------ state

    def scheduler_state(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lrs": [self.base_lr]}

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.base_lr = float(state.get("base_lrs", [self.base_lr])[0])
        self._set_lr()

    def _slot(self, p: torch.nn.Parameter) -> tuple[Any, slice | None]:
        """(the inner torch optimizer's parameter holding p's state or None, the slice of p's
        flattened elements it covers; None = all of p)."""
        part = self._owner[p]
        if not self.distributed:
            return getattr(p, "main_param", p), None  # bf16: Adam's state is keyed by the fp32 main copy
        if p not in part.model_param_group_index_map:  # no element of p on this DP rank
            return None, None
        gi, go = part.model_param_group_index_map[p]
        r = part._get_model_param_range_map(p)["param"]
        return part.optimizer.param_groups[gi]["params"][go], slice(r.start, r.end)

    def _local_step(self) -> float | None:
        steps = {float(s["step"]) for part in self.parts for s in part.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer parameters are at different steps {sorted(steps)}")
        return steps.pop() if steps else None

    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """{model parameter: {exp_avg, exp_avg_sq}} in the parameter's shape (collective over DP
        with the distributed optimizer); empty before the first step."""
        if self.step_count() is None:
            return {}
        keys = self.state_keys()
        out = {}
        for p in self.params:
            slot, sl = self._slot(p)
            state = self._owner[p].optimizer.state.get(slot, {}) if slot is not None else {}
            if slot is not None:
                state = {**state, MAIN: slot.detach()}
            if sl is None and slot is not None:
                out[p] = {k: state[k].detach().clone() for k in keys}
                continue
            flat = torch.zeros(len(keys), p.numel(), dtype=torch.float32, device=p.device)
            for i, k in enumerate(keys):
                if k in state:
                    flat[i, sl] = state[k]
            # the slices are disjoint: a sum assembles them (over the expert-data-parallel ranks for MoE experts)
            dist.all_reduce(flat, group=self._owner[p].data_parallel_group)
            out[p] = {k: flat[i].view(p.shape) for i, k in enumerate(keys)}
        return out

    def state_keys(self) -> list[str]:
        """What `param_states` holds per parameter."""
        return [*STATE_KEYS, MAIN] if self.model.config.bf16 else list(STATE_KEYS)

    def load_param_states(self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: float | None) -> None:
        """Replace Adam's state with `states` (each parameter's whole tensors; this rank keeps
        its slice) at Adam step `step`; None = no state (a checkpoint from before any step)."""
        for part in self.parts:
            part.optimizer.state.clear()
        self.reload_main_params()  # from the weights just loaded, unless `states` has the fp32 ones
        if step is None:
            return
        for p in self.params:
            slot, sl = self._slot(p)
            if slot is None:
                continue
            s = {k: (v.reshape(-1)[sl] if sl is not None else v).to(slot) for k, v in states[p].items()}
            self._owner[p].optimizer.state[slot] = {
                "step": torch.tensor(float(step), dtype=torch.float32), **{k: s[k].clone() for k in STATE_KEYS}}
            if MAIN in s:  # saved in mixed precision: more exact than the bf16 weights (into fp32 ones too)
                with torch.no_grad():
                    slot.copy_(s[MAIN].view_as(slot))

    def step_count(self) -> float | None:
        """Adam's step (bias correction), common to all parameters; None before the first step.
        Collective over DP with the distributed optimizer (a rank may own no element at all)."""
        step = self._local_step()
        if not self.distributed:
            return step
        t = torch.tensor([-1.0 if step is None else step], dtype=torch.float64, device=self.params[0].device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return None if float(t) < 0 else float(t)

    def main_params(self) -> list[torch.Tensor]:
        """The fp32 copies Adam updates in mixed precision (all of them or this DP rank's shards);
        empty when the model itself is fp32."""
        if not self.model.config.bf16:
            return []
        return [p for part in self.parts for g in part.optimizer.param_groups for p in g["params"]]

    def reload_main_params(self) -> None:
        """After the model's weights were replaced (a checkpoint loaded): the fp32 main copies from them."""
        if self.model.config.bf16:
            for part in self.parts:
                part.reload_model_params()

    def state_bytes(self) -> int:
        """Bytes of this rank's parameters, fp32 main copies and optimizer state (what parallelism divides)."""
        tensors = [*self.params, *self.main_params(),
                   *(t for part in self.parts for s in part.optimizer.state.values()
                     for k, t in s.items() if torch.is_tensor(t) and k != "step")]
        return sum(t.numel() * t.element_size() for t in tensors)


def _model_params(part: Any) -> list[torch.nn.Parameter]:
    """The model parameters one of megatron's optimizers steps (the distributed optimizer's inner
    optimizer holds slices of them instead)."""
    if hasattr(part, "model_param_group_index_map"):  # its buffers': MoE experts have a part of their own
        return [p for buf in part.buffers for p in buf.params]
    if hasattr(part, "float16_groups"):  # mixed precision: the inner optimizer holds fp32 main copies
        return [p for groups in (part.float16_groups, part.fp32_from_fp32_groups) for g in groups for p in g]
    return [p for g in part.optimizer.param_groups for p in g["params"]]
