"""The megatron-core learner: SFT and RL steps on a GPTModel built from an HF directory.

Optimizer: torch AdamW. Megatron's own optimizer needs DDP-wrapped models and, on CPU, a
device redirect plus a CPU grad-clip (FACTS.md); AdamW is element-wise, so it gives the
same update on tensor-parallel shards. Gradient clipping by global norm; LR schedule linear
warm-up then constant. Micro-batches hold whole groups and each micro-batch's loss is
weighted by its share of the aggregation unit (tokens, sequences or groups), so the step
equals one pass over the whole batch.

The caller sets up torch.distributed and megatron's parallel state (`init_single_process`
for one CPU process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrl.connectors.mcore_batch import TokenBatch, logprobs_and_entropy
from streamrl.core import algorithms as alg


def init_single_process(seed: int = 0) -> None:
    """torch.distributed (gloo, world size 1) + megatron parallel state + CPU patches."""
    init_distributed(rank=0, world_size=1, tp=1, seed=seed)


def init_distributed(rank: int, world_size: int, tp: int = 1, seed: int = 0, *, port: int = 0,
                     listen_fd: int | None = None) -> None:
    """One learner rank: torch.distributed (gloo on CPU, NCCL on GPU), megatron parallel state
    with tensor parallel size `tp` (data parallel = world_size / tp), CPU patches, seeds.
    The store is served by rank 0 on 127.0.0.1 (connectors/ports.py): on a socket it inherited
    (`listen_fd`, bound to `port` by whoever started the ranks) or, alone, on one of its own;
    the other ranks connect to `port`."""
    import torch.distributed as dist

    from streamrl.connectors import megatron_cpu
    from streamrl.connectors.ports import tcp_store

    megatron_cpu.apply()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = tcp_store(world_size, rank=rank, port=port, listen_fd=listen_fd)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        megatron_cpu.seed_cpu(seed)


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab shards of the logits. Every tensor-parallel rank then computes the same
    loss, so the gradient of a rank's own shard is just its slice (no reduction, which would
    count the loss once per rank)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(shard) for _ in range(ctx.size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


@dataclass
class RLConfig:
    """The objective; mirrors recipe `learner:` keys (streamrl/recipe.py LearnerCfg)."""

    loss_agg: str = "token"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    off_policy: str = "none"  # none | tis | decoupled
    tis_cap: float = 2.0
    temperature: float = 1.0  # rollout temperature: log-probs are of softmax(logits / T)

    @classmethod
    def from_recipe(cls, learner: Any, temperature: float) -> RLConfig:
        """From a recipe's `learner:` section (streamrl.recipe.LearnerCfg) and rollout temperature."""
        return cls(**{f: getattr(learner, f) for f in cls.__dataclass_fields__ if f != "temperature"},
                   temperature=temperature)


@dataclass
class Sample:
    """One learner row: prompt and response ids, rollout log-probs, advantage, group, mask."""

    prompt: Sequence[int]
    response: Sequence[int]
    advantage: float = 0.0
    rollout_logprobs: Sequence[float] | None = None
    group: int = 0
    loss_mask: Sequence[int] | None = None


