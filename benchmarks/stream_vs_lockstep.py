#!/usr/bin/env python
"""Stream vs lockstep vs one-step-off: a recipe's RL phase in each mode, same steps.

    .venv/bin/python benchmarks/stream_vs_lockstep.py [--steps N] [--quick] [--out FILE]   # recipes/longtail.yaml
    .venv/bin/python benchmarks/stream_vs_lockstep.py --quickstart --steps 100            # recipes/quickstart.yaml

The default recipe is the long-tail countdown task (responses 9-220 tokens, median ~47: lockstep
waits for the longest chain of every batch, as in real reasoning workloads); `--quickstart` runs
the quick-start's addition task instead (1-7 tokens, no tail), `--recipe` any other.

The SFT warm-start runs once (in this process); each mode then starts from the same warm-started
weights with the same recipe, seed and number of learner steps, as a full `streamrl run` (Ray,
router, engines, learner actor, rollout workers; one after the other in this process tree).
By default one engine is pinned to core 0 and the learner to core 1, so on this 2-core machine
generation and training each get one core (the driver, router and rollout worker float).

Per mode: RL wall time (from the first step to the last publish; start-up and evaluation are
not counted), samples/s, held-out accuracy before/after, and where the time went — per step,
the learner's wait for a batch (`wait_s`, generation it could not overlap), its training
(`train_s`), the weight push (`push_s`), the engines' pause (`pause_s`), and the fraction of generated
tokens the in-flight policy threw away (`discarded_token_frac`). Prints one JSON object; `speedup_stream_vs_lockstep`
is lockstep wall time / stream wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from streamrl.recipe import load_recipe  # noqa: E402
from streamrl.runtime.inputs import prepare_inputs, sft_rows  # noqa: E402
from streamrl.runtime.learner import LearnerDriver  # noqa: E402
from streamrl.runtime.run import run  # noqa: E402
from streamrl.runtime.runlog import RunLog, read_jsonl  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402


def warm_start(recipe: Any, out: Path) -> Path:
    """The quick-start's SFT phase once, exported as an HF directory every mode starts from."""
    tok = AutoTokenizer.from_pretrained(recipe.model.path)
    drv = LearnerDriver(recipe, recipe.model.path, pool=False)
    s = recipe.sft
    drv.sft(sft_rows(recipe, tok), s.steps, s.lr, s.batch_size, recipe.run.seed, s.lr_schedule)
    return Path(drv.export(str(out / "sft-model")))


def shared_start(recipe: Any, prefix: str, sft_model: str | None = None) -> tuple[Path, Path, float]:
    """A fresh work directory with the recipe's inputs prepared and its SFT warm-start done once
    (or `sft_model`, one done before): (work dir, the model every run starts from, SFT seconds)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    prepare_inputs(recipe, RunLog(work / "prepare", echo=False))
    t0 = time.perf_counter()
    if sft_model:
        model = Path(sft_model)
    else:
        model = warm_start(recipe, work) if recipe.sft is not None else Path(recipe.model.path)
    return work, model, time.perf_counter() - t0


def mode_recipe(base: Any, model: Path, run_dir: Path, mode: str, steps: int, engines: int, pin: bool,
                **parts: Any) -> Any:
    """`base` as one benchmark run takes it: from `model` (no SFT), `mode` for `steps` steps into `run_dir`,
    no checkpoints or periodic evaluations, `engines` engines, pinned (engine core 0, learner core 1) when
    `pin`; `parts` replace whole recipe sections (e.g. staleness=...)."""
    return msgspec.structs.replace(
        base, sft=None,
        model=msgspec.structs.replace(base.model, path=str(model), init=None),
        run=msgspec.structs.replace(base.run, mode=mode, steps=steps, checkpoint_every=0, eval_every=0,
                                    dir=str(run_dir)),
        engines=msgspec.structs.replace(base.engines, num=engines, cpus=[0] if pin else []),
        learner=msgspec.structs.replace(base.learner, cpus=[1] if pin else []), **parts)


def run_mode(recipe: Any, run_dir: Path, label: str) -> dict[str, Any]:
    """One benchmark run of `recipe` into `run_dir`, announced on stderr as `label`: its summary. A run
    directory as `streamrl run` leaves it (recipe.yaml, summary.json), so `streamrl plan`, `report` and
    `replay` read it."""
    print(f"[{label}] {recipe.run.steps} steps ...", file=sys.stderr, flush=True)
    return run(recipe, run_dir, progress=False)


def mode_report(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    m = read_jsonl(run_dir / "metrics.jsonl")

    def mean(k: str) -> float:
        return statistics.fmean(x[k] for x in m) if m else 0.0

    return {"rl_wall_s": summary["rl_s"], "samples_per_s": summary["samples_per_s"], "samples": summary["samples"],
            "accuracy_before": summary["eval_before"]["accuracy"], "accuracy_after": summary["eval_after"]["accuracy"],
            "greedy_before": summary["eval_before"]["greedy_accuracy"],
            "greedy_after": summary["eval_after"]["greedy_accuracy"],
            "reward_first_step": summary["reward_first"], "reward_last_step": summary["reward_last"],
            "per_step_s": summary["rl_s"] / max(1, len(m)), "learner_wait_s": mean("wait_s"),
            "learner_train_s": mean("train_s"), "push_s": mean("push_s"), "pause_s": mean("pause_s"),
            "finish_window_s": mean("finish_window_s"), "interrupted_calls": m[-1].get("interrupted_calls", 0) if m else 0,
            "discarded_token_frac": m[-1].get("discarded_token_frac", 0.0) if m else 0.0,
            "staleness_mean": mean("staleness_mean"), "staleness_max": max((x["staleness_max"] for x in m), default=0),
            "dropped_stale": sum(x["dropped_stale"] for x in m),
            "gen_tokens_per_s": mean("gen_tokens_per_s"), "train_tokens_per_s": mean("train_tokens_per_s")}


def add_recipe_args(ap: argparse.ArgumentParser) -> None:
    """--recipe (default: the long-tail recipe) or --quickstart."""
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--recipe", default="recipes/longtail.yaml", help="the recipe (default: %(default)s)")
    which.add_argument("--quickstart", dest="recipe", action="store_const", const="recipes/quickstart.yaml",
                       help="the quick-start recipe (recipes/quickstart.yaml)")


def add_placement_args(ap: argparse.ArgumentParser) -> None:
    """--engines (default 1) and --no-pin: where every mode's engines and learner run."""
    ap.add_argument("--engines", type=int, default=1, help="rollout engines per run (default: %(default)s)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the engine and learner to separate cores")


