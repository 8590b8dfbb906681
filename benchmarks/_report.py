"""What every benchmark adds to its JSON: the code measured and the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


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


def emit(result: dict[str, Any], out: Path | str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
