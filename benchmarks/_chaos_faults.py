"""The chaos trials' hands (benchmarks/chaos.py): find a running `streamrl run`'s parts among its driver's
descendants, and stop, kill or power off them. Plain /proc and signals: what an operator's `kill` does."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# A part's process, told apart by its command line (Ray names an actor's worker `ray::<Class>`; an engine's
# command line starts with the launcher's marker; sglang-router names its process itself).
ROLES = {
    "learner": lambda cmd: cmd.startswith("ray::_Rank"),
    "worker": lambda cmd: cmd.startswith("ray::_ActorWorker"),
    "engine": lambda cmd: "# streamrl engine process" in cmd,
    "router": lambda cmd: cmd.startswith("sglang::router"),
}


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks since boot: a pid the kernel gave to a new process is not this one
    cmd: str

    @property
    def role(self) -> str | None:
        return next((r for r, is_it in ROLES.items() if is_it(self.cmd)), None)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def tree(root: int) -> list[Proc]:
    """The live descendants of `root` (not itself)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None:
            children.setdefault(st[0], []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if (st := _stat(c)) is not None and st[1] != "Z":
                out.append(Proc(c, st[2], _cmd(c)))
            todo.append(c)
    return out


def alive(procs: list[Proc]) -> list[Proc]:
    """Those of `procs` still running (a zombie is not: nothing of it runs, its parent reaps it)."""
    return [p for p in procs if (st := _stat(p.pid)) is not None and st[2] == p.start and st[1] != "Z"]


def signal_quietly(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_for(pid: int, hold_s: float) -> threading.Thread:
    """SIGSTOP now, SIGCONT after hold_s (a hung process that comes back: a GC pause, a swapped-out
    node, a debugger); returns the thread that continues it."""
    signal_quietly(pid, signal.SIGSTOP)

    def cont() -> None:
        time.sleep(hold_s)
        signal_quietly(pid, signal.SIGCONT)

    t = threading.Thread(target=cont, daemon=True)
    t.start()
    return t


def power_off(driver: int, seen: list[Proc]) -> int:
    """Every process of the run stopped first (none reacts to another's death), then killed: a power cut.
    `seen`: the run's processes noted earlier (a Ray worker whose parent died is no longer a descendant)."""
    killed: set[int] = set()
    for _ in range(5):  # a process may have been forking while we looked
        procs = [p for p in alive([*seen, *tree(driver)]) if p.pid not in killed]
        pids = [p.pid for p in procs] + ([driver] if driver not in killed and _stat(driver) else [])
        if not pids:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in pids:
                signal_quietly(p, sig)
        killed |= set(pids)
    return len(killed)
