#!/usr/bin/env python
"""Which off-policy correction? The same stale stream run once per `learner.off_policy` option.

    .venv/bin/python benchmarks/off_policy.py [--quick] [--steps N] [--repeats R] [--recipe FILE]
        [--corrections none,tis,...] [--max-staleness 4] [--out-dir DIR] [KEY=VALUE ...]

The recipe's SFT warm-start runs once (in this process); every run then starts from those weights
as a full `streamrl run` in stream mode at `staleness.max_staleness` 4 (--max-staleness) with
`staleness.policy: keep`, so generation runs up to four versions ahead and nothing stale is
dropped: what differs between runs is only how the learner corrects for it. Same recipe, seed
and number of learner steps for every option; --repeats R runs each option R times with seeds
run.seed, run.seed + 1, ... (the lead's comparison uses 3). As in stream_vs_lockstep.py one engine
is pinned to core 0 and the learner to core 1 (--no-pin to let them float).

Per run (JSON `runs`): held-out accuracy before and after (sampled, and greedy), train reward
first/last step, the reward per policy version, staleness, and the means of the correction's
metrics (is_weight_mean, is_masked_tokens, is_capped_tokens, clip_frac), the largest gradient
norm and the optimizer steps skipped as non-finite. Per option (JSON `options`): the median over
its runs of accuracy after and of its gain over before. `default` names what `off_policy: auto`
picks for this stream run. Writes off_policy.json and off_policy.png (reward per version, one
line per option, and held-out accuracy before/after) into --out-dir (default runs/off_policy/)
and prints the JSON.
"""

from __future__ import annotations

import argparse
import math
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from streamrl.core import corrections  # noqa: E402
from streamrl.recipe import RecipeError, load_recipe  # noqa: E402
from streamrl.runtime.run import run_async  # noqa: E402
from streamrl.runtime.runlog import read_jsonl  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402
from benchmarks.stream_vs_lockstep import add_placement_args, mode_report, pinned, shared_start  # noqa: E402

OPTIONS = ("none", "tis", "tis_seq", "mis", "decoupled", "icepop")
METRICS = ("is_weight_mean", "is_masked_tokens", "is_capped_tokens", "is_ratio_mean", "clip_frac")


