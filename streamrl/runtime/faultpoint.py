"""Crash-test seam. `STREAMRL_FREEZE_AT=<point>:<n>` makes the process that reaches `<point>` for
the n-th time write `RUN_DIR/frozen_at` and stop there for good, so a test can SIGKILL the whole
run at exactly that moment (mid-broadcast, mid-checkpoint). Unset, as it always is outside
tests, `reached` returns at once.

Points: `publish` (engines paused, new weights not yet pushed), `checkpoint.<stage>` for the
stages of `streamrl.connectors.megatron.checkpoint.save_checkpoint` (`files`: written to the temporary
directory, not yet renamed into place).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

ENV = "STREAMRL_FREEZE_AT"
_seen: Counter[str] = Counter()


def reached(point: str, run_dir: str | Path) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != point:
        return
    _seen[point] += 1
    if _seen[point] == int(nth or 1):
        Path(run_dir, "frozen_at").write_text(f"{spec} pid {os.getpid()}\n")
        while True:  # the whole process (its event loop included) stays here until it is killed
            time.sleep(3600)
