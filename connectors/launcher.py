"""Engine launcher: N inference engines as Ray actors, registered with the sglang-router and kept
alive (a dead engine is removed from the router, restarted on a new port and re-registered).

Each `EngineActor` owns one engine *process* (never the engine inside the actor itself, so a
crash is visible as an exit and the actor can restart it):

- on CPU, the embedded engine: `python -c "...serve(model_dir, host, port, ...)"`;
- on a GPU node (`backend="sglang"`, or `"auto"` where the actor sees CUDA), real SGLang:
  `python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port P
  --weight-version V --tp-size N [extra args]` (run through `runpy` under the same shim).

Both speak the same HTTP API, so the same `SGLangClient` and `Router` serve both. Every engine
binds 127.0.0.1; its stdout/stderr go to `LOG_DIR/engine-<i>.log` (appended across restarts).

No orphans: the engine runs in its own process group (stopped with SIGTERM, then SIGKILL, to the
whole group) and a watchdog thread inside the engine process exits as soon as its parent (the
actor) is gone, so `ray.kill`, `ray.shutdown` or a crashed driver also take the engines down.

    ensure_ray()
    router = Router(policy="round_robin").start()
    launcher = EngineLauncher("runs/models/tiny", 2, router, log_dir="runs/x/logs")
    await launcher.start()          # actors up, engines healthy, registered, watcher running
    ...
    await launcher.stop()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from connectors.ports import (PortTaken, held_by, listen_socket, port_of, process_tree, says_address_in_use,
                              start_on_free_port)
from connectors.router import Router

log = logging.getLogger(__name__)

BACKENDS = ("embedded", "sglang", "auto")

# Runs inside the engine process before the engine itself: argv[1] is the actor's pid, argv[2]
# the backend, the rest its arguments. The watchdog makes the engine exit with its actor.
_SHIM = r"""# streamrl engine process (connectors/launcher.py)
import os, sys, threading, time
_parent = int(sys.argv[1])
def _watchdog():
    while True:
        if os.getppid() != _parent:
            os._exit(70)
        time.sleep(0.25)
threading.Thread(target=_watchdog, name="parent-watchdog", daemon=True).start()
_backend, _args = sys.argv[2], sys.argv[3:]
if _backend == "embedded":
    import json
    from connectors.engine_server import serve
    serve(**json.loads(_args[0]))
