"""`streamrl run --resume`: load the newest checkpoint, then train the steps that came after it
again on the groups the pool says they consumed (same batches in the same order), so the learner
reaches the weights it had when the run stopped and no group is trained on twice or lost."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.core.types import RunResumed
from streamrl.runtime import RunFailed
from streamrl.runtime.runlog import RunLog, now_ns, read_jsonl


REFUSALS = ("CheckpointError", "UnpicklingError")  # a checkpoint refused as damaged or tampered with


def _refusal(e: BaseException) -> str | None:
    """The refusal inside `e` (a Ray task error wraps the learner's), as one line, or None."""
    seen: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in seen:
        seen.append(x)
        if type(x).__name__ in REFUSALS or any(c.__name__ in REFUSALS for c in type(x).__mro__):
            found = re.search(rf"(?:{'|'.join(REFUSALS)}): (.+)", str(x))
            return (found.group(1) if found else str(x).splitlines()[0]).strip()
        x = getattr(x, "cause", None) or x.__cause__ or x.__context__
    return None


@dataclass
class Resumed:
    """Where start-up leaves a run: version 0 at step 0 for a new one."""

    version: int = 0
    start_step: int = 0  # the first step this process trains
    wall_offset: float = 0.0  # wall time the run had used before
    data_states: list[dict[str, Any]] | None = field(default=None)  # the workers' dataset positions at the checkpoint
    redone: int = 0  # steps after the checkpoint trained again from the pool


async def restore(learner: Any, run_dir: Path, log: RunLog, max_staleness: int) -> Resumed:
    """Restore `learner` (the learner group) from RUN_DIR/checkpoints and the pool. When steps were
    trained again (`redone`), the caller checkpoints, so another stop need not redo them."""
    try:
        extra = await learner.restore.remote(str(run_dir / "checkpoints"))
    except Exception as e:
        if (why := _refusal(e)) is None:
            raise
        raise RunFailed(f"cannot resume {run_dir}: {why}. Nothing was loaded from that checkpoint; restore it from a "
                        "copy, or move its step directory away to resume from the one before") from None
    ck_step = int(extra["step"]) if extra else -1
    redo = await learner.consumed_steps.remote(ck_step + 1)
    if list(redo) != list(range(ck_step + 1, ck_step + 1 + len(redo))):
        raise RunFailed(f"cannot resume {run_dir}: the pool's consumed steps after checkpoint step {ck_step} "
                        f"are not contiguous ({list(redo)[:10]}); the pool and checkpoints do not belong together")
    original = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    wall_offset = max((m.get("wall_time_s") or 0.0 for m in original.values()), default=0.0)
    kept = (extra or {}).get("step_metrics") or {}
    if ck_step >= 0 and ck_step not in original and kept.get("step") == ck_step:
        # The checkpoint caught a step that trained while the last publish ran; the run stopped before logging it.
        log.metrics(kept | {"from_checkpoint": True, "wall_time_s": wall_offset})
    for step, ids in redo.items():
        m = await learner.retrain.remote(step, ids, max_staleness)
        was = original.get(step)
        if was is None:  # the run stopped after the claim, before the step's metrics were written
            log.metrics(m | {"redo": True, "wall_time_s": wall_offset})
        elif was.get("loss") != m.get("loss"):
            log.warn(f"step {step} trained again on its {len(ids)} groups gives loss {m.get('loss')}, "
                     f"the stopped run had {was.get('loss')}: the resumed weights differ slightly")
    version = await learner.ping.remote()
    start_step = ck_step + 1 + len(redo)
    log.event(RunResumed(checkpoint_step=ck_step, redone_steps=list(redo), version=version, at=now_ns()))
    log.info(f"resuming {run_dir} at step {start_step} (version {version}): checkpoint of step "
             f"{ck_step}, then {len(redo)} step(s) trained again from the pool")
    return Resumed(version, start_step, wall_offset, extra.get("workers") if extra else None, len(redo))
