"""The megatron-core learner: SFT and RL steps on a GPTModel built from an HF directory.

Optimizer: torch AdamW. Megatron's own optimizer needs DDP-wrapped models and, on CPU, a
device redirect plus a CPU grad-clip (FACTS.md); AdamW is element-wise, so it gives the
same update on tensor-parallel shards. Gradient clipping by global norm; LR schedule linear
warm-up then constant (counted in optimizer steps). A claimed batch is trained in
`mini_batches` x `epochs` optimizer steps (1 x 1 by default) after its proximal log-probs and
off-policy correction are taken once; the objective of a micro-batch is
streamrl.core.algorithms.objective.micro_batch_loss. Micro-batches hold whole groups and each
micro-batch's loss is weighted by its share of the aggregation units (tokens, sequences or
groups with at least one token in the loss), so an optimizer step equals one pass over its
whole mini-batch. A step whose loss or gradient norm is not finite is skipped (weights,
optimizer and LR schedule untouched) and counted.

The caller sets up torch.distributed and megatron's parallel state (`init_single_process`
for one CPU process).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrl.connectors.mcore_batch import TokenBatch, logprobs_and_entropy
from streamrl.core import algorithms as alg
from streamrl.core.algorithms import offpolicy
from streamrl.core.algorithms.objective import LossInputs, RLConfig, micro_batch_loss

__all__ = ["MegatronLearner", "RLConfig", "Sample", "init_distributed", "init_single_process"]
log = logging.getLogger(__name__)


def init_single_process(seed: int = 0) -> None:
    """torch.distributed (gloo, world size 1) + megatron parallel state + CPU patches."""
    init_distributed(rank=0, world_size=1, tp=1, seed=seed)


def init_distributed(rank: int, world_size: int, tp: int = 1, pp: int = 1, seed: int = 0, *, port: int = 0,
                     listen_fd: int | None = None) -> None:
    """One learner rank: torch.distributed (gloo on CPU, NCCL on GPU), megatron parallel state
    with tensor parallel size `tp` and pipeline parallel size `pp` (data parallel = world_size /
    (tp * pp)), CPU patches, seeds. The store is on 127.0.0.1 (connectors/ports.py): rank 0 serves
    it on a socket it inherited (`listen_fd`, bound to `port` by whoever started the ranks) or,
    given no port, on one of its own; otherwise every rank connects to `port` (a store the
    starter serves: the learner group's driver)."""
    import torch.distributed as dist

    from streamrl.connectors import megatron_cpu
    from streamrl.connectors.ports import tcp_store

    megatron_cpu.apply()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        serve = rank == 0 and (listen_fd is not None or not port)
        # tcp_store serves for rank 0 and connects for any other: rank 0 of a served store is a client too
        store = tcp_store(world_size, rank=0 if serve else max(rank, 1), port=port, listen_fd=listen_fd)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
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
        self.version = 0  # +1 per SFT step and per claimed RL batch (however many optimizer steps it took)
        self.nonfinite_skipped = 0  # optimizer steps skipped for a non-finite loss or gradient norm, so far
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

    def _mini_batches(self, samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
        """`parts` mini-batches of whole groups in batch order, their group counts as even as
        possible (fewer mini-batches when the batch has fewer groups); every rank splits alike."""
        order = list(dict.fromkeys(s.group for s in samples))
        parts = max(1, min(parts, len(order)))
        index = {g: i * parts // len(order) for i, g in enumerate(order)}
        out: list[list[Sample]] = [[] for _ in range(parts)]
        for s in samples:
            out[index[s.group]].append(s)
        return out

    def _reduce_grads_and_norm(self) -> float:
        """Global L2 norm over all ranks' gradients. Tensor-parallel shards are summed across the
        TP group; replicated parameters (norms) count once; after the DP all-reduce every
        data-parallel rank holds the same gradients."""
        import torch.distributed as dist

        if self.dp > 1:
            for p in self.params:
                if p.grad is None:  # a rank with no rows in this step still joins every all-reduce
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.dp_group)  # losses are pre-weighted: a sum is the full-batch grad
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
        return float((sharded + replicated).sqrt())

    def _shard(self, items: Sequence[Any], key: Any) -> list[Any]:
        """This data-parallel rank's share: whole groups (by `key`), round robin."""
        if self.dp == 1:
            return list(items)
        keys = sorted({key(x) for x in items})
        mine = set(keys[self.dp_rank::self.dp])
        return [x for x in items if key(x) in mine]

    def _optimizer_step(self, loss: float) -> dict[str, Any]:
        """Clip by global norm and step, unless the loss (summed over ranks) or the gradient norm
        is not finite: then the gradients are dropped and the weights, the optimizer's moments and
        the LR schedule stay exactly as they were (counted in `nonfinite_skipped`)."""
        norm = self._reduce_grads_and_norm()
        lr = self.opt.param_groups[0]["lr"]
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.opt.zero_grad(set_to_none=True)
            self.nonfinite_skipped += 1
            log.warning("optimizer step skipped: loss %s, gradient norm %s (%d skipped so far)", loss, norm,
                        self.nonfinite_skipped)
            return {"grad_norm": norm, "lr": lr, "skipped": "nonfinite"}
        coef = self.grad_clip / (norm + 1e-6)
        if coef < 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return {"grad_norm": norm, "lr": lr, "skipped": None}

    # ------------------------------------------------------------ steps

    def sft_step(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, Any]:
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
        loss_sum = self._dp_sum(loss_sum)
        step = self._optimizer_step(loss_sum)
        self.version += 1
        return {"loss": loss_sum, "grad_norm": step["grad_norm"], "lr": step["lr"],
                "nonfinite_skipped": int(step["skipped"] == "nonfinite")}

    def _dp_sum(self, x: float, op: str = "sum") -> float:
        if self.dp == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM, group=self.dp_group)
        return float(t)

    def _dp_max(self, x: float) -> float:
        return -self._dp_sum(-x, op="min") if self.dp > 1 else x

    def _prepare(self, mb: Sequence[Sample], cfg: RLConfig) -> tuple[TokenBatch, LossInputs, dict[str, float]]:
        """A micro-batch's tensors, taken before the batch's first optimizer step: proximal (and
        reference) log-probs, advantages, and the off-policy correction's loss mask and weights;
        with the correction's counts for the step's metrics."""
        b = TokenBatch([(s.prompt, s.response) for s in mb]).to(self.device)
        with torch.no_grad():
            prox = self._forward(self.model, b, cfg.temperature)[0] * b.resp_mask
            ref = None
            if cfg.kl_coef > 0:
                assert self.ref is not None, "kl_coef > 0 needs a reference model (with_reference=True)"
                ref = self._forward(self.ref, b, cfg.temperature)[0] * b.resp_mask
        mask = b.resp_mask * b.scatter([s.loss_mask if s.loss_mask is not None else [1] * len(s.response)
                                        for s in mb])
        behav = None
        if all(s.rollout_logprobs is not None for s in mb):
            behav = b.scatter([s.rollout_logprobs for s in mb])  # type: ignore[misc]
        c = offpolicy.correct(cfg.off_policy, prox, behav, mask, **cfg.correction)
        adv = alg.tokens_from_samples(torch.tensor([s.advantage for s in mb], device=self.device), b.resp_mask)
        groups = torch.tensor([s.group for s in mb], device=self.device)
        x = LossInputs(mask=c.mask, adv=adv, prox=prox, groups=groups, share=0.0, weight=c.weight, ref=ref)
        return b, x, offpolicy.sums(prox, behav, mask, c)

    def _train_mini_batch(self, mini: list[tuple[TokenBatch, LossInputs]], cfg: RLConfig) -> dict[str, Any]:
        """One optimizer step on a mini-batch (this rank's micro-batches of it). Each micro-batch's
        loss is weighted by its share of the aggregation units of the whole mini-batch over all
        ranks, so the step is the gradient of the full mini-batch's aggregate."""
        units = [alg.aggregation_units(x.mask, cfg.loss_agg, x.groups) for _, x in mini]  # type: ignore[arg-type]
        total = self._dp_sum(sum(units))
        tokens = self._dp_sum(sum(float(x.mask.sum()) for _, x in mini))
        st = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac", "ratio_max"), 0.0)
        if total == 0:  # nothing in the loss; Adam's momentum alone would still move the weights
            return {**st, "grad_norm": 0.0, "lr": self.opt.param_groups[0]["lr"], "skipped": "empty"}
        for (b, x), u in zip(mini, units):
            if u == 0:
                continue
            x.share = u / total
            logp, ent = self._forward(self.model, b, cfg.temperature, with_entropy=True)
            loss, parts = micro_batch_loss(logp, ent, x, cfg)  # type: ignore[arg-type]
            loss.backward()
            for k in ("loss", "pg_loss", "kl", "entropy"):
                st[k] += float(parts[k]) * x.share
            tok_share = float(x.mask.sum()) / tokens
            st["ratio_mean"] += float(parts["ratio_mean"]) * tok_share
            st["clip_frac"] += float(parts["clip_frac"]) * tok_share
            st["ratio_max"] = max(st["ratio_max"], float(parts["ratio_max"]))
        for k in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac"):
            st[k] = self._dp_sum(st[k])
        st["ratio_max"] = self._dp_max(st["ratio_max"])
        return {**st, **self._optimizer_step(st["loss"])}

    def rl_step(self, samples: Sequence[Sample], cfg: RLConfig) -> dict[str, Any]:
        """Train on one claimed batch: `cfg.epochs` passes of `cfg.mini_batches` optimizer steps,
        each on whole groups. The proximal policy is the learner before the batch's first step
        (its log-probs and the off-policy correction are taken once), so the PPO ratio is exactly
        1 on the first step and departs from it on later ones, where the clip acts. The policy
        version moves by one per claimed batch, however many optimizer steps it took: versions
        count what the broadcaster publishes and what staleness is measured in."""
        self.model.train()
        minis = [self._shard(m, key=lambda s: s.group) for m in self._mini_batches(samples, cfg.mini_batches)]
        prepared: list[list[tuple[TokenBatch, LossInputs]]] = []
        counts: list[dict[str, float]] = []
        for m in minis:
            prepared.append([])
            for mb in self._micro_batches(m):
                b, x, c = self._prepare(mb, cfg)
                prepared[-1].append((b, x))
                counts.append(c)
        steps = [self._train_mini_batch(mini, cfg) for _ in range(cfg.epochs) for mini in prepared]
        self.version += 1
        out: dict[str, Any] = {k: sum(s[k] for s in steps) / len(steps)
                               for k in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac", "grad_norm")}
        out |= {"ratio_max": max(s["ratio_max"] for s in steps), "lr": steps[-1]["lr"],
                "optimizer_steps": sum(s["skipped"] is None for s in steps),
                "nonfinite_skipped": sum(s["skipped"] == "nonfinite" for s in steps),
                "nonfinite_skipped_total": self.nonfinite_skipped,
                "optim_steps": [{k: s[k] for k in ("loss", "clip_frac", "ratio_max", "grad_norm", "skipped")}
                                for s in steps]}
        return out | self._offpolicy_metrics(counts, with_ratio=all(s.rollout_logprobs is not None for s in samples))

    def _offpolicy_metrics(self, counts: list[dict[str, float]], with_ratio: bool) -> dict[str, float]:
        total = {k: self._dp_sum(sum(c[k] for c in counts)) for k in offpolicy.SUM_KEYS}
        total |= {k: self._dp_max(max((c[k] for c in counts), default=0.0)) for k in offpolicy.MAX_KEYS}
        return offpolicy.metrics(total, with_ratio)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        from streamrl.connectors.mcore_model import hf_state_dict

        return hf_state_dict(self.model, self.bridge)
