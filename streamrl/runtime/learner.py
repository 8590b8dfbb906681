"""Learner driver: claims batches from the pool, trains the megatron learner, hands out weights.

Runs as one rank of the learner group in a run (streamrl/runtime/learner_group.py: tp * pp * dp
Ray actors). Rank 0 owns the pool's claim side and sends or writes the published weights, which
every rank gathers with it when they are published (WeightSource); every rank trains its share.
`train_step(step)` claims `groups_per_step` whole groups oldest-first under the staleness
bound and consumption policy, turns them into learner rows (advantages over the samples that were
scored, failed samples left out: streamrl/core/algorithms/step.py, `learner.advantage`), trains
on them (`learner.mini_batches` x `learner.epochs` optimizer steps, the off-policy correction
applied) and returns the step's metrics, including which groups it used. The version it
publishes is `learner.version`: one per claimed batch. Rank 0 hands the batch's learner rows to
the other ranks (msgpack over the group's gloo control group; no pickle), so they never read the pool.
With learner.lora the rank trains adapters only, attached after the SFT warm-start, and publishes
them as a PEFT directory (`export_adapter`); `export(base=True)` writes the base they apply to.

Long file: one learner rank's protocol (claim, train, checkpoint, restore, publish, LoRA) under one lock.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from streamrl.connectors.megatron import checkpoint as megatron_checkpoint
from streamrl.connectors.megatron import hf_export
from streamrl.connectors.megatron.learner import MegatronLearner, Sample, init_distributed
from streamrl.connectors.megatron.lora import write_peft_dir
from streamrl.connectors.ports import LOOPBACK, bind_host
from streamrl.connectors.sglang import weight_sync
from streamrl.core import algorithms as alg
from streamrl.core import credit
from streamrl.core import lora as lora_names
from streamrl.core.algorithms.objective import Choice
from streamrl.core.staleness import claimed_per_step, decide, mask_stale_tokens
from streamrl.core.types import Batch, SampleGroup, from_msgpack, to_msgpack
from streamrl.plugins.filters import top_by_reward_std
from streamrl.pools import PoolError, open_pool
from streamrl.recipe import Recipe, learner_layout, resolve_fn
from streamrl.runtime import faultpoint


def learner_rows(groups: list[SampleGroup], advantage: Choice,
                 negative_credit: str = "sequence") -> tuple[list[Sample], list[float]]:
    """Learner rows and the scored rewards of a batch; `advantage` is `learner.advantage`, a
    built-in name or the user's function (step.sample_advantages); `negative_credit`:
    `first_error` trains a below-average sample on the token its verifier blames and an above-average
    one on its tokens before it (core/credit.py)."""
    scored = [alg.scored(g) for g in groups]
    rewards = [[float(s.reward) for s in grp] for grp in scored]  # type: ignore[arg-type]
    advs = alg.sample_advantages(rewards, advantage)
    rows = []
    for gi, (g, grp, a) in enumerate(zip(groups, scored, advs)):
        prompt = g.prompt_tokens.tolist()
        for s, adv in zip(grp, a):
            rows.append(Sample(prompt=prompt, response=s.response_tokens.tolist(), advantage=float(adv),
                               rollout_logprobs=s.rollout_logprobs.tolist(), group=gi,
                               loss_mask=credit.error_mask(s.loss_mask.tolist(), adv, s.rewards.get(credit.ERROR_TOKEN))
                               if negative_credit == "first_error" else s.loss_mask.tolist(),
                               routed_experts=s.routed_experts))
    return rows, [r for grp in rewards for r in grp]


def batch_order(groups: list[SampleGroup]) -> list[SampleGroup]:
    """The order a step trains its groups in (oldest started first): a replay re-creates it from the pool alone."""
    return sorted(groups, key=lambda g: (g.created_at, g.group_id))


def batch_metrics(batch: Batch, rewards: list[float]) -> dict[str, Any]:
    stal = [batch.learner_version - (g.min_version if g.min_version is not None else batch.learner_version)
            for g in batch.groups]
    return {"reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "staleness_mean": float(np.mean(stal)) if stal else 0.0,
            "staleness_max": int(max(stal, default=0)),
            "dropped_stale": len(batch.dropped),
            "dropped_over_sampling": len(batch.rejected),
            "masked_tokens": batch.masked_tokens,
            "groups": [g.group_id for g in batch.groups],
            "dropped_ids": list(batch.dropped) + list(batch.rejected),
            "samples": batch.num_samples}


class WeightSource:
    """The learner's side of weight sync over `hf_weights()` (its weights under HF names, one
    tensor at a time): the disk export, the weight group and the broadcast. LearnerDriver is one:
    there the weights are gathered from every rank's shards when they are published, so every rank
    takes part in each call below and rank 0 (`sends`) sends or writes them. Nothing keeps a copy
    of the model between publishes; the lock keeps a publish from interleaving with a step.
    benchmarks/broadcast.py holds fixed weights."""

    sends = True  # this rank sends or writes the weights (the other ranks of a learner only gather)

    def __init__(self, model_dir: str) -> None:
        self.model_dir = str(model_dir)
        self._group: Any = None
        self._store: Any = None
        self._lock = threading.Lock()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_weights(self, base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """`base`: with LoRA, the frozen base without the adapters (what engines apply adapters to)."""
        yield from self.hf_state_dict().items()

    def _gather_only(self, weights: Iterator[Any]) -> None:
        """Take the rest of a collective gather, so the other ranks finish it too."""
        for _ in weights:
            pass

    def export(self, out_dir: str, base: bool = False, dtype: str | None = None) -> str:
        """HF safetensors of the weights as they are now (disk weight sync, restarted engines,
        the final model, a background evaluation's version); with LoRA merged, or with `base`
        the base alone (the engines' weights under the adapters); `dtype` (a torch dtype name):
        cast to it (the engines' dtype: a bf16 engine gets half of an fp32 learner's bytes)."""
        with self._lock:
            weights = _cast(self.hf_weights(base), dtype)
            if not self.sends:
                self._gather_only(weights)
                return str(out_dir)
            return str(hf_export.export_hf(weights, self.model_dir, out_dir))  # a shard at a time

    def weights_meta(self, dtype: str | None = None) -> tuple[list[str], list[str], list[list[int]]]:
        """Names, dtypes and shapes of what `push_weights(dtype=dtype)` sends."""
        with self._lock:
            meta = [(name, dtype or weight_sync.dtype_name(t.dtype), list(t.shape)) for name, t in self.hf_weights()]
        return [m[0] for m in meta], [m[1] for m in meta], [m[2] for m in meta]

    def open_weight_store(self, host: str, world_size: int, timeout_s: float = weight_sync.TIMEOUT_S) -> tuple[str, int]:
        """First half of forming the weight group: its store, served here on `host` (ports.NODE:
        this node's cluster address); returns the address and port engines join at."""
        host = bind_host(host)
        self._store = weight_sync.open_store(world_size, host, timeout_s)
        return host, int(self._store.port)

    def init_weight_group(self, world_size: int, group_name: str, backend: str,
                          timeout_s: float = weight_sync.TIMEOUT_S) -> None:
        """Second half: rank 0 of the group (returns once every engine has joined); `timeout_s`
        bounds each of its operations (the join, each bucket: weight_sync)."""
        assert self._store is not None, "open_weight_store first"
        self._group = weight_sync.create_group(self._store, world_size, group_name, backend=backend, timeout_s=timeout_s)

    def drop_weight_group(self) -> None:
        self._group = self._store = None

    def push_weights(self, bucketed: bool = False, dtype: str | None = None,
                     bucket_bytes: int = weight_sync.BUCKET_BYTES) -> None:
        """Broadcast the weights to the engines (rank 0 of the weight group), in buckets of at most
        `bucket_bytes` or (`bucketed=False`) one tensor at a time, cast to `dtype` when given: as the
        engines were told (weight_sync, weights_meta). Each bucket is sent as soon as its tensors are
        gathered: the extra memory is one bucket. A failed push drops the group, which releases the
        engines still waiting in it, finishes the gather (the other ranks are released too) and raises
        `weight_sync.PushFailed` naming the bucket; the next push forms a new group."""
        with self._lock:
            weights = (t for _, t in _cast(self.hf_weights(), dtype))
            failed: weight_sync.PushFailed | None = None
            try:
                if self.sends:
                    assert self._group is not None, "init_weight_group first"
                    weight_sync.broadcast(self._group, weights, bucketed=bucketed, max_bytes=bucket_bytes)
            except weight_sync.PushFailed as e:
                failed = weight_sync.PushFailed(e.bucket, e.reason)  # not e: its traceback holds the group
            finally:  # a failed push still finishes the gather (the disk fallback comes next)
                self._gather_only(weights)
            if failed is not None:
                self._group = self._store = None  # the last reference: its connections close now
                raise failed


def _cast(weights: Iterator[tuple[str, torch.Tensor]], dtype: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` cast to the torch dtype named `dtype` (None: as they are)."""
    if dtype is None:
        yield from weights
        return
    to = getattr(torch, dtype)
    for name, t in weights:
        yield name, t.to(to)


class LearnerDriver(WeightSource):
    def __init__(self, recipe: Recipe, model_dir: str, pool: bool = True, *, rank: int = 0,
                 store_port: int = 0, store_host: str = LOOPBACK) -> None:
        """One rank of the learner: `rank` of tp * pp * dp (learner.parallel), joining the
        process group through the store at `store_host:store_port` (port 0: a single process serves its own)."""
        tp, pp, dp = learner_layout(recipe)
        self.rank, self.world = rank, tp * pp * dp
        if recipe.learner.cpus:  # ranks share out the cores when there are enough, else share them all
            os.sched_setaffinity(0, recipe.learner.cpus[rank::self.world] or recipe.learner.cpus)
        torch.set_num_threads(recipe.learner.threads)
        init_distributed(rank, self.world, tp=tp, pp=pp, ep=recipe.learner.parallel.ep, seed=recipe.run.seed,
                         port=store_port, host=store_host)
        # Batches travel on the host: a gloo group even where training runs on NCCL.
        self._ctl = (dist.new_group(backend="gloo") if torch.cuda.is_available() else dist.group.WORLD) \
            if self.world > 1 else None
        super().__init__(model_dir)
        lc = recipe.learner
        self.r = recipe
        self.learner = MegatronLearner(model_dir, lr=lc.lr, grad_clip=lc.grad_clip, warmup_steps=lc.warmup_steps,
                                       micro_batch_size=lc.micro_batch_size, with_reference=lc.kl_coef > 0,
                                       distributed_optimizer=lc.parallel.distributed_optimizer,
                                       max_tokens_per_micro_batch=lc.max_tokens_per_micro_batch, dtype=lc.dtype,
                                       moe=msgspec.structs.asdict(lc.moe), routing_replay=lc.routing_replay)
        # learner.advantage / loss / off_policy: built-in names, or the user's functions imported here
        self.cfg = alg.RLConfig.from_recipe(lc, recipe.rollout.temperature,
                                            recipe.max_staleness, resolve_fn)
        self.pool = None
        if pool and rank == 0:
            self.pool = open_pool(recipe.pool_uri, create=True, config=recipe.pool, compact_every=recipe.pool.compact_every)
        # learner.lora: adapters only, attached after the SFT warm-start (which trains the whole model)
        # or, without one, before anything else happens (_lora_ready)
        self._lora_pending = lc.lora is not None
        if recipe.sft is None:
            self._lora_ready()
        self.last_step = -1  # the learner step the current weights come from (-1: none yet)
        self.last_metrics: dict[str, Any] = {}  # that step's metrics: a checkpoint of it keeps them (see checkpoint)

    @property
    def sends(self) -> bool:  # type: ignore[override]
        return self.rank == 0

    def _share(self, rows: list[Any] | None) -> list[Any] | None:
        """Rank 0's learner rows (None: no batch) on every rank."""
        if self.world == 1:
            return rows
        # a routing array travels flat (msgpack ext) beside its shape
        flat = None if rows is None else [
            s if s.routed_experts is None else dataclasses.replace(
                s, routed_experts=(list(s.routed_experts.shape), np.ascontiguousarray(s.routed_experts, np.int32).ravel()))
            for s in rows]
        data = to_msgpack(flat) if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self._ctl)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._ctl)
        if self.rank == 0:
            return rows
        got = from_msgpack(buf.numpy().tobytes(), list[Sample] | None)
        for s in got or []:
            if s.routed_experts is not None:
                shape, arr = s.routed_experts
                s.routed_experts = arr.reshape(shape)
        return got

    def _lora_ready(self) -> None:
        """Attach the LoRA adapters (learner.lora) unless they are: after SFT, before anything
        that trains, restores, checkpoints or publishes them (every rank at the same call)."""
        if not self._lora_pending:
            return
        lo = self.r.learner.lora
        assert lo is not None
        self.learner.enable_lora(lo.rank, lo.alpha, lo.dropout, lora_names.targets(lo.target_modules)[0],
                                 seed=self.r.run.seed)
        self._lora_pending = False

    def export_adapter(self, out_dir: str) -> str:
        """The LoRA adapters as they are now, a PEFT directory (what a version push sends: SGLang's
        /load_lora_adapter reads it); collective over the TP ranks, rank 0 writes."""
        lo = self.r.learner.lora
        assert lo is not None, "export_adapter needs learner.lora"
        with self._lock:
            self._lora_ready()
            state = self.learner.lora_state()
            if self.sends:
                config = lora_names.adapter_config(lo.rank, lo.alpha, lo.dropout,
                                                   lora_names.targets(lo.target_modules)[0], self.model_dir)
                write_peft_dir(state, config, out_dir)
        return str(out_dir)

    # ------------------------------------------------------------ SFT warm-start

    def sft(self, rows: list[tuple[list[int], list[int]]], steps: int, lr: float, batch_size: int,
            seed: int = 0, schedule: str = "constant") -> list[float]:
        """Cross-entropy steps on (prompt, response) rows at `lr` (`cosine`: falling to lr/10);
        afterwards the RL optimizer starts fresh at version 0 and the reference model (for KL) is
        the warm-started policy."""
        rng = np.random.default_rng(seed)
        losses = []
        for step in range(steps):
            self.learner.opt.set_lr(lr if schedule == "constant" else
                                    lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))))
            idx = rng.choice(len(rows), size=min(batch_size, len(rows)), replace=False)
            losses.append(self.learner.sft_step([rows[i] for i in idx])["loss"])
        self.learner.opt.reset(self.r.learner.lr)
        self.learner.version = 0
        self.learner.nonfinite_skipped = 0  # the running count is of RL steps
        if self.learner.ref is not None:
            self.learner.ref.load_state_dict(self.learner.model.state_dict())
        self._lora_ready()  # the warm-started model is the base the adapters train on
        return losses

    # ------------------------------------------------------------ RL

    @property
    def version(self) -> int:
        return self.learner.version

    def train_step(self, step: int, max_staleness: int, timeout_s: float = 600) -> dict[str, Any] | None:
        """Claim a batch (waiting up to `timeout_s` for enough complete groups), train, return metrics;
        None when no batch became ready in time."""
        if self.rank != 0:  # rank 0 claims and sends the rows
            rows = self._share(None)
            if rows is not None:
                self._train(step, rows)
            return None
        assert self.pool is not None
        ro, st = self.r.rollout, self.r.staleness
        k = claimed_per_step(ro.groups_per_step, ro.over_sampling)
        select = None
        if k > ro.groups_per_step:
            def select(groups: list[SampleGroup]) -> tuple[list[SampleGroup], dict[str, str]]:
                kept, rest = top_by_reward_std(groups, ro.groups_per_step)
                return kept, {g.group_id: "over_sampling" for g in rest}
        t_wait = time.perf_counter()
        deadline = t_wait + timeout_s
        while True:
            batch = self.pool.claim(step, self.version, k, max_staleness, st.policy, select=select)
            if batch is not None:
                break
            if time.perf_counter() > deadline:
                self._share(None)
                return None
            time.sleep(0.05)
        wait_s = time.perf_counter() - t_wait
        batch.groups = batch_order(batch.groups)
        rows, rewards = learner_rows(batch.groups, self.cfg.advantage, self.cfg.negative_credit)
        m = self._train(step, self._share(rows) or [], {"wait_s": wait_s, **batch_metrics(batch, rewards),
                                                       "stale_dropped_total": self.stale_dropped()})
        return m

    def _train(self, step: int, rows: list[Any], info: dict[str, Any] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        tokens = sum(len(r.response) for r in rows)
        with self._lock:
            self._lora_ready()
            stats = self.learner.rl_step(rows, self.cfg) if rows else {}
            train_s = time.perf_counter() - t0
            m = {"step": step, "policy_version": self.version, **(info or {}), "train_s": train_s,
                 "train_tokens": tokens, "train_tokens_per_s": tokens / train_s if train_s > 0 else 0.0, **stats}
            # Set with the weights, under the lock a checkpoint takes: a checkpoint of this step has its metrics.
            self.last_step, self.last_metrics = step, m
        return m

    def retrain(self, step: int, group_ids: list[str], max_staleness: int, as_read: bool = True) -> dict[str, Any]:
        """Train on the groups a past step consumed, as that step did (resume, replay). `as_read`:
        they are the groups `step` consumed, read as that step read them; False for other groups
        (`replay --where`), read as stored now."""
        if self.rank != 0:
            self._train(step, self._share(None) or [])
            return {}
        assert self.pool is not None
        groups = batch_order(self.pool.step_groups(step, group_ids) if as_read else self.pool.groups(group_ids))
        missing = set(group_ids) - {g.group_id for g in groups}
        if missing:
            raise RuntimeError(f"step {step}: groups {sorted(missing)[:3]} are not in the pool")
        if self.r.staleness.policy == "mask":
            for g in groups:
                v = g.consumed_version if g.consumed_version is not None else self.version
                if decide(v, g.min_version if g.min_version is not None else v, max_staleness, "mask") == "mask":
                    mask_stale_tokens(g, v, max_staleness)
        rows, rewards = learner_rows(groups, self.cfg.advantage, self.cfg.negative_credit)
        return self._train(step, self._share(rows) or [], {
            "groups": [g.group_id for g in groups], "samples": sum(len(g.samples) for g in groups),
            "reward_mean": float(np.mean(rewards)) if rewards else float("nan")})

    def stale_dropped(self) -> int:
        """Groups this learner's claims dropped as stale, waiting claims included (rank 0)."""
        return self.pool.claim_stats()["stale_dropped"] if self.pool is not None else 0

    def consumed_steps(self, first: int = 0, last: int | None = None) -> dict[int, list[str]]:
        assert self.pool is not None
        return self.pool.consumed_steps(first, last)

    def restore(self, root: str, version: int | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint under `root` (or the one of `version`): model, optimizer,
        scheduler, RNG, policy version. Returns its `extra`, or None when there is none."""
        if version is None and megatron_checkpoint.latest_checkpoint(root) is None:
            return None
        with self._lock:
            self._lora_ready()  # a LoRA run's checkpoints hold its adapters (and Adam's state of them alone)
            extra = megatron_checkpoint.load_checkpoint(self.learner, root, step=version)
            self.last_step = int(extra.get("step", self.version - 1))
            self.learner.nonfinite_skipped = int(extra.get("nonfinite_skipped_total", 0))
        return extra

    # ------------------------------------------------------------ weights

    def hf_weights(self, base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights as they are now, gathered one tensor at a time (collective: every rank
        takes every item); take the items under the lock, before a step changes the weights.
        With LoRA merged, or with `base` the base alone."""
        return self.learner.hf_weights(merged=not base)

    def export(self, out_dir: str, version: int | None = None, base: bool = False,
               dtype: str | None = None) -> str:
        """`WeightSource.export`; `version`: the one the caller means (a background evaluation's),
        which must be the learner's now (the run exports it right after publishing it)."""
        if version is not None and version != self.version:
            raise RuntimeError(f"export of version {version} asked for, but the learner is at version {self.version}")
        return super().export(out_dir, base, dtype)

    def checkpoint(self, root: str, extra: dict[str, Any]) -> dict[str, Any]:
        """Save the learner as it is now; `extra["step"]` is set to the last step it trained (a step
        may have trained since the caller asked). Returns {path, step, version}."""
        if os.environ.get(faultpoint.ENV):
            megatron_checkpoint._crash_point = lambda stage: faultpoint.reached(f"checkpoint.{stage}", self.r.run_dir)
        with self._lock:
            self._lora_ready()
            step = self.last_step
            # The step's metrics too: when this step trained after the caller asked, the run may stop before the
            # driver logs them, and resume starts after this step (Services._restore writes them back).
            extra = {**extra, "step": step, "step_metrics": self.last_metrics,
                     "nonfinite_skipped_total": self.learner.nonfinite_skipped}
            if self.pool is not None:  # the pool as this step read it stays readable while the checkpoint exists
                try:
                    extra["pool_versions"] = self.pool.tag_checkpoint(self.version, step)
                except (PoolError, OSError, ValueError) as e:  # a missing tag costs time travel, not the checkpoint
                    warnings.warn(f"checkpoint of version {self.version}: the pool versions it read were not tagged "
                                  f"({e}); `pool query --as-of-step {step}` may not find them after a cleanup",
                                  stacklevel=1)
            path = megatron_checkpoint.save_checkpoint(self.learner, root, extra=extra,
                                   keep_last=self.r.run.keep_checkpoints or None)
            if self.pool is not None and self.r.run.keep_checkpoints:  # pruned checkpoints free their versions
                try:
                    self.pool.untag_checkpoints({v for v, _ in megatron_checkpoint.list_checkpoints(root)})
                except (PoolError, OSError, ValueError) as e:
                    warnings.warn(f"the pool tags of pruned checkpoints stay ({e}): their versions are kept", stacklevel=1)
            return {"path": str(path), "step": step, "version": self.version}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def quiet_megatron() -> None:
    """megatron-core announces every missing GPU extra (TE, Apex) once per import: not news on CPU."""
    # transformers costs seconds to import and only the learner's processes need it: loaded here.
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
    hf_logging.disable_progress_bar()
