"""`streamrl replay RUN_DIR`: train past steps again from the pool, and compare.

    streamrl replay runs/quickstart --steps 120-125
    streamrl replay runs/quickstart --where "min_version BETWEEN 10 AND 12 AND reward_std = 0"

`--steps A-B` starts from the newest checkpoint saved before step A was trained (its meta.json
records the last step it holds; with none, from the run's starting weights, as step 0 was),
trains the steps between it and A again without printing them, then steps A..B, each on exactly the
groups it consumed (the pool records the step), read as that step read them (the pool table
version its claim recorded, pools/asof.py: later appends, compactions and groups stored again do
not change them), and prints the loss and grad norm the run logged
next to the replayed ones. On CPU, with the run's recipe, they are identical.

`--where SQL` selects groups with a filter over one row per group (columns: GROUP_COLUMNS) and
trains on them in batches of `rollout.groups_per_step`, oldest first, starting from the
checkpoint before the first of them was consumed (or the newest checkpoint).

The learner is built as the run built it (recipe.yaml, sft_model/ or the model path,
learner.threads) and reads the pool without changing it: in this process, or, for a run whose
learner had several ranks (learner.parallel), as the same group of ranks on a Ray instance of
its own (another layout would sum in another order, and float32 rounding drifts apart over steps).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from streamrl.connectors.megatron.checkpoint import list_checkpoints
from streamrl.pools import RECORDED_RECIPE as RECIPE
from streamrl.pools import open_pool
from streamrl.pools.queries import pool_query
from streamrl.pools.sql import QueryError
from streamrl.recipe import Recipe, learner_layout
from streamrl.runtime.learner import LearnerDriver, quiet_megatron
from streamrl.runtime.learner_group import SyncLearner
from streamrl.runtime.runlog import read_jsonl
from streamrl.runtime.user_code import UntrustedCode, load_run_recipe

GROUP_COLUMNS = ("group_id", "prompt_id", "producer_id", "status", "n_samples", "min_version", "max_version",
                 "consumed_step", "consumed_version", "created_ns", "drop_reason", "reward_mean", "reward_std",
                 "reward_min", "reward_max", "tokens_mean", "failed_samples")

_GROUPS_SQL = """
SELECT group_id, any_value(prompt_id) AS prompt_id, any_value(producer_id) AS producer_id,
       any_value(status) AS status, any_value(n_samples) AS n_samples, min(min_version) AS min_version,
       max(max_version) AS max_version, any_value(consumed_step) AS consumed_step,
       any_value(consumed_version) AS consumed_version, min(created_ns) AS created_ns,
       any_value(drop_reason) AS drop_reason, avg(reward) AS reward_mean, coalesce(stddev_pop(reward), 0) AS reward_std,
       min(reward) AS reward_min, max(reward) AS reward_max, avg(num_tokens) AS tokens_mean,
       sum(CASE WHEN failed THEN 1 ELSE 0 END) AS failed_samples
FROM pool GROUP BY group_id
"""


class ReplayError(ValueError):
    """The replay cannot be done as asked (the message says why and what exists)."""


def parse_steps(text: str) -> tuple[int, int]:
    a, _, b = text.partition("-")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise ReplayError(f"--steps {text!r}: expected A-B (e.g. 10-12) or one step (e.g. 10)") from None
    if lo < 0 or hi < lo:
        raise ReplayError(f"--steps {text!r}: need 0 <= A <= B")
    return lo, hi


def load_run(run_dir: str | Path, trust_run_dir: bool = False) -> Recipe:
    """The run's recipe, its user code imported as `--resume` does (runtime/user_code.py)."""
    d = Path(run_dir)
    if not (d / RECIPE).is_file():
        raise ReplayError(f"{d} has no {RECIPE}: not a StreamRL run directory (or one from before runs kept it)")
    try:
        return load_run_recipe(d, trust=trust_run_dir)
    except UntrustedCode as e:
        raise ReplayError(str(e)) from None


def _learner(r: Recipe, run_dir: Path) -> Any:
    quiet_megatron()
    sft = run_dir / "sft_model"
    model = str(sft) if (sft / "config.json").exists() else r.model.path
    if math.prod(learner_layout(r)) > 1:
        return SyncLearner(r, model, str(Path(r.model.tokenizer or r.model.path).resolve()))
    return LearnerDriver(r, model)


def _checkpoints(run_dir: Path) -> list[tuple[int, int]]:
    """(version, last step trained) of every checkpoint, oldest first."""
    out = []
    for v, p in list_checkpoints(run_dir / "checkpoints"):
        extra = json.loads((p / "meta.json").read_text()).get("extra", {})
        out.append((v, int(extra.get("step", v - 1))))
    return out


