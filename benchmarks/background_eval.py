#!/usr/bin/env python
"""What periodic held-out evaluation costs training: none vs background vs inline.

    .venv/bin/python benchmarks/background_eval.py [--steps N] [--every E] [--configs none,background,inline]
                                                   [--repeats R] [--out FILE] [KEY=VALUE ...]

Each configuration is a full `streamrl run RECIPE run.steps=N ...` subprocess (SFT warm-start
included: it is part of the recipe) into its own run directory under `--work-dir`:

- `none`: `run.eval_every=0` (only the evaluations before and after training, not timed);
- `background`: `run.eval_every=E run.eval_mode=background` (a dedicated eval engine evaluates
  version E, 2E, ... while training goes on);
- `inline`: `run.eval_every=E run.eval_mode=inline` (the rollout engines evaluate between steps,
  training waits).

Per configuration (median over `--repeats`, configurations interleaved): RL wall time `rl_s`
(summary.json: from the first step to the last publish; set-up and the evaluations before and
after are not counted), seconds per step, the learner's mean wait for a batch and train time per
step (metrics.jsonl), and the periodic evaluations in eval.jsonl (how many, how long each took,
for background ones the lag from submission to the row). `slowdown_background` and
`slowdown_inline` are each RL wall time / the `none` RL wall time (target: background <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from streamrl.runtime.runlog import read_jsonl  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402

CONFIGS = {
    "none": ["run.eval_every=0"],
    "background": ["run.eval_every={every}", "run.eval_mode=background"],
    "inline": ["run.eval_every={every}", "run.eval_mode=inline"],
}


def run_once(recipe: str, name: str, overrides: list[str], run_dir: Path, log_path: Path,
             timeout_s: float) -> dict[str, Any]:
    """One `streamrl run` subprocess; its report, or {"error": ...} with the log's tail."""
    cmd = [sys.executable, "-m", "streamrl", "run", recipe, *overrides, "--run-dir", str(run_dir), "--quiet"]
    env = dict(os.environ)
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if rc != 0 or not (run_dir / "summary.json").exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        return {"error": f"{name}: `{' '.join(cmd)}` ended with {rc}", "log": str(log_path), "log_tail": tail}
    return report(run_dir, wall)


def report(run_dir: Path, process_s: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = read_jsonl(run_dir / "metrics.jsonl")
    n = max(1, len(steps))
    # Periodic evaluations: the background rows, and the inline rows but the first and the last
    # (before and after training).
    rows = read_jsonl(run_dir / "eval.jsonl")
    periodic = [r for r in rows if r.get("mode") == "background"] + \
        [r for r in rows if r.get("mode") != "background"][1:-1]
    lag = [r["finished_wall_s"] - r["wall_time_s"] for r in periodic if "finished_wall_s" in r]

    def mean(rows: list[dict[str, Any]], k: str) -> float | None:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        return statistics.fmean(vals) if vals else None

    return {"rl_s": summary["rl_s"], "s_per_step": summary["rl_s"] / n, "steps": len(steps),
            "setup_s": summary.get("setup_s"), "process_s": process_s,
            "learner_wait_s": mean(steps, "wait_s"), "learner_train_s": mean(steps, "train_s"),
            "periodic_evals": len(periodic), "eval_versions": [r.get("policy_version") for r in periodic],
            "eval_modes": sorted({str(r.get("mode", "inline")) for r in periodic}),
            "eval_s_mean": mean(periodic, "eval_s"), "eval_lag_s_mean": statistics.fmean(lag) if lag else None,
            "version_mismatches": sum(bool(r.get("version_mismatch")) for r in periodic),
            "accuracy_after": (summary.get("eval_after") or {}).get("accuracy"),
            "run_dir": str(run_dir)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=100, help="learner steps per run (default 100)")
    ap.add_argument("--every", type=int, default=20, help="run.eval_every for background and inline (default 20)")
    ap.add_argument("--configs", default="none,background,inline", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved (median reported)")
    ap.add_argument("--work-dir", help="where the run directories go (default: a new temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every configuration")
    a = ap.parse_args(argv)
    a.config_names = [c for c in a.configs.split(",") if c]
    unknown = sorted(set(a.config_names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    return a


def main() -> None:
    a = parse_args()
    configs = a.config_names
    os.chdir(REPO)  # the recipe's relative paths (runs/models/..., runs/data/...) are the checkout's
    load0 = os.getloadavg()[0]
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="background-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(a.repeats):
        for c in configs:
            overrides = [f"run.steps={a.steps}", *(o.format(every=a.every) for o in CONFIGS[c]), *a.overrides]
            name = f"{c}-{rep}"
            print(f"[{name}] streamrl run {a.recipe} {' '.join(overrides)} ...", file=sys.stderr, flush=True)
            res = run_once(a.recipe, name, overrides, work / name, work / f"{name}.log", a.timeout)
            runs[c].append(res)
            print(f"[{name}] " + (res["error"] if "error" in res else
                                  f"RL {res['rl_s']:.1f}s ({res['s_per_step']:.3f} s/step), "
                                  f"{res['periodic_evals']} periodic evals"), file=sys.stderr, flush=True)
    out: dict[str, Any] = {"benchmark": "background_eval", "git": git_rev(), "recipe": a.recipe,
                           "overrides": a.overrides, "steps": a.steps, "eval_every": a.every,
                           "repeats": a.repeats, "configs": {}, "work_dir": str(work)}
    for c, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        out["configs"][c] = {"rl_s": statistics.median(r["rl_s"] for r in ok) if ok else None,
                             "s_per_step": statistics.median(r["s_per_step"] for r in ok) if ok else None,
                             "runs": rs}
    base = out["configs"].get("none", {}).get("rl_s")
    for c in ("background", "inline"):
        mine = out["configs"].get(c, {}).get("rl_s")
        if base and mine:
            out[f"slowdown_{c}"] = mine / base
    if "slowdown_background" in out:
        out["target_background_le_1_10_met"] = out["slowdown_background"] <= 1.10
    out["machine"] = machine(load0, ("torch", "ray", "lancedb", "megatron-core"))
    emit(out, a.out)
    if any("error" in r for rs in runs.values() for r in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
