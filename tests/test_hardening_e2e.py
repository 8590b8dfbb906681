"""During a real run (engines, router, learner, rollout workers, background evaluation): nothing of StreamRL's listens beyond 127.0.0.1, and what Ray listens on everywhere (its gRPC
servers, which Ray cannot bind to one address) refuses anyone without the run's own token. The
engines and the router refuse calls without the run's keys."""

from __future__ import annotations

import http.client
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from streamrl.connectors.ports import process_tree

from streamkit import (
    assert_ledger_balanced,
    finish_streamrl,
    read_metrics,
    start_streamrl,
    task_data,
    tiny_model,
    wait_for,
    write_recipe,
)

pytestmark = pytest.mark.slow
__all__ = ["task_data", "tiny_model"]  # fixtures

# One method of each gRPC service a Ray process serves (its auth interceptor answers only for
# methods the server knows; an unknown one is UNIMPLEMENTED before any check).
RAY_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
               "/ray.rpc.ObjectManagerService/Push", "/ray.rpc.CoreWorkerService/NumPendingTasks",
               "/ray.rpc.LogService/ListLogs")


def _refuses_strangers(addr: str, port: int) -> str:
    """How a listener answers a caller without the run's token: 'http 401', 'grpc UNAUTHENTICATED', or
    what else it said."""
    import grpc

    host = "127.0.0.1" if addr in ("*", "0.0.0.0", "::") else f"[{addr}]" if ":" in addr else addr
    try:
        urllib.request.urlopen(f"http://{host}:{port}/", timeout=10)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return "http 401"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        pass  # not HTTP/1.1: gRPC
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        for method in RAY_METHODS:
            try:
                ch.unary_unary(method)(b"", timeout=20)
                return f"grpc answered {method}"
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return f"grpc {e.code().name}"
    return "grpc: no known method"


def _listeners() -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every listening TCP socket on this machine."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        addr, port = line.split()[3].rsplit(":", 1)
        for pid in re.findall(r"pid=(\d+)", line):
            rows.append((addr.strip("[]"), int(port), int(pid)))
    return rows


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_nothing_reachable_beyond_loopback_during_a_run(tmp_path: Path, tiny_model: Path,
                                                         task_data: dict[str, Path]) -> None:
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": 14, "run.eval_every": 4, "data.eval_path": str(task_data["eval"]),
        "data.eval_size": 4, "data.eval_samples": 1})
    run_dir, io = tmp_path / "run", tmp_path / "io"
    proc = start_streamrl(["run", str(recipe), "--run-dir", str(run_dir), "--quiet"], io)
    try:
        wait_for(lambda: len(read_metrics(run_dir)) >= 2, 300, "two steps", alive=proc)
        tree = set(process_tree(proc.pid))
        mine = [(a, p, pid) for a, p, pid in _listeners() if pid in tree]
        outside = [(a, p, pid) for a, p, pid in mine if not a.startswith("127.") and a != "::1"]
        # Ray's gRPC servers listen on every interface and cannot be told otherwise: each must refuse a
        # caller without this run's Ray token. Anything else beyond loopback is a leak.
        answers = {(a, p, _comm(pid)): _refuses_strangers(a, p) for a, p, pid in outside}
        leaks = {k: v for k, v in answers.items() if v not in ("http 401", "grpc UNAUTHENTICATED")}
        assert outside and not leaks, f"listening beyond loopback without refusing strangers: {leaks}"
        assert not [k for k in answers if not re.search(r"^(gcs_server|raylet|python)$|^ray::", k[2])], answers
        assert any(a.startswith("127.") for a, _, _ in mine), mine  # the run's own servers: on loopback
        # The router and the engines want the run's keys (which live in the driver's memory only).
        router = re.search(r"sglang-router at (http://[\d.:]+)", (run_dir / "run.log").read_text()).group(1)
        for url in (router + "/generate", router + "/workers"):
            req = urllib.request.Request(url, data=b'{"input_ids": [1]}', headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 401, url
        engines = [p for a, p, pid in mine if a.startswith("127.") and "serve_embedded" in _cmd(pid)]
        assert engines, mine
        for port in engines:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/update_weights_from_disk",
                                         data=b'{"model_path": "/tmp"}', headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 401
    finally:
        finish_streamrl(proc, io, run_dir=run_dir)
    assert assert_ledger_balanced(run_dir)["ledger"]["consumed"] >= 14 * 2
