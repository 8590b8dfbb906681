"""One inference engine process, started, watched and restarted from a Ray actor (`EngineActor`):

- on CPU, the embedded engine: `python -c "...serve(model_dir, host, port, sock_fd, ...)"`, on a
  listening socket the actor bound to a free port and the process inherits (connectors/ports.py);
- real SGLang (`backend="sglang"`, or `"auto"` where the actor sees CUDA):
  `python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port P
  --weight-version V --tp-size N [extra args]` (run through `runpy` under the same shim),
  started again on another port if P was taken before SGLang bound it. Where the actor sees no GPU,
  SGLang runs on the CPU from the venv `make sglang` builds, with the flags and environment of
  connectors/sglang/cpu_sglang.py.

Both speak the same HTTP API. Every engine binds 127.0.0.1 unless told another address (recipe
`engines.host`); its stdout/stderr go to
`LOG_DIR/engine-<i>.log` (appended across restarts; SGLang's through a pipe that blanks the run's keys,
which SGLang prints with its server arguments at start). The engine runs in its own process group
(stopped with SIGTERM, then SIGKILL, to the whole group) and a watchdog thread inside the engine
process exits as soon as its parent (the actor) is gone, so `ray.kill`, `ray.shutdown` or a
crashed driver also take the engines down. `streamrl/connectors/sglang/launcher.py` runs N of them.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from streamrl.connectors.auth import Keys, write_private
from streamrl.connectors.sglang import cpu_sglang
from streamrl.connectors.sglang.engine_process import engine_command
from streamrl.connectors.ports import (
    PortTaken,
    bind_host,
    held_by,
    listen_socket,
    port_of,
    process_tree,
    says_address_in_use,
    start_on_free_port,
)

BACKENDS = ("embedded", "sglang", "auto")


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


def sglang_key_config(keys: Keys) -> dict[str, str]:
    """The keys as SGLang's `--config` YAML wants them: it turns each key into the flag `--{key}` as
    written (server_args_config_parser.py), and only `--api-key` / `--admin-api-key` exist (`api_key`
    made every SGLang engine exit 2 at start, echoing both keys in the error)."""
    return {k: v for k, v in (("api-key", keys.api), ("admin-api-key", keys.admin)) if v}


def copy_redacted(src: Any, log_path: Path, secrets_: list[bytes]) -> None:
    """Copy an engine's output, line by line, to the end of `log_path` with every secret blanked
    (SGLang logs its server arguments, the keys among them, at start and in some errors)."""
    with open(log_path, "ab", buffering=0) as out:
        for line in iter(src.readline, b""):
            for s in secrets_:
                line = line.replace(s, b"<redacted>")
            out.write(line)
    src.close()


@ray.remote(num_cpus=1, max_restarts=0)
class EngineActor:
    """One engine process (embedded or SGLang), started, watched and restarted from this actor.

    Methods return plain values; `start()`/`restart()` return once the engine answers
    `GET /health` and raise (with the log's tail) when it exits or times out first.
    """

    def __init__(self, index: int, model_dir: str, backend: str = "embedded", log_dir: str | None = None,
                 weight_version: str = "0", tp: int = 1, extra_args: Sequence[str] = (),
                 engine_kwargs: dict[str, Any] | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = 600, stop_grace_s: float = 10, keys: Keys | None = None,
                 python: str | None = None, threads: int = 1, cpus: Sequence[int] = ()) -> None:
        """`keys` (connectors/auth.py): the engine requires them; they reach it through its
        environment (embedded) or a 0600 `--config` file beside its log (SGLang), never argv.
        `python` (recipe engines.python): the interpreter that starts SGLang; None = this one on a GPU,
        the `make sglang` venv on CPU. `threads`, `cpus`: torch threads of SGLang on CPU and the cores its
        processes may run on (recipe engines.threads, engines.cpus; empty: any)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.index, self.model_dir, self.host = index, str(model_dir), bind_host(host)  # on the engine's node
        self.requested_backend = backend
        self.weight_version, self.tp = str(weight_version), int(tp)
        self.extra_args = [str(a) for a in extra_args]
        self.engine_kwargs = dict(engine_kwargs or {})
        self.python, self.threads, self.cpus = python, int(threads), [int(c) for c in cpus]
        self.cpu = False  # SGLang on the CPU (no GPU in this actor)
        self.keys = keys or Keys()
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "engine-logs"
        self.log_path = self.log_dir / f"engine-{index}.log"
        self.backend: str | None = None  # resolved on first start
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None  # copies SGLang's output to the log, keys blanked
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
                self.backend = "sglang" if cuda or want == "sglang" else "embedded"
                self.cpu = self.backend == "sglang" and not cuda
        return self.backend

    def _spawn(self, port: int, sock: socket.socket | None = None) -> None:
        """Start the engine process on `port`; `sock` (embedded) is the socket already listening
        there, which the process inherits."""
        self.port = port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        extra = list(self.extra_args)
        sglang = self._resolve_backend() == "sglang"
        if sglang and (self.keys.api or self.keys.admin):
            conf = self.log_dir / f"engine-{self.index}.keys.yaml"
            write_private(conf, json.dumps(sglang_key_config(self.keys)))  # JSON is YAML
            extra += ["--config", str(conf)]
        python, env = (self.python if sglang else None), {**os.environ, "PYTHONUNBUFFERED": "1", **self.keys.env()}
        if self.cpu:
            python = cpu_sglang.venv_python(self.python)
            extra = cpu_sglang.cpu_args(extra)
            env.update(cpu_sglang.cpu_env(python, self.threads))
        cmd = engine_command(self.backend, self.model_dir, port, host=self.host,  # type: ignore[arg-type]
                             weight_version=self.weight_version, tp=self.tp, extra_args=extra,
                             engine_kwargs=self.engine_kwargs, sock_fd=sock.fileno() if sock else None,
                             python=python)
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== engine {self.index} start #{self.starts} backend={self.backend}"
                      f"{' (cpu)' if self.cpu else ''} port={port} {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
            out.flush()
            self._log_start = out.tell()
            secrets_ = [k.encode() for k in (self.keys.api, self.keys.admin) if k] if sglang else []
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if secrets_ else out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                         pass_fds=(sock.fileno(),) if sock else ())
        if self.cpu and self.cpus:  # (the embedded engine pins itself: engine_kwargs cpus) SGLang's scheduler and
            os.sched_setaffinity(self.proc.pid, self.cpus)  # detokenizer start seconds later, after its imports: they inherit it
        if secrets_:
            assert self.proc.stdout is not None
            self._pump = threading.Thread(target=copy_redacted, args=(self.proc.stdout, self.log_path, secrets_),
                                          name=f"engine-{self.index}-log", daemon=True)
            self._pump.start()

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
                self._drain()
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

    def _drain(self) -> None:
        """Wait (briefly) until the pump has copied an exited engine's last output to the log."""
        if self._pump is not None:
            self._pump.join(timeout=5)

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
        self._drain()

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
        return {"index": self.index, "backend": self.backend, "cpu": self.cpu, "url": self.url(), "pid": self.pid(),
                "alive": self.alive(), "starts": self.starts, "actor_pid": os.getpid(),
                "log": str(self.log_path), "model_dir": self.model_dir, "weight_version": self.weight_version}

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(collections.deque(f, maxlen=lines)).decode(errors="replace")
        except OSError:
            return ""
