"""The megatron-core learner: SFT and RL steps on a GPTModel built from an HF directory.

Optimizer (connectors/megatron/optimizer.py): megatron's DistributedDataParallel and Adam from
`get_megatron_optimizer`, the distributed optimizer when there are several data-parallel ranks
(each keeps 1/dp of Adam's moments). Gradient clipping by global norm; LR schedule linear
warm-up then constant (counted in optimizer steps). A claimed batch is trained in
`mini_batches` x `epochs` optimizer steps (1 x 1 by default) after its proximal log-probs and
off-policy correction are taken once. What is computed from the tensors (the correction, token
advantages, the objective of a micro-batch) is streamrl/core/algorithms/step.py; this module runs
the model and moves the tensors. Micro-batches hold rows of similar length
(mcore_batch.plan_micro_batches: at most `micro_batch_size` rows and, when set,
`max_tokens_per_micro_batch` padded tokens; whole groups under group aggregation) and each
micro-batch's loss is weighted by its share of the aggregation units (tokens, sequences or
groups with at least one token in the loss), so an optimizer step equals one pass over its
whole mini-batch, however it was cut. A step whose loss or gradient norm is not finite is skipped (weights,
optimizer and LR schedule untouched) and counted.

Precision (`dtype`, recipe learner.dtype): fp32, or bf16 parameters and activations with fp32 main
parameters in the optimizer. Either way log-probs, ratios and losses are computed in fp32: each chunk of
the logits is upcast before the softmax (vocab_parallel.chosen_logprobs: vocab-parallel under TP, no
fp32 copy of the logits kept for autograd).

Parallelism (connectors/megatron/parallel.py): tensor, pipeline and data parallel ranks. Every
forward and backward goes through megatron's `get_forward_backward_func` schedule (1F1B when
pp > 1); the last pipeline stage computes log-probs and losses and hands the proximal
log-probs and the step's numbers to the other stages, so every rank takes the same decisions
and returns the same metrics. A claimed batch is split over data-parallel ranks by whole
groups, balanced by token count (mcore_batch.balanced_split).

The caller sets up torch.distributed and megatron's parallel state (`init_distributed`, or
`init_single_process` for one CPU process).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrl.connectors.megatron import lora, routing
from streamrl.connectors.megatron.batch import TokenBatch, balanced_split, plan_micro_batches
from streamrl.connectors.megatron.model import hf_weights, load_model
from streamrl.connectors.megatron.optimizer import Optimizer
from streamrl.connectors.megatron.parallel import Parallel, init_distributed
from streamrl.connectors.megatron.vocab_parallel import chosen_logprobs, defer_output_layer, hidden_states, output_weight
from streamrl.core.algorithms import aggregation_units, offpolicy
from streamrl.core.algorithms.objective import LossInputs, RLConfig
from streamrl.core.algorithms.step import loss_inputs, micro_batch_loss

__all__ = ["DTYPES", "MegatronLearner", "RLConfig", "Sample", "init_distributed", "init_single_process"]
log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # recipe learner.dtype


def init_single_process(seed: int = 0) -> None:
    """torch.distributed (gloo, world size 1) + megatron parallel state + CPU patches."""
    init_distributed(rank=0, world_size=1, tp=1, pp=1, seed=seed)


@dataclass
class Sample:
    """One learner row: prompt and response ids, rollout log-probs, advantage, group, mask."""

    prompt: Sequence[int]
    response: Sequence[int]
    advantage: float = 0.0
    rollout_logprobs: Sequence[float] | None = None
    group: int = 0
    loss_mask: Sequence[int] | None = None
    routed_experts: Any = None  # MoE: [prompt + response - 1, layers, top_k] expert ids from the engine, or None


class MegatronLearner:
    def __init__(self, model_dir: str | Path, lr: float = 1e-4, grad_clip: float = 1.0, weight_decay: float = 0.0,
                 warmup_steps: int = 0, micro_batch_size: int = 8, with_reference: bool = False,
                 distributed_optimizer: bool = True, adam_eps: float = 1e-8,
                 max_tokens_per_micro_batch: int | None = None, dtype: str = "fp32",
                 moe: dict[str, Any] | None = None, routing_replay: bool = True) -> None:
        self.dtype = DTYPES[dtype]  # bf16: mixed precision (fp32 main params and gradients: optimizer.py)
        self.model, self.bridge = load_model(model_dir, self.dtype, moe)  # with pp > 1: this stage's chunk
        self.ref = load_model(model_dir, self.dtype, moe)[0].eval() if with_reference else None
        for m in (self.model, self.ref):
            if m is not None and getattr(m, "post_process", False):
                defer_output_layer(m)
        # MoE: every router answers through a RowReplay (routing.py), which replays the engine's
        # routing when `routing_replay` and counts how often the learner's own choice differs
        self.moe = bool(self.bridge.config.num_moe_experts)
        self._replays = routing.install(self.model)
        self._ref_replays = routing.install(self.ref) if self.ref is not None else []
        for r in self._replays + self._ref_replays:
            r.enabled = routing_replay
        if self.ref is not None:
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self._opt_args = dict(lr=lr, grad_clip=grad_clip, weight_decay=weight_decay, warmup_steps=warmup_steps,
                              adam_eps=adam_eps, distributed=distributed_optimizer)
        self.opt = Optimizer(self.model, **self._opt_args)
        self.params = self.opt.params
        self.adapters: list[lora.Adapter] = []  # LoRA (enable_lora): only these train
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.version = 0  # +1 per SFT step and per claimed RL batch (however many optimizer steps it took)
        self.nonfinite_skipped = 0  # optimizer steps skipped for a non-finite loss or gradient norm, so far
        self.device = next(self.model.parameters()).device
        self.par = Parallel()
        self.tp, self.pp, self.dp = self.par.tp, self.par.pp, self.par.dp

    def enable_lora(self, rank: int, alpha: float, dropout: float, layers: list[str], seed: int = 0) -> None:
        """From now on train LoRA adapters on `layers` (megatron names, streamrl/core/lora.py) and
        nothing else: the adapters are attached, every other weight frozen, and the optimizer built
        anew over them (megatron's DDP and optimizer take what requires grad when built, so gradient
        buffers and Adam's state hold the adapters alone). Called once, after any SFT warm-start."""
        if self.adapters:
            return
        self.adapters = lora.attach(self.model, rank, alpha, dropout, layers, seed=seed)
        lr = self.opt.base_lr
        for p in self.model.parameters():  # the old DDP's gradient buffers: nothing writes them any more
            if not p.requires_grad and hasattr(p, "main_grad"):
                del p.main_grad
        self.opt = Optimizer(self.model, **{**self._opt_args, "lr": lr})
        self.params = self.opt.params

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapters as PEFT tensors (whole, on every rank; collective over the TP group)."""
        return lora.adapter_state(self.adapters, self.bridge.hf_config)

    # ------------------------------------------------------------ pieces

    def _logp(self, hidden: torch.Tensor, batch: TokenBatch, temperature: float, with_entropy: bool = False,
              model: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `batch`'s targets from the last stage's hidden states of `model` (the
        policy unless given), its output layer applied in chunks (vocab_parallel.py)."""
        model = self.model if model is None else model
        return chosen_logprobs(hidden, output_weight(model), batch.ids, temperature, with_entropy,
                               self.par.tp_group if self.par.tp > 1 else None)

    def _run(self, chunk: Any, b: TokenBatch) -> torch.Tensor:
        """The model (or this stage's chunk) on one micro-batch, its routers given the batch's routing."""
        routing.set_batch(self._replays + self._ref_replays, b.routing, b.routing_known)
        with hidden_states(chunk):  # the last stage: hidden states, for _logp (no [tokens, vocab] logits)
            return chunk(b.ids, b.positions, b.attn_mask)

    def _forward(self, model: Any, batch: TokenBatch, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole model's log-probs (pp = 1 only: a stage alone has no logits)."""
        return self._logp(self._run(model, batch), batch, temperature, with_entropy, model)

    def _logprobs(self, model: Any, batches: Sequence[TokenBatch], temperature: float,
                  every_stage: bool) -> list[torch.Tensor | None]:
        """Log-probs [B, T-1] of each batch's targets, no grad, through the pipeline: on the last
        stage, and on every stage with `every_stage` (else None elsewhere)."""
        def step(chunk: Any, i: int) -> tuple[torch.Tensor, None]:
            b = batches[i]
            out = self._run(chunk, b)
            return (self._logp(out, b, temperature, model=model)[0] if self.par.last_stage else out), None

        with torch.no_grad():
            got = self.par.run_schedule(model, batches, step, forward_only=True)
        if not every_stage:
            return list(got) if self.par.last_stage else [None] * len(batches)
        if not self.par.last_stage:
            got = [torch.zeros_like(b.resp_mask) for b in batches]
        return list(self.par.from_last_stage(got))

    def _micro_batches(self, samples: Sequence[Sample], whole_groups: bool = False) -> list[list[Sample]]:
        """Rows of similar length per micro-batch (mcore_batch.plan_micro_batches)."""
        plan = plan_micro_batches([len(s.prompt) + len(s.response) for s in samples], [s.group for s in samples],
                                  self.micro_batch_size, self.max_tokens_per_micro_batch, whole_groups)
        return [[samples[i] for i in mb] for mb in plan]

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

    def _dp_share(self, items: Sequence[Any], key: Any, tokens: Any) -> list[Any]:
        """This data-parallel rank's share of `items`: whole groups (by `key`), spread over the
        ranks balanced by their token counts (`tokens(item)`), in batch order."""
        if self.dp == 1:
            return list(items)
        size: dict[Any, int] = {}
        for x in items:
            size[key(x)] = size.get(key(x), 0) + tokens(x)
        part = dict(zip(size, balanced_split(list(size.values()), self.dp)))
        return [x for x in items if part[key(x)] == self.par.dp_rank]

    def _optimizer_step(self, loss: float) -> dict[str, Any]:
        """Clip by global norm and step, unless the loss (summed over ranks) or the gradient norm
        is not finite: then the gradients are dropped and the weights, the optimizer's moments and
        the LR schedule stay exactly as they were (counted in `nonfinite_skipped`)."""
        norm = self.opt.finish_grads()
        lr = self.opt.lr
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.opt.zero_grad()
            self.nonfinite_skipped += 1
            log.warning("optimizer step skipped: loss %s, gradient norm %s (%d skipped so far)", loss, norm,
                        self.nonfinite_skipped)
            return {"grad_norm": norm, "lr": lr, "skipped": "nonfinite"}
        self.opt.step(norm)
        return {"grad_norm": norm, "lr": lr, "skipped": None}

    # ------------------------------------------------------------ steps

    def sft_step(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, Any]:
        """Cross-entropy on response tokens (token mean over the whole batch)."""
        self.model.train()
        total = sum(len(r) for _, r in rows)
        rows = [r for _, r in self._dp_share(list(enumerate(rows)), key=lambda x: x[0],
                                             tokens=lambda x: len(x[1][0]) + len(x[1][1]))]
        plan = plan_micro_batches([len(p) + len(r) for p, r in rows], [0] * len(rows), self.micro_batch_size,
                                  self.max_tokens_per_micro_batch)
        batches = [TokenBatch([rows[i] for i in mb]).to(self.device) for mb in plan]

        def step(chunk: Any, i: int) -> tuple[torch.Tensor, Any]:
            b = batches[i]
            out = self._run(chunk, b)
            if not self.par.last_stage:
                return out, None

            def loss_fn(_: Any) -> tuple[torch.Tensor, float]:
                loss = -(self._logp(out, b, 1.0)[0] * b.resp_mask).sum() / total
                return loss, float(loss.detach())

            return out, loss_fn

        losses = self.par.run_schedule(self.opt.ddp, batches, step, forward_only=False)
        loss_sum = self.par.dp_sum(self.par.floats_from_last_stage([sum(losses)])[0])
        step_out = self._optimizer_step(loss_sum)
        self.version += 1
        return {"loss": loss_sum, "grad_norm": step_out["grad_norm"], "lr": step_out["lr"],
                "nonfinite_skipped": int(step_out["skipped"] == "nonfinite")}

    def _prepare(self, mbs: Sequence[Sequence[Sample]], cfg: RLConfig
                 ) -> tuple[list[tuple[TokenBatch, LossInputs]], list[dict[str, float]]]:
        """Micro-batches' tensors, taken before the batch's first optimizer step: proximal (and,
        on the last stage, reference) log-probs, and from them (step.loss_inputs) the advantages
        and the off-policy correction's loss mask and weights; with the correction's counts for
        the step's metrics."""
        batches = [TokenBatch([(s.prompt, s.response) for s in mb], routing=[s.routed_experts for s in mb])
                   .to(self.device) for mb in mbs]
        routing.take_counts(self._replays)
        proxs = self._logprobs(self.model, batches, cfg.temperature, every_stage=True)
        counts = routing.take_counts(self._replays)  # the proximal forward's: once per token
        self._routing_counts = [a + b for a, b in zip(self._routing_counts, counts)]
        refs: list[torch.Tensor | None] = [None] * len(batches)
        if cfg.kl_coef > 0:
            assert self.ref is not None, "kl_coef > 0 needs a reference model (with_reference=True)"
            refs = self._logprobs(self.ref, batches, cfg.temperature, every_stage=False)
        out, counts = [], []
        for mb, b, prox, ref in zip(mbs, batches, proxs, refs):
            loss_mask = b.scatter([s.loss_mask if s.loss_mask is not None else [1] * len(s.response) for s in mb])
            behav = None
            if all(s.rollout_logprobs is not None for s in mb):
                behav = b.scatter([s.rollout_logprobs for s in mb])  # type: ignore[misc]
            x, count = loss_inputs(cfg, prox, b.resp_mask, loss_mask, behav,  # type: ignore[arg-type]
                                   torch.tensor([s.advantage for s in mb], device=self.device),
                                   torch.tensor([s.group for s in mb], device=self.device), ref)
            out.append((b, x))
            counts.append(count)
        return out, counts

    _SUMS = ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac")

    def _train_mini_batch(self, mini: list[tuple[TokenBatch, LossInputs]], cfg: RLConfig) -> dict[str, Any]:
        """One optimizer step on a mini-batch (this rank's micro-batches of it). Each micro-batch's
        loss is weighted by its share of the aggregation units of the whole mini-batch over all
        ranks, so the step is the gradient of the full mini-batch's aggregate."""
        units = [aggregation_units(x.mask, cfg.loss_agg, x.groups) for _, x in mini]  # type: ignore[arg-type]
        total = self.par.dp_sum(sum(units))
        tokens = self.par.dp_sum(sum(float(x.mask.sum()) for _, x in mini))
        st = dict.fromkeys((*self._SUMS, "ratio_max"), 0.0)
        if total == 0:  # nothing in the loss; Adam's momentum alone would still move the weights
            return {**st, "grad_norm": 0.0, "lr": self.opt.lr, "skipped": "empty"}
        todo = [(b, x) for (b, x), u in zip(mini, units) if u > 0]
        for (_, x), u in zip(todo, [u for u in units if u > 0]):
            x.share = u / total

        def step(chunk: Any, i: int) -> tuple[torch.Tensor, Any]:
            b, x = todo[i]
            out = self._run(chunk, b)
            if not self.par.last_stage:
                return out, None
            return out, lambda _: micro_batch_loss(*self._logp(out, b, cfg.temperature, True), x, cfg)  # type: ignore[arg-type]

        parts = self.par.run_schedule(self.opt.ddp, [b for b, _ in todo], step, forward_only=False)
        for (_, x), p in zip(todo, parts):  # the last stage's numbers (no parts elsewhere)
            for k in ("loss", "pg_loss", "kl", "entropy"):
                st[k] += float(p[k]) * x.share
            tok_share = float(x.mask.sum()) / tokens
            st["ratio_mean"] += float(p["ratio_mean"]) * tok_share
            st["clip_frac"] += float(p["clip_frac"]) * tok_share
            st["ratio_max"] = max(st["ratio_max"], float(p["ratio_max"]))
        st = dict(zip(st, self.par.floats_from_last_stage(list(st.values()))))
        for k in self._SUMS:
            st[k] = self.par.dp_sum(st[k])
        st["ratio_max"] = self.par.dp_max(st["ratio_max"])
        return {**st, **self._optimizer_step(st["loss"])}

    def rl_step(self, samples: Sequence[Sample], cfg: RLConfig) -> dict[str, Any]:
        """Train on one claimed batch: `cfg.epochs` passes of `cfg.mini_batches` optimizer steps,
        each on whole groups. The proximal policy is the learner before the batch's first step
        (its log-probs and the off-policy correction are taken once), so the PPO ratio is exactly
        1 on the first step and departs from it on later ones, where the clip acts. The policy
        version moves by one per claimed batch, however many optimizer steps it took: versions
        count what the broadcaster publishes and what staleness is measured in."""
        self.model.train()
        self._routing_counts = [0, 0, 0]
        minis = [self._dp_share(m, key=lambda s: s.group, tokens=lambda s: len(s.prompt) + len(s.response))
                 for m in self._mini_batches(samples, cfg.mini_batches)]
        prepared: list[list[tuple[TokenBatch, LossInputs]]] = []
        counts: list[dict[str, float]] = []
        for m in minis:
            mini, c = self._prepare(self._micro_batches(m, whole_groups=cfg.loss_agg == "group"), cfg)
            prepared.append(mini)
            counts += c
        steps = [self._train_mini_batch(mini, cfg) for _ in range(cfg.epochs) for mini in prepared]
        self.version += 1
        out: dict[str, Any] = {k: sum(s[k] for s in steps) / len(steps) for k in (*self._SUMS, "grad_norm")}
        out |= {"ratio_max": max(s["ratio_max"] for s in steps), "lr": steps[-1]["lr"],
                "optimizer_steps": sum(s["skipped"] is None for s in steps),
                "nonfinite_skipped": sum(s["skipped"] == "nonfinite" for s in steps),
                "nonfinite_skipped_total": self.nonfinite_skipped,
                "optim_steps": [{k: s[k] for k in ("loss", "clip_frac", "ratio_max", "grad_norm", "skipped")}
                                for s in steps]}
        out |= self._routing_metrics(samples)
        return out | self._offpolicy_metrics(counts, with_ratio=all(s.rollout_logprobs is not None for s in samples))

    def _routing_metrics(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """MoE only, over the (token, layer) pairs that came with engine routing. routing_own_mismatch:
        the fraction where the learner's own top-k (before the step) picks other experts;
        routing_mismatch: where the experts it routed to differ from the engine's (0 with
        routing_replay). routing_missing_rows: samples without routing data (routed by the learner)."""
        if not self.moe:
            return {}
        own, used, known = self.par.world_sum(self._routing_counts)  # tp replicas count alike: ratios
        return {"routing_own_mismatch": own / known if known else float("nan"),
                "routing_mismatch": used / known if known else float("nan"),
                "routing_missing_rows": sum(s.routed_experts is None for s in samples)}

    def _offpolicy_metrics(self, counts: list[dict[str, float]], with_ratio: bool) -> dict[str, float]:
        total = {k: self.par.dp_sum(sum(c[k] for c in counts)) for k in offpolicy.SUM_KEYS}
        total |= {k: self.par.dp_max(max((c[k] for c in counts), default=0.0)) for k in offpolicy.MAX_KEYS}
        return offpolicy.metrics(total, with_ratio)

    def hf_state_dict(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """A host copy of the whole model under HF names, on every rank (collective over the
        model-parallel group: TP shards and PP stages are gathered); with LoRA, merged."""
        return {name: t.to("cpu", copy=True) for name, t in self.hf_weights(merged)}

    def hf_weights(self, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The same one tensor at a time, without a copy of the model (model.hf_weights). With
        LoRA each adapted weight is W + s B A (lora.merged: the adapted weights are copied while
        the export runs), or with `merged=False` the frozen base alone."""
        weights = hf_weights(self.model, self.bridge)
        if not self.adapters:
            return weights
        return lora.merged_weights(self.model, self.adapters, weights) if merged else \
            lora.base_weights(self.model, weights)

    def state_bytes(self) -> int:
        """Bytes of this rank's parameters and optimizer state (what parallelism divides)."""
        return self.opt.state_bytes()
