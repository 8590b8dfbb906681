"""`streamrl run RECIPE`: start everything, evaluate, train in the recipe's mode, evaluate, report.

The run directory (`--run-dir`, default `run.dir` or runs/<run.name>) gets metrics.jsonl,
eval.jsonl, events.jsonl, run.log, logs/ (router, engines), checkpoints/, model/ (the final
policy, HF format) and pool/ (the experience pool; inspect it with `streamrl pool ...`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from ray.exceptions import RayActorError
from tqdm import tqdm

from streamrl.pools import RECORDED_RECIPE, NoPool, PoolError, open_pool
from streamrl.recipe import Recipe, dump_recipe, load_recipe
from streamrl.runtime import RunFailed, RunLost, faultpoint, loop
from streamrl.runtime.user_code import MODULES_FILE, load_run_recipe, record_modules
from streamrl.runtime.services import Services
from streamrl.runtime.steps import Steps


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


async def run_async(r: Recipe, run_dir: Path, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    svc = Services(r, run_dir, progress, resume=resume)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "mode": r.run.mode, "steps": r.run.steps}
    events, main = asyncio.get_running_loop(), asyncio.current_task()
    assert main is not None

    def on_sigint() -> None:  # Ctrl-C: stop at once; groups in flight are not waited for (resume restarts them)
        if not svc.interrupted:
            svc.interrupted = True
            svc.log.warn(f"interrupted: `streamrl run --resume {run_dir}` continues this run from its last checkpoint; "
                        "nothing in the pool is lost")
            main.cancel()

    events.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        t_setup = time.perf_counter()
        await svc.start()
        rt = Steps(svc)
        summary["setup_s"] = time.perf_counter() - t_setup
        summary["start_step"] = rt.start_step
        before = await rt.evaluate(rt.start_step)
        bar = tqdm(total=r.run.steps, initial=rt.start_step, desc=f"{r.run.mode} RL", unit="step",
                   disable=not progress, dynamic_ncols=True, mininterval=1.0)

        seen = [0]

        def on_step(m: dict[str, Any]) -> None:
            bar.update(1)
            seen[0] += m["samples"]
            bar.set_postfix_str(f"v{m['policy_version']} samples {seen[0]} reward {_fmt(m['reward_mean'])} "
                                f"stale {m['staleness_mean']:.2f}/{m['staleness_max']} "
                                f"gen {m['gen_tokens_per_s']:.0f} tok/s loss {_fmt(m.get('loss', float('nan')))}")

        rt.t0 = t_rl = time.perf_counter()
        if svc.bg_eval is not None:
            svc.bg_eval.t0 = rt.t0 - rt.wall_offset
        await loop.MODES[r.run.mode](rt, r.run.steps, on_step)
        summary["rl_s"] = time.perf_counter() - t_rl
        bar.close()
        if svc.bg_eval is not None:
            await svc.bg_eval.drain()  # evaluations of versions the run went past
        if r.run.checkpoint_every == 0 or r.run.steps % r.run.checkpoint_every:
            await rt.checkpoint()
        after = await rt.evaluate(r.run.steps)
        summary["model"] = await svc.export()
        samples = sum(m["samples"] for m in rt.steps)
        summary |= {"policy_version": rt.version, "samples": samples,
                    "samples_per_s": samples / summary["rl_s"] if summary["rl_s"] else 0.0,
                    "eval_before": before, "eval_after": after,
                    "reward_first": rt.steps[0]["reward_mean"] if rt.steps else None,
                    "reward_last": rt.steps[-1]["reward_mean"] if rt.steps else None,
                    "staleness_max": max((m["staleness_max"] for m in rt.steps), default=0),
                    "engine_restarts": svc.engines.restarts}
    except RunFailed:
        # A run that stops with a reason (out of prompts, a filter that always raises) still evaluates
        # the versions it held or queued: its evaluation engine is its own and alive, and with
        # run.eval_mode after those evaluations are the run's only held-out curve.
        if svc.bg_eval is not None and svc.bg_eval.waiting:
            svc.log.warn(f"the run stopped early: evaluating the {svc.bg_eval.waiting} version(s) it queued first")
            await svc.bg_eval.drain()
        raise
    except asyncio.CancelledError:
        if svc.interrupted:
            raise KeyboardInterrupt from None
        raise
    except RayActorError as e:  # the learner's node lost (workers and engines are restarted), or a process killed
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        why = next((line for line in lines if "died because" in line), lines[0][:300])
        msg = (f"the run lost a process it cannot restart, such as the learner ({why}); "
               f"`streamrl run --resume {run_dir}` continues this run from its "
               "last checkpoint once the cluster has the resources again; nothing in the pool is lost")
        svc.log.warn(msg)
        raise RunLost(msg) from None
    finally:
        events.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C aborts the clean-up too
        await svc.stop()
    return summary


RECIPE = RECORDED_RECIPE  # the run's resolved recipe, which `--resume`, `streamrl replay` and the pool CLI read
# What a resumed run must keep: which prompt instances exist and who owns them, and the policy the checkpoints hold.
FIXED_ON_RESUME = ("model", "sft", "data.path", "data.shuffle", "data.seed", "rollout.workers", "rollout.n_samples",
                   "rollout.groups_per_step", "pool", "producer_api.enabled")


def _get(r: Recipe, dotted: str) -> Any:
    node: Any = msgspec.to_builtins(r)
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


RUN_MARKERS = ("metrics.jsonl", "pool", "run.log", RECIPE, "checkpoints")  # what a run leaves in its directory


class RunExists(RunFailed):
    """The run directory already holds a run; nothing was changed."""


def holds_run(d: Path) -> bool:
    return d.is_dir() and any((d / m).exists() for m in RUN_MARKERS)


def _clear(d: Path) -> None:
    """--overwrite: remove the files an earlier run left in `d` (and nothing else)."""
    for name in ("metrics.jsonl", "eval.jsonl", "events.jsonl", "run.log", "summary.json", RECIPE, faultpoint.FROZEN, faultpoint.THAW, MODULES_FILE,
                 "endpoints.json", "producer_token", "producer.json", "producer.lock"):
        (d / name).unlink(missing_ok=True)
    for name in ("pool", "checkpoints", "weights", "model", "adapter", "sft_model", "logs", "report"):
        shutil.rmtree(d / name, ignore_errors=True)


def new_run_dir(r: Recipe, run_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """The directory a new run writes to. Nothing a run left is ever deleted implicitly:
    - `run_dir` (--run-dir) or the recipe's run.dir: used as given; when it already holds a run
      this raises RunExists, unless `overwrite` (which deletes that run's files first);
    - neither: a fresh dated directory `runs/<run.name>-YYYYmmdd-HHMMSS`, with `runs/<run.name>`
      a symbolic link to the newest, so `streamrl report runs/<run.name>` finds the latest run
      and every earlier one is kept."""
    explicit = run_dir or r.run.dir
    if explicit:
        d = Path(explicit)
        if holds_run(d):
            if not overwrite:
                raise RunExists(f"{d} already holds a run (its pool, checkpoints and logs are kept): continue it with "
                                f"`streamrl run --resume {d}`, start a new one with another --run-dir, or pass "
                                "--overwrite to delete it and start again")
            _clear(d)
        elif d.exists() and any(d.iterdir()):  # never delete what StreamRL did not write
            raise FileExistsError(f"{d} exists and is not a StreamRL run directory; pick another --run-dir")
        d.mkdir(parents=True, exist_ok=True)
        return d
    latest = r.run_dir  # runs/<run.name>
    latest.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        d = latest.with_name(f"{latest.name}-{stamp}" + (f"-{n}" if n else ""))
        try:
            d.mkdir()
            break
        except FileExistsError:
            continue
    if latest.is_symlink() or not latest.exists():
        tmp = latest.with_name(f".{latest.name}.{os.getpid()}.link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(d.name)
        os.replace(tmp, latest)  # atomic: readers see the old run or the new one
    return d


def run(r: Recipe, run_dir: str | Path | None = None, progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """A new run (see `new_run_dir` for where; an existing run is never replaced silently)."""
    if r.pool.uri:
        _refuse_a_used_pool(r)
    d = new_run_dir(r, run_dir, overwrite)
    r = msgspec.structs.replace(r, run=msgspec.structs.replace(r.run, dir=str(d)))
    (d / RECIPE).write_text(dump_recipe(r))
    record_modules(r, d)  # what --resume may import again
    return _run(r, d, progress, resume=False)


def _refuse_a_used_pool(r: Recipe) -> None:
    """A new run never writes into another run's pool: `pool.uri` (an object store, or a path
    outside the run directory) must name no pool or an empty one; --overwrite never deletes it."""

    try:
        with open_pool(r.pool.uri, config=r.pool) as pool:  # type: ignore[arg-type]
            rows = pool.count()
    except NoPool:
        return  # nothing there yet: this run creates it
    except PoolError as e:
        raise RunFailed(f"pool.uri: {e}") from None
    if rows:
        raise RunExists(f"pool.uri {r.pool.uri} already holds an experience pool ({rows} rows) of another run: give "
                        "this run a new pool.uri, or continue that run with `streamrl run --resume RUN_DIR` "
                        "(--overwrite never deletes a pool outside the run directory)")


def resume(run_dir: str | Path, overrides: list[str] | None = None, progress: bool = True,
           trust_run_dir: bool = False) -> dict[str, Any]:
    """Continue a stopped or killed run from its last checkpoint (`streamrl run --resume DIR`).
    User code is imported only from the files the run imported it from when it started
    (runtime/user_code.py), unless `trust_run_dir`."""
    d = Path(run_dir)
    if not (d / RECIPE).is_file():
        raise FileNotFoundError(f"{d} has no {RECIPE}: it is not a StreamRL run directory (or was made before "
                                "runs saved their recipe); start a new run with `streamrl run RECIPE --run-dir ...`")
    was = load_recipe(d / RECIPE, resolve=False)
    r = load_run_recipe(d, overrides, trust=trust_run_dir,
                        say=None if not progress else lambda line: print(f"streamrl: {line}", file=sys.stderr))
    for key in FIXED_ON_RESUME:
        old, new = (_get(x, key) for x in (was, r))
        if old != new:
            raise RunFailed(f"{key} cannot change on --resume ({old!r} -> {new!r}): the pool, checkpoints and "
                             "dataset positions of this run were made with the old value; start a new run instead")
    if overrides:
        (d / RECIPE).write_text(dump_recipe(r))
    for name in (faultpoint.FROZEN, faultpoint.THAW):
        (d / name).unlink(missing_ok=True)
    return _run(r, d, progress, resume=True)


def _run(r: Recipe, d: Path, progress: bool, resume: bool) -> dict[str, Any]:
    summary = asyncio.run(run_async(r, d, progress, resume))
    (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