def pinned(a: argparse.Namespace) -> bool:
    """Pin (engine core 0, learner core 1) unless --no-pin or the machine has one core."""
    return not a.no_pin and (os.cpu_count() or 1) >= 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(ap)
    ap.add_argument("--steps", type=int, help="learner steps per mode (default: the recipe's run.steps)")
    ap.add_argument("--modes", default="lockstep,one_step_off,stream")
    add_placement_args(ap)
    ap.add_argument("--quick", action="store_true", help="6 steps per mode (a smoke run, not a measurement)")
    ap.add_argument("--policies", default="",
                    help="also run stream once per staleness.partial_rollout listed (abort_resume,in_place,restart,"
                         "finish_old), reported as stream_<policy>")
    ap.add_argument("--sft-model", help="start every mode from this HF directory instead of running the recipe's SFT "
                                        "(e.g. WORK_DIR/sft-model of an earlier run of this script)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every mode")
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    os.chdir(REPO)  # the recipes' relative paths (runs/models/..., runs/data/...) are the checkout's
    load0 = os.getloadavg()[0]
    base = load_recipe(a.recipe, a.overrides)
    steps = 6 if a.quick else (a.steps or base.run.steps)
    work, model, sft_s = shared_start(base, "stream-vs-lockstep-", a.sft_model)
    pin = pinned(a)
    modes: dict[str, Any] = {}
    runs = [(m, m, base.staleness.partial_rollout) for m in a.modes.split(",")]
    runs += [(f"stream_{p}", "stream", p) for p in a.policies.split(",") if p]
    for label, mode, policy in runs:
        r = mode_recipe(base, model, work / label, mode, steps, a.engines, pin,
                        staleness=msgspec.structs.replace(base.staleness, partial_rollout=policy))
        modes[label] = mode_report(run_mode(r, work / label, label), work / label)
        print(f"[{label}] {modes[label]['rl_wall_s']:.1f}s, accuracy {modes[label]['accuracy_before']:.3f} -> "
              f"{modes[label]['accuracy_after']:.3f}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"benchmark": "stream_vs_lockstep", "git": git_rev(), "recipe": a.recipe,
                           "overrides": a.overrides, "steps": steps, "engines": a.engines, "pinned": pin,
                           "sft_s": sft_s, "sft_model": str(model), "modes": modes, "work_dir": str(work)}
    if "lockstep" in modes:
        for m in modes:
            if m != "lockstep":
                out[f"speedup_{m}_vs_lockstep"] = modes["lockstep"]["rl_wall_s"] / modes[m]["rl_wall_s"]
    out["machine"] = machine(load0, ("torch", "ray", "lancedb", "megatron-core"))
    emit(out, a.out)


if __name__ == "__main__":
    main()
