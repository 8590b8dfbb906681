#!/usr/bin/env python
"""Cluster-scale throughput of lockstep, one-step-off and streaming, simulated.

    .venv/bin/python benchmarks/simulate_cluster.py [--quick] [--gpus 8,64,512] [--out-dir DIR]
    .venv/bin/python benchmarks/simulate_cluster.py --sweep          # + which parameters drive the speedup
    .venv/bin/python benchmarks/simulate_cluster.py --calibrate MEASURED.json  # vs stream_vs_lockstep.py
    .venv/bin/python benchmarks/simulate_cluster.py --gpus 64,512 --within 0.3 --schedules fifo,longest_first

A discrete-event simulation in virtual time (streamrl/sim/cluster.py) that runs StreamRL's own
admission control, claim/consumption policy, partial-rollout transitions and ledger against
modelled engines, learner and weight broadcast. Defaults model a 7B dense model in bf16 on H100s:

  engine      one GPU (tp 1); a decode iteration takes 8 ms + 0.04 ms per running request
              (14k output tokens/s at the cap of 256 running requests); prefill 40k tokens/s
  learner     engine GPUs / 2 GPUs (a third of the cluster); 7k tokens/s per GPU for
              forward + backward + log-prob recompute over prompt + response; 1 s per step fixed
  broadcast   15.2 GB at 25 GB/s + 0.5 s; engines are paused while it runs (stream)
  workload    512 prompts x 16 samples per step (AReaL's batch); prompts 256 tokens; responses
              lognormal, median 1000 tokens, sigma 1.0, capped at 8192 (long-tailed: mean ~1.5k,
              p99 ~8k); --lengths FILE takes an empirical histogram instead
  consumption policy `drop`, 4 rollout workers, lengths counted in 16-token blocks

Length-aware scheduling (`--schedules`): each mode again with `rollout.schedule` longest_first or
tail_batching (MODE+SCHEDULE); prompts then come back epoch after epoch (4 steps an epoch) and
each prompt has its own length scale (`--within`: the share of the length variance left within
one prompt's samples), which the pool's history learns from the epochs before.

Modes: lockstep, one_step_off, stream at max_staleness (eta) 1, 2, 4, 8 with partial rollout
(`abort_resume`: interrupted responses continue on the new weights) and without (`restart`: they
are generated again), and `lockstep_colocated`: lockstep on all engine + learner GPUs, each
phase using all of them (+5 s per step to swap engine and trainer memory) — the synchronous
baseline AReaL and verl report their speedups against.

Figures per mode and cluster size (JSON on stdout and in --out-dir, plus a PNG):
  samples_per_s        consumed samples per second after the warm-up steps (throughput)
  train_tokens_per_s   the same in tokens (restart favours short responses, so compare both)
  speedup              samples_per_s / lockstep's samples_per_s at the same size
  speedup_tokens       the same for train_tokens_per_s
  response_tokens_mean mean length of the responses trained on (restart biases it down)
  engine_utilisation   output tokens per engine-second / the engine's peak (256 running requests)
  engine_busy          fraction of engine time decoding or prefilling (not idle, not paused)
  tail_share           per step, the fraction of its batch's rollout time during which only the last
                       10% of its requests still ran (Seer's measure; streamrl/core/lengths.py)
  learner_utilisation  fraction of wall time the learner trains
  staleness_mean/max   learner version - oldest token version of each consumed group
  wasted_token_fraction tokens generated but never trained on (restarted or dropped as stale)
  ledger               the real ledger over the simulated pool: lost and duplicated must be 0

`--calibrate` models the CPU runs stream_vs_lockstep.py measured (its recipe: the long-tail
countdown task by default; one embedded engine, learner on its own core) as `streamrl plan
--calibrate` does (streamrl/sim/fromrun.py): the lockstep run's learner, push and response
lengths, one engine parameter fitted to its step time; then it predicts one-step-off and stream
and compares them with the measured step times and speedups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from matplotlib.figure import Figure  # noqa: E402

from streamrl.sim.fromrun import RunReadError, read_run  # noqa: E402
from streamrl.sim.plan import calibration  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402
from streamrl.sim.cluster import Cluster, Lengths, Workload, simulate  # noqa: E402

COLOCATE_SWITCH_S = 5.0


def scenarios() -> list[tuple[str, dict[str, Any]]]:
    """(label, workload changes) for every mode compared."""
    out: list[tuple[str, dict[str, Any]]] = [
        ("lockstep", {"mode": "lockstep", "max_staleness": 0}),
        ("lockstep_colocated", {"mode": "lockstep", "max_staleness": 0}),
        ("one_step_off", {"mode": "one_step_off", "max_staleness": 1}),
    ]
    for eta in (1, 2, 4, 8):
        for pr in ("abort_resume", "restart"):
            out.append((f"stream_eta{eta}_{pr}", {"mode": "stream", "max_staleness": eta, "partial_rollout": pr}))
    return out


def colocated(c: Cluster) -> Cluster:
    """Every GPU generates, then every GPU trains; weights move within each GPU."""
    gpus = c.engines + c.learner_gpus
    return dataclasses.replace(c, engines=gpus, learner_gpus=gpus,
                               learner_step_overhead_s=c.learner_step_overhead_s + COLOCATE_SWITCH_S,
                               broadcast_bytes_per_s=c.broadcast_bytes_per_s * 4)


def cluster_for(gpus: int, overrides: dict[str, Any]) -> Cluster:
    return dataclasses.replace(Cluster(engines=gpus, learner_gpus=max(1, gpus // 2)), **overrides)


def run_size(gpus: int, base: Workload, cover: dict[str, Any], only: set[str] | None,
             schedules: tuple[str, ...] = ()) -> dict[str, Any]:
    res: dict[str, Any] = {}
    cases = [(label, change) for label, change in scenarios() if not only or label in only or label == "lockstep"]
    cases += [(f"{label}+{s}", {**change, "schedule": s}) for label, change in cases for s in schedules if s != "fifo"]
    for label, change in cases:
        c = cluster_for(gpus, cover)
        if label.startswith("lockstep_colocated"):
            c = colocated(c)
        t0 = time.perf_counter()
        r = simulate(c, dataclasses.replace(base, **change))
        r["sim_s"] = time.perf_counter() - t0
        r["speedup"] = r["samples_per_s"] / res["lockstep"]["samples_per_s"] if res else 1.0
        r["speedup_tokens"] = r["train_tokens_per_s"] / res["lockstep"]["train_tokens_per_s"] if res else 1.0
        led = r["ledger"]
        if led["lost"] or led["duplicated"] or led["unadmitted"]:
            raise SystemExit(f"{label} at {gpus} GPUs: the ledger does not balance: {led}")
        res[label] = r
        print(f"  {gpus:4d} GPUs {label:26s} {r['samples_per_s']:9.1f} samples/s  x{r['speedup']:.2f} "
              f"(tokens x{r['speedup_tokens']:.2f})  "
              f"engines {r['engine_utilisation']:.2f}  learner {r['learner_utilisation']:.2f}  "
              f"staleness {r['staleness_mean']:.2f}/{r['staleness_max']}  busy {r['engine_busy']:.2f}  "
              f"tail {r['tail_share']:.2f}  ({r['sim_s']:.1f}s)",
              file=sys.stderr, flush=True)
    return res


def sweep(base: Workload, cover: dict[str, Any], gpus: int) -> list[dict[str, Any]]:
    """Stream (eta 4, abort_resume) over lockstep while one parameter moves."""
    cases: list[tuple[str, Any, dict[str, Any], dict[str, Any]]] = []
    for s in (0.5, 1.0, 1.5):
        cases.append(("length_sigma", s, {"lengths": dataclasses.replace(base.lengths, sigma=s)}, {}))
    for m in (2048, 8192, 32768):
        cases.append(("max_new_tokens", m, {"lengths": dataclasses.replace(base.lengths, max_new_tokens=m)}, {}))
    for ratio in (0.25, 0.5, 1.0):
        cases.append(("learner_gpus_per_engine_gpu", ratio, {}, {"learner_gpus": max(1, int(gpus * ratio))}))
    for gps in (128, 512, 2048):
        cases.append(("groups_per_step", gps, {"groups_per_step": gps}, {}))
    for bw in (2.5e9, 25e9, 250e9):
        cases.append(("broadcast_bytes_per_s", bw, {}, {"broadcast_bytes_per_s": bw}))
    out = []
    for name, value, wchange, cchange in cases:
        w = dataclasses.replace(base, **wchange)
        c = cluster_for(gpus, {**cover, **cchange})
        lock = simulate(c, dataclasses.replace(w, mode="lockstep", max_staleness=0))
        st = simulate(c, dataclasses.replace(w, mode="stream", max_staleness=4, partial_rollout="abort_resume"))
        row = {"parameter": name, "value": value, "speedup": st["samples_per_s"] / lock["samples_per_s"],
               "lockstep_engine_utilisation": lock["engine_utilisation"],
               "stream_engine_utilisation": st["engine_utilisation"],
               "stream_learner_utilisation": st["learner_utilisation"], "stream_staleness_mean": st["staleness_mean"]}
        out.append(row)
        print(f"  sweep {name}={value}: x{row['speedup']:.2f}", file=sys.stderr, flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    sizes = list(result["sizes"])
    labels = list(result["sizes"][sizes[0]])
    figs = [("speedup", "samples/s ÷ lockstep"), ("engine_utilisation", "engine utilisation"),
            ("learner_utilisation", "learner utilisation"), ("staleness_mean", "mean staleness (max: dot)")]
    # A bare Figure (no pyplot): no GUI backend to pick and no global figure to close.
    fig = Figure(figsize=(11, 3.2 * len(figs)))
    axes = fig.subplots(len(figs), 1, sharex=True)
    width = 0.8 / len(sizes)
    for ax, (key, title) in zip(axes, figs):
        for k, size in enumerate(sizes):
            xs = [i + (k - (len(sizes) - 1) / 2) * width for i in range(len(labels))]
            vals = [result["sizes"][size][lab][key] for lab in labels]
            ax.bar(xs, vals, width, label=f"{size} engine GPUs")
            if key == "staleness_mean":
                ax.plot(xs, [result["sizes"][size][lab]["staleness_max"] for lab in labels], "k.", ms=4)
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(ncol=len(sizes), fontsize=8)
    axes[-1].set_xticks(range(len(labels)))
    axes[-1].set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    fig.suptitle("StreamRL cluster simulation (benchmarks/simulate_cluster.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_lengths(path: str, max_new_tokens: int) -> Lengths:
    """A histogram file: JSON {"length": count, ...}, or one length per line (or `length count`)."""
    text = Path(path).read_text()
    counts: dict[int, int] = {}
    try:
        counts = {int(k): int(v) for k, v in json.loads(text).items()}
    except (json.JSONDecodeError, AttributeError):
        for lineno, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if not parts:
                continue
            try:
                counts[int(parts[0])] = counts.get(int(parts[0]), 0) + (int(parts[1]) if len(parts) > 1 else 1)
            except ValueError:
                raise SystemExit(f"{path}:{lineno}: expected `length [count]`, got {line!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"{path}: needs at least one length >= 1")
    vals = sorted(counts)
    return Lengths(max_new_tokens, values=vals, counts=[counts[v] for v in vals])


def parse_overrides(items: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """KEY=VALUE for Cluster or Workload fields (numbers)."""
    cf = {f.name: f.type for f in dataclasses.fields(Cluster)}
    wf = {f.name for f in dataclasses.fields(Workload)} - {"lengths", "mode"}
    c, w = {}, {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or (key not in cf and key not in wf):
            raise SystemExit(f"override {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(set(cf) | wf))}")
        num: Any = float(val) if any(ch in val for ch in ".e") else int(val) if val.lstrip("-").isdigit() else val
        (c if key in cf else w)[key] = num
    return c, w


def main_simulate(a: argparse.Namespace) -> None:
    cover, wover = parse_overrides(a.overrides)
    lengths = read_lengths(a.lengths, a.max_new_tokens) if a.lengths else \
        Lengths(a.max_new_tokens, median=a.median, sigma=a.sigma)
    lengths = dataclasses.replace(lengths, within=a.within)
    steps = a.steps or (10 if a.quick else 24)
    base = Workload(steps=steps, groups_per_step=128 if a.quick else 512, lengths=lengths,
                    warmup_steps=max(1, steps // 4))
    base = dataclasses.replace(base, **wover)
    schedules = tuple(x for x in (a.schedules or "").split(",") if x)
    if schedules and not base.prompts:  # a dataset small enough to come back: 4 steps an epoch
        base = dataclasses.replace(base, prompts=4 * base.groups_per_step)
    only = set(a.modes.split(",")) if a.modes else None
    t0 = time.perf_counter()
    sizes = {}
    for g in [int(x) for x in a.gpus.split(",")]:
        sizes[str(g)] = run_size(g, base, cover, only, schedules)
    out: dict[str, Any] = {"benchmark": "simulate_cluster", "git": git_rev(), "quick": a.quick,
                           "cluster": dataclasses.asdict(Cluster(**cover)),
                           "workload": {**dataclasses.asdict(base), "mode": "(per scenario)"},
                           "learner_gpus": "engine GPUs // 2 unless overridden",
                           "sizes": sizes}
    if a.sweep:
        out["sweep_64"] = sweep(base, cover, 64)
    out["elapsed_s"] = time.perf_counter() - t0
    out["machine"] = machine(os.getloadavg()[0], ("numpy", "pyarrow"))
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(out, out_dir / "simulate_cluster.png")
    out["png"] = str(out_dir / "simulate_cluster.png")
    emit(out, out_dir / "simulate_cluster.json")


# ------------------------------------------------------------------ calibration against the CPU run


def main_calibrate(a: argparse.Namespace) -> None:
    """`streamrl plan`'s calibration on the runs stream_vs_lockstep.py left: fitted on its lockstep run."""
    measured = json.loads(Path(a.calibrate).read_text())
    work = Path(measured["work_dir"])
    modes = [m for m in ("lockstep", "one_step_off", "stream") if m in measured["modes"]]
    if "lockstep" not in modes:
        raise SystemExit(f"{a.calibrate}: no lockstep run to fit on (stream_vs_lockstep.py --modes lockstep,...)")
    try:
        runs = [read_run(work / m) for m in modes]
    except RunReadError as e:
        raise SystemExit(f"{a.calibrate}: {e}") from None
    cal = calibration(runs[0], runs[1:])
    for r in cal["rows"]:
        print(f"  {r['mode']:14s} measured {r['measured_step_s']:.3f} s/step  simulated {r['predicted_step_s']:.3f}"
              + (f"  speedup {r['measured_speedup']:.2f} vs {r['predicted_speedup']:.2f} "
                 f"({r['speedup_error']:+.0%})" if "speedup_error" in r else ""), file=sys.stderr)
    emit({"benchmark": "simulate_cluster calibrate", "git": git_rev(), "measured": a.calibrate,
          "measured_git": measured.get("git"), **cal}, a.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 steps of 128 prompts x 16 (under a minute)")
    ap.add_argument("--gpus", default="8,64,512", help="engine GPU counts to simulate")
    ap.add_argument("--steps", type=int, help="learner steps per mode (default 24; --quick 10)")
    ap.add_argument("--modes", help="comma-separated scenario labels (lockstep always runs)")
    ap.add_argument("--lengths", help="empirical response-length histogram (JSON {len: count} or lines)")
    ap.add_argument("--median", type=float, default=1000.0, help="lognormal median response length")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (tail weight)")
    ap.add_argument("--max-new-tokens", type=int, default=8192)
    ap.add_argument("--within", type=float, default=1.0,
                    help="share of the length variance within one prompt's samples (1: prompts alike; 0.3: a "
                         "prompt's own scale explains 70%%)")
    ap.add_argument("--schedules", help="also run every mode with these rollout.schedule values (e.g. "
                                        "fifo,longest_first,tail_batching), labelled MODE+SCHEDULE; the dataset "
                                        "is then 4 steps of prompts (prompts=N overrides) seen epoch after epoch")
    ap.add_argument("--sweep", action="store_true", help="also vary one parameter at a time at 64 GPUs")
    ap.add_argument("--out-dir", default="runs/simulate_cluster", help="JSON and PNG go here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="Cluster/Workload fields, e.g. learner_gpus=16 groups_per_step=1024")
    cal = ap.add_argument_group("calibration against a CPU run of stream_vs_lockstep.py (long-tail recipe by default)")
    cal.add_argument("--calibrate", metavar="MEASURED.json",
                     help="simulate the runs stream_vs_lockstep.py measured (its JSON; its work_dir must still exist), "
                          "fitted on the lockstep run: `streamrl plan WORK/lockstep --calibrate WORK/stream ...`")
    cal.add_argument("--out", help="also write the calibration JSON here")
    a = ap.parse_args()
    if a.calibrate:
        main_calibrate(a)
    else:
        main_simulate(a)


if __name__ == "__main__":
    main()
