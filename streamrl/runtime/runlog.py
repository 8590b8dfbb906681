"""The run directory's logs: `metrics.jsonl` (one object per learner step), `eval.jsonl` (one per
evaluation), `events.jsonl` (the typed events of streamrl.core.types, append-only) and `run.log`.

Each line is written with one `write` on a file opened for appending, so lines from several
processes never interleave.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

from streamrl.core.types import Event

_events = msgspec.json.Encoder()


def now_ns() -> int:
    """Wall-clock nanoseconds: the timestamp of events (the core types take it as a value)."""
    return time.time_ns()


def json_safe(v: Any) -> Any:
    """JSON has no NaN/inf: write null instead (a step with no scored sample has no reward mean)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_safe(x) for x in v]
    return v


class RunLog:
    def __init__(self, run_dir: str | Path, echo: bool = True, mirror: Any = None) -> None:
        """`mirror`: streamrl.tools.loggers.Loggers that also get every metrics and eval row (TensorBoard, W&B)."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.echo, self.mirror = echo, mirror

    def _append(self, name: str, line: bytes) -> None:
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line + b"\n")
        finally:
            os.close(fd)

    def metrics(self, row: dict[str, Any]) -> None:
        self._append("metrics.jsonl", json.dumps(json_safe(row), sort_keys=False).encode())
        if self.mirror is not None:
            self.mirror.metrics(row)

    def eval(self, row: dict[str, Any]) -> None:
        self._append("eval.jsonl", json.dumps(json_safe(row)).encode())
        if self.mirror is not None:
            self.mirror.eval(row)

    def event(self, ev: Event) -> None:
        self._append("events.jsonl", _events.encode(ev))

    def info(self, msg: str) -> None:
        self._append("run.log", f"{time.strftime('%H:%M:%S')} {msg}".encode())
        if self.echo:
            tqdm.write(msg, file=sys.stderr)

    def warn(self, msg: str) -> None:
        self.info(f"warning: {msg}")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a log the run may still be appending to. A last line without its newline is a
    write in progress (a reader can see part of one `write`; CI of 2026-11-29 read half a metrics row)
    or one a crash cut short: it is not a record yet, and is left out."""
    p = Path(path)
    if not p.exists():
        return []
    text = p.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
