"""The learner as a group of Ray actors: tp * pp * dp ranks (learner.parallel) in one placement
group, driven through one handle that looks like a single learner actor.

    group = LearnerGroup(recipe, model_dir, tokenizer_dir)
    m = await group.train_step.remote(step, max_staleness, 5.0)      # every rank trains; rank 0's metrics
    await group.push_weights.remote(bucketed)              # every rank gathers, rank 0 sends

Collective methods (training, SFT, restore, checkpoint, and publishing: the weights are gathered
from every rank's shards as they are pushed or exported) run on every rank with the same
arguments, in the order the driver called them: each call carries a sequence number and a rank
runs call k only after k - 1, so two collectives never interleave differently on two ranks, and
a publish asked for before the next step takes the weights before that step changes them.
Awaiting a collective waits for all ranks and raises the first rank's error. Everything else
(the weight group's set-up, pool queries) goes to rank 0, on another of its threads.

The ranks join torch.distributed through a TCPStore this process serves on 127.0.0.1; the
placement group holds them (one bundle per rank: a CPU slot, plus a GPU on GPU; recipe
`placement.learner`, STRICT_PACK by default: one node).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from typing import Any

import msgspec
import ray
from ray.util.placement_group import remove_placement_group

from streamrl.connectors.ports import LOOPBACK, NODE, bind_host, tcp_store
from streamrl.connectors.sglang.launcher import ensure_ray
from streamrl.recipe import Recipe, learner_layout
from streamrl.runtime import placement

COLLECTIVE = frozenset({"train_step", "retrain", "sft", "restore", "checkpoint", "push_weights", "export",
                        "weights_meta", "export_adapter"})
EVERY_RANK = frozenset({"close"})  # on all ranks, but no collective inside: not ordered


class _Rank:
    """One rank: a LearnerDriver (streamrl/runtime/learner.py) built in the actor's own process.
    The run's driver only names this class, so it never imports megatron-core (5 s of CPU at the
    start of every run on a CPU machine, before Ray is even up); every call reaches the LearnerDriver
    through `ordered` (collectives) or `call`."""

    def __init__(self, recipe_json: bytes, model_dir: str, tokenizer_dir: str, rank: int, store_port: int,
                 store_host: str) -> None:
        from streamrl.runtime.learner import LearnerDriver, quiet_megatron  # in the actor only: see above

        quiet_megatron()
        self._turn = threading.Condition()
        self._next = 0
        self.driver = LearnerDriver(msgspec.json.decode(recipe_json, type=Recipe), model_dir, rank=rank,
                                    store_port=store_port, store_host=store_host)
        if self.driver.pool is not None:
            self.driver.pool.set_tokenizer(tokenizer_dir)  # `streamrl pool show` decodes with it

    def ordered(self, seq: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run collective `name` as call number `seq` of the group (see the module docstring)."""
        with self._turn:
            self._turn.wait_for(lambda: self._next == seq)
        try:
            return self.call(name, *args, **kwargs)
        finally:
            with self._turn:
                self._next += 1
                self._turn.notify_all()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ping":
            return self.driver.version
        return getattr(self.driver, name)(*args, **kwargs)


class _Method:
    def __init__(self, group: LearnerGroup, name: str) -> None:
        self.group, self.name = group, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        g = self.group
        if self.name in COLLECTIVE:
            seq = next(g._seq)
            return _all([r.ordered.remote(seq, self.name, *args, **kwargs) for r in g.ranks])
        if self.name in EVERY_RANK:
            return _all([r.call.remote(self.name, *args, **kwargs) for r in g.ranks])
        return g.ranks[0].call.remote(self.name, *args, **kwargs)


async def _all(refs: list[Any]) -> Any:
    """Rank 0's result once every rank finished; the first error as soon as one rank fails."""
    tasks = [asyncio.ensure_future(_await(r)) for r in refs]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            raise t.exception()  # type: ignore[misc]
    return tasks[0].result()


async def _await(ref: Any) -> Any:
    return await ref


class LearnerGroup:
    def __init__(self, recipe: Recipe, model_dir: str, tokenizer_dir: str) -> None:
        tp, pp, dp = learner_layout(recipe)
        self.world = tp * pp * dp
        gpus = 1 if recipe.learner.num_gpus else 0
        have = ray.cluster_resources().get("GPU", 0)
        if gpus and have < self.world:  # Ray would keep the group pending forever
            raise RuntimeError(f"the learner needs {self.world} GPU(s) (learner.parallel tp {tp} x pp {pp} x dp {dp}) "
                               f"but the Ray cluster has {have:g}")
        # The ranks' rendezvous, kept for the group's life (new_group uses it): on this node's cluster address
        # when the ranks may be on other nodes (network.bind: node), else loopback
        self.store_host = bind_host(NODE) if recipe.network.bind == "node" else LOOPBACK
        self.store = tcp_store(self.world, host=self.store_host)
        self.pg = placement.group(placement.learner_request(recipe))
        # Threads: rank 0 joins the weight group and answers pool queries while a collective runs.
        cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0, max_concurrency=8)(_Rank)
        recipe_json = msgspec.json.encode(recipe)
        self.ranks = [cls.options(**placement.on(self.pg, i)).remote(recipe_json, model_dir, tokenizer_dir, i,
                                                                     self.store.port, self.store_host)
                      for i in range(self.world)]
        self._seq = itertools.count()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def kill(self) -> None:
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        remove_placement_group(self.pg)


class SyncLearner:
    """A LearnerGroup on a Ray instance of its own, called from synchronous code (`streamrl
    replay` of a run whose learner had several ranks: the same layout gives the same numbers)."""

    def __init__(self, recipe: Recipe, model_dir: str, tokenizer_dir: str) -> None:
        ensure_ray(num_cpus=math.prod(learner_layout(recipe)) + 1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        self._loop = asyncio.new_event_loop()
        self.group = LearnerGroup(recipe, model_dir, tokenizer_dir)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(_await(getattr(self.group, name).remote(*args, **kwargs)))
        return call

    def close(self) -> None:
        try:
            self._loop.run_until_complete(_await(self.group.close.remote()))
        finally:
            self.group.kill()
            ray.shutdown()
            self._loop.close()
