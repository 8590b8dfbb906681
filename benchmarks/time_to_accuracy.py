#!/usr/bin/env python
"""Time to accuracy: held-out accuracy against wall-clock time and samples trained, per mode.

    .venv/bin/python benchmarks/time_to_accuracy.py [--steps N] [--repeats 3] [--out FILE]   # recipes/longtail.yaml
    .venv/bin/python benchmarks/time_to_accuracy.py --quickstart                             # recipes/quickstart.yaml

One shared SFT start (stream_vs_lockstep.shared_start), then the recipe's RL phase in `lockstep`,
`one_step_off` and `stream` (same seed, steps and groups per step, so the same number of samples
trained), `--repeats` times each, placed as stream_vs_lockstep.py places them (`--engines` engines
pinned to core 0, the learner to core 1; `--no-pin` lets them float), evaluated every `run.eval_every`
versions by the dedicated evaluation engine: by default (`--eval-mode after`) each version is exported
when reached and evaluated once the run's training is over, because on a machine with few cores an
evaluator running beside training takes CPU from it (on the 2-core box a 512-prompt evaluation took
40-90 s and one-step-off fell behind lockstep); `--eval-mode background` evaluates while training goes
on, as on a cluster where the evaluator has its own device. A curve point is one evaluated version:
`wall_s` is when the learner published it (seconds of RL; evaluation time is not counted), `samples` how
many samples it had trained on.

The target (`--target`, default: the median final accuracy of lockstep's runs) and each run's time to
reach it: linear between the first evaluated version at or above it and the one before (null if none
did). Per mode, the median over runs (null when most runs never reached it), the ratio lockstep / mode,
and the final accuracy (median, min-max). The JSON carries `time_to_target_s: {mode: s}`,
`target_accuracy`, `final_accuracy: {mode: ...}`; the PNG (`--png`, default next to `--out` or in the
work directory) draws every run's curve against seconds and against samples. `gains: {mode: [per run]}`
has each run's first -> last evaluation, sampled and greedy, with the larger of the two 95% half-widths
and whether the gain is over twice it. `--report WORK_DIR` builds all of this again from the run
directories an earlier invocation left (another `--target` or `--metric`, nothing re-run).
`cpu_probe_s`: before each run, the seconds a fixed single-core loop took (benchmarks/_common.py): the
machine's own speed drifts (on the 2-core box the same lockstep run took 273 s and then 443 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import msgspec  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from streamrl.recipe import load_recipe  # noqa: E402
from streamrl.runtime.run import run_async  # noqa: E402
from streamrl.runtime.runlog import read_jsonl  # noqa: E402

from benchmarks._common import cpu_probe, emit, git_rev, log, machine  # noqa: E402
from benchmarks.stream_vs_lockstep import (  # noqa: E402
    add_placement_args,
    add_recipe_args,
    mode_recipe,
    pinned,
    shared_start,
)

MODES = ("lockstep", "one_step_off", "stream")
COLORS = {"lockstep": "tab:gray", "one_step_off": "tab:blue", "stream": "tab:orange"}


def curve(evals: list[dict[str, Any]], samples_per_step: int, metric: str = "accuracy") -> list[dict[str, Any]]:
    """One point per evaluated version, in version order: wall_s, samples, the metric and its interval."""
    ci_key = "greedy_ci95" if metric == "greedy_accuracy" else "accuracy_ci95"
    rows = sorted(evals, key=lambda e: e["policy_version"])
    return [{"version": e["policy_version"], "wall_s": e["wall_time_s"], "samples": e["step"] * samples_per_step,
             "accuracy": e[metric], "ci95": e.get(ci_key)} for e in rows]


def gains(evals: list[dict[str, Any]]) -> dict[str, dict[str, float | bool]]:
    """First -> last evaluation of one run, sampled and greedy: the gain, the larger 95% half-width of
    the two points, and whether the gain is over twice it (what the long-tail recipe must show)."""
    rows = sorted(evals, key=lambda e: e["policy_version"])
    first, last, out = rows[0], rows[-1], {}
    for name, key, ci in (("sampled", "accuracy", "accuracy_ci95"), ("greedy", "greedy_accuracy", "greedy_ci95")):
        if key not in last:
            continue
        half = max(first.get(ci) or 0.0, last.get(ci) or 0.0)
        out[name] = {"first": first[key], "last": last[key], "gain": last[key] - first[key], "ci95": half,
                     "over_2x_ci95": last[key] - first[key] > 2 * half}
    return out


def time_to_target(points: list[dict[str, Any]], target: float) -> float | None:
    """When the curve first reaches `target`: linear between the first evaluated version at or above it
    and the one before (evaluations are tens of steps apart; taking the later one's time would round
    every mode up to its next evaluation); the first point's time if it starts there; None if never."""
    for prev, p in zip([None, *points], points):
        if p["accuracy"] >= target:
            if prev is None:
                return p["wall_s"]
            f = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return prev["wall_s"] + f * (p["wall_s"] - prev["wall_s"])
    return None


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the runs that reached the target, or None when most did not."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) * 2 > len(values) else None


