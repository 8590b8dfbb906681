"""Engine launcher: N inference engines as Ray actors (connectors/sglang/engine_actor.py), registered
with the sglang-router and kept alive (a dead engine is removed from the router, restarted on a
new port and re-registered); and `ensure_ray`, which gives a run its own local Ray instance or
joins the cluster its recipe names.

    ensure_ray()
    router = Router(policy="round_robin").start()
    launcher = EngineLauncher("runs/models/tiny", 2, router, log_dir="runs/x/logs")
    await launcher.start()          # actors up, engines healthy, registered, watcher running
    ...
    await launcher.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.connectors.auth import Keys
from streamrl.connectors.sglang.engine_actor import BACKENDS, EngineActor
from streamrl.connectors.ports import LOOPBACK, listen_socket, port_of
from streamrl.connectors.sglang.router import Router

log = logging.getLogger(__name__)


class RayUnavailable(RuntimeError):
    """Ray could not be started or joined; the message is one line that says why."""


# Ray starts idle Python workers for the first driver; a run's actors carry its runtime_env (py_modules,
# env_vars), so none of them could use those: each cost ~0.6 s of CPU for nothing.
_NO_PRESTART = {"prestart_worker_first_driver": False}


def ensure_ray(num_cpus: int = 4, object_store_memory: int = 200 * 1024**2, address: str | None = None,
               **kwargs: Any) -> None:
    """Start this process's own local Ray instance (no dashboard, a small object store), or, with
    `address` (e.g. "auto", "10.0.0.5:6379", "ray://..."), join that cluster, whose resources are
    its own. Without an address a cluster already running on the machine (found through its
    session files or RAY_ADDRESS) is never joined: address="local" always starts a new instance.
    Does nothing when Ray is already initialised in this process.

    A local instance is locked down (`local_ray_env`): Ray's token authentication with a fresh
    token of its own (Ray's gRPC servers listen on every interface and cannot be told otherwise,
    so nobody without the token may talk to them), its Prometheus exporters kept off (metrics
    collection off; the two fixed-port ones by holding their ports, `_hold_ray_metric_ports`),
    and gloo on the loopback interface. Joining a cluster uses that
    cluster's own authentication (RAY_AUTH_MODE / RAY_AUTH_TOKEN or ~/.ray/auth_token)."""
    if ray.is_initialized():
        return
    if not address:
        os.environ.update(local_ray_env())
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")  # Ray read RAY_AUTH_MODE when it was imported: let it see token mode
        AuthenticationTokenLoader.instance().reset_cache()  # and the new token, if it started before
        _hold_ray_metric_ports()
    host, _, port = (address or "").rpartition(":")
    if host and port.isdigit() and "://" not in address:  # Ray would retry a dead GCS address for minutes
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise RayUnavailable(f"could not join the Ray cluster at {address!r}: nothing answers there "
                                 f"({e.strerror or e}); is `ray start --head` running?") from None
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _system_config=_NO_PRESTART,
                     object_store_memory=object_store_memory, **kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; the user needs one line
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        where = f"join the Ray cluster at {address!r}" if address else "start a local Ray instance"
        raise RayUnavailable(f"could not {where}: {type(e).__name__}: {first}") from e


_held_ports: list[socket.socket] = []


def _hold_ray_metric_ports() -> None:
    """Ray's autoscaler monitor and dashboard start Prometheus exporters on every interface at
    fixed ports (AUTOSCALER_METRIC_PORT 44217, DASHBOARD_METRIC_PORT 44227), with no option to
    bind loopback or turn them off; when the port is taken they log it and go on without one. So
    the run takes two ports on 127.0.0.1 first, points Ray at them and holds them while it lives:
    nothing unauthenticated of Ray's listens beyond loopback. (Ray also rewrites a node address of
    127.0.0.1 to the machine's routable one, so `_node_ip_address` cannot do this.)"""
    if not _held_ports:
        _held_ports.extend(listen_socket(LOOPBACK, 0, backlog=1) for _ in range(2))
    os.environ["AUTOSCALER_METRIC_PORT"] = str(port_of(_held_ports[0]))
    os.environ["DASHBOARD_METRIC_PORT"] = str(port_of(_held_ports[1]))


