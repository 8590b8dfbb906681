"""What the benchmarks share (one way to do each thing): progress lines, the JSON every benchmark
prints with the code measured and the machine it ran on, embedded-engine child processes, and
worker processes that never outlive a failure of the main one."""

from __future__ import annotations

import json
import os
import platform
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO, Any

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.connectors.sglang.engine_process import engine_command

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def git_rev() -> str:
    """The commit measured, `-dirty` when anything (untracked files too) differs from it."""
    git = ["git", "-C", str(REPO)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    return rev + ("-dirty" if dirty else "")


def machine(load0: float, packages: tuple[str, ...]) -> dict[str, Any]:
    """`load0`: the 1-minute load average at start; anything above ~0 means other jobs compete."""
    return {"cpus": os.cpu_count(), "loadavg_1m_at_start": round(load0, 2),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "platform": platform.platform(),
            "python": platform.python_version(), **{p: version(p) for p in packages}}


def cpu_probe(n: int = 3_000_000) -> float:
    """Seconds a fixed pure-Python loop takes here: a reading of the machine's speed, taken between
    measurements when nothing else runs. A shared VM's speed drifts with its neighbours' load (the
    2-core box ran one lockstep run in 273 s and the same run in 443 s half an hour later, its
    learner step 0.52 s and 0.76 s with nothing beside it), which a load average does not show."""
    t, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def emit(result: dict[str, Any], out: Path | str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


# ---------------------------------------------------------------- child processes


def start_engine(model_dir: str | Path, out: IO[Any] | int, threads: int = 1,
                 weight_version: str = "0") -> tuple[subprocess.Popen[bytes], str]:
    """An embedded engine on a socket bound here to a free port (connectors/ports.py), in its own
    session, output to `out`; returns the process and its URL (not yet healthy)."""
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


def gather(results: Any, procs: Sequence[BaseProcess], timeout: float) -> list[Any]:
    """One item per process from the multiprocessing queue `results`. A worker that dies first
    (an exception, a kill) fails this at once instead of leaving the main process waiting out
    `timeout`; so does the timeout. Start workers daemon=True, so they die with the main process."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            out.append(results.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        # A worker that put its item and exited 0 is fine; one that exited otherwise never will.
        if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
            raise RuntimeError(f"{len(dead)} worker process(es) failed, exit codes {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(procs) - len(out)} of {len(procs)} workers did not report in {timeout:g} s")
    return out


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float, what: str = "child processes") -> None:
    """Wait for every child process to exit 0. The first that fails, or the timeout, or a failure
    here (KeyboardInterrupt, SIGTERM turned into SystemExit) kills the rest at once: peers left in a
    collective with a dead rank would otherwise wait out gloo's 30-minute timeout."""
    deadline = time.monotonic() + timeout
    try:
        while None in (codes := [p.poll() for p in procs]):
            if any(codes):  # a non-zero exit code (None is still running)
                raise RuntimeError(f"{what}: one failed, exit codes {codes} (the others are killed)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: still running after {timeout:g} s, exit codes {codes}")
            time.sleep(0.1)
        if any(codes):
            raise RuntimeError(f"{what}: exit codes {codes}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def rss_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Start VmHWM again from the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
