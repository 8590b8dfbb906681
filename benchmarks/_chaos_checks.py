"""The chaos trials' judgement (benchmarks/chaos.py): what is wrong with a run after its faults, read the
way a user reads it (`metrics.jsonl`, `streamrl pool stats --json`, the pool as of each step, the
checkpoints' manifests) and from /proc (what is left running)."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from benchmarks._chaos_faults import Proc, alive, signal_quietly
from connectors.megatron.checkpoint import list_checkpoints, verify_checkpoint
from streamrl.pools import open_pool
from streamrl.runtime.runlog import read_jsonl
from streamrl.tools.cli import main as cli_main

_LOCK = threading.Lock()  # the CLI writes to the process's stdout: one at a time


def clear_stop(stderr: str) -> str | None:
    """What is wrong with how a run stopped (None: one clear message that names --resume)."""
    if "Traceback (most recent call last)" in stderr:
        return "a traceback on stderr"
    if "--resume" not in stderr:
        return "stderr does not say how to resume"
    return None



def _cli_json(args: list[str]) -> tuple[int, Any]:
    """`streamrl ARGS` (a --json command) run by the CLI's own main in this process: what a user types,
    without a process's start-up per trial."""
    out, err = io.StringIO(), io.StringIO()
    with _LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # sys.stdout is the process's
        code = cli_main(args)
    try:
        return code, json.loads(out.getvalue())
    except json.JSONDecodeError:
        return code, out.getvalue()[-500:] + err.getvalue()[-1500:]


def check_run(run_dir: Path, bound: int, steps: int, groups: int) -> tuple[list[str], dict[str, Any]]:
    """What is wrong with a finished run of `steps` steps of `groups` groups under staleness bound `bound`
    (empty: nothing), and its ledger's counts."""
    problems = []
    last = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    if sorted(last) != list(range(steps)):
        problems.append(f"steps logged {sorted(set(range(steps)) ^ set(last))} missing or extra")
    if [m["policy_version"] for _, m in sorted(last.items())] != list(range(1, len(last) + 1)):
        problems.append("policy versions out of order: " + str([m["policy_version"] for _, m in sorted(last.items())]))
    # (a step that came back from a checkpoint has no row of its own: the pool's groups below cover it)
    if over := [s for s, m in last.items() if m.get("staleness_max", 0) > bound]:
        problems.append(f"steps {over} trained past the staleness bound {bound}")
    if "differ slightly" in (run_dir / "run.log").read_text(errors="replace"):
        problems.append("a resumed step's loss differs from the one logged before the stop")

    code, stats = _cli_json(["pool", "stats", str(run_dir), "--json"])
    if not isinstance(stats, dict):
        return [*problems, f"pool stats failed (exit {code}): {stats}"], {}
    led = stats["ledger"]
    ledger = {"lost": led["lost"], "duplicated": led["duplicated"], "consumed": led["consumed"],
              "dropped": led.get("dropped")}
    bad = {k: led[k] for k in ("lost", "duplicated", "unadmitted", "in_flight", "partial") if led[k]}
    if code != 0 or bad or led["consumed"] != steps * groups:
        problems.append(f"ledger: {bad or ''} consumed {led['consumed']} of {steps * groups} (exit {code})")

    pool = open_pool(run_dir)
    try:
        rows = pool.scan(["group_id", "status", "min_version", "consumed_version"], where="status = 'consumed'")
        stale = {r["group_id"] for r in rows.to_pylist()
                 if r["min_version"] is not None and r["consumed_version"] - r["min_version"] > bound}
        if stale:
            problems.append(f"{len(stale)} consumed group(s) past the staleness bound {bound}")
        for s in range(steps):
            try:
                pool.as_of(step=s).count()
            except Exception as e:  # noqa: BLE001 - reported, whatever it is
                problems.append(f"the pool as of step {s} does not read: {e}")
                break
    finally:
        pool.close()
    for step, path in list_checkpoints(run_dir / "checkpoints"):
        try:
            verify_checkpoint(path)
        except Exception as e:  # noqa: BLE001
            problems.append(f"checkpoint {path.name} does not verify: {e}")
    return problems, ledger


def check_gone(seen: list[Proc], run_dir: Path, grace_s: float = 30) -> list[str]:
    """Every process the run was seen with has ended, and its router's port is closed."""
    t0 = time.monotonic()
    while (left := alive(seen)) and time.monotonic() - t0 < grace_s:
        time.sleep(0.5)
    problems = [f"{len(left)} process(es) left behind: " + "; ".join(f"{p.pid} {p.cmd[:80]}" for p in left)
                ] if left else []
    for p in left:  # the next trial starts clean
        signal_quietly(p.pid, signal.SIGKILL)
    try:
        url = urlparse(json.loads((run_dir / "endpoints.json").read_text())["router_url"])
        with socket.create_connection((url.hostname, url.port), timeout=1):
            problems.append(f"the router's port {url.port} still accepts connections")
    except (OSError, KeyError, ValueError):
        pass
    return problems
