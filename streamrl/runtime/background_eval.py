"""Background evaluation pinned to a version: held-out accuracy of exactly version V, measured on
a dedicated engine while training goes on.

The rollout engines change version every step, so they cannot evaluate one version without
stalling training. One extra engine (an `EngineActor` on Ray, like the rollout engines, but not
behind the run's router; on a GPU node it takes its own GPUs; the embedded engine runs under
SCHED_IDLE, on CPU time training does not use) does it instead: for each submitted version it loads
that version's HF export (`/update_weights_from_disk`, weight_version V), runs
`streamrl.runtime.evaluate.evaluate` against it, checks that every response came from V, and writes one
row to eval.jsonl:

    {"policy_version": V, "step": S, "wall_time_s": <submitted at>, "finished_wall_s": ...,
     "mode": "background", "accuracy": ..., "greedy_accuracy": ..., "engine_versions": ["V"], ...}

Evaluations run one at a time; at most `max_pending` wait (the oldest waiting one is skipped
when a new one arrives: training never blocks on evaluation). After `hold()` (`run.eval_mode:
after`) none starts and none is skipped until `drain()`: the exports wait on disk and the engine
evaluates them once training is over, so on a machine with few cores the run's clock measures
training alone. An export under RUN_DIR/weights/
is temporary and deleted once evaluated (or skipped).

    bg = BackgroundEval(recipe, log, tokenizer, records, model_dir, backend="embedded",
                        engine_kwargs={...}, log_dir=run_dir / "logs")
    await bg.start()
    bg.submit(version, step, learner.export.remote(str(run_dir / "weights" / f"eval-v{version:06d}")), wall_s)
    ...
    await bg.drain(); await bg.stop()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from streamrl.connectors.auth import Keys
from streamrl.connectors.sglang.client import SGLangClient
from streamrl.connectors.sglang.launcher import EngineLauncher
from streamrl.core.evalstats import with_ci
from streamrl.plugins.data import PromptRecord
from streamrl.recipe import Recipe
from streamrl.runtime.evaluate import evaluate
from streamrl.runtime.runlog import RunLog


@dataclass
class _Job:
    version: int
    step: int
    weights: Awaitable[str] | str
    wall_time_s: float


class BackgroundEval:
    def __init__(self, recipe: Recipe, log: RunLog, tokenizer: Any, records: list[PromptRecord], model_dir: str, *,
                 backend: str, engine_kwargs: dict[str, Any] | None, extra_args: Sequence[str] = (), tp: int = 1,
                 log_dir: Path, max_pending: int = 2, clock: Callable[[], float] = time.perf_counter,
                 t0: float = 0.0, startup_timeout_s: float = 600, keys: Keys | None = None) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.recipe, self.log, self.tokenizer, self.records = recipe, log, tokenizer, list(records)
        self.model_dir, self.backend, self.tp = str(model_dir), backend, tp
        self.keys = keys  # its engine's keys (connectors/auth.py)
        self.engine_kwargs = {**(engine_kwargs or {}), "idle": True} if backend == "embedded" else engine_kwargs
        self.extra_args, self.log_dir = list(extra_args), Path(log_dir)
        self.max_pending, self.clock, self.t0 = max_pending, clock, t0
        self.startup_timeout_s = startup_timeout_s
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[int] = []  # versions dropped because the queue was full
        self.url = ""
        self._actor: Any = None
        self._client: Any = None
        self._pending: collections.deque[_Job] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._released = asyncio.Event()  # cleared by hold(): evaluations wait for drain()
        self._released.set()
        self.mode = "background"  # eval.jsonl's "mode"; "after" once held
        self._task: asyncio.Task[None] | None = None
        self._cleanups: set[asyncio.Task[None]] = set()
        self._temp_root = (log.dir / "weights").resolve()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the eval engine (a Ray actor, not registered with any router) and wait until it is healthy."""
        # The launcher's actor recipe (GPUs for SGLang, a clear error when the cluster has none),
        # but no CPU reserved: the run's Ray cluster is sized for the rollout engines.
        spec = EngineLauncher(self.model_dir, 1, None, self.backend, self.log_dir / "eval",  # type: ignore[arg-type]
                              self.extra_args, tp=self.tp, num_cpus=0, engine_kwargs=self.engine_kwargs,
                              startup_timeout_s=self.startup_timeout_s, keys=self.keys,
                              python=self.recipe.engines.python, threads=self.recipe.engines.threads)
        self._actor = spec.new_actor(0)
        try:
            self.url = await self._actor.start.remote()
        except BaseException:
            await self.stop()
            raise
        self._client = SGLangClient(self.url, keys=self.keys)
        self._task = asyncio.create_task(self._loop(), name="background-eval")
        self.log.info(f"background evaluation engine up at {self.url} (log {self.log_dir / 'eval'})")

    def hold(self) -> None:
        """Start no evaluation, and skip none, until `drain()`."""
        self._released.clear()
        self.mode = "after"

    def submit(self, version: int, step: int, weights: Awaitable[str] | str, wall_time_s: float) -> bool:
        """Queue an evaluation of `version` from `weights` (an HF directory, or an awaitable of
        one, e.g. the learner's export ref). Never blocks: with `max_pending` already waiting
        (and not held), the oldest waiting one is skipped (warning) and False is returned."""
        ok = True
        while self._released.is_set() and len(self._pending) >= self.max_pending:
            old = self._pending.popleft()
            self.skipped.append(old.version)
            self.log.warn(f"background evaluation of version {old.version} skipped: {self.max_pending} evaluations "
                          f"already waiting (the eval engine is slower than run.eval_every steps)")
            self._discard(old.weights)
            ok = False
        if not isinstance(weights, str):  # a future: awaitable again by whoever needs the path
            weights = asyncio.ensure_future(weights)
        self._pending.append(_Job(version, step, weights, wall_time_s))
        self._idle.clear()
        self._wake.set()
        return ok

    @property
    def waiting(self) -> int:
        """Evaluations queued and not started (all of them while held)."""
        return len(self._pending)

    async def drain(self, timeout_s: float = 600) -> None:
        """Release a hold and wait until every queued evaluation has finished (or `timeout_s`
        passed, per evaluation queued: warning)."""
        if self._task is None:
            return
        timeout_s *= max(1, len(self._pending))
        self._released.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.log.warn(f"background evaluation still busy after {timeout_s:.0f}s "
                          f"({len(self._pending)} waiting); giving up on it")
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel what is running or waiting, stop the engine and kill its actor. Safe to repeat."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        while self._pending:
            self._discard(self._pending.popleft().weights)
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=60)
        self._idle.set()
        if self._client is not None:
            await self._client.close()
            self._client = None
        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.stop.remote(), 30)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------ the evaluation task

    async def _loop(self) -> None:
        while True:
            await self._released.wait()
            if not self._pending:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._run(self._pending.popleft())

    async def _run(self, job: _Job) -> None:
        v, path = job.version, None
        try:
            path = job.weights if isinstance(job.weights, str) else str(await asyncio.shield(job.weights))
            out = await self._client.update_weights_from_disk(path, str(v))
            if isinstance(out, dict) and out.get("success") is False:
                raise RuntimeError(f"the eval engine could not load {path}: {out.get('message')}")
            res = await evaluate(self._client, self.tokenizer, self.records, self.recipe)
            row = {"policy_version": v, "step": job.step, "wall_time_s": job.wall_time_s,
                   "finished_wall_s": self.clock() - self.t0, "mode": self.mode, **res}
            if res["engine_versions"] != [str(v)]:
                row["version_mismatch"] = True
                self.log.warn(f"background evaluation of version {v}: responses came from engine versions "
                              f"{res['engine_versions']}, not only {v}")
            self.rows.append(row)
            self.log.eval(row)
            self.log.info(f"background eval at version {v}: accuracy {with_ci(res, 'accuracy')} "
                          f"(greedy {with_ci(res, 'greedy_accuracy')}) over {res['prompts']} prompts "
                          f"in {res['eval_s']:.1f}s")
        except asyncio.CancelledError:
            if path is None:
                self._discard(job.weights)
            raise
        except Exception as e:  # noqa: BLE001 - one failed evaluation must not end the run
            self.log.warn(f"background evaluation of version {v} failed: {type(e).__name__}: {e}")
        finally:
            if path is not None:
                self._remove(path)

    # ------------------------------------------------------------ temporary exports

    def _remove(self, path: str) -> None:
        """Delete `path` when it is a temporary export under RUN_DIR/weights/."""
        p = Path(path).resolve()
        if p != self._temp_root and p.is_relative_to(self._temp_root):
            shutil.rmtree(p, ignore_errors=True)

    def _discard(self, weights: Awaitable[str] | str) -> None:
        """A job that will not run: delete its export (once written, for an awaitable)."""
        if isinstance(weights, str):
            self._remove(weights)
            return

        async def later() -> None:
            try:
                self._remove(str(await weights))
            except Exception as e:  # noqa: BLE001
                self.log.warn(f"a skipped evaluation's weight export failed: {type(e).__name__}: {e}")

        t = asyncio.ensure_future(later())
        self._cleanups.add(t)
        t.add_done_callback(self._cleanups.discard)
