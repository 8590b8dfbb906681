"""Crash-test seam. `STREAMRL_FREEZE_AT=<point>:<n>` makes the process that reaches `<point>` for
the n-th time write `RUN_DIR/frozen_at` and stop there, so a test can SIGKILL the whole run at exactly
that moment (mid-broadcast, mid-checkpoint). Unset, as it always is outside tests, `reached` returns at once.

`<point>:<n>:once` freezes there the n-th time only (the chaos trials: one moment, then the run goes on).

A test that finds nothing to test at that moment (e.g. no request in flight at a publish: generation
happened to finish first) writes `RUN_DIR/thaw`: the process goes on and freezes again the next time it
reaches the point, so the test waits for a moment that has what it needs instead of failing by timing.

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
FROZEN, THAW = "frozen_at", "thaw"
_seen: Counter[str] = Counter()


def reached(point: str, run_dir: str | Path) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, rest = spec.partition(":")
    if name != point:
        return
    nth, _, once = rest.partition(":")
    _seen[point] += 1
    if _seen[point] < int(nth or 1) or (once == "once" and _seen[point] > int(nth or 1)):
        return
    frozen, thaw = Path(run_dir, FROZEN), Path(run_dir, THAW)
    tmp = frozen.with_name(f".{FROZEN}.{os.getpid()}")
    tmp.write_text(f"{point}:{_seen[point]} pid {os.getpid()}\n")
    tmp.replace(frozen)  # whole: a test that sees the file reads its text
    while not thaw.exists():  # the whole process (its event loop included) stays here until it is killed
        time.sleep(0.2)
    frozen.unlink()  # first: a test that sees thaw gone may wait for frozen_at to come back
    thaw.unlink()
