"""Running the producer API: `streamrl produce serve RUN_DIR` (one service per run, held by a
lock file; its URL in RUN_DIR/producer.json) and, with `producer_api.enabled`, the same command as
a child process of the run driver. The service itself is streamrl/producers/api_app.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from aiohttp import web

from streamrl.connectors.ports import listen_socket
from streamrl.connectors.sglang.router import _die_with_parent
from streamrl.producers.api_app import INFO_FILE, LOCK_FILE, TOKEN_FILE, ProducerService, ServiceError
from streamrl.recipe import RecipeError, load_recipe


def _lock(run_dir: Path) -> int:
    """Hold RUN_DIR/producer.lock for the life of this process: one service per run."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            info = json.loads((run_dir / INFO_FILE).read_text())
            who = f"pid {info.get('pid')} at {info.get('url')}"
        except (OSError, ValueError):
            who = "a process that is still starting"
        raise ServiceError(f"a producer service for {run_dir} is already running ({who}); producers can use it "
                           f"(ProducerClient.from_run_dir), or stop it first") from None
    return fd


def open_service(run_dir: str | Path, quiet: bool = False) -> ProducerService:
    """Check the run directory and recipe, then open the pool (ServiceError says what is wrong)."""
    d = Path(run_dir)
    if not (d / "recipe.yaml").is_file():
        raise ServiceError(f"{d} has no recipe.yaml: pass the directory of a run (`streamrl run` writes it)")
    try:
        r = load_recipe(d / "recipe.yaml", resolve=False)  # the service calls no user function: import none
    except RecipeError as e:
        raise ServiceError(str(e)) from None
    if not r.producer_api.enabled:
        raise ServiceError(f"{d / 'recipe.yaml'}: producer_api.enabled is false, so the run reserves no admission "
                           "capacity for external producers; start the run with producer_api.enabled=true")
    return ProducerService(d, r, quiet)


async def _serve(svc: ProducerService, host: str, port: int) -> None:
    runner = web.AppRunner(svc.app(), access_log=None)
    await runner.setup()
    try:
        sock = listen_socket(host, port)  # port 0: the kernel picks one, reported in producer.json
        await web.SockSite(runner, sock).start()
    except OSError as e:
        await runner.cleanup()
        raise ServiceError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:{bound_port}"
    info = svc.dir / INFO_FILE
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "token_file": str((svc.dir / TOKEN_FILE).resolve())}))
    os.replace(tmp, info)
    if not svc.quiet:
        print(f"streamrl produce: serving {svc.dir} on {url} (token in {svc.dir / TOKEN_FILE})", file=sys.stderr,
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    follower = asyncio.create_task(svc.follow_versions())
    try:
        await stop.wait()
    finally:
        follower.cancel()
        await runner.cleanup()  # finishes the submissions in progress
        with contextlib.suppress(OSError, ValueError):
            if json.loads(info.read_text()).get("pid") == os.getpid():
                info.unlink()


def serve(run_dir: str | Path, host: str | None = None, port: int | None = None, quiet: bool = False) -> None:
    """`streamrl produce serve`: run until SIGINT/SIGTERM."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ServiceError(f"{d} is not a directory; pass a run directory")
    lock = _lock(d)
    try:
        svc = open_service(d, quiet)
        api = svc.r.producer_api
        try:
            asyncio.run(_serve(svc, host or api.host, api.port if port is None else port))
        finally:
            svc.close()
    finally:
        os.close(lock)


# ---------------------------------------------------------------- as a child of the run driver


def start_service_process(run_dir: str | Path, cwd: str | Path, log_path: str | Path,
                          timeout_s: float = 60, host: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start `python -m streamrl produce serve RUN_DIR --quiet` in `cwd` (the run's working directory:
    recipe paths are relative to it), dying with its parent; return it and its URL once /health answers."""
    cwd, log_path = Path(cwd), Path(log_path)
    rd = Path(run_dir) if Path(run_dir).is_absolute() else cwd / run_dir
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "streamrl", "produce", "serve", str(run_dir), "--quiet",
           *(["--host", host] if host else [])]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)

    def fail(why: str) -> RuntimeError:
        stop_service_process(proc)
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        return RuntimeError(f"producer service {why} (command: {' '.join(cmd)}); {log_path} ends with:\n{text[-2000:]}")

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise fail(f"exited with code {proc.returncode}")
        try:
            info = json.loads((rd / INFO_FILE).read_text())
            if info.get("pid") == proc.pid:
                with urllib.request.urlopen(info["url"] + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return proc, info["url"]
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise fail(f"did not answer /health within {timeout_s:g}s")
        time.sleep(0.1)


def stop_service_process(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM (submissions in progress finish), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