else:
    import runpy
    sys.argv = ["sglang.launch_server", *_args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


class RayUnavailable(RuntimeError):
    """Ray could not be started or joined; the message is one line that says why."""


def ensure_ray(num_cpus: int = 4, object_store_memory: int = 200 * 1024**2, address: str | None = None,
               **kwargs: Any) -> None:
    """Start this process's own local Ray instance (no dashboard, a small object store), or, with
    `address` (e.g. "auto", "10.0.0.5:6379", "ray://..."), join that cluster, whose resources are
    its own. Without an address a cluster already running on the machine (found through its
    session files or RAY_ADDRESS) is never joined: address="local" always starts a new instance.
    Does nothing when Ray is already initialised in this process."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
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
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     object_store_memory=object_store_memory, **kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; the user needs one line
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        where = f"join the Ray cluster at {address!r}" if address else "start a local Ray instance"
        raise RayUnavailable(f"could not {where}: {type(e).__name__}: {first}") from e


def engine_command(backend: str, model_dir: str, port: int, *, host: str = "127.0.0.1", weight_version: str = "0",
                   tp: int = 1, extra_args: Sequence[str] = (), engine_kwargs: dict[str, Any] | None = None,
                   parent_pid: int | None = None, sock_fd: int | None = None) -> list[str]:
    """The engine process's command line. `backend` is "embedded" (`serve(**kwargs)`, which
    takes `engine_kwargs` such as max_running, seed, and `sock_fd`: a listening socket the
    process inherits, bound to `port` by the parent with connectors.ports.listen_socket; pass it
    in Popen's pass_fds) or "sglang" (`sglang.launch_server` with `extra_args` appended, which
    binds `port` itself). Both run under the shim's parent watchdog (`parent_pid`: the pid the
    engine must not outlive, default this process)."""
    head = [sys.executable, "-u", "-c", _SHIM, str(parent_pid or os.getpid()), backend]
    if backend == "embedded":
        if extra_args:
            raise ValueError(f"extra_args are for backend='sglang'; the embedded engine takes "
                             f"engine_kwargs (got {list(extra_args)})")
        kw = {"model_dir": str(model_dir), "host": host, "port": int(port), "weight_version": str(weight_version),
              **({"sock_fd": sock_fd} if sock_fd is not None else {}), **(engine_kwargs or {})}
        return [*head, json.dumps(kw)]
    if backend == "sglang":
        if engine_kwargs:
            raise ValueError(f"engine_kwargs are for backend='embedded'; pass SGLang options as extra_args "
                             f"(got {engine_kwargs})")
        return [*head, "--model-path", str(model_dir), "--host", host, "--port", str(port),
                "--weight-version", str(weight_version), "--tp-size", str(tp), *map(str, extra_args)]
    raise ValueError(f"no engine command for backend {backend!r}")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@ray.remote(num_cpus=1, max_restarts=0)
class EngineActor:
    """One engine process (embedded or SGLang), started, watched and restarted from this actor.

    Methods return plain values; `start()`/`restart()` return once the engine answers
    `GET /health` and raise (with the log's tail) when it exits or times out first.
    """

    def __init__(self, index: int, model_dir: str, backend: str = "embedded", log_dir: str | None = None,
                 weight_version: str = "0", tp: int = 1, extra_args: Sequence[str] = (),
                 engine_kwargs: dict[str, Any] | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = 600, stop_grace_s: float = 10) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.index, self.model_dir, self.host = index, str(model_dir), host
        self.requested_backend = backend
        self.weight_version, self.tp = str(weight_version), int(tp)
        self.extra_args = [str(a) for a in extra_args]
        self.engine_kwargs = dict(engine_kwargs or {})
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "engine-logs"
        self.log_path = self.log_dir / f"engine-{index}.log"
        self.backend: str | None = None  # resolved on first start
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.starts = 0
        self._log_start = 0  # where the current start's output begins in the log

    # ------------------------------------------------------------ process

    def _resolve_backend(self) -> str:
        if self.backend is None:
            want = self.requested_backend
            if want == "embedded":
                self.backend = "embedded"
            else:
                cuda = _cuda_available()
                if want == "sglang" and not cuda:
                    raise RuntimeError("backend='sglang' needs a GPU: torch.cuda.is_available() is False in "
                                       "this actor (schedule it with num_gpus, or use backend='embedded')")
                self.backend = "sglang" if cuda else "embedded"
        return self.backend

    def _spawn(self, port: int, sock: socket.socket | None = None) -> None:
        """Start the engine process on `port`; `sock` (embedded) is the socket already listening
        there, which the process inherits."""
        self.port = port
        cmd = engine_command(self._resolve_backend(), self.model_dir, port, host=self.host,
                             weight_version=self.weight_version, tp=self.tp, extra_args=self.extra_args,
                             engine_kwargs=self.engine_kwargs, sock_fd=sock.fileno() if sock else None)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== engine {self.index} start #{self.starts} backend={self.backend} "
                      f"port={port} {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
            out.flush()
            self._log_start = out.tell()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env, pass_fds=(sock.fileno(),) if sock else ())

    def _start_at(self, port: int, sock: socket.socket | None = None) -> None:
        self._spawn(port, sock)
        try:
            self._wait_healthy()
        except BaseException:
            self._terminate()
            raise

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        url = self.url() + "/health"
        while True:
            code = self.proc.poll()
            if code is not None:
                if says_address_in_use(self._log_since_start()):  # SGLang binds its port itself: try another
                    raise PortTaken(f"engine {self.index}: port {self.port} was taken")
                raise RuntimeError(f"engine {self.index} exited with {code} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        if held_by(self.port, process_tree(self.proc.pid)) is False:
                            raise PortTaken(f"engine {self.index}: port {self.port} is held by another process")
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self._terminate()
                raise TimeoutError(f"engine {self.index} not healthy at {url} within {self.startup_timeout_s}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Whatever else is left in the engine's process group (SGLang's scheduler processes).
        _kill_group(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------ API

    def start(self) -> str:
        """Start the engine (if not running) and wait until it is healthy; returns its URL.
        The embedded engine inherits a socket bound here to a free port; SGLang, which takes
        only a number, is started again on another port if its port was taken meanwhile."""
        if self.alive():
            return self.url()
        self._terminate()
        if self._resolve_backend() == "embedded":
            with listen_socket(self.host) as sock:
                self._start_at(port_of(sock), sock)
        else:
            start_on_free_port(self._start_at, self.host)
        return self.url()

    def restart(self, model_dir: str | None = None, weight_version: str | int | None = None) -> str:
        """Stop the engine (if any) and start it again on a new port, optionally from other
        weights (e.g. the newest checkpoint) and with another weight version."""
        if model_dir is not None:
            self.model_dir = str(model_dir)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self._terminate()
        return self.start()

    def stop(self) -> None:
        self._terminate()

    def url(self) -> str:
        return f"http://{self.host}:{self.port}" if self.port else ""

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "backend": self.backend, "url": self.url(), "pid": self.pid(),
                "alive": self.alive(), "starts": self.starts, "actor_pid": os.getpid(),
                "log": str(self.log_path), "model_dir": self.model_dir, "weight_version": self.weight_version}

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(collections.deque(f, maxlen=lines)).decode(errors="replace")
        except OSError:
            return ""


@dataclass
class RestartEvent:
    index: int
    old_url: str
    new_url: str
    detected_at: float  # time.time() when the watcher found the engine dead
    at: float  # time.time() when it was serving and registered again
    reason: str


OnRestart = Callable[[int, str], Awaitable[None]]


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
                 max_restarts: int | None = None, actor_options: dict[str, Any] | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if num_engines < 1:
            raise ValueError("num_engines must be >= 1")
        self.model_dir, self.weight_version = str(model_dir), str(weight_version)
        self.num_engines, self.router, self.backend = num_engines, router, backend
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "engine-logs"
        self.extra_args, self.tp = list(extra_args), tp
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus  # None: tp for SGLang (and for "auto" where the cluster has GPUs)
        self.engine_kwargs = engine_kwargs or {}
        self.poll_interval_s, self.startup_timeout_s = poll_interval_s, startup_timeout_s
        self.on_restart, self.max_restarts = on_restart, max_restarts
        self.actor_options = actor_options or {}
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.restarts = 0
        self.events: list[RestartEvent] = []
        self.failures: list[tuple[int, str]] = []  # (engine index, error) of failed recoveries
        self._watch_task: asyncio.Task[None] | None = None
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    def new_actor(self, index: int) -> Any:
        num_gpus = self.num_gpus
        if num_gpus is None:
            gpus = self.backend == "sglang" or (self.backend == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
            num_gpus = self.tp if gpus else 0
        have = ray.cluster_resources().get("GPU", 0)
        if num_gpus and have < num_gpus:  # Ray would keep the actor pending forever
            raise RuntimeError(f"engine {index} needs {num_gpus} GPU(s) (backend={self.backend!r}, tp={self.tp}) but "
                               f"the Ray cluster has {have:g}; on CPU use backend='embedded'")
        opts = {"num_cpus": self.num_cpus, "num_gpus": num_gpus, **self.actor_options}
        return EngineActor.options(**opts).remote(
            index, self.model_dir, self.backend, str(self.log_dir), self.weight_version, self.tp,
            self.extra_args, self.engine_kwargs, "127.0.0.1", self.startup_timeout_s)

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
        await asyncio.gather(*(self._monitor(i) for i in range(len(self.actors))))

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
