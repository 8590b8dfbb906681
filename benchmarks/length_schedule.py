#!/usr/bin/env python
"""Length-aware scheduling on the long-tail task: `rollout.schedule` fifo vs longest_first (and
tail_batching) in lockstep and stream, and how well the pool's history predicts lengths.

    .venv/bin/python benchmarks/length_schedule.py [--steps 48] [--prompts 128] [--quick] [--out FILE]
    .venv/bin/python benchmarks/length_schedule.py --schedules fifo,longest_first,tail_batching

The recipe is recipes/longtail.yaml on a training set of `--prompts` prompts (written here), so
that a run of `--steps` steps x 8 groups sees each prompt in several epochs: the first epoch has no
history (every schedule is fifo there), the later ones are ordered by what the pool holds. The SFT
warm-start runs once; every (mode, schedule) run starts from it with the same seed and steps, as a
full `streamrl run` (stream_vs_lockstep.py's setup: one engine on core 0, the learner on core 1).

Per run: samples/s over the whole RL phase and over the steps after the first epoch (where the
schedule can act), mean step time, the tail share (per step, the fraction of its groups' rollout
time during which only its last group was still generating: a group's samples are one batched
call, so the client sees groups, not samples; with 10 or more groups a step, its last 10%) and
`tail_share_tokens` (the same in decode iterations, from the responses' lengths: see tail_shares),
interrupted calls, staleness mean/max, held-out accuracy before and after. `rank_corr`:
Spearman's rho of each predictor against the real lengths (streamrl/core/lengths.py rank_quality)
over the fifo lockstep run's pool: `history` on the groups whose prompt was seen before.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from streamrl.core import lengths  # noqa: E402
from streamrl.plugins.tasks import write_longtail_task  # noqa: E402
from streamrl.pools.lance_pool import LancePool  # noqa: E402
from streamrl.pools.queries import group_lengths  # noqa: E402
from streamrl.recipe import load_recipe  # noqa: E402
from streamrl.runtime.runlog import read_jsonl  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402
from benchmarks.stream_vs_lockstep import mode_recipe, mode_report, pinned, run_mode, shared_start  # noqa: E402


def step_times(run_dir: Path) -> tuple[list[dict[str, Any]], list[float]]:
    """The run's step metrics and each step's wall seconds (from the end of the one before)."""
    m = read_jsonl(run_dir / "metrics.jsonl")
    ends = [x["wall_time_s"] for x in m]
    return m, [b - a for a, b in zip([0.0, *ends], ends)]


def epoch_of(group_id: str) -> int:
    return int(group_id.rsplit(":", 2)[1][1:])  # rollout-0:e1:p17


def tail_shares(run_dir: Path, metrics: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(groups, tokens). groups: per step, its groups from admission to storage (pool created_ns, the
    group_appended event), in wall-clock time. tokens: per step, (longest response - the 90th percentile's)
    / longest: the share of the step's decode iterations in which only its last 10% of responses still ran,
    for a batch whose responses all start together (lockstep; iterations, not seconds: an iteration of
    few responses is cheaper)."""
    with LancePool(str(run_dir / "pool")) as pool:
        t = pool.scan(["group_id", "created_ns", "num_tokens", "sample_index"])
    start = {g: c for g, c, i in zip(*(t[k].to_pylist() for k in ("group_id", "created_ns", "sample_index"))) if i == 0}
    lens: dict[str, list[int]] = {}
    for g, n in zip(t["group_id"].to_pylist(), t["num_tokens"].to_pylist()):
        lens.setdefault(g, []).append(n)
    by_step = [sorted(n for g in m["groups"] for n in lens.get(g, [])) for m in metrics if m.get("groups")]
    tokens = [(x[-1] - x[max(0, math.ceil(0.9 * len(x)) - 1)]) / x[-1] for x in by_step if x and x[-1] > 0]
    end = {g: e["at"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("type") == "group_appended"
           for g in e["group_ids"]}
    batches = [([start[g] / 1e9 for g in m["groups"]], [end[g] / 1e9 for g in m["groups"]]) for m in metrics
               if m.get("groups") and all(g in start and g in end for g in m["groups"])]
    last = max(0.1, 1 / max(1, min((len(s) for s, _ in batches), default=1)))
    return lengths.tail_share(batches, last=last), (statistics.fmean(tokens) if tokens else None)


def run_report(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    m, secs = step_times(run_dir)
    later = [(x, s) for x, s in zip(m, secs) if x.get("groups") and min(epoch_of(g) for g in x["groups"]) >= 1]
    rep = mode_report(summary, run_dir)
    rep.update({
        "samples_per_s_after_epoch_1": (sum(x["samples"] for x, _ in later) / sum(s for _, s in later)) if later else None,
        "steps_after_epoch_1": len(later),
        "step_s_mean": statistics.fmean(secs) if secs else None})
    rep["tail_share"], rep["tail_share_tokens"] = tail_shares(run_dir, m)
    return rep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/longtail.yaml")
    ap.add_argument("--steps", type=int, default=48, help="learner steps per run (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=128, help="training prompts (default: %(default)s: 16 steps an epoch)")
    ap.add_argument("--modes", default="lockstep,stream")
    ap.add_argument("--schedules", default="fifo,longest_first")
    ap.add_argument("--quick", action="store_true", help="8 steps on 16 prompts (a smoke run, not a measurement)")
    ap.add_argument("--sft-model", help="start every run from this HF directory instead of the recipe's SFT")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the engine and learner to separate cores")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    os.chdir(REPO)
    load0 = os.getloadavg()[0]
    steps, prompts = (8, 16) if a.quick else (a.steps, a.prompts)
    base = load_recipe(a.recipe, a.overrides)
    work, model, sft_s = shared_start(base, "length-schedule-", a.sft_model)
    files = write_longtail_task(work / "data", seed=base.run.seed, n_train=prompts)
    epochs = math.ceil(steps * base.rollout.groups_per_step * base.rollout.over_sampling / prompts) + 1
    pin = pinned(a)
    runs: dict[str, Any] = {}
    for mode in a.modes.split(","):
        for schedule in a.schedules.split(","):
            label = f"{mode}_{schedule}"
            r = mode_recipe(base, model, work / label, mode, steps, 1, pin,
                            data=msgspec.structs.replace(base.data, path=str(files["train"]),
                                                         eval_path=str(files["eval"]), epochs=epochs, generate=None),
                            rollout=msgspec.structs.replace(base.rollout, schedule=schedule))
            runs[label] = run_report(run_mode(r, work / label, label), work / label)
            print(f"[{label}] {runs[label]['rl_wall_s']:.1f}s, {runs[label]['samples_per_s']:.1f} samples/s, tail share "
                  f"{runs[label]['tail_share']}", file=sys.stderr, flush=True)
    first = next(iter(runs))
    with LancePool(str(work / first / "pool")) as pool:
        quality = lengths.rank_quality(group_lengths(pool))
    out: dict[str, Any] = {
        "benchmark": "length_schedule", "git": git_rev(), "recipe": a.recipe, "overrides": a.overrides, "steps": steps,
        "prompts": prompts, "epochs": epochs, "pinned": pin, "sft_s": sft_s, "sft_model": str(model),
        "samples_per_s": {k: v["samples_per_s"] for k, v in runs.items()},
        "samples_per_s_after_epoch_1": {k: v["samples_per_s_after_epoch_1"] for k, v in runs.items()},
        "tail_share": {k: v["tail_share"] for k, v in runs.items()},
        "tail_share_tokens": {k: v["tail_share_tokens"] for k, v in runs.items()},
        "rank_corr": {k: quality[k] for k in ("history", "siblings", "fallback")},
        "rank_corr_groups": {k: quality[f"n_{k}"] for k in ("history", "siblings", "fallback")},
        "rank_corr_from": first, "runs": runs, "work_dir": str(work)}
    for mode in a.modes.split(","):
        fifo = runs.get(f"{mode}_fifo")
        for k, v in runs.items():
            if fifo and k.startswith(mode + "_") and k != f"{mode}_fifo":
                out[f"speedup_{k}_vs_fifo"] = v["samples_per_s"] / fifo["samples_per_s"]
    out["machine"] = machine(load0, ("torch", "ray", "lancedb", "megatron-core"))
    emit(out, a.out)


if __name__ == "__main__":
    main()
