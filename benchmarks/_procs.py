"""Child processes the benchmarks start (engines): stopped with everything they started."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]


def start_engine(model_dir: str | Path, out: IO[Any] | int, threads: int = 1,
                 weight_version: str = "0") -> tuple[subprocess.Popen[bytes], str]:
    """An embedded engine on a socket bound here to a free port (connectors/ports.py), in its own
    session, output to `out`; returns the process and its URL (not yet healthy)."""
    from streamrl.connectors.sglang.engine_process import engine_command
    from streamrl.connectors.ports import listen_socket, port_of

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with listen_socket() as sock:
        port = port_of(sock)
        cmd = engine_command("embedded", str(model_dir), port, weight_version=weight_version,
                             engine_kwargs={"threads": threads}, sock_fd=sock.fileno())
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                start_new_session=True, env=env, pass_fds=(sock.fileno(),))
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True), SIGKILL after 10 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
