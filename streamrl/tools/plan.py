"""`streamrl plan RUN --gpus N`: size a cluster for a run's workload (streamrl/sim/plan.py decides; this
prints the table, writes the JSON and draws the sweep)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from streamrl.sim import plan
from streamrl.sim.fromrun import RunProfile, read_run


def length_summary(p: RunProfile) -> dict[str, Any]:
    v, c = np.asarray(p.lengths.values), np.asarray(p.lengths.counts)
    q = np.repeat(v, c)
    return {"responses": int(c.sum()), "mean": float(q.mean()), "p50": float(np.percentile(q, 50)),
            "p90": float(np.percentile(q, 90)), "p99": float(np.percentile(q, 99)), "max": int(q.max()),
            "at_cap": float((q >= p.lengths.max_new_tokens).mean()), "max_new_tokens": p.lengths.max_new_tokens,
            "within_prompt_share": p.lengths.within, "prompts": p.prompts, "groups_per_prompt": p.groups_per_prompt}


def run_plan(run_dir: str, gpus: int, model_size: str = "7b", steps: int = 16, groups_per_step: int | None = None,
             n_samples: int | None = None, calibrate: list[str] | None = None, out_dir: str | None = None,
             progress: bool = True) -> dict[str, Any]:
    p = read_run(run_dir)
    base = plan.plan_workload(p, steps, groups_per_step, n_samples)
    make, tp, hardware = plan.cluster_maker(p, model_size)
    with tqdm(total=plan.sweep_size(gpus, tp), desc="simulating", unit="run", disable=not progress,
              dynamic_ncols=True) as bar:
        rows = plan.sweep(base, make, gpus, tp, bar.update, processes=os.cpu_count() or 1)
    pick, lock = plan.recommend(rows), plan.baseline(rows)
    out: dict[str, Any] = {
        "run_dir": str(p.run_dir), "run_mode": p.mode, "gpus": gpus, "model_size": model_size, **hardware,
        "max_running": make(1, 1).max_running,
        "workload": {"groups_per_step": base.groups_per_step, "n_samples": base.n_samples,
                     "prompt_tokens": base.prompt_tokens, "steps_simulated": base.steps, "prompts": base.prompts},
        "lengths": length_summary(p),
        "recommended": {**pick, "speedup_over_lockstep": pick["train_tokens_per_s"] / lock["train_tokens_per_s"],
                        "samples_speedup_over_lockstep": pick["samples_per_s"] / lock["samples_per_s"]},
        "recipe_keys": plan.recipe_keys(pick, base), "lockstep": lock, "sweep": rows}
    if calibrate is not None:
        out["calibration"] = plan.calibration(p, [read_run(d) for d in calibrate])
    out_path = Path(out_dir) if out_dir else p.run_dir / "plan"
    out_path.mkdir(parents=True, exist_ok=True)
    draw(out, out_path / "plan.png")
    out["png"] = str(out_path / "plan.png")
    (out_path / "plan.json").write_text(json.dumps(out, indent=1))
    out["json"] = str(out_path / "plan.json")
    return out


def draw(out: dict[str, Any], path: Path) -> None:
    """Per engine/learner split: tokens trained per second against the staleness bound (lockstep at 0,
    one-step-off marked), and the tail share; the recommendation starred."""
    fig = Figure(figsize=(10, 7))
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    rows = [r for r in out["sweep"] if r["schedule"] == "fifo"]
    for learner, engines in sorted({(r["learner_gpus"], r["engines"]) for r in rows}):
        here = [r for r in rows if (r["learner_gpus"], r["engines"]) == (learner, engines)]
        for pr, style in (("abort_resume", "-o"), ("restart", ":x")):
            line = sorted([r for r in here if r["mode"] == "lockstep" or r["partial_rollout"] == pr],
                          key=lambda r: r["max_staleness"])
            label = f"{learner} learner GPUs / {engines} engines, {pr}"
            ax.plot([r["max_staleness"] for r in line], [r["train_tokens_per_s"] for r in line], style, label=label)
            ax2.plot([r["max_staleness"] for r in line], [r["tail_share"] or 0 for r in line], style, label=label)
        osd = [r for r in here if r["mode"] == "one_step_off"]
        ax.plot([1 for _ in osd], [r["train_tokens_per_s"] for r in osd], "ks", ms=5)
    pick = out["recommended"]
    ax.plot([pick["max_staleness"]], [pick["train_tokens_per_s"]], "r*", ms=16, label="recommended")
    ax.set_ylabel("tokens trained / s")
    ax2.set_ylabel("tail share (last 10% of requests)")
    ax2.set_xlabel("max_staleness (0: lockstep; black square: one_step_off)")
    ax2.set_xticks([0, *plan.STALENESS])
    ax.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"streamrl plan {out['run_dir']}: {out['gpus']} GPUs, {out['model_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_plan(out: dict[str, Any]) -> None:
    con = Console() if sys.stdout.isatty() else Console(width=160)  # piped: a file has no 80-column limit
    ln = out["lengths"]
    con.print(f"[bold]{out['run_dir']}[/bold] ({out['run_mode']}): {ln['responses']} responses, length mean "
              f"{ln['mean']:.0f}, p90 {ln['p90']:.0f}, p99 {ln['p99']:.0f}, {ln['at_cap']:.1%} at the cap of "
              f"{ln['max_new_tokens']}; a prompt explains {1 - ln['within_prompt_share']:.0%} of the length spread")
    con.print(f"simulated on {out['gpus']} GPUs: {out['hardware']}; {out['workload']['groups_per_step']} groups x "
              f"{out['workload']['n_samples']} samples per step")
    pick = out["recommended"]
    per_engine = out["workload"]["groups_per_step"] * out["workload"]["n_samples"] / pick["engines"]
    if per_engine < out["max_running"] / 4:
        con.print(f"[yellow]note[/yellow]: {per_engine:.0f} requests per engine per step at most, of the "
                  f"{out['max_running']} an engine runs at once: the engines idle at this batch; plan a larger one "
                  "with --groups-per-step / --n-samples")
    t = Table(title="each configuration at its best split (eta: max_staleness; tail: share of rollout time only "
                    "the last 10% of requests ran; busy: engines; waste: tokens never trained)")
    for col in ("", "mode", "eta", "partial", "schedule", "learner/eng", "tok/s", "x lock", "tail", "busy", "waste"):
        t.add_column(col, no_wrap=True)
    lock = out["lockstep"]["train_tokens_per_s"]
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in out["sweep"]:
        key = (r["mode"], r["max_staleness"], r["partial_rollout"], r["schedule"])
        if key not in best or r["train_tokens_per_s"] > best[key]["train_tokens_per_s"]:
            best[key] = r
    for r in sorted(best.values(), key=lambda r: (r["max_staleness"], r["mode"], str(r["partial_rollout"]), r["schedule"])):
        star = "*" if all(r[k] == pick[k] for k in ("mode", "max_staleness", "partial_rollout", "schedule")) else ""
        t.add_row(star, r["mode"], str(r["max_staleness"]), r["partial_rollout"] or "-", r["schedule"],
                  f"{r['learner_gpus']}/{r['engines']}", f"{r['train_tokens_per_s']:.0f}",
                  f"{r['train_tokens_per_s'] / lock:.2f}", f"{r['tail_share'] or 0:.2f}", f"{r['engine_busy']:.2f}",
                  f"{r['wasted_token_fraction']:.2f}")
    con.print(t)
    keys = " ".join(f"{k}={v}" for k, v in out["recipe_keys"].items())
    con.print(f"[bold]recommended[/bold] (*): {keys} with {pick['learner_gpus']} learner GPUs and "
              f"{pick['engine_gpus']} engine GPUs: predicted {pick['speedup_over_lockstep']:.2f}x lockstep's tokens/s, "
              f"tail share {pick['tail_share'] or 0:.2f} (lockstep {out['lockstep']['tail_share'] or 0:.2f})")
    if "calibration" in out:
        cal = out["calibration"]
        con.print(f"calibration on the run's own machine (fitted on {cal['fitted_mode']}):")
        for r in cal["rows"]:
            line = (f"  {r['mode']:13s} step {r['measured_step_s']:.3f} s measured, {r['predicted_step_s']:.3f} s "
                    f"predicted ({r['step_error']:+.0%})")
            if "measured_speedup" in r:
                line += (f"; over lockstep {r['measured_speedup']:.2f}x measured, {r['predicted_speedup']:.2f}x "
                         f"predicted ({r['speedup_error']:+.0%})")
            con.print(line)
    con.print(f"wrote {out['json']} and {out['png']}")