class MegatronLearner:
    def __init__(self, model_dir: str | Path, lr: float = 1e-4, grad_clip: float = 1.0, weight_decay: float = 0.0,
                 warmup_steps: int = 0, micro_batch_size: int = 8, with_reference: bool = False) -> None:
        from streamrl.connectors.mcore_model import load_model

        self.model, self.bridge = load_model(model_dir)
        self.ref = load_model(model_dir)[0].eval() if with_reference else None
        if self.ref is not None:
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.version = 0  # +1 per optimizer step
        self.device = next(self.model.parameters()).device
        from megatron.core import parallel_state as mpu

        self.tp, self.tp_group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()
        self.dp, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.dp_group = mpu.get_data_parallel_group()

    # ------------------------------------------------------------ pieces

    def _forward(self, model: Any, batch: TokenBatch, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = model(batch.ids, batch.positions, batch.attn_mask)
        if self.tp > 1:  # the output layer is vocab-parallel: gather the full vocabulary
            logits = _GatherVocab.apply(logits, self.tp_group)
        return logprobs_and_entropy(logits, batch.ids, temperature, with_entropy)

    def _micro_batches(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        """Whole groups per micro-batch, about `micro_batch_size` rows each."""
        out: list[list[Sample]] = []
        for s in samples:
            new_group = not out or out[-1][-1].group != s.group
            if not out or (new_group and len(out[-1]) >= self.micro_batch_size):
                out.append([])
            out[-1].append(s)
        return out

    def _grad_norm_and_clip(self) -> float:
        """Global L2 norm over all ranks' gradients, then clip. Tensor-parallel shards are summed
        across the TP group; replicated parameters (norms) count once; after the DP all-reduce
        every data-parallel rank holds the same gradients."""
        import torch.distributed as dist

        grads = [p.grad for p in self.params if p.grad is not None]
        if self.dp > 1:
            for g in grads:
                dist.all_reduce(g, group=self.dp_group)  # losses are pre-weighted: a sum is the full-batch grad
        # On the parameters' device: NCCL reduces device tensors only, and one sync at the end
        # beats a host copy per parameter.
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        norm = float((sharded + replicated).sqrt())
        coef = self.grad_clip / (norm + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return norm

    def _shard(self, items: Sequence[Any], key: Any) -> list[Any]:
        """This data-parallel rank's share: whole groups (by `key`), round robin."""
        if self.dp == 1:
            return list(items)
        keys = sorted({key(x) for x in items})
        mine = set(keys[self.dp_rank::self.dp])
        return [x for x in items if key(x) in mine]

    def _step(self) -> dict[str, float]:
        grad_norm = self._grad_norm_and_clip()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.version += 1
        return {"grad_norm": float(grad_norm), "lr": lr}

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample], temperature: float = 1.0, reference: bool = False) -> list[torch.Tensor]:
        model = self.ref if reference else self.model
        assert model is not None, "no reference model (with_reference=False)"
        out = []
        for mb in self._micro_batches(samples):
            b = TokenBatch([(s.prompt, s.response) for s in mb]).to(self.device)
            logp, _ = self._forward(model, b, temperature)
            out.extend(b.response_values(logp.cpu()))
        return out

    # ------------------------------------------------------------ steps

    def sft_step(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, float]:
        """Cross-entropy on response tokens (token mean over the whole batch)."""
        self.model.train()
        total = sum(len(r) for _, r in rows)
        rows = [r for _, r in self._shard(list(enumerate(rows)), key=lambda x: x[0])]
        loss_sum = 0.0
        for i in range(0, len(rows), self.micro_batch_size):
            b = TokenBatch(rows[i: i + self.micro_batch_size]).to(self.device)
            logp, _ = self._forward(self.model, b, 1.0)
            loss = -(logp * b.resp_mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        return {"loss": self._dp_sum(loss_sum), **self._step()}

    def _dp_sum(self, x: float, op: str = "sum") -> float:
        if self.dp == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM, group=self.dp_group)
        return float(t)

    def rl_step(self, samples: Sequence[Sample], cfg: RLConfig) -> dict[str, float]:
        """One policy-gradient step. The proximal policy is the learner before the step
        (its recomputed log-probs), so on fresh on-policy data the ratio is exactly 1."""
        self.model.train()
        everything = samples
        samples = self._shard(samples, key=lambda s: s.group)
        mbs = self._micro_batches(samples)
        prox = self.logprobs(samples, cfg.temperature)
        ref = self.logprobs(samples, cfg.temperature, reference=True) if cfg.kl_coef > 0 else None
        samples = everything  # the aggregation unit is the whole batch's
        unit = {"token": sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.response) for s in samples),
                "seq": len(samples),
                "group": len({s.group for s in samples})}[cfg.loss_agg]
        stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0,
                 "clip_frac": 0.0}
        k = 0
        tokens_total = sum(len(s.response) for s in samples)
        for mb in mbs:
            b = TokenBatch([(s.prompt, s.response) for s in mb]).to(self.device)
            n = len(mb)
            mask = b.resp_mask * b.scatter([s.loss_mask if s.loss_mask is not None else [1] * len(s.response)
                                            for s in mb])
            old = b.scatter(prox[k: k + n])
            adv = alg.tokens_from_samples(torch.tensor([s.advantage for s in mb], device=self.device), b.resp_mask)
            weight = None
            if cfg.off_policy != "none":
                behav = b.scatter([s.rollout_logprobs for s in mb])  # type: ignore[misc]
                weight = alg.importance_weight(old, behav, cfg.tis_cap) * b.resp_mask
            groups = torch.tensor([s.group for s in mb], device=self.device)
            logp, ent = self._forward(self.model, b, cfg.temperature, with_entropy=True)
            pg, pst = alg.policy_loss(logp, old, adv, mask, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip,
                                      weight, cfg.loss_agg, groups)  # type: ignore[arg-type]
            loss = pg
            kl = torch.zeros((), device=self.device)
            if ref is not None:
                kl = alg.aggregate(alg.kl_penalty(logp, b.scatter(ref[k: k + n]), cfg.kl_estimator),  # type: ignore[arg-type]
                                   mask, cfg.loss_agg, groups)  # type: ignore[arg-type]
                loss = loss + cfg.kl_coef * kl
            entropy = alg.aggregate(ent.detach(), mask, cfg.loss_agg, groups)  # type: ignore[arg-type, union-attr]
            if cfg.entropy_coef:
                loss = loss + alg.entropy_bonus(ent, mask, cfg.entropy_coef, cfg.loss_agg, groups)  # type: ignore[arg-type]
            share = {"token": float(mask.sum()), "seq": n, "group": len(set(groups.tolist()))}[cfg.loss_agg] / unit
            (loss * share).backward()
            tok_share = float(b.resp_mask.sum()) / tokens_total
            stats["loss"] += float(loss.detach()) * share
            stats["pg_loss"] += float(pg.detach()) * share
            stats["kl"] += float(kl.detach()) * share
            stats["entropy"] += float(entropy) * share
            stats["ratio_mean"] += float(pst["ratio_mean"]) * tok_share
            stats["ratio_max"] = max(stats["ratio_max"], float(pst["ratio_max"]))
            stats["clip_frac"] += float(pst["clip_frac"]) * tok_share
            k += n
        for key in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac"):
            stats[key] = self._dp_sum(stats[key])
        stats["ratio_max"] = -self._dp_sum(-stats["ratio_max"], op="min") if self.dp > 1 else stats["ratio_max"]
        return {**stats, **self._step()}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        from streamrl.connectors.mcore_model import hf_state_dict

        return hf_state_dict(self.model, self.bridge)
