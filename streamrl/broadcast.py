"""Version broadcaster: pushes each new policy version from the learner to every engine.

Paths (recipe `engines.weight_sync`):
- `distributed`: a torch.distributed group of its own (gloo on CPU, NCCL on GPU); the learner is
  rank 0 and broadcasts each tensor while every engine receives it through SGLang's
  `/update_weights_from_distributed`. The group is re-formed when the set of engines changes
  (an engine restarted); a push that fails falls back to disk for that version.
- `disk`: the learner writes HF safetensors, engines load them (`/update_weights_from_disk`).
(SGLang's `/update_weights_from_tensor` carries pickled tensors; StreamRL sends no pickle over
the network, so that path is not offered.)

In-flight generations follow the partial-rollout policy: `abort_resume`/`restart` pause the
engines in `abort` mode (requests return what they have; the rollout worker resubmits them),
`in_place` pauses them in place (they continue on the new weights). `interrupt=False` (lockstep,
one-step-off: nothing is in flight) updates without pausing.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from connectors.router import Router, free_port
from streamrl.runlog import RunLog
from streamrl.types import EnginePaused, EngineResumed, VersionPublished, now_ns


class VersionBroadcaster:
    def __init__(self, router: Router, learner: Any, weight_sync: str, policy: str, run_dir: Path, log: RunLog,
                 host: str = "127.0.0.1", keep_weights: int = 2) -> None:
        self.router, self.learner, self.weight_sync, self.policy = router, learner, weight_sync, policy
        self.weights_dir = run_dir / "weights"
        self.log, self.host, self.keep_weights = log, host, keep_weights
        self._group_urls: tuple[str, ...] = ()
        self._group_gen = 0
        self._meta: Any = None
        self.version = 0
        self.history: list[dict[str, Any]] = []

    async def _ensure_group(self) -> None:
        urls = tuple(sorted(self.router.workers))
        if urls == self._group_urls:
            return
        self._group_gen += 1
        name, port = f"streamrl-weights-{self._group_gen}", free_port(self.host)
        await self.learner.drop_weight_group.remote()
        init = self.learner.init_weight_group.remote(self.host, port, len(urls) + 1, name)
        await asyncio.gather(init, *(self.router.workers[u].init_weights_update_group(
            self.host, port, i + 1, len(urls) + 1, name, "nccl" if self._meta_is_cuda() else "gloo")
            for i, u in enumerate(urls)))
        self._group_urls, self._group_name = urls, name
        if self._meta is None:
            self._meta = await self.learner.weights_meta.remote()

    @staticmethod
    def _meta_is_cuda() -> bool:
        import torch

        return torch.cuda.is_available()

    async def _push_distributed(self, version: int) -> None:
        await self._ensure_group()
        names, dtypes, shapes = self._meta
        await asyncio.gather(self.learner.push_weights.remote(), *(
            c.update_weights_from_distributed(names, dtypes, shapes, weight_version=version,
                                              group_name=self._group_name)
            for u, c in self.router.workers.items()))

    async def _push_disk(self, version: int, urls: list[str] | None = None) -> str:
        path = str(self.weights_dir / f"v{version:06d}")
        if not Path(path, "config.json").exists():
            await self.learner.export.remote(path)
        workers = self.router.workers
        await asyncio.gather(*(workers[u].update_weights_from_disk(path, weight_version=version)
                               for u in (urls or list(workers))))
        if self.keep_weights:
            for old in sorted(self.weights_dir.glob("v*"))[:-self.keep_weights]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    async def publish(self, version: int, step: int, interrupt: bool = True) -> dict[str, Any]:
        """Make every engine serve `version`; returns timings (pause window, push)."""
        workers = self.router.workers
        mode = None
        if interrupt:
            mode = "in_place" if self.policy == "in_place" else "abort"
        t0 = time.perf_counter()
        if mode:
            await asyncio.gather(*(c.pause(mode) for c in workers.values()))
            for u in workers:
                self.log.event(EnginePaused(engine=u, mode=mode, at=now_ns()))
        t_push = time.perf_counter()
        path = "distributed"
        try:
            if self.weight_sync == "distributed":
                await self._push_distributed(version)
            else:
                path = await self._push_disk(version)
        except Exception as e:  # noqa: BLE001 - an engine died mid-push: re-form the group next time
            self._group_urls = ()
            self.log.warn(f"weight push of version {version} over {self.weight_sync} failed ({e!r}); using disk")
            path = await self._push_disk(version)
        push_s = time.perf_counter() - t_push
        if mode:
            await asyncio.gather(*(c.resume() for c in self.router.workers.values()))
            for u in workers:
                self.log.event(EngineResumed(engine=u, version=version, at=now_ns()))
        self.version = version
        self.log.event(VersionPublished(version=version, step=step, at=now_ns()))
        out = {"version": version, "push_s": push_s, "pause_s": time.perf_counter() - t0 if mode else 0.0,
               "path": path}
        self.history.append(out)
        return out

    async def on_engine_restart(self, index: int, url: str) -> None:
        """A restarted engine loads the current version from disk before it takes traffic."""
        from connectors.sglang_client import SGLangClient

        path = str(self.weights_dir / f"v{self.version:06d}")
        if not Path(path, "config.json").exists():
            await self.learner.export.remote(path)
        async with SGLangClient(url) as c:
            await c.update_weights_from_disk(path, weight_version=self.version)
        self._group_urls = ()  # the weight group must include the new engine