def local_ray_env() -> dict[str, str]:
    """Environment of a locked-down local Ray instance (see ensure_ray); its processes inherit it."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_urlsafe(32),
            "RAY_enable_metrics_collection": "0", "GLOO_SOCKET_IFNAME": "lo"}


@dataclass
class RestartEvent:
    index: int
    old_url: str
    new_url: str
    detected_at: float  # time.time() when the watcher found the engine dead
    at: float  # time.time() when it was serving and registered again
    reason: str


OnRestart = Callable[[int, str], Awaitable[None]]


def engine_gpus(backend: str, tp: int) -> int:
    """GPUs an engine actor takes: tp for SGLang and "auto" where the cluster has GPUs; none without
    (SGLang then runs on the CPU, from the `make sglang` venv: connectors/sglang/cpu_sglang.py)."""
    gpus = backend != "embedded" and ray.cluster_resources().get("GPU", 0) > 0
    return tp if gpus else 0


class EngineLauncher:
    """Start `num_engines` engines as Ray actors, register them with `router`, and keep them up.

    `start()` returns when every engine is healthy and listed by the router; it then watches the
    engines (`watch=True`): every `poll_interval_s` it asks each actor whether its process is
    alive, and for a dead one removes its URL from the router, restarts it on a new port (a new
    actor if the actor itself died), awaits `on_restart(index, url)` if given (push the current
    weights there before it takes traffic: a restarted engine serves `model_dir` at
    `weight_version`; change both with `set_restart_weights`), re-registers it, and counts it in
    `restarts`. `stop()` stops the watcher, deregisters, stops the engines and kills the actors.
    """

    def __init__(self, model_dir: str | Path, num_engines: int, router: Router, backend: str = "embedded",
                 log_dir: str | Path | None = None, extra_args: Sequence[str] = (), *, weight_version: str | int = "0",
                 tp: int = 1, num_cpus: float = 1, num_gpus: float | None = None,
                 engine_kwargs: dict[str, Any] | None = None, poll_interval_s: float = 1.0,
                 startup_timeout_s: float = 600, on_restart: OnRestart | None = None,
                 max_restarts: int | None = None, actor_options: dict[str, Any] | None = None,
                 keys: Keys | None = None, host: str = "127.0.0.1", placement_group: Any = None,
                 python: str | None = None, threads: int = 1, cpus: Sequence[int] = ()) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if num_engines < 1:
            raise ValueError("num_engines must be >= 1")
        self.model_dir, self.weight_version = str(model_dir), str(weight_version)
        self.num_engines, self.router, self.backend = num_engines, router, backend
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "engine-logs"
        self.extra_args, self.tp = list(extra_args), tp
        self.host = host  # the address every engine binds (recipe engines.host)
        self.python = python  # the interpreter that starts SGLang engines (recipe engines.python); None = this one
        self.threads, self.cpus = threads, list(cpus)  # SGLang on CPU: torch threads, cores (engines.threads, .cpus)
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus  # None: tp for SGLang (and for "auto" where the cluster has GPUs)
        self.engine_kwargs = engine_kwargs or {}
        self.poll_interval_s, self.startup_timeout_s = poll_interval_s, startup_timeout_s
        self.on_restart, self.max_restarts = on_restart, max_restarts
        self.actor_options = actor_options or {}
        self.placement_group = placement_group  # engine i (and its restarts) in bundle i
        self.keys = router.keys if router is not None else keys or Keys()  # the engines' keys are the router's
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.restarts = 0
        self.router_restarts = 0
        self.events: list[RestartEvent] = []
        self.failures: list[tuple[int, str]] = []  # (engine index, error) of failed recoveries
        self._watch_task: asyncio.Task[None] | None = None
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    def new_actor(self, index: int) -> Any:
        num_gpus = engine_gpus(self.backend, self.tp) if self.num_gpus is None else self.num_gpus
        have = ray.cluster_resources().get("GPU", 0)
        if num_gpus and have < num_gpus:  # Ray would keep the actor pending forever
            raise RuntimeError(f"engine {index} needs {num_gpus} GPU(s) (backend={self.backend!r}, tp={self.tp}) but "
                               f"the Ray cluster has {have:g}; on CPU use backend='embedded'")
        opts = {"num_cpus": self.num_cpus, "num_gpus": num_gpus, **self.actor_options}
        if self.placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index)
        return EngineActor.options(**opts).remote(
            index, self.model_dir, self.backend, str(self.log_dir), self.weight_version, self.tp,
            self.extra_args, self.engine_kwargs, self.host, self.startup_timeout_s, keys=self.keys, python=self.python,
            threads=self.threads, cpus=self.cpus)

    async def start(self, watch: bool = True) -> list[str]:
        if self.actors:
            raise RuntimeError("launcher already started")
        self._stopping = False
        try:
            for i in range(self.num_engines):
                self.actors.append(self.new_actor(i))
            self.urls = list(await asyncio.gather(*(a.start.remote() for a in self.actors)))
            await asyncio.gather(*(self.router.add_worker(u) for u in self.urls))
        except BaseException:
            await self.stop()
            raise
        if watch:
            self.watch()
        return list(self.urls)

    def watch(self) -> asyncio.Task[None]:
        """Start (once) the background task that restarts dead engines."""
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch(), name="engine-launcher-watch")
        return self._watch_task

    async def stop(self) -> None:
        """Stop watching, deregister, stop every engine and kill the actors. Safe to repeat."""
        self._stopping = True
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.router.proc is not None and self.router.proc.poll() is None:
            for url in self.urls:
                if url:
                    try:
                        await self.router.remove_worker(url)
                    except Exception as e:  # noqa: BLE001 - best effort while shutting down
                        log.warning("could not remove %s from the router: %r", url, e)
        actors, self.actors, self.urls = self.actors, [], []
        if actors:
            done = await asyncio.gather(*(self._call(a.stop.remote(), 30) for a in actors), return_exceptions=True)
            for a, r in zip(actors, done):
                if isinstance(r, BaseException) and not isinstance(r, ray.exceptions.RayActorError):
                    log.warning("engine actor stop failed: %r", r)
                try:
                    ray.kill(a, no_restart=True)  # were the engine still up, its watchdog ends it too
                except Exception as e:  # noqa: BLE001
                    log.warning("could not kill an engine actor: %r", e)

    def kill(self) -> None:
        """Synchronous last resort (no event loop needed): kill the actors; each engine exits
        with its actor (watchdog). The router is not told."""
        task, self._watch_task = self._watch_task, None
        if task is not None:
            try:
                task.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors, self.urls = [], []

    async def __aenter__(self) -> EngineLauncher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ queries

    @staticmethod
    async def _call(ref: Any, timeout_s: float | None = None) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)

    async def pids(self) -> list[int | None]:
        return list(await asyncio.gather(*(a.pid.remote() for a in self.actors)))

    async def info(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(a.info.remote() for a in self.actors)))

    def set_restart_weights(self, model_dir: str | Path | None = None, weight_version: str | int | None = None) -> None:
        """Weights a restarted engine loads (e.g. the newest checkpoint on disk)."""
        if model_dir is not None:
            self.model_dir = str(model_dir)
        if weight_version is not None:
            self.weight_version = str(weight_version)

    # ------------------------------------------------------------ watching

    async def _watch(self) -> None:
        await asyncio.gather(self._monitor_router(), *(self._monitor(i) for i in range(len(self.actors))))

    async def _monitor_router(self) -> None:
        """A router that died is started again at its address, with the engines it had: the rollout workers,
        the producer service and the user keep its URL, and their calls fail only while it is down."""
        backoff = self.poll_interval_s
        while not self._stopping and self.router is not None:
            code = self.router.exited()
            if code is not None:
                log.warning("the sglang-router at %s exited (code %s); starting it again there", self.router.url, code)
                try:
                    missing = await self.router.revive()
                except Exception as e:  # noqa: BLE001 - keep watching; retry with backoff
                    log.error("the sglang-router could not be started again: %r", e)
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
                self.router_restarts += 1
                backoff = self.poll_interval_s
                log.warning("the sglang-router is up again at %s (restarts=%d)%s", self.router.url,
                            self.router_restarts, f"; engines not registered again: {missing}" if missing else "")
            await asyncio.sleep(self.poll_interval_s)

    async def _monitor(self, index: int) -> None:
        backoff = self.poll_interval_s
        while not self._stopping:
            actor = self.actors[index]
            actor_dead = False
            try:
                alive = await self._call(actor.alive.remote(), 30)
            except ray.exceptions.RayActorError:
                alive, actor_dead = False, True
            except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
                log.warning("engine %d: alive() failed: %r", index, e)
                alive = True  # unknown: ask again next round
            if not alive and not self._stopping:
                if self.max_restarts is not None and self.restarts >= self.max_restarts:
                    log.error("engine %d is dead and max_restarts=%d is spent", index, self.max_restarts)
                    return
                try:
                    await self._recover(index, actor_dead)
                    backoff = self.poll_interval_s
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - keep watching; retry with backoff
                    log.error("engine %d: restart failed: %r", index, e)
                    self.failures.append((index, repr(e)))
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
            await asyncio.sleep(self.poll_interval_s)

    async def _recover(self, index: int, actor_dead: bool) -> None:
        detected_at = time.time()
        old_url = self.urls[index]
        log.warning("engine %d at %s is dead (%s); restarting", index, old_url,
                    "actor died" if actor_dead else "process exited")
        if old_url:
            try:
                await self.router.remove_worker(old_url)
            except Exception as e:  # noqa: BLE001 - the router drops it on its own health check anyway
                log.warning("engine %d: could not remove %s from the router: %r", index, old_url, e)
            self.urls[index] = ""
        if actor_dead:
            try:
                ray.kill(self.actors[index], no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            self.actors[index] = self.new_actor(index)
            url = await self._call(self.actors[index].start.remote())
        else:
            url = await self._call(self.actors[index].restart.remote(self.model_dir, self.weight_version))
        self.urls[index] = url  # before registering: a stop() meanwhile deregisters it
        try:
            if self.on_restart is not None:
                await self.on_restart(index, url)
            await self.router.add_worker(url)
        except Exception:
            # Up but not serving through the router: stop it, so the next round starts it afresh.
            with contextlib.suppress(Exception):
                await self.router.remove_worker(url)
            with contextlib.suppress(Exception):
                await self._call(self.actors[index].stop.remote(), 60)
            self.urls[index] = ""
            raise
        self.restarts += 1
        self.events.append(RestartEvent(index, old_url, url, detected_at, time.time(),
                                        "actor died" if actor_dead else "process exited"))
        log.warning("engine %d restarted at %s (restarts=%d)", index, url, self.restarts)
