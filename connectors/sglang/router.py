"""sglang-router management: start it on 127.0.0.1 with an explicit policy, register and
remove workers, and reach every worker directly for control calls the router does not
forward (abort, pause, continue, weight updates).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamrl.connectors.auth import ADMIN_KEY_ENV, API_KEY_ENV, Keys
from streamrl.connectors.ports import (
    PortTaken,
    held_by,
    listen_socket,
    port_of,
    process_tree,
    says_address_in_use,
    start_on_free_port,
)
from streamrl.connectors.sglang.client import SGLangClient

if sys.platform.startswith("linux"):
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the forked child must not import
else:
    _prctl = None


def _die_with_parent() -> None:
    """In the router's child process: SIGTERM it when the thread that started it dies, so a
    killed run leaves no router behind (Linux PR_SET_PDEATHSIG; elsewhere a no-op)."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)


# Runs sglang_router.launch_router with the run's keys added to its arguments from the environment.
_LAUNCH = """import os, runpy, sys
args = sys.argv[1:]
api, admin = os.environ.pop("%s", ""), os.environ.pop("%s", "")
if api:
    args += ["--api-key=" + api]  # a key may begin with "-"
if admin:
    args += ["--control-plane-api-keys", "streamrl:driver:admin:" + admin]
sys.argv = ["sglang_router.launch_router", *args]
runpy.run_module("sglang_router.launch_router", run_name="__main__", alter_sys=True)
""" % (API_KEY_ENV, ADMIN_KEY_ENV)


class Router:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, policy: str = "round_robin",
                 log_dir: str | Path | None = None, request_timeout_s: int = 600, keys: Keys | None = None) -> None:
        """`keys` (connectors/auth.py): the router requires the API key from clients and sends it
        to the engines; its control plane (/workers) requires the admin key; the engine clients
        it hands out carry both."""
        self.host, self.policy = host, policy
        self.keys = keys or Keys()
        self.port = port or 0  # 0: a free port, chosen at start()
        self.log_dir = Path(log_dir) if log_dir else None
        self.request_timeout_s = request_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._temp_log: Path | None = None
        self.client = SGLangClient(self.url, keys=self.keys)
        self._workers: dict[str, SGLangClient] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60) -> Router:
        """Start the router and return once it listens. With no port given, on a free one (and
        another if that one was taken meanwhile: connectors/ports.py)."""
        if self.port:
            self._start_at(self.port, timeout_s)
        else:
            start_on_free_port(lambda port: self._start_at(port, timeout_s), self.host)
        return self

    def _start_at(self, port: int, timeout_s: float) -> None:
        # Its metrics port is a second number the router binds itself: a clash there is retried too.
        with listen_socket() as probe:
            metrics_port = port_of(probe)
        args = ["--host", self.host, "--port", str(port), "--policy", self.policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--request-timeout-secs", str(self.request_timeout_s),
                "--log-level", "warn"]
        # The keys reach the router through its environment, not its command line (`ps` shows that).
        cmd = [sys.executable, "-c", _LAUNCH, *args]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / "router.log"
        else:  # its output is needed to tell a taken port from other failures; removed by stop()
            with tempfile.NamedTemporaryFile(prefix="streamrl-router-", suffix=".log", delete=False) as f:
                log_path = self._temp_log = Path(f.name)
        start_at = log_path.stat().st_size if log_path.exists() else 0
        self.port = port
        self.client.base_url = self.url
        with open(log_path, "ab") as out:
            self.proc = proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **self.keys.env()})

        def output() -> str:
            with open(log_path, "rb") as f:
                f.seek(start_at)
                return f.read().decode(errors="replace")

        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                text = output()
                self.proc = None
                if says_address_in_use(text):
                    raise PortTaken(f"sglang-router: port {port} or {metrics_port} taken")
                raise RuntimeError(f"sglang-router exited with {proc.returncode} (command: {' '.join(cmd)}): "
                                   f"{text.strip()[-1000:]}")
            try:
                with socket.create_connection((self.host, port), timeout=0.5):
                    pass
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"sglang-router did not listen on {self.url} within {timeout_s}s") from None
                time.sleep(0.1)
                continue
            if held_by(port, process_tree(proc.pid)) is False:  # somebody else's server answered
                self.stop()
                raise PortTaken(f"port {port} is held by another process")
            return

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._temp_log is not None:
            self._temp_log.unlink(missing_ok=True)
            self._temp_log = None

    def exited(self) -> int | None:
        """The exit code of a router process that has ended since start(); None while it runs (or before)."""
        return None if self.proc is None else self.proc.poll()

    async def revive(self, timeout_s: float = 30) -> list[str]:
        """Start a router whose process ended again, at the same address (every client keeps its URL), and
        register its workers again; returns those that did not come back (left to whoever watches them).
        Call it from the thread that called start(): the router's parent-death signal follows that thread."""
        self._start_at(self.port, timeout_s)
        # The direct clients stay as they are: weight pushes and other control calls go to the engines
        # themselves, before, during and after the router's absence.
        urls = list(self._workers)
        done = await asyncio.gather(*(self._register(u, timeout_s) for u in urls), return_exceptions=True)
        return [u for u, r in zip(urls, done) if isinstance(r, BaseException)]

    async def close(self) -> None:
        await self.client.close()
        for c in self._workers.values():
            await c.close()
        self._workers.clear()
        self.stop()

    # ------------------------------------------------------------ workers

    async def list_workers(self) -> list[dict[str, Any]]:
        out = await self.client.json("GET", "/workers")
        return out.get("workers", out) if isinstance(out, dict) else out

    async def add_worker(self, url: str, timeout_s: float = 60) -> None:
        """Register a worker and wait until the router lists it as healthy."""
        await self._register(url, timeout_s)
        self._workers[url] = SGLangClient(url, connect_retries=1, keys=self.keys)  # a dead engine fails fast

    async def _register(self, url: str, timeout_s: float) -> None:
        async with SGLangClient(url, keys=self.keys) as probe:
            await probe.wait_healthy(timeout_s)
        await self.client.json("POST", "/workers", {"url": url})
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not any(w.get("url") == url and w.get("is_healthy", True) for w in await self.list_workers()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"router did not register {url} within {timeout_s}s")
            await asyncio.sleep(0.1)

    async def remove_worker(self, url: str, timeout_s: float = 10) -> None:
        """Deregister a worker and wait until the router no longer lists it (the router's
        DELETE answers 202 and removes the worker in the background)."""
        for w in await self.list_workers():
            if w.get("url") == url:
                await self.client.json("DELETE", f"/workers/{w.get('id') or w.get('worker_id')}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(w.get("url") == url for w in await self.list_workers()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"router still lists {url} {timeout_s}s after its removal")
            await asyncio.sleep(0.05)
        client = self._workers.pop(url, None)
        if client is not None:
            await client.close()

    @property
    def workers(self) -> dict[str, SGLangClient]:
        """Direct clients for control calls, by worker URL."""
        return dict(self._workers)

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a client method (abort, pause, resume, update_weights_*) on every worker."""
        return list(await asyncio.gather(*(getattr(c, method)(*args, **kwargs) for c in self._workers.values())))
