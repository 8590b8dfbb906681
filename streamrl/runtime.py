"""The run's moving parts, started and stopped in one place: Ray, the sglang-router, the engines,
the learner actor, the rollout workers, the version broadcaster and the run directory's logs.

`streamrl/loop.py` drives them; this module only wires them and offers the steps the loops
are made of (`generate`, `train_step`, `publish`, `evaluate`, `checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec

from streamrl.recipe import Recipe
from streamrl import faultpoint
from streamrl.runlog import RunLog, read_jsonl
from streamrl.types import BatchClaimed, RunCheckpointed, RunResumed, now_ns


class RunFailed(RuntimeError):
    """The run cannot go on (the message says why and what to check)."""


def prepare_inputs(r: Recipe, log: RunLog) -> None:
    """Build what the recipe says to build when missing: the tiny model, the task data."""
    if r.model.init is not None and not (Path(r.model.path) / "config.json").exists():
        from connectors.model_kit import init_model_dir

        init_model_dir(r.model.path, r.model.init.preset, r.model.init.seed)
    if r.data.generate is not None and not Path(r.data.path).exists():
        from streamrl.recipe import resolve_fn

        resolve_fn(r.data.generate.fn)(out_dir=str(Path(r.data.path).parent), **r.data.generate.args)
    for what, path in (("model.path", Path(r.model.path) / "config.json"), ("data.path", Path(r.data.path)),
                       ("data.eval_path", Path(r.data.eval_path) if r.data.eval_path else None),
                       ("sft.path", Path(r.sft.path) if r.sft else None)):
        if path is not None and not path.exists():
            hint = " (add model.init to build a tiny model, or `streamrl model init DIR`)" if what == "model.path" else ""
            raise RunFailed(f"{what}: {path} does not exist{hint}")
    # Read every dataset once now, so a malformed row stops the run before anything starts.
    from streamrl.data import DataError, PromptSource

    d = r.data
    checks = [(d.path, d.prompt_key, d.label_key)]
    if d.eval_path:
        checks.append((d.eval_path, d.prompt_key, d.label_key))
    if r.sft is not None:
        checks.append((r.sft.path, r.sft.prompt_key, r.sft.response_key))
    for path, pk, lk in checks:
        try:
            src = PromptSource(path, pk, lk, shuffle=False, on_error=d.on_error)
        except DataError as e:
            raise RunFailed(str(e)) from None
        for msg in src.skipped:
            log.warn(f"skipped a malformed row: {msg}")


def sft_rows(r: Recipe, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + eos) for the SFT warm-start; prompts encoded as rollouts encode them."""
    from streamrl.data import PromptSource
    from streamrl.rollout import encode_prompt

    s = r.sft
    assert s is not None
    src = PromptSource(s.path, s.prompt_key, s.response_key, shuffle=False, on_error=r.data.on_error)
    rows = []
    while (rec := src.next()) is not None:
        resp = list(tokenizer(str(rec.label), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        rows.append((encode_prompt(tokenizer, rec.prompt), resp))
    return rows


def eval_records(r: Recipe) -> list[Any]:
    """The held-out prompts evaluations use (data.eval_path, the first data.eval_size)."""
    from streamrl.data import PromptSource

    d = r.data
    if not d.eval_path:
        return []
    src = PromptSource(d.eval_path, d.prompt_key, d.label_key, shuffle=False, on_error=d.on_error)
    recs = []
    while (rec := src.next()) is not None and (d.eval_size is None or len(recs) < d.eval_size):
        recs.append(rec)
    return recs


def max_staleness_of(r: Recipe) -> int:
    """The bound each mode trains under: lockstep is on-policy, one-step-off one version behind."""
    return {"lockstep": 0, "one_step_off": 1}.get(r.run.mode, r.staleness.max_staleness)


class Runtime:
    def __init__(self, recipe: Recipe, run_dir: Path, progress: bool = True, resume: bool = False) -> None:
        from streamrl.loggers import LoggerUnavailable, open_loggers

        self.r, self.dir, self.resume = recipe, Path(run_dir), resume
        self.start_step = 0  # the first step this process trains (> 0 when resuming)
        self.wall_offset = 0.0  # wall time the run had used before a resume
        try:  # before anything starts: a logger whose package is missing is a recipe problem
            mirror = open_loggers(recipe.run.loggers, self.dir, recipe.run.name, recipe.run.wandb_project)
        except LoggerUnavailable as e:
            raise RunFailed(str(e)) from None
        self.log = RunLog(self.dir, echo=progress, mirror=mirror)
        self.bg_eval: Any = None  # streamrl.background_eval.BackgroundEval with run.eval_mode background
        self.producer_proc: Any = None  # `streamrl produce serve` with producer_api.enabled
        self.interrupted = False  # Ctrl-C: stop without waiting for in-flight groups
        self.progress = progress
        self.eta = max_staleness_of(recipe)
        self.router: Any = None
        self.engines: Any = None
        self.learner: Any = None
        self.workers: list[Any] = []
        self.broadcaster: Any = None
        self.tokenizer: Any = None
        self.version = 0
        self.t0 = time.perf_counter()
        self._last = (time.perf_counter(), 0)
        self.evals: list[dict[str, Any]] = []
        self._accepted: dict[int, int] = {}  # groups each worker has produced (lockstep, one-step-off)
        self.steps: list[dict[str, Any]] = []

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from connectors.launcher import EngineLauncher, RayUnavailable, ensure_ray
        from connectors.router import Router
        from streamrl.broadcast import VersionBroadcaster
        from streamrl.learner import learner_actor
        from streamrl.rollout import worker_actor

        r = self.r
        prepare_inputs(r, self.log)
        self.tokenizer = AutoTokenizer.from_pretrained(r.model.tokenizer or r.model.path)
        recipe_json = msgspec.json.encode(r)
        need = r.engines.num + r.rollout.workers + 2
        env_vars = {"PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
                    **({faultpoint.ENV: os.environ[faultpoint.ENV]} if os.environ.get(faultpoint.ENV) else {})}
        try:  # no ray.address: a Ray instance of this run's own, never one found on the machine
            ensure_ray(num_cpus=r.ray.num_cpus or need, address=r.ray.address, runtime_env={"env_vars": env_vars})
        except RayUnavailable as e:
            hint = " (check ray.address, or leave it out to start a local instance)" if r.ray.address else ""
            raise RunFailed(f"{e}{hint}") from None
        import ray

        self.log.info(f"Ray: {'joined the cluster at ' + r.ray.address if r.ray.address else 'a local instance of its own'}"
                      f" (GCS {ray.get_runtime_context().gcs_address})")
        self.log.info(f"run directory {self.dir}: starting the router, {r.engines.num} engine(s), the learner")
        self.router = Router(policy=r.engines.router_policy, log_dir=self.dir / "logs").start()
        # The SFT policy is kept as an HF directory: a resumed run or a replay builds its learner
        # (and KL reference) from it; checkpoints then hold what RL changed.
        sft_dir = self.dir / "sft_model"
        sft_done = self.resume and (sft_dir / "config.json").exists()
        if self.resume:
            shutil.rmtree(self.dir / "weights", ignore_errors=True)  # exports of the stopped run
        self.learner = learner_actor(1, r.learner.num_gpus).remote(
            recipe_json, str(sft_dir) if sft_done else r.model.path,
            str(Path(r.model.tokenizer or r.model.path).resolve()))
        self.broadcaster = VersionBroadcaster(self.router, self.learner, r.engines.weight_sync,
                                              r.staleness.partial_rollout, self.dir, self.log,
                                              keep_weights=r.engines.keep_weights)
        kwargs = {"max_running": r.engines.max_running, "threads": r.engines.threads, "seed": r.run.seed,
                  **({"cpus": r.engines.cpus} if r.engines.cpus else {})} if r.engines.backend == "embedded" else None
        self.engines = EngineLauncher(r.model.path, r.engines.num, self.router, r.engines.backend,
                                      log_dir=self.dir / "logs", extra_args=r.engines.extra_args, tp=r.engines.tp,
                                      engine_kwargs=kwargs, on_restart=self.broadcaster.on_engine_restart)
        # Engines start (slow imports) while the learner warm-starts; SFT weights reach them as version 0.
        engines_up = asyncio.create_task(self.engines.start())
        bg_up = None
        if r.run.eval_every and r.run.eval_mode == "background" and r.data.eval_path:
            from streamrl.background_eval import BackgroundEval

            self.bg_eval = BackgroundEval(r, self.log, self.tokenizer, eval_records(r), r.model.path,
                                          backend=r.engines.backend, engine_kwargs=kwargs, extra_args=r.engines.extra_args,
                                          tp=r.engines.tp, log_dir=self.dir / "logs")
            bg_up = asyncio.create_task(self.bg_eval.start())
        if r.sft is not None and not sft_done:
            await self._sft()
            await self.learner.export.remote(str(sft_dir))
        data_states = await self._restore() if self.resume else None
        await engines_up
        if bg_up is not None:
            await bg_up
        if r.sft is not None or self.version:
            _, failed = await self.broadcaster.push_disk(self.version)
            if failed:
                raise RunFailed(f"engines could not load the weights of version {self.version}: {failed}")
            self.broadcaster.version = self.version
        n = r.rollout.workers
        states = data_states if data_states and len(data_states) == n else [None] * n
        self.workers = [worker_actor().remote(recipe_json, self.router.url, i, n, self.version, states[i])
                        for i in range(n)]
        await asyncio.gather(*(w.ready.remote() for w in self.workers))
        for w in self.workers:
            await w.set_version.remote(self.version, self.eta)
        if r.producer_api.enabled:
            await self._start_producer_service()

    async def _start_producer_service(self) -> None:
        """`streamrl produce serve RUN_DIR` as a child process: it reads the published version from
        events.jsonl and hands producers the router's URL from endpoints.json."""
        from streamrl.produce import start_service_process
        from streamrl.staleness import capacity_shares

        (self.dir / "endpoints.json").write_text(json.dumps({"router_url": self.router.url}))
        self.producer_proc, url = await asyncio.to_thread(
            start_service_process, self.dir, os.getcwd(), self.dir / "logs" / "producer.log")
        self.log.info(f"producer API at {url} (bearer token in {self.dir / 'producer_token'}); external producers "
                      f"hold {1 if self.r.rollout.workers else 'all'} of {capacity_shares(self.r.rollout.workers, True)} admission shares")

    async def _restore(self) -> list[dict[str, Any]] | None:
        """Resume: load the newest checkpoint, then train the steps that came after it again on
        the groups the pool says they consumed (same batches in the same order, so the learner
        reaches the weights it had when the run stopped and no group is trained on twice or
        lost). Returns the workers' dataset positions saved with the checkpoint."""
        extra = await self.learner.restore.remote(str(self.dir / "checkpoints"))
        ck_step = int(extra["step"]) if extra else -1
        redo = await self.learner.consumed_steps.remote(ck_step + 1)
        if list(redo) != list(range(ck_step + 1, ck_step + 1 + len(redo))):
            raise RunFailed(f"cannot resume {self.dir}: the pool's consumed steps after checkpoint step {ck_step} "
                            f"are not contiguous ({list(redo)[:10]}); the pool and checkpoints do not belong together")
        original = {m["step"]: m for m in read_jsonl(self.dir / "metrics.jsonl")}
        self.wall_offset = max((m.get("wall_time_s") or 0.0 for m in original.values()), default=0.0)
        for step, ids in redo.items():
            m = await self.learner.retrain.remote(step, ids, self.eta)
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
        workers = extra.get("workers") if extra else None
        if redo:  # so that another stop does not have to train these steps a third time
            await self.checkpoint(workers)
        return workers

    async def _sft(self) -> None:
        s = self.r.sft
        assert s is not None
        rows = sft_rows(self.r, self.tokenizer)
        t0 = time.perf_counter()
        losses = await self.learner.sft.remote(rows, s.steps, s.lr, s.batch_size, self.r.run.seed)
        self.log.info(f"SFT warm-start: {s.steps} steps on {len(rows)} rows, loss {losses[0]:.3f} -> "
                      f"{losses[-1]:.3f} in {time.perf_counter() - t0:.0f}s")
        self.sft_losses = losses

    async def stop(self) -> None:
        import ray

        if self.bg_eval is not None:
            await self.bg_eval.stop()
        if self.producer_proc is not None:
            from streamrl.produce import stop_service_process

            await asyncio.to_thread(stop_service_process, self.producer_proc)

        for w in [] if self.interrupted else self.workers:  # interrupted: killed below, groups in flight restart on resume
            try:
                await asyncio.wait_for(w.close.remote(), 60)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                self.log.warn(f"rollout worker did not close cleanly: {e!r}")
        if self.engines is not None:
            await self.engines.stop()
        if self.learner is not None:
            try:
                await asyncio.wait_for(self.learner.close.remote(), 30)
            except Exception:  # noqa: BLE001
                pass
        if self.router is not None:
            await self.router.close()
        for a in [*self.workers, self.learner]:
            if a is not None:
                ray.kill(a, no_restart=True)
        if not self.r.ray.address:
            ray.shutdown()
        if self.log.mirror is not None:
            self.log.mirror.close()

    # ------------------------------------------------------------ steps the loops are made of

    def _shares(self, total: int) -> list[int]:
        n = len(self.workers)
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    async def generate(self, num_groups: int) -> None:
        """Each worker produces its share of `num_groups` accepted groups (lockstep, one-step-off)."""
        shares = self._shares(num_groups)
        busy = [i for i, k in enumerate(shares) if k]
        before = {i: self._accepted.get(i, 0) for i in busy}
        reports = await asyncio.gather(*(_worker_result(self.workers[i].generate.remote(shares[i])) for i in busy))
        for i, r in zip(busy, reports):
            self._accepted[i] = r["accepted"]
        made = sum(self._accepted[i] - before[i] for i in busy)
        if made < num_groups and any(r["exhausted"] for r in reports):
            raise RunFailed(f"the rollout workers ran out of prompts ({made} of {num_groups} groups for this step); "
                            "raise data.epochs or lower run.steps")

    def start_streaming(self) -> list[Any]:
        return [w.stream.remote() for w in self.workers]

    async def stop_workers(self) -> None:
        await asyncio.gather(*(w.stop.remote() for w in self.workers))

    async def train_step(self, step: int, streams: list[Any] | None = None) -> dict[str, Any]:
        """Claim a batch and train on it; the learner's version moves to step + 1."""
        task = asyncio.ensure_future(self.learner.train_step.remote(step, self.eta, 5.0))
        waited = time.perf_counter()
        while True:  # poll, so a worker that ran out of prompts or died ends the run with a reason
            m = await task
            if m is not None:
                break
            for s in streams or []:
                if _done(s):
                    await _worker_result(s)  # a worker that stopped with an error ends the run with that error
            if not streams and time.perf_counter() - waited > 30:  # only external producers feed this run
                waited = time.perf_counter()
                self.log.info(f"step {step}: waiting for external producers to submit groups "
                              f"({self.dir / 'producer.json'} has the URL)")
            if streams and all(_done(s) for s in streams):
                reports = await asyncio.gather(*(w.report.remote() for w in self.workers))
                raise RunFailed(f"step {step}: no batch of {self.r.rollout.groups_per_step} groups can be formed and "
                                f"the rollout workers have stopped (out of prompts: "
                                f"{all(x['exhausted'] for x in reports)}; raise data.epochs or lower run.steps)")
            task = asyncio.ensure_future(self.learner.train_step.remote(step, self.eta, 5.0))
        self.version = m["policy_version"]
        self.log.event(BatchClaimed(step=step, learner_version=m["policy_version"] - 1, group_ids=m["groups"],
                                    dropped=m["dropped_ids"], at=now_ns()))
        reports = await asyncio.gather(*(w.report.remote() for w in self.workers))
        now, tokens = time.perf_counter(), sum(x.get("gen_tokens", 0) for x in reports)
        m["gen_tokens_per_s"] = (tokens - self._last[1]) / max(1e-9, now - self._last[0])
        self._last = (now, tokens)
        m["wall_time_s"] = now - self.t0 + self.wall_offset
        m["drops"] = _sum_dicts(x["drops"] for x in reports)
        m["interrupted_calls"] = sum(x.get("interrupted_calls", 0) for x in reports)
        m["engine_errors"] = sum(x.get("engine_errors", 0) for x in reports)
        m["engine_restarts"] = self.engines.restarts
        self._reports = reports
        return m

    async def publish(self, step: int, metrics: dict[str, Any], interrupt: bool) -> None:
        """Push the learner's new version to every engine, then let the workers admit under it."""
        pub = await self.broadcaster.publish(metrics["policy_version"], step, interrupt)
        metrics.update(pause_s=pub["pause_s"], push_s=pub["push_s"], failed_engines=pub["failed_engines"])
        await asyncio.gather(*(w.set_version.remote(metrics["policy_version"]) for w in self.workers))
        self.steps.append(metrics)
        self.log.metrics({k: v for k, v in metrics.items() if k != "groups"} | {"groups": metrics["groups"]})
        every = self.r.run.checkpoint_every
        if every and (step + 1) % every == 0:
            await self.checkpoint()
        from streamrl.evaluate import eval_due

        v = metrics["policy_version"]
        if eval_due(self.r.run, v):
            if self.bg_eval is not None:  # the learner kept version v for this export
                path = str(self.dir / "weights" / f"eval-v{v:06d}")
                self.bg_eval.submit(v, step + 1, self.learner.export.remote(path, v), metrics["wall_time_s"])
            else:
                await self.evaluate(step + 1)  # on the rollout engines: training waits

    async def checkpoint(self, workers: list[dict[str, Any]] | None = None) -> None:
        """`workers`: their dataset positions (default: as of the last step's reports)."""
        if workers is None:
            workers = [x["data_state"] for x in getattr(self, "_reports", [])]
        ck = await self.learner.checkpoint.remote(str(self.dir / "checkpoints"), {"workers": workers})
        self.log.event(RunCheckpointed(step=ck["step"], version=ck["version"], path=ck["path"], at=now_ns()))

    async def evaluate(self, step: int) -> dict[str, Any] | None:
        """Held-out accuracy at the version the engines serve now (eval.jsonl)."""
        if not self.r.data.eval_path:
            return None
        from connectors.sglang_client import SGLangClient
        from streamrl.evaluate import evaluate

        async with SGLangClient(self.router.url) as c:
            res = await evaluate(c, self.tokenizer, eval_records(self.r), self.r)
        served = self.broadcaster.version  # what the engines serve (the learner may be a step ahead)
        wall = time.perf_counter() - self.t0 + self.wall_offset if self.steps else self.wall_offset
        row = {"policy_version": served, "step": step, "wall_time_s": wall, "mode": "inline", **res}
        self.evals.append(row)
        self.log.eval(row)
        self.log.info(f"eval at version {served}: accuracy {res['accuracy']:.3f} "
                      f"(greedy {res['greedy_accuracy']:.3f}) over {res['prompts']} prompts")
        return row

    async def export(self) -> str:
        return await self.learner.export.remote(str(self.dir / "model"))


async def _worker_result(ref: Any) -> Any:
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RunFailed(f"a rollout worker stopped: {cause}") from None


def _done(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _sum_dicts(ds: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out

