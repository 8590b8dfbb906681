"""Version broadcaster: pushes each new policy version from the learner to every engine.

Paths (recipe `engines.weight_sync`):
- `distributed`: a torch.distributed group of its own (gloo on CPU, NCCL on GPU); the learner is
  rank 0 and broadcasts the weights in buckets (connectors/sglang/weight_sync.py) while every engine
  receives them through SGLang's `/update_weights_from_distributed` (load_format
  "flattened_bucket", one request per bucket). The group is re-formed when the set of engines changes
  (an engine restarted); a push that fails falls back to disk for that version, for every engine
  that still answers. The learner sends each bucket once every engine took the one before; the group's
  timeout (recipe `engines.push_timeout_s`) bounds each bucket, not the push, so a push of any size
  passes while each bucket moves; progress is logged every PROGRESS_S of a long push. A push that
  fails (an engine killed or hung mid-push, a bucket refused) ends at once for every rank and every
  engine (weight_sync's module doc) with one warning naming the engine and the bucket
  (core/weight_group.py `blame`).
- The learner casts what it sends to the engines' dtype (core/engine_dtype.py) when they differ:
  bf16 engines receive bf16 from an fp32 learner, on either path.
- `disk`: the learner writes HF safetensors, engines load them (`/update_weights_from_disk`).
- LoRA (recipe learner.lora; docs/lora.md): only the adapters travel. The learner writes them as a
  PEFT directory under RUN_DIR/weights/lora-v<version> and every engine loads it under the
  version's name (`v12`, SGLang's `/load_lora_adapter`); new generations name it in `lora_path`
  (the rollout workers' clients), a request keeps its adapter to the end, and its tokens carry
  that adapter's version. The previous version's adapter stays loaded (calls made before the
  workers heard of the new version); older ones are unloaded in the background (SGLang's unload
  returns once no request uses them). The engines' own weights stay the base (`start_lora`).
  `in_place` needs no pause at all: nothing a running request uses changes.
(SGLang's `/update_weights_from_tensor` carries pickled tensors; StreamRL sends no pickle over
the network, so that path is not offered. The embedded engine takes it with safetensors blobs
instead: benchmarks/broadcast.py measures it.)

In-flight generations follow the partial-rollout policy: `abort_resume`/`restart` pause the
engines in `abort` mode (requests return what they have; the rollout worker resubmits them),
`in_place` pauses them in place (they continue on the new weights, so the update is sent with
`flush_cache: false`: SGLang fails a flushing update while requests run; the prefix cache the old
weights made stays, and no later request reuses it: streamrl/core/prefix_cache.py), `finish_old` first
lets the engines generate on the old weights for `finish_window_s` (requests that finish then are
never interrupted: single-version samples, no resume and no re-prefill) and then aborts the rest as
`abort_resume` does (the window delays the push, and so the learner's next step, which waits
for it; the tokens are tagged with the old version, so the learner's staleness rule still applies
to them). `interrupt=False` (lockstep, one-step-off: nothing is in flight) updates without pausing.
The weight group holds rank 0 (the learner) and every TP rank of every engine
(streamrl/core/weight_group.py: world 1 + sum of tp, engine i from its rank_offset).

The learner keeps no copy of its weights for the broadcaster: `push_weights`, `export` and
`weights_meta` gather them from the learner's ranks when called (collectives on the learner group,
streamrl/runtime/learner.py), so a version is published before the learner trains the next one
(streamrl/runtime/loop.py), and `export` writes whatever version the learner is at.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from streamrl.connectors.sglang.client import ENGINE_FAILURES, EngineError, SGLangClient
from streamrl.connectors.sglang.router import Router
from streamrl.connectors.sglang.weight_sync import BUCKET_BYTES, BUCKET_FORMAT, TIMEOUT_S, plan_buckets, tensor_bytes
from streamrl.core.lora import adapter_name
from streamrl.core.types import EnginePaused, EngineResumed, VersionPublished
from streamrl.core.weight_group import EngineOutcome, blame, weight_group
from streamrl.runtime import faultpoint
from streamrl.runtime.runlog import RunLog, now_ns


PROGRESS_S = 10.0  # a push longer than this logs its progress this often
RELEASE_S = 30.0  # after the learner's side failed: how long the engines get to answer (released ones do at once)


class _UseDisk(Exception):
    pass


class PushError(RuntimeError):
    """A distributed push that failed: `gone` are the engines that did not answer (dead or hung)."""

    def __init__(self, message: str, gone: tuple[str, ...]) -> None:
        super().__init__(message)
        self.gone = gone


def _cause(e: BaseException) -> BaseException:
    """The learner's own exception inside Ray's wrapper (RayTaskError keeps it as `cause`)."""
    c = getattr(e, "cause", None)
    return c if isinstance(c, BaseException) else e


def _default_backend() -> str:
    """NCCL between GPUs (SGLang's default for /init_weights_update_group), gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class VersionBroadcaster:
    def __init__(self, router: Router, learner: Any, weight_sync: str, policy: str, run_dir: Path, log: RunLog,
                 host: str = "127.0.0.1", keep_weights: int = 2, tp: int = 1, lora: bool = False,
                 dtype: str | None = None, timeout_s: float = TIMEOUT_S, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.router, self.learner, self.weight_sync, self.policy = router, learner, weight_sync, policy
        self.tp = tp  # every engine's tensor-parallel size (recipe engines.tp): each TP rank joins the group
        self.weights_dir = run_dir / "weights"
        self.log, self.host, self.keep_weights = log, host, keep_weights
        self._group_urls: tuple[str, ...] = ()
        self._joined: tuple[str, ...] = ()  # the engines that joined the group named _group_name
        self._group_name = ""
        self._group_gen = 0
        self._meta: Any = None
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self.bucketed = True  # distributed: weight_sync's buckets (SGLang's flattened_bucket)
        self.backend = _default_backend()  # distributed: the weight group's (benchmarks/broadcast.py may set gloo)
        self.lora = lora  # learner.lora: publish adapters (module doc)
        self._adapters: list[int] = []  # versions whose adapters the engines hold, oldest first
        self._unloads: set[asyncio.Task[Any]] = set()
        self.dtype = dtype  # the engines' (core/engine_dtype.py): what the learner casts to; None: its own
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes  # engines.push_timeout_s, push_bucket_mb

    async def _ensure_group(self) -> None:
        urls = tuple(sorted(self.router.workers))
        if urls == self._group_urls:
            return
        if self._joined:  # engines keep a group (an NCCL communicator on GPU) until told to drop it
            await self._each({u: c for u, c in self.router.workers.items() if u in self._joined},
                             lambda c: c.destroy_weights_update_group(self._group_name))
            self._joined = ()
        self._group_gen += 1
        # Unique across broadcasters too: an engine that outlived a learner may still hold the old names.
        name = f"streamrl-weights-{self._group_gen}-{uuid.uuid4().hex[:8]}"
        group = weight_group([self.tp] * len(urls))
        await self.learner.drop_weight_group.remote()
        host, port = await self.learner.open_weight_store.remote(self.host, group.world_size, self.timeout_s)
        init = self.learner.init_weight_group.remote(group.world_size, name, self.backend, self.timeout_s)
        await asyncio.gather(init, *(self.router.workers[u].init_weights_update_group(
            host, port, group.rank_offsets[i], group.world_size, name, self.backend)
            for i, u in enumerate(urls)))
        self._group_urls, self._group_name, self._joined = urls, name, urls
        if self._meta is None:
            self._meta = await self.learner.weights_meta.remote(self.dtype)

    async def _push_distributed(self, version: int, flush: bool) -> None:
        """Raises PushError (one message naming the engine and the bucket) when any part failed."""
        await self._ensure_group()
        names, dtypes, shapes = self._meta
        # One request per bucket, in the order the learner broadcasts them; the version is set
        # with the last one. bucketed=False: SGLang's default, one broadcast per tensor.
        parts = plan_buckets(dtypes, shapes, self.bucket_bytes) if self.bucketed else [range(len(names))]
        # The group's members: an engine registered since (restarted mid-publish) loaded the current
        # weights from disk and joins the next group, which forms when the set of engines changed.
        workers = {u: c for u, c in self.router.workers.items() if u in self._joined}
        taken = dict.fromkeys(workers, 0)  # buckets each engine has taken
        failures: dict[str, EngineOutcome] = {}
        progress = _Progress(self, version, len(parts), [sum(tensor_bytes(names[i], dtypes[i], shapes[i]) for i in b)
                                                         for b in parts])

        async def engine(u: str, c: Any) -> None:
            k = 0
            try:
                await c.begin_weight_update()  # SGLang takes distributed updates only inside a session
                for k, b in enumerate(parts):
                    try:
                        await c.update_weights_from_distributed(
                            names[b.start:b.stop], dtypes[b.start:b.stop], shapes[b.start:b.stop],
                            weight_version=version if k == len(parts) - 1 else None, group_name=self._group_name,
                            load_format=BUCKET_FORMAT if self.bucketed else None, flush_cache=flush)
                    except EngineError as e:  # it answered: keep its part going, so the broadcast does not wait on it
                        failures.setdefault(u, EngineOutcome(k, True, e.message))
                    taken[u] = k + 1
                    progress.taken(min(taken.values()))
                k = len(parts)
                await c.end_weight_update()
            except ENGINE_FAILURES as e:  # a refused or dropped connection, or no answer in time
                if u not in failures:
                    failures[u] = EngineOutcome(min(k, len(parts) - 1), isinstance(e, EngineError), f"{type(e).__name__}: {e}")
            except asyncio.CancelledError:  # no answer in time (below): it hangs, leave its session as it is
                failures.setdefault(u, EngineOutcome(min(k, len(parts) - 1), False, f"no answer within {wait_s:g} s"))
                raise

        tasks = {u: asyncio.ensure_future(engine(u, c)) for u, c in workers.items()}
        learner: tuple[int, str] | None = None
        try:
            await self.learner.push_weights.remote(self.bucketed, self.dtype, self.bucket_bytes)
        except Exception as e:  # noqa: BLE001 - the learner's side of the push failed
            c = _cause(e)
            learner = (getattr(c, "bucket", 0), getattr(c, "reason", f"{type(c).__name__}: {c}"))
        # The engines answer at once when the push went through or was dropped; one that does not
        # is hung (a stopped process, an engine stuck in its receive).
        wait_s = RELEASE_S if learner else self.timeout_s
        # (no engine at all: every one is being restarted, and each gets the current weights when it is up)
        _, pending = await asyncio.wait(tasks.values(), timeout=wait_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        if learner is not None or failures:
            b = blame(version, len(parts), learner, failures)
            raise PushError(b.message, b.gone)

    async def push_disk(self, version: int, clients: dict[str, Any] | None = None,
                        flush: bool = True) -> tuple[str, dict[str, BaseException]]:
        """Export `version` to disk and have the engines load it; returns the path and the engines that failed."""
        path = str(self.weights_dir / f"v{version:06d}")
        if not Path(path, "config.json").exists():
            await self.learner.export.remote(path, dtype=self.dtype)
        clients = self.router.workers if clients is None else clients
        failed = await self._each(clients, lambda c: c.update_weights_from_disk(path, weight_version=version, flush_cache=flush))
        if self.keep_weights:
            for old in sorted(self.weights_dir.glob("v*"))[:-self.keep_weights]:
                shutil.rmtree(old, ignore_errors=True)
        return path, failed

    async def start_lora(self, version: int, base_changed: bool) -> dict[str, BaseException]:
        """LoRA runs: the engines take the base weights (when they are not the model they started
        with: an SFT warm-start) as version 0's weights, then `version`'s adapter."""
        failed: dict[str, BaseException] = {}
        if base_changed:
            path = str(self.weights_dir / "base")
            await self.learner.export.remote(path, base=True, dtype=self.dtype)
            failed = await self._each(self.router.workers, lambda c: c.update_weights_from_disk(path, weight_version=0))
        _, more = await self.push_lora(version)
        return failed | more

    async def push_lora(self, version: int, clients: dict[str, Any] | None = None
                        ) -> tuple[str, dict[str, BaseException]]:
        """Write `version`'s adapter and have the engines load it; the adapters two versions
        back and older are unloaded in the background. Returns the path and the engines that failed."""
        path = self.weights_dir / f"lora-v{version:06d}"
        if not (path / "adapter_config.json").exists():
            await self.learner.export_adapter.remote(str(path))
        clients = self.router.workers if clients is None else clients
        failed = await self._each(clients, lambda c: c.load_lora_adapter(adapter_name(version), str(path)))
        if version not in self._adapters:
            self._adapters.append(version)
        old, self._adapters = self._adapters[:-2], self._adapters[-2:]
        for v in old:
            task = asyncio.create_task(self._each(self.router.workers,
                                                  lambda c, v=v: c.unload_lora_adapter(adapter_name(v))))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        if self.keep_weights:
            for d in sorted(self.weights_dir.glob("lora-v*"))[:-max(self.keep_weights, 2)]:
                shutil.rmtree(d, ignore_errors=True)
        return str(path), failed

    async def _each(self, clients: dict[str, Any], call: Any) -> dict[str, BaseException]:
        """Run `call(client)` on every engine; returns the engines that failed (dead or dying:
        the launcher restarts them, and a restarted engine loads the current version itself)."""
        res = await asyncio.gather(*(call(c) for c in clients.values()), return_exceptions=True)
        return {u: r for u, r in zip(clients, res) if isinstance(r, BaseException)}

    async def publish(self, version: int, step: int, interrupt: bool = True,
                      finish_window_s: float = 0.0) -> dict[str, Any]:
        """Make every live engine serve `version`; returns timings (the finish window, pause window, push)."""
        mode = None
        if interrupt and not (self.lora and self.policy == "in_place"):  # LoRA in place: nothing to pause for
            mode = "in_place" if self.policy == "in_place" else "abort"
        window_s = 0.0
        if mode and self.policy == "finish_old" and finish_window_s > 0:
            t_window = time.perf_counter()
            await asyncio.sleep(finish_window_s)  # requests close to done finish on the old weights
            window_s = time.perf_counter() - t_window
        workers = self.router.workers
        t0 = time.perf_counter()
        failed: dict[str, BaseException] = {}
        if mode:
            failed = await self._each(workers, lambda c: c.pause(mode))
            for u in workers:
                if u not in failed:
                    self.log.event(EnginePaused(engine=u, mode=mode, at=now_ns()))
        live = {u: c for u, c in workers.items() if u not in failed}
        faultpoint.reached("publish", self.weights_dir.parent)
        t_push = time.perf_counter()
        path = self.weight_sync
        # SGLang refuses to flush its cache (and so the update) while requests run, as in_place keeps
        # them: they go on with the KV the old weights made, which in_place accepts by design. New
        # requests never match that cache: their clients key it by version (core/prefix_cache.py).
        flush = mode != "in_place"
        try:
            if self.lora:
                path, lora_failed = await self.push_lora(version, live)
                failed |= lora_failed
            elif self.weight_sync != "distributed" or failed:
                raise _UseDisk()
            else:
                await self._push_distributed(version, flush)
        except Exception as e:  # noqa: BLE001 - an engine died: re-form the group next time, use disk now
            if self.lora:  # the full weights on disk are merged: an engine would apply its adapters twice
                raise
            if isinstance(e, PushError):  # engines that did not answer get nothing more: dead or hung
                self.log.warn(f"{e}; using disk")
                failed |= {u: RuntimeError(f"no answer during the push of version {version}") for u in e.gone}
                live = {u: c for u, c in live.items() if u not in e.gone}
            elif not isinstance(e, _UseDisk):
                self.log.warn(f"weight push of version {version} over {self.weight_sync} failed ({e!r}); using disk")
            self._group_urls = () if self.weight_sync == "distributed" else self._group_urls
            path, disk_failed = await self.push_disk(version, live, flush)
            failed |= disk_failed
        push_s = time.perf_counter() - t_push
        if mode:
            failed |= await self._each({u: c for u, c in live.items() if u not in failed}, lambda c: c.resume())
            for u in live:
                if u not in failed:
                    self.log.event(EngineResumed(engine=u, version=version, at=now_ns()))
        for u, e in failed.items():
            self.log.warn(f"engine {u} did not take version {version} ({type(e).__name__}: {e}); "
                          "the launcher restarts dead engines with the current weights")
        self.version = version
        self.log.event(VersionPublished(version=version, step=step, at=now_ns()))
        out = {"version": version, "push_s": push_s, "pause_s": time.perf_counter() - t0 if mode else 0.0,
               "finish_window_s": window_s, "path": path, "failed_engines": len(failed)}
        self.history.append(out)
        return out

    async def on_engine_restart(self, index: int, url: str) -> None:
        """A restarted engine loads the current version from disk before it takes traffic (LoRA:
        the base, then the current and the previous version's adapters)."""
        if self.lora:
            base = self.weights_dir / "base"
            if not (base / "config.json").exists():
                await self.learner.export.remote(str(base), base=True, dtype=self.dtype)
            async with SGLangClient(url, keys=self.router.keys) as c:
                await c.update_weights_from_disk(str(base), weight_version=0)
                for v in self._adapters:  # what the others hold (each written when it was pushed)
                    p = self.weights_dir / f"lora-v{v:06d}"
                    if (p / "adapter_config.json").exists():
                        await c.load_lora_adapter(adapter_name(v), str(p))
            return
        path = str(self.weights_dir / f"v{self.version:06d}")
        if not Path(path, "config.json").exists():
            await self.learner.export.remote(path, dtype=self.dtype)
        async with SGLangClient(url, keys=self.router.keys) as c:
            await c.update_weights_from_disk(path, weight_version=self.version)
        self._group_urls = ()  # the weight group must include the new engine


class _Progress:
    """A push's progress: the faultpoint after each bucket every engine took (`push_bucket`), and a
    line in the run log every PROGRESS_S of a long push."""

    def __init__(self, bc: VersionBroadcaster, version: int, buckets: int, sizes: list[int]) -> None:
        self.bc, self.version, self.buckets, self.sizes = bc, version, buckets, sizes
        self.done, self.t0 = 0, time.perf_counter()
        self.last = self.t0

    def taken(self, n: int) -> None:
        while self.done < n:
            self.done += 1
            faultpoint.reached("push_bucket", self.bc.weights_dir.parent)
        now = time.perf_counter()
        if now - self.last >= PROGRESS_S:
            self.last = now
            gb = sum(self.sizes[:self.done]) / 1e9
            self.bc.log.info(f"weight push of version {self.version}: bucket {self.done} of {self.buckets} on every "
                             f"engine ({gb:.2f} of {sum(self.sizes) / 1e9:.2f} GB, {now - self.t0:.0f} s)")
