#!/usr/bin/env python
"""Routing replay (R3) on a stale stream run of the MoE quick-start: with and without it.

    .venv/bin/python benchmarks/routing_replay.py [--steps 60] [--repeats 3] [--out FILE]

recipes/moe_quickstart.yaml (tiny Qwen3-MoE, ep 2) in stream mode with max_staleness 4, from one
shared SFT start, `learner.routing_replay` true then false, `--repeats` times each (same seed).
Per run, averaged over the RL steps (each step's figures are over the tokens it trained on):
- routing_mismatch: the fraction of (token, layer) pairs that came with the engine's routing where
  the experts the learner routed to differ from the engine's (0 with replay, by construction and
  counted to check it);
- routing_own_mismatch: where the learner's own top-k would differ (with or without replay);
- logprob_gap: mean |learner log-prob - engine log-prob| of the trained tokens (the learner before
  the step: staleness, kernels and routing together);
- held-out accuracy before and after (the run's own evaluation).
Prints one JSON object; `routing_mismatch_frac` and `logprob_gap` hold the medians over repeats
({replay, no_replay}), `runs` every run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from streamrl.recipe import load_recipe  # noqa: E402
from streamrl.runtime.run import run_async  # noqa: E402
from streamrl.runtime.runlog import read_jsonl  # noqa: E402

from benchmarks._common import emit, git_rev, machine  # noqa: E402
from benchmarks.stream_vs_lockstep import mode_report, shared_start  # noqa: E402

KEYS = ("routing_mismatch", "routing_own_mismatch", "logprob_gap")


def step_means(run_dir: Path) -> dict[str, float]:
    m = read_jsonl(run_dir / "metrics.jsonl")
    out = {}
    for k in KEYS:
        vals = [x[k] for x in m if isinstance(x.get(k), (int, float)) and math.isfinite(x[k])]
        out[k] = statistics.fmean(vals) if vals else float("nan")
    out["routing_missing_rows"] = sum(x.get("routing_missing_rows", 0) for x in m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/moe_quickstart.yaml")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="3 steps, 1 repeat, SFT 50 steps (a smoke run)")
    ap.add_argument("--only", choices=("replay", "no_replay"), help="run one side only")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    a = ap.parse_args()
    os.chdir(REPO)
    load0 = os.getloadavg()[0]
    over = [*a.overrides, f"staleness.max_staleness={a.max_staleness}"] + (["sft.steps=50"] if a.quick else [])
    base = load_recipe(a.recipe, over)
    steps, repeats = (3, 1) if a.quick else (a.steps, a.repeats)
    # the SFT warm start runs in this process: one rank (its weights do not depend on the layout)
    one_rank = msgspec.structs.replace(base.learner, parallel=msgspec.structs.replace(base.learner.parallel, dp=1, ep=1))
    work, model, sft_s = shared_start(msgspec.structs.replace(base, learner=one_rank), "routing-replay-")
    runs: dict[str, list[dict[str, Any]]] = {"replay": [], "no_replay": []}
    for i in range(repeats):
        for label, replay in (("replay", True), ("no_replay", False)):
            if a.only and label != a.only:
                continue
            r = msgspec.structs.replace(
                base, sft=None, model=msgspec.structs.replace(base.model, path=str(model), init=None),
                run=msgspec.structs.replace(base.run, steps=steps, checkpoint_every=0, eval_every=0,
                                            dir=str(work / f"{label}-{i}")),
                learner=msgspec.structs.replace(base.learner, routing_replay=replay))
            print(f"[{label} {i + 1}/{repeats}] {steps} steps ...", file=sys.stderr, flush=True)
            summary = asyncio.run(run_async(r, work / f"{label}-{i}", progress=False))
            rep = mode_report(summary, work / f"{label}-{i}")
            got = {**step_means(work / f"{label}-{i}"),
                   **{k: rep[k] for k in ("accuracy_before", "accuracy_after", "greedy_before", "greedy_after",
                                          "rl_wall_s", "staleness_mean")}}
            runs[label].append(got)
            print(f"[{label} {i + 1}/{repeats}] {got}", file=sys.stderr, flush=True)

    runs = {lb: got for lb, got in runs.items() if got}

    def med(label: str, k: str) -> float:
        return statistics.median(x[k] for x in runs[label])

    out = {"benchmark": "routing_replay", "git": git_rev(), "recipe": a.recipe, "overrides": over, "steps": steps,
           "repeats": repeats, "sft_s": sft_s,
           "routing_mismatch_frac": {lb: med(lb, "routing_mismatch") for lb in runs},
           "routing_own_mismatch_frac": {lb: med(lb, "routing_own_mismatch") for lb in runs},
           "logprob_gap": {lb: med(lb, "logprob_gap") for lb in runs},
           "accuracy_after": {lb: med(lb, "accuracy_after") for lb in runs},
           "greedy_after": {lb: med(lb, "greedy_after") for lb in runs},
           "runs": runs, "work_dir": str(work),
           "machine": machine(load0, ("torch", "ray", "megatron-core"))}
    emit(out, a.out)


if __name__ == "__main__":
    main()