def _start(run_dir: Path, before_step: int) -> tuple[int, int]:
    """(version, first step to train) of the newest checkpoint saved before `before_step` was
    trained; (0, 0): the run's starting weights."""
    return max(((v, s + 1) for v, s in _checkpoints(run_dir) if s < before_step), default=(0, 0))


def _original(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}  # a resumed run: its last row wins


def replay_steps(run_dir: str | Path, first: int, last: int, progress: bool = True,
                 trust_run_dir: bool = False) -> list[dict[str, Any]]:
    """Rows {step, groups, loss, grad_norm, orig_loss, orig_grad_norm, ...} for steps first..last."""
    d = Path(run_dir)
    r = load_run(d, trust_run_dir)
    drv = _learner(r, d)
    batches = drv.consumed_steps(0, last)
    missing = [s for s in range(first, last + 1) if s not in batches]
    if missing:
        done = max(batches, default=-1)
        raise ReplayError(f"steps {missing[:5]} consumed no groups in {d / 'pool'} (the run trained steps 0-{done})")
    v0, s0 = _start(d, first)
    if v0:
        drv.restore(str(d / "checkpoints"), version=v0)
    orig, rows = _original(d), []
    for step in tqdm(range(s0, last + 1), desc="replay", unit="step", disable=not progress):
        m = drv.retrain(step, batches[step], r.max_staleness)
        if step >= first:
            o = orig.get(step, {})
            rows.append({"step": step, "groups": len(m["groups"]), "loss": m.get("loss"),
                         "grad_norm": m.get("grad_norm"), "orig_loss": o.get("loss"),
                         "orig_grad_norm": o.get("grad_norm"), "reward_mean": m["reward_mean"],
                         "start_version": v0, "identical": o.get("loss") == m.get("loss")
                         and o.get("grad_norm") == m.get("grad_norm")})
    drv.close()
    return rows


def select_groups(run_dir: str | Path, where: str) -> list[dict[str, Any]]:
    """One row per group (GROUP_COLUMNS) matching `where`, oldest first."""
    pool = open_pool(str(run_dir))
    try:
        t = pool_query(pool, f"SELECT * FROM ({_GROUPS_SQL}) WHERE {where} ORDER BY created_ns, group_id")
    except QueryError as e:
        raise ReplayError(f"--where {where!r}: {e} (columns: {', '.join(GROUP_COLUMNS)})") from None
    finally:
        pool.close()
    return t.to_pylist()


def replay_where(run_dir: str | Path, where: str, progress: bool = True,
                 trust_run_dir: bool = False) -> list[dict[str, Any]]:
    """Train on the selected groups, `groups_per_step` at a time; one row per batch."""
    d = Path(run_dir)
    r = load_run(d, trust_run_dir)
    groups = select_groups(d, where)
    if not groups:
        raise ReplayError(f"--where {where!r} selects no group in {d / 'pool'}")

    consumed = [g["consumed_step"] for g in groups if g["consumed_step"] is not None]
    v0, s0 = _start(d, min(consumed)) if consumed else max(((v, s + 1) for v, s in _checkpoints(d)), default=(0, 0))
    drv = _learner(r, d)
    if v0:
        drv.restore(str(d / "checkpoints"), version=v0)
    k, rows = r.rollout.groups_per_step, []
    for i in tqdm(range(0, len(groups), k), desc="replay", unit="batch", disable=not progress):
        chunk = groups[i:i + k]
        m = drv.retrain(s0 + i // k, [g["group_id"] for g in chunk], r.max_staleness, as_read=False)
        steps = sorted({g["consumed_step"] for g in chunk if g["consumed_step"] is not None})
        rows.append({"batch": i // k, "groups": len(chunk), "loss": m.get("loss"), "grad_norm": m.get("grad_norm"),
                     "reward_mean": m["reward_mean"], "start_version": v0, "orig_steps": steps,
                     "statuses": sorted({g["status"] for g in chunk})})
    drv.close()
    return rows


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    def f(v: Any) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.6g}" if isinstance(v, float) \
            else str(v)

    heads = {"step": "step", "batch": "batch", "groups": "groups", "orig_loss": "run loss", "loss": "replayed loss",
             "orig_grad_norm": "run grad norm", "grad_norm": "replayed grad norm", "reward_mean": "reward",
             "orig_steps": "run steps", "statuses": "status", "identical": "identical"}
    t = Table(title=title)
    cols = [c for c in heads if rows and c in rows[0]]
    for c in cols:
        t.add_column(heads[c], justify="right")
    for row in rows:
        t.add_row(*(f(row[c]) if not isinstance(row[c], list) else ",".join(map(str, row[c])) for c in cols))
    Console(width=None if sys.stdout.isatty() else 160).print(t)