def summarize(runs: dict[str, list[list[dict[str, Any]]]], target: float | None) -> dict[str, Any]:
    """Per mode: final accuracy (median, min, max), time to target per run and its median, ratio to lockstep."""
    finals = {m: [c[-1]["accuracy"] for c in cs] for m, cs in runs.items() if cs}
    if target is None:
        target = statistics.median(finals["lockstep"])
    times = {m: [time_to_target(c, target) for c in cs] for m, cs in runs.items()}
    ttt = {m: median_or_none(t) for m, t in times.items()}
    base = ttt.get("lockstep")
    return {"target_accuracy": target,
            "time_to_target_s": ttt, "time_to_target_runs_s": times,
            "speedup_vs_lockstep": {m: (base / t if base and t else None) for m, t in ttt.items()},
            # per repeat (runs of one repeat ran minutes apart, so a drift in the machine's speed
            # touches them alike; the medians above mix repeats)
            "speedup_vs_lockstep_per_repeat": {m: [(b / t if b and t else None) for b, t in
                                                   zip(times.get("lockstep", []), ts)] for m, ts in times.items()},
            "final_accuracy": {m: statistics.median(v) for m, v in finals.items()},
            "final_accuracy_range": {m: [min(v), max(v)] for m, v in finals.items()}}


def plot(runs: dict[str, list[list[dict[str, Any]]]], target: float, path: Path, title: str) -> None:
    fig = Figure(figsize=(11, 4.2))
    for ax, x, label in ((fig.add_subplot(1, 2, 1), "wall_s", "seconds of RL"),
                         (fig.add_subplot(1, 2, 2), "samples", "samples trained")):
        for mode, cs in runs.items():
            for i, c in enumerate(cs):
                ax.errorbar([p[x] for p in c], [p["accuracy"] for p in c], yerr=[p["ci95"] or 0 for p in c],
                            color=COLORS.get(mode), alpha=0.8, capsize=2, label=mode if i == 0 else None)
        ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:.3f}")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (±95%)")
        ax.grid(alpha=0.3)
    fig.axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(ap)
    ap.add_argument("--steps", type=int, help="learner steps per run (default: the recipe's run.steps)")
    add_placement_args(ap)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--eval-every", type=int, help="versions between evaluations (default: the recipe's run.eval_every)")
    ap.add_argument("--eval-mode", choices=("after", "background"), default="after",
                    help="evaluate the versions once each run's training is over (default), or while it trains")
    ap.add_argument("--target", type=float, help="accuracy to reach (default: lockstep's median final accuracy)")
    ap.add_argument("--metric", choices=("accuracy", "greedy_accuracy"), default="accuracy",
                    help="sampled (default) or greedy held-out accuracy")
    ap.add_argument("--sft-model", help="start every run from this HF directory instead of the recipe's SFT")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--png", help="the curves (default: next to --out, else in the work directory)")
    ap.add_argument("--report", metavar="WORK_DIR", help="run nothing: report on the runs an earlier invocation left "
                    "in WORK_DIR (its <mode>-<repeat> directories)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    a = ap.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    if bad := [m for m in a.modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if a.report and not Path(a.report).is_dir():
        ap.error(f"--report: {a.report} is not a directory")
    if a.target is None and "lockstep" not in a.modes:
        ap.error("without lockstep among --modes, give --target")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.chdir(REPO)  # the recipes' relative paths are the checkout's
    load0 = os.getloadavg()[0]
    base = load_recipe(a.recipe, a.overrides)
    steps = a.steps or base.run.steps
    every = a.eval_every or base.run.eval_every or max(1, steps // 6)
    pin = pinned(a)
    per_step = base.rollout.groups_per_step * base.rollout.n_samples
    if a.report:
        work, model, sft_s = Path(a.report), None, None
    else:
        work, model, sft_s = shared_start(base, "time-to-accuracy-", a.sft_model)
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in a.modes}
    run_gains: dict[str, list[dict[str, Any]]] = {m: [] for m in a.modes}
    probes: dict[str, list[float]] = {m: [] for m in a.modes}
    for rep in range(a.repeats):
        for mode in a.modes:  # interleaved, so a drift in the machine's speed touches every mode alike
            label = f"{mode}-{rep}"
            if not a.report:
                probes[mode].append(round(cpu_probe(), 3))
                r = mode_recipe(base, model, work / label, mode, steps, a.engines, pin)
                r = msgspec.structs.replace(r, run=msgspec.structs.replace(r.run, eval_every=every,
                                                                            eval_mode=a.eval_mode))
                log(f"[{label}] {steps} steps, evaluated every {every} ...")
                asyncio.run(run_async(r, work / label, progress=False))
            evals = read_jsonl(work / label / "eval.jsonl")
            if not evals:
                raise SystemExit(f"{work / label}: no evaluations in eval.jsonl (--report needs the directories "
                                 f"of {a.repeats} repeats of {', '.join(a.modes)})")
            runs[mode].append(curve(evals, per_step, a.metric))
            run_gains[mode].append(gains(evals))
            c = runs[mode][-1]
            log(f"[{label}] {a.metric} {c[0]['accuracy']:.3f} -> {c[-1]['accuracy']:.3f} in {c[-1]['wall_s']:.0f}s")
    out: dict[str, Any] = {"benchmark": "time_to_accuracy", "git": git_rev(), "recipe": a.recipe,
                           "overrides": a.overrides, "steps": steps, "eval_every": every, "eval_mode": a.eval_mode,
                           "engines": a.engines, "pinned": pin, "repeats": a.repeats,
                           "metric": a.metric, "samples_per_step": per_step, "sft_s": sft_s,
                           "sft_model": a.sft_model or (model and str(model)),
                           **summarize(runs, a.target), "gains": run_gains, "cpu_probe_s": probes, "curves": runs,
                           "work_dir": str(work)}
    png = Path(a.png) if a.png else (Path(a.out).with_suffix(".png") if a.out else work / "time_to_accuracy.png")
    plot(runs, out["target_accuracy"], png, f"{a.recipe} ({a.metric}), {a.repeats} runs per mode, {out['git']}")
    out["png"] = str(png)
    out["machine"] = machine(load0, ("torch", "ray", "lancedb", "megatron-core"))
    emit(out, a.out)


if __name__ == "__main__":
    main()
