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
import time
from pathlib import Path
from typing import Any

from connectors.sglang_client import SGLangClient


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Router:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, policy: str = "round_robin",
                 log_dir: str | Path | None = None, request_timeout_s: int = 600) -> None:
        self.host, self.port, self.policy = host, port or free_port(host), policy
        self.log_dir = Path(log_dir) if log_dir else None
        self.request_timeout_s = request_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = SGLangClient(self.url)
        self._workers: dict[str, SGLangClient] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60) -> Router:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
               "--policy", self.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--request-timeout-secs", str(self.request_timeout_s), "--log-level", "warn"]
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / "router.log", "ab")  # noqa: SIM115 - lives as long as the router
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode} (command: {' '.join(cmd)})")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"sglang-router did not listen on {self.url} within {timeout_s}s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

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
        async with SGLangClient(url) as probe:
            await probe.wait_healthy(timeout_s)
        await self.client.json("POST", "/workers", {"url": url})
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not any(w.get("url") == url and w.get("is_healthy", True) for w in await self.list_workers()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"router did not register {url} within {timeout_s}s")
            await asyncio.sleep(0.1)
        self._workers[url] = SGLangClient(url, connect_retries=1)  # control calls to a dead engine fail fast

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
