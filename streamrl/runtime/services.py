"""The run's services, started and stopped in one place: Ray, the sglang-router, the engines,
the learner actor, the rollout workers, the version broadcaster, background evaluation, the
producer API and the run directory's logs. Start-up ends with the learner at the version the run
continues from: 0, the SFT policy, or (resume) the checkpoint plus the steps trained after it
again (`resumed`: streamrl/runtime/resume.py). `streamrl/runtime/steps.py` holds what happens every step.
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
import ray
from transformers import AutoTokenizer

from streamrl.connectors.auth import Keys, write_private
from streamrl.connectors.ports import LOOPBACK, NODE, bind_host
from streamrl.connectors.sglang.cpu_sglang import cpu_args
from streamrl.connectors.sglang.launcher import EngineLauncher, RayUnavailable, engine_gpus, ensure_ray
from streamrl.connectors.sglang.router import Router
from streamrl.core import lora as lora_names
from streamrl.core.engine_dtype import engine_dtype
from streamrl.core.staleness import capacity_shares
from streamrl.core.types import RunCheckpointed
from streamrl.producers.api_process import start_service_process, stop_service_process
from streamrl.recipe import Recipe, learner_layout, learner_summary
from streamrl.runtime import RunFailed, faultpoint, placement
from streamrl.runtime.background_eval import BackgroundEval
from streamrl.runtime.broadcast import VersionBroadcaster
from streamrl.runtime.inputs import check_enough_prompts, eval_records, prepare_inputs, sft_rows
from streamrl.runtime.learner_group import LearnerGroup
from streamrl.runtime.resume import Resumed, restore
from streamrl.runtime.rollout import model_routing, worker_actor
from streamrl.runtime.runlog import RunLog, now_ns
from streamrl.runtime.user_code import runtime_env
from streamrl.runtime.workers import Crew
from streamrl.tools.loggers import LoggerUnavailable, open_loggers

ROUTED_FLAG = "--enable-return-routed-experts"  # SGLang 0.5.23 server flag for rollout.routing
LORA_FLAG = "--enable-lora"  # SGLang 0.5.23: serve LoRA adapters (learner.lora)


class Services:
    def __init__(self, recipe: Recipe, run_dir: Path, progress: bool = True, resume: bool = False) -> None:
        self.r, self.dir, self.resume = recipe, Path(run_dir), resume
        try:  # before anything starts: a logger whose package is missing is a recipe problem
            mirror = open_loggers(recipe.run.loggers, self.dir, recipe.run.name, recipe.run.wandb_project)
        except LoggerUnavailable as e:
            raise RunFailed(str(e)) from None
        self.log = RunLog(self.dir, echo=progress, mirror=mirror)
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
        self.resumed = Resumed()  # where start-up leaves the run (streamrl/runtime/resume.py)

    # ------------------------------------------------------------ start

    async def start(self) -> None:
        r = self.r
        check_enough_prompts(r, prepare_inputs(r, self.log))
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
        if self.learner.world > 1:
            self.log.info(f"learner: {self.learner.world} ranks meet at {self.learner.store_host}:{self.learner.store.port}")
        self.engines_pg, self.workers_pg = placement.group(groups["engines"]), placement.group(groups["workers"])
        for pg, what in ((self.learner.pg, "the learner's ranks"), (self.engines_pg, "the engines"),
                         (self.workers_pg, "the rollout workers")):
            await placement.ready(pg, what)
        hosts = placement.check_hosts(r.network.bind, {"the learner's ranks": self.learner.pg,
                                                       "the engines": self.engines_pg, "the rollout workers": self.workers_pg})
        if len(set().union(*hosts.values())) > 1:
            self.log.info("placed on " + "; ".join(f"{what} on {', '.join(sorted(ips))}" for what, ips in hosts.items() if ips))
        self.broadcaster = VersionBroadcaster(self.router, self.learner, r.engines.weight_sync,
                                              r.staleness.partial_rollout, self.dir, self.log,
                                              host=NODE if node else LOOPBACK, keep_weights=r.engines.keep_weights,
                                              tp=r.engines.tp, lora=r.learner.lora is not None,
                                              timeout_s=r.engines.push_timeout_s,
                                              bucket_bytes=int(r.engines.push_bucket_mb * 1024**2))
        (self.dir / "weights").mkdir(parents=True, exist_ok=True)
        kwargs = {"max_running": r.engines.max_running, "threads": r.engines.threads, "seed": r.run.seed,
                  "weights_root": str((self.dir / "weights").resolve()),  # the only weights an engine may load
                  **({"cpus": r.engines.cpus} if r.engines.cpus else {})} if r.engines.backend == "embedded" else None
        extra = list(r.engines.extra_args)
        if r.engines.backend == "sglang" and "--random-seed" not in extra:  # ("auto" may turn out embedded: no extra_args)
            extra += ["--random-seed", str(r.run.seed)]  # as the embedded engine's seed: sampling repeats run to run
        if r.engines.backend == "sglang" and model_routing(r) and ROUTED_FLAG not in extra:
            extra.append(ROUTED_FLAG)  # SGLang captures routed experts only with it (the embedded engine always can)
        if r.engines.backend != "embedded" and r.learner.lora is not None and LORA_FLAG not in extra:
            # SGLang loads adapters at run time only when started for them (its lora_hook.py: without
            # --lora-paths it wants the largest rank and the modules up front)
            lo = r.learner.lora
            extra += [LORA_FLAG, "--max-lora-rank", str(lo.rank), "--lora-target-modules",
                      *lora_names.hf_modules(lora_names.targets(lo.target_modules)[0])]
        self.broadcaster.dtype = self._engine_dtype(extra)
        self.engines = EngineLauncher(r.model.path, r.engines.num, self.router, r.engines.backend,
                                      log_dir=self.dir / "logs", extra_args=extra, tp=r.engines.tp,
                                      engine_kwargs=kwargs, on_restart=self.broadcaster.on_engine_restart,
                                      host=NODE if node else r.engines.host, num_cpus=placement.ENGINE_CPUS,
                                      placement_group=self.engines_pg, python=r.engines.python,
                                      threads=r.engines.threads, cpus=r.engines.cpus)
        # Engines start (slow imports) while the learner warm-starts; SFT weights reach them as version 0.
        engines_up = asyncio.create_task(self.engines.start())
        bg_up = None
        if r.run.eval_every and r.run.eval_mode in ("background", "after") and r.data.eval_path:
            self.bg_eval = BackgroundEval(r, self.log, self.tokenizer, eval_records(r), r.model.path,
                                          backend=r.engines.backend, engine_kwargs=kwargs, extra_args=r.engines.extra_args,
                                          tp=r.engines.tp, log_dir=self.dir / "logs", keys=self.keys)
            if r.run.eval_mode == "after":
                self.bg_eval.hold()
            bg_up = asyncio.create_task(self.bg_eval.start())
        if r.sft is not None and not sft_done:
            await self._sft()
            await self.learner.export.remote(str(sft_dir))
        if self.resume:
            self.resumed = await restore(self.learner, self.dir, self.log, r.max_staleness)
            if self.resumed.redone:  # another stop need not train these steps a third time
                await self.checkpoint(self.resumed.data_states)
        n = r.rollout.workers
        saved = self.resumed.data_states
        states = saved if saved and len(saved) == n else [None] * n

        def spawn(i: int, version: int, state: dict[str, Any] | None) -> Any:  # worker i, in bundle i
            return worker_actor(placement.WORKER_CPUS).options(**placement.on(self.workers_pg, i)).remote(
                recipe_json, self.router.url, i, n, version, state, self.keys.api)

        # The rollout workers are built (slow imports: tokenizer, pool) while the engines still start;
        # none generates before the run's loop asks it to.
        self.crew = Crew(spawn, states, self.resumed.version, r.max_staleness, self.log)
        workers_up = asyncio.create_task(self.crew.start())
        try:
            engine_urls = await engines_up
        except BaseException:
            workers_up.cancel()
            raise
        self.log.info(f"engines at {', '.join(engine_urls)} (behind the router)")
        if bg_up is not None:
            await bg_up
        version = self.resumed.version
        if r.learner.lora is not None:  # the base weights (an SFT warm-start's) and the version's adapter
            failed = await self.broadcaster.start_lora(version, base_changed=r.sft is not None)
            if failed:
                raise RunFailed(f"engines could not load the base and adapter of version {version}: {failed}")
            self.broadcaster.version = version
        elif r.sft is not None or version:
            _, failed = await self.broadcaster.push_disk(version)
            if failed:
                raise RunFailed(f"engines could not load the weights of version {version}: {failed}")
            self.broadcaster.version = version
        await workers_up
        await self.crew.set_engines(engine_urls)
        if r.producer_api.enabled:
            await self._start_producer_service()

    def _engine_dtype(self, extra: list[str]) -> str:
        """The engines' weight dtype (core/engine_dtype.py), which every push is cast to."""
        r = self.r
        gpu = engine_gpus(r.engines.backend, r.engines.tp) > 0
        sglang = r.engines.backend == "sglang" or gpu  # "auto": SGLang where the cluster has GPUs
        config = json.loads(Path(r.model.path, "config.json").read_text())
        dtype = engine_dtype(sglang, cpu_args(extra) if sglang and not gpu else extra, config)
        learner = {"fp32": "float32", "bf16": "bfloat16"}[r.learner.dtype]
        if dtype != learner:
            self.log.info(f"the engines hold {dtype} weights and the learner {learner}: every push is cast to {dtype}")
        return dtype

    async def _start_producer_service(self) -> None:
        """`streamrl produce serve RUN_DIR` as a child process: it reads the published version from
        events.jsonl and hands producers the router's URL from endpoints.json."""
        self.producer_proc, url = await asyncio.to_thread(
            start_service_process, self.dir, os.getcwd(), self.dir / "logs" / "producer.log",
            host=self.bind if self.r.network.bind == "node" else None)
        self.log.info(f"producer API at {url} (bearer token in {self.dir / 'producer_token'}); external producers "
                      f"hold {1 if self.r.rollout.workers else 'all'} of {capacity_shares(self.r.rollout.workers, True)} admission shares")

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
        """The final policy in HF format (RUN_DIR/model; LoRA: merged, and the adapter alone in RUN_DIR/adapter)."""
        if self.r.learner.lora is not None:
            await self.learner.export_adapter.remote(str(self.dir / "adapter"))
        return await self.learner.export.remote(str(self.dir / "model"))

    # ------------------------------------------------------------ stop

    async def stop(self) -> None:
        import ray

        if self.bg_eval is not None:
            await self.bg_eval.stop()
        if self.producer_proc is not None:
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
