"""The run's services, started and stopped in one place: Ray, the sglang-router, the engines,
the learner actor, the rollout workers, the version broadcaster, background evaluation, the
producer API and the run directory's logs. Start-up ends with the learner at the version the run
continues from: 0, the SFT policy, or (resume) the checkpoint plus the steps trained after it
again (`start_step`, `version`). `streamrl/runtime/steps.py` holds what happens every step.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec

from streamrl.connectors.auth import Keys, write_private
from streamrl.connectors.ports import LOOPBACK, NODE, bind_host
from streamrl.core.types import RunCheckpointed, RunResumed
from streamrl.recipe import Recipe, learner_layout, learner_summary
from streamrl.runtime import RunFailed, faultpoint
from streamrl.runtime.inputs import eval_records, prepare_inputs, sft_rows
from streamrl.runtime.runlog import RunLog, now_ns, read_jsonl


class Services:
    def __init__(self, recipe: Recipe, run_dir: Path, progress: bool = True, resume: bool = False) -> None:
        from streamrl.tools.loggers import LoggerUnavailable, open_loggers

        self.r, self.dir, self.resume = recipe, Path(run_dir), resume
        try:  # before anything starts: a logger whose package is missing is a recipe problem
            mirror = open_loggers(recipe.run.loggers, self.dir, recipe.run.name, recipe.run.wandb_project)
        except LoggerUnavailable as e:
            raise RunFailed(str(e)) from None
        self.log = RunLog(self.dir, echo=progress, mirror=mirror)
        self.max_staleness = recipe.max_staleness
        self.router: Any = None
        self.engines: Any = None  # streamrl.connectors.sglang.launcher.EngineLauncher
        self.learner: Any = None  # the learner actor (streamrl/runtime/learner.py)
        self.crew: Any = None  # the rollout workers (streamrl/runtime/workers.py)
        self.engines_pg: Any = None  # placement groups (streamrl/runtime/placement.py); the learner's is its own
        self.workers_pg: Any = None
        self.broadcaster: Any = None
        self.bg_eval: Any = None  # BackgroundEval with run.eval_mode background
        self.producer_proc: Any = None  # `streamrl produce serve` with producer_api.enabled
        self.tokenizer: Any = None
        self.keys = Keys.new()  # this run's engine and router keys (connectors/auth.py), kept in memory
        self.interrupted = False  # Ctrl-C: stop without waiting for in-flight groups
        # Where start-up leaves the run (resume: after the checkpoint and the steps trained again).
        self.version = 0
        self.start_step = 0
        self.wall_offset = 0.0  # wall time the run had used before a resume
        self.data_states: list[dict[str, Any]] | None = None  # the workers' dataset positions at the checkpoint

    # ------------------------------------------------------------ start

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from streamrl.connectors.sglang.launcher import EngineLauncher, RayUnavailable, engine_gpus, ensure_ray
        from streamrl.connectors.sglang.router import Router
        from streamrl.runtime import placement
        from streamrl.runtime.broadcast import VersionBroadcaster
        from streamrl.runtime.learner_group import LearnerGroup
        from streamrl.runtime.rollout import worker_actor
        from streamrl.runtime.user_code import runtime_env
        from streamrl.runtime.workers import Crew

        r = self.r
        prepare_inputs(r, self.log)
        self.tokenizer = AutoTokenizer.from_pretrained(r.model.tokenizer or r.model.path)
        recipe_json = msgspec.json.encode(r)
        need = r.engines.num + r.rollout.workers + 1 + math.prod(learner_layout(r))
        env_vars = {"PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1",
                    **({faultpoint.ENV: os.environ[faultpoint.ENV]} if os.environ.get(faultpoint.ENV) else {})}
        env = runtime_env(r, env_vars)
        if env.get("py_modules"):
            self.log.info(f"shipping your modules to every Ray worker: {', '.join(env['py_modules'])}")
        try:  # no ray.address: a Ray instance of this run's own, never one found on the machine
            ensure_ray(num_cpus=r.ray.num_cpus or need, address=r.ray.address, runtime_env=env)
        except RayUnavailable as e:
            hint = " (check ray.address, or leave it out to start a local instance)" if r.ray.address else ""
            raise RunFailed(f"{e}{hint}") from None
        import ray

        self.log.info(f"Ray: {'joined the cluster at ' + r.ray.address if r.ray.address else 'a local instance of its own'}"
                      f" (GCS {ray.get_runtime_context().gcs_address})")
        self.log.info(f"run directory {self.dir}: starting the router, {r.engines.num} engine(s), the learner")
        self.log.info(f"learner: {learner_summary(r)}")
        groups = placement.plan(r, engine_gpus(r.engines.backend, r.engines.tp), placement.ENGINE_CPUS)
        placement.check(groups)  # before anything starts: exit 2 naming a short resource
        # network.bind node: the servers bind their node's cluster address (engines theirs, the router and
        # the producer API the driver's), else 127.0.0.1; the keys are required either way.
        node = r.network.bind == "node"
        self.bind = bind_host(NODE) if node else LOOPBACK
        self.router = Router(host=self.bind, policy=r.engines.router_policy, log_dir=self.dir / "logs",
                             keys=self.keys).start()
        # Who may generate during the run (the user with curl, the producer service for external
        # producers) finds the router and the API key here (owner-only; never the admin key).
        write_private(self.dir / "endpoints.json", json.dumps({"router_url": self.router.url, "api_key": self.keys.api}))
        self.log.info(f"sglang-router at {self.router.url} (it and the engines want this run's keys: "
                      f"the API key is in {self.dir / 'endpoints.json'})")
        # The SFT policy is kept as an HF directory: a resumed run or a replay builds its learner
        # (and KL reference) from it; checkpoints then hold what RL changed.
        sft_dir = self.dir / "sft_model"
        sft_done = self.resume and (sft_dir / "config.json").exists()
        if self.resume:
            shutil.rmtree(self.dir / "weights", ignore_errors=True)  # exports of the stopped run
        self.learner = LearnerGroup(r, str(sft_dir) if sft_done else r.model.path,
                                    str(Path(r.model.tokenizer or r.model.path).resolve()))
        self.engines_pg, self.workers_pg = placement.group(groups["engines"]), placement.group(groups["workers"])
        for pg, what in ((self.learner.pg, "the learner's ranks"), (self.engines_pg, "the engines"),
                         (self.workers_pg, "the rollout workers")):
            await placement.ready(pg, what)
        self.broadcaster = VersionBroadcaster(self.router, self.learner, r.engines.weight_sync,
                                              r.staleness.partial_rollout, self.dir, self.log,
                                              host=NODE if node else LOOPBACK, keep_weights=r.engines.keep_weights,
                                              tp=r.engines.tp)
        (self.dir / "weights").mkdir(parents=True, exist_ok=True)
        kwargs = {"max_running": r.engines.max_running, "threads": r.engines.threads, "seed": r.run.seed,
                  "weights_root": str((self.dir / "weights").resolve()),  # the only weights an engine may load
                  **({"cpus": r.engines.cpus} if r.engines.cpus else {})} if r.engines.backend == "embedded" else None
        self.engines = EngineLauncher(r.model.path, r.engines.num, self.router, r.engines.backend,
                                      log_dir=self.dir / "logs", extra_args=r.engines.extra_args, tp=r.engines.tp,
                                      engine_kwargs=kwargs, on_restart=self.broadcaster.on_engine_restart,
                                      host=NODE if node else r.engines.host, num_cpus=placement.ENGINE_CPUS,
                                      placement_group=self.engines_pg)
        # Engines start (slow imports) while the learner warm-starts; SFT weights reach them as version 0.
        engines_up = asyncio.create_task(self.engines.start())
        bg_up = None
        if r.run.eval_every and r.run.eval_mode == "background" and r.data.eval_path:
            from streamrl.runtime.background_eval import BackgroundEval

            self.bg_eval = BackgroundEval(r, self.log, self.tokenizer, eval_records(r), r.model.path,
                                          backend=r.engines.backend, engine_kwargs=kwargs, extra_args=r.engines.extra_args,
                                          tp=r.engines.tp, log_dir=self.dir / "logs", keys=self.keys)
            bg_up = asyncio.create_task(self.bg_eval.start())
        if r.sft is not None and not sft_done:
            await self._sft()
            await self.learner.export.remote(str(sft_dir))
        if self.resume:
            await self._restore()
        self.log.info(f"engines at {', '.join(await engines_up)} (behind the router)")
        if bg_up is not None:
            await bg_up
        if r.sft is not None or self.version:
            _, failed = await self.broadcaster.push_disk(self.version)
            if failed:
                raise RunFailed(f"engines could not load the weights of version {self.version}: {failed}")
            self.broadcaster.version = self.version
        n = r.rollout.workers
        states = self.data_states if self.data_states and len(self.data_states) == n else [None] * n

        def spawn(i: int, version: int, state: dict[str, Any] | None) -> Any:  # worker i, in bundle i
            return worker_actor(placement.WORKER_CPUS).options(**placement.on(self.workers_pg, i)).remote(
                recipe_json, self.router.url, i, n, version, state, self.keys.api)

        self.crew = Crew(spawn, states, self.version, self.max_staleness, self.log)
        await self.crew.start()
        if r.producer_api.enabled:
            await self._start_producer_service()

    async def _start_producer_service(self) -> None:
        """`streamrl produce serve RUN_DIR` as a child process: it reads the published version from
        events.jsonl and hands producers the router's URL from endpoints.json."""
        from streamrl.core.staleness import capacity_shares
        from streamrl.producers.api_process import start_service_process

        self.producer_proc, url = await asyncio.to_thread(
            start_service_process, self.dir, os.getcwd(), self.dir / "logs" / "producer.log",
            host=self.bind if self.r.network.bind == "node" else None)
        self.log.info(f"producer API at {url} (bearer token in {self.dir / 'producer_token'}); external producers "
                      f"hold {1 if self.r.rollout.workers else 'all'} of {capacity_shares(self.r.rollout.workers, True)} admission shares")

    async def _restore(self) -> None:
        """Resume: load the newest checkpoint, then train the steps that came after it again on
        the groups the pool says they consumed (same batches in the same order, so the learner
        reaches the weights it had when the run stopped and no group is trained on twice or
        lost). Keeps the workers' dataset positions saved with the checkpoint."""
        extra = await self.learner.restore.remote(str(self.dir / "checkpoints"))
        ck_step = int(extra["step"]) if extra else -1
        redo = await self.learner.consumed_steps.remote(ck_step + 1)
        if list(redo) != list(range(ck_step + 1, ck_step + 1 + len(redo))):
            raise RunFailed(f"cannot resume {self.dir}: the pool's consumed steps after checkpoint step {ck_step} "
                            f"are not contiguous ({list(redo)[:10]}); the pool and checkpoints do not belong together")
        original = {m["step"]: m for m in read_jsonl(self.dir / "metrics.jsonl")}
        self.wall_offset = max((m.get("wall_time_s") or 0.0 for m in original.values()), default=0.0)
        kept = (extra or {}).get("step_metrics") or {}
        if ck_step >= 0 and ck_step not in original and kept.get("step") == ck_step:
            # The checkpoint caught a step that trained while the last publish ran; the run stopped before logging it.
            self.log.metrics(kept | {"from_checkpoint": True, "wall_time_s": self.wall_offset})
        for step, ids in redo.items():
            m = await self.learner.retrain.remote(step, ids, self.max_staleness)
            was = original.get(step)
            if was is None:  # the run stopped after the claim, before the step's metrics were written
                self.log.metrics(m | {"redo": True, "wall_time_s": self.wall_offset})
            elif was.get("loss") != m.get("loss"):
                self.log.warn(f"step {step} trained again on its {len(ids)} groups gives loss {m.get('loss')}, "
                              f"the stopped run had {was.get('loss')}: the resumed weights differ slightly")
        self.version = await self.learner.ping.remote()
        self.start_step = ck_step + 1 + len(redo)
        self.log.event(RunResumed(checkpoint_step=ck_step, redone_steps=list(redo), version=self.version, at=now_ns()))
        self.log.info(f"resuming {self.dir} at step {self.start_step} (version {self.version}): checkpoint of step "
                      f"{ck_step}, then {len(redo)} step(s) trained again from the pool")
        self.data_states = extra.get("workers") if extra else None
        if redo:  # so that another stop does not have to train these steps a third time
            await self.checkpoint(self.data_states)

    async def _sft(self) -> None:
        s = self.r.sft
        assert s is not None
        rows = sft_rows(self.r, self.tokenizer)
        t0 = time.perf_counter()
        losses = await self.learner.sft.remote(rows, s.steps, s.lr, s.batch_size, self.r.run.seed, s.lr_schedule)
        self.log.info(f"SFT warm-start: {s.steps} steps on {len(rows)} rows, loss {losses[0]:.3f} -> "
                      f"{losses[-1]:.3f} in {time.perf_counter() - t0:.0f}s")

    # ------------------------------------------------------------ what outlives a step

    async def checkpoint(self, workers: list[dict[str, Any]] | None) -> None:
        """The learner's checkpoint, with the rollout workers' dataset positions `workers`."""
        ck = await self.learner.checkpoint.remote(str(self.dir / "checkpoints"), {"workers": workers or []})
        self.log.event(RunCheckpointed(step=ck["step"], version=ck["version"], path=ck["path"], at=now_ns()))

    async def export(self) -> str:
        """The final policy in HF format (RUN_DIR/model)."""
        return await self.learner.export.remote(str(self.dir / "model"))

    # ------------------------------------------------------------ stop

    async def stop(self) -> None:
        import ray

        if self.bg_eval is not None:
            await self.bg_eval.stop()
        if self.producer_proc is not None:
            from streamrl.producers.api_process import stop_service_process

            await asyncio.to_thread(stop_service_process, self.producer_proc)

        workers = self.crew.actors if self.crew is not None else []
        if self.crew is not None and not self.interrupted:  # interrupted: killed below, groups in flight restart on resume
            try:
                await asyncio.wait_for(self.crew.call("close"), 60)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                self.log.warn(f"rollout workers did not close cleanly: {e!r}")
        if self.engines is not None:
            await self.engines.stop()
        if self.learner is not None:
            try:
                await asyncio.wait_for(self.learner.close.remote(), 30)
            except Exception:  # noqa: BLE001
                pass
        if self.router is not None:
            await self.router.close()
        for a in workers:
            ray.kill(a, no_restart=True)
        if self.learner is not None:
            self.learner.kill()
        for pg in (self.engines_pg, self.workers_pg):
            if pg is not None:
                ray.util.remove_placement_group(pg)
        if not self.r.ray.address:
            ray.shutdown()
        if self.log.mirror is not None:
            self.log.mirror.close()