def run_report(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    out = mode_report(summary, run_dir)
    for k in METRICS:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        out[k] = statistics.fmean(vals) if vals else None
    out["grad_norm_max"] = max((r["grad_norm"] for r in rows if isinstance(r.get("grad_norm"), float)), default=None)
    out["nonfinite_skipped"] = sum(r.get("nonfinite_skipped", 0) for r in rows)
    out["reward_by_version"] = [[r["policy_version"], r["reward_mean"]] for r in rows]
    return out


def option_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    after = [r["accuracy_after"] for r in runs]
    gain = [r["accuracy_after"] - r["accuracy_before"] for r in runs]
    return {"runs": len(runs), "accuracy_after_median": statistics.median(after),
            "accuracy_gain_median": statistics.median(gain), "accuracy_after": after,
            "greedy_after_median": statistics.median(r["greedy_after"] for r in runs),
            "reward_last_median": statistics.median(r["reward_last_step"] for r in runs),
            "nonfinite_skipped": sum(r["nonfinite_skipped"] for r in runs)}


def plot(result: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax_r, ax_a = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = list(result["options"])
    for i, name in enumerate(names):
        runs = [r for r in result["runs"] if r["off_policy"] == name]
        by_v: dict[int, list[float]] = {}
        for r in runs:
            for v, rew in r["reward_by_version"]:
                if isinstance(rew, float) and math.isfinite(rew):
                    by_v.setdefault(v, []).append(rew)
        v = np.array(sorted(by_v))
        y = np.array([statistics.fmean(by_v[k]) for k in v])
        w = max(1, len(v) // 15)
        smooth = np.convolve(y, np.ones(w) / w, mode="valid") if len(y) >= w else y
        label = name + (" (default)" if name == result["default"] else "")
        ax_r.plot(v[w - 1:] if len(y) >= w else v, smooth, lw=2, color=f"C{i}", label=label)
        before = [r["accuracy_before"] for r in runs]
        after = [r["accuracy_after"] for r in runs]
        ax_a.scatter([i - 0.15] * len(before), before, color="gray", s=18, zorder=3)
        ax_a.scatter([i + 0.15] * len(after), after, color=f"C{i}", s=18, zorder=3)
        ax_a.bar([i - 0.15, i + 0.15], [statistics.median(before), statistics.median(after)], width=0.3,
                 color=["lightgray", f"C{i}"], alpha=0.6)
    reps = max(result["options"][n]["runs"] for n in names)
    ax_r.set(title=f"Train reward per version (mean of {reps} run(s), rolling)", xlabel="policy version",
             ylabel="reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=9)
    ax_a.set_xticks(range(len(names)), names, rotation=20)
    ax_a.set(title="Held-out accuracy: before (gray) / after, median and runs", ylabel="accuracy")
    ax_a.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result['recipe']}: stream, max_staleness {result['max_staleness']}, policy keep, "
                 f"{result['steps']} steps per run")
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml", help="any stream recipe (default: the quick-start)")
    ap.add_argument("--corrections", default=",".join(OPTIONS), help="learner.off_policy options to run")
    ap.add_argument("--steps", type=int, help="learner steps per run (default: the recipe's run.steps)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per option, seeds run.seed + 0, 1, ... (default 1)")
    ap.add_argument("--max-staleness", type=int, default=4)
    add_placement_args(ap)
    ap.add_argument("--quick", action="store_true", help="6 steps, one run per option (a smoke run, not a measurement)")
    ap.add_argument("--out-dir", default="runs/off_policy", help="off_policy.json and off_policy.png go here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    a = ap.parse_args(argv)
    a.names = [c for c in a.corrections.split(",") if c]
    bad = [c for c in a.names if c not in OPTIONS]
    if bad or not a.names:
        ap.error(f"--corrections: unknown {bad}; choose from {', '.join(OPTIONS)}")
    return a


def main() -> None:
    a = parse_args()
    names = a.names
    os.chdir(REPO)  # the recipes' relative paths (runs/models/..., runs/data/...) are the checkout's
    load0 = os.getloadavg()[0]
    fixed = [f"staleness.max_staleness={a.max_staleness}", "staleness.policy=keep", "run.mode=stream"]
    try:
        base = load_recipe(a.recipe, [*a.overrides, *fixed])
    except RecipeError as e:
        print(f"off_policy.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    steps = 6 if a.quick else (a.steps or base.run.steps)
    repeats = 1 if a.quick else a.repeats
    work, model, sft_s = shared_start(base, "off-policy-")
    pin = pinned(a)
    runs: list[dict[str, Any]] = []
    for name in names:
        for rep in range(repeats):
            seed = base.run.seed + rep
            run_dir = work / f"{name}-seed{seed}"
            per_run = ["sft=null", "model.init=null", f"model.path={model}", f"run.steps={steps}", f"run.seed={seed}",
                       "run.checkpoint_every=0", "run.eval_every=0", f"run.dir={run_dir}", f"learner.off_policy={name}",
                       f"engines.num={a.engines}", f"engines.cpus={[0] if pin else []}",
                       f"learner.cpus={[1] if pin else []}"]
            try:
                r = load_recipe(a.recipe, [*a.overrides, *fixed, *per_run])
            except RecipeError as e:  # e.g. an override for one correction's key while running another
                print(f"off_policy.py: {name}: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            print(f"[{name} seed {seed}] {steps} steps ...", file=sys.stderr, flush=True)
            summary = asyncio.run(run_async(r, run_dir, progress=False))
            rep_ = {"off_policy": name, "seed": seed, **run_report(summary, run_dir)}
            runs.append(rep_)
            print(f"[{name} seed {seed}] accuracy {rep_['accuracy_before']:.3f} -> {rep_['accuracy_after']:.3f} "
                  f"in {rep_['rl_wall_s']:.0f}s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "benchmark": "off_policy", "git": git_rev(), "recipe": a.recipe, "overrides": a.overrides, "steps": steps,
        "repeats": repeats, "max_staleness": a.max_staleness, "policy": "keep", "engines": a.engines, "pinned": pin,
        "default": corrections.resolve("auto", a.max_staleness), "sft_s": sft_s,
        "options": {n: option_summary([r for r in runs if r["off_policy"] == n]) for n in names},
        "runs": runs, "work_dir": str(work)}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(out, out_dir / "off_policy.png")
    out["png"] = str(out_dir / "off_policy.png")
    out["machine"] = machine(load0, ("torch", "ray", "lancedb", "megatron-core"))
    emit(out, out_dir / "off_policy.json")


if __name__ == "__main__":
    main()
