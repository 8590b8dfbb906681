"""`streamrl plan`'s reasoning: simulate a run's workload on a cluster of N GPUs in every mode, staleness
bound, partial-rollout policy, engine/learner split and prompt schedule worth trying, and pick one.

The workload is the run's own (streamrl/sim/fromrun.py: its batch, its pool's response lengths and how
much of them each prompt explains). The hardware is a model size's preset on H100s (`preset`), or, with
model size `run`, the machine the run itself ran on (its measured learner, push and fitted engine: each
of the N "GPUs" is then one of that run's devices).

Choice (`recommend`): by tokens trained per second (samples per second would favour `restart`, which
drops long responses); among the configurations within `tolerance` of the best, the one with the least
staleness (it costs learning, so past that point it buys nothing), then the least waste, then fifo prompt
order unless only a schedule gets near the best (a gain inside the tolerance is not worth the change). The baseline
is lockstep at its own best split with fifo prompts: what a synchronous system would run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any

from streamrl.sim.cluster import Cluster, Workload, simulate
from streamrl.sim.fromrun import RunProfile, calibrated_cluster, workload

LEARNER_SHARES = (0.25, 1 / 3, 0.5)  # learner GPUs / all GPUs
STALENESS = (1, 2, 4, 8)
PARTIAL = ("abort_resume", "restart")
SCHEDULES = ("longest_first", "tail_batching")  # tried on the chosen configuration and on lockstep
REFERENCE_PARAMS = 7.6e9  # Cluster's defaults model a 7B-class model (15.2 GB in bf16) on one H100


class PlanError(ValueError):
    """Arguments the planner cannot use (the message says which and what it takes)."""


def preset(model_size: str) -> tuple[Cluster, int]:
    """(one engine and the learner's rates for `model_size`, e.g. 7b, 32b, 1.5b; tensor parallel GPUs per
    engine). Scaled from the 7B defaults in proportion to the parameter count: decode time per iteration
    (weights and KV cache read once per token) and prefill and training time per token (2 and 6 FLOPs
    per parameter); tensor parallelism (1 GPU per engine up to 15B, 2 up to 40B, 4 up to 80B, then 8)
    divides an engine's time by its GPUs, ideally. A first-order model: no KV-cache capacity limit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*[bB]", model_size.strip())
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"--model-size {model_size!r}: expected a parameter count in billions such as 7b, 32b or "
                        "1.5b, or `run` (the machine the run ran on)")
    params = float(m.group(1)) * 1e9
    tp = 1 if params <= 15e9 else 2 if params <= 40e9 else 4 if params <= 80e9 else 8
    k = params / REFERENCE_PARAMS
    d = Cluster()
    c = dataclasses.replace(d, decode_base_s=d.decode_base_s * k / tp, decode_per_seq_s=d.decode_per_seq_s * k / tp,
                            prefill_tokens_per_s=d.prefill_tokens_per_s * tp / k,
                            learner_tokens_per_s_per_gpu=d.learner_tokens_per_s_per_gpu / k, model_bytes=2 * params)
    return c, tp


def splits(gpus: int, tp: int) -> list[tuple[int, int]]:
    """(learner GPUs, engines) for each learner share, each split once; every side gets at least one."""
    out: list[tuple[int, int]] = []
    for share in LEARNER_SHARES:
        learner = min(gpus - tp, max(1, round(gpus * share)))
        engines = (gpus - learner) // tp
        if learner >= 1 and engines >= 1 and (learner, engines) not in out:
            out.append((learner, engines))
    if not out:
        raise PlanError(f"--gpus {gpus}: too few for one learner GPU and one engine of {tp} GPU(s)")
    return out


def configurations() -> list[dict[str, Any]]:
    """Workload changes per mode tried at every split (schedules come after, on the best)."""
    out: list[dict[str, Any]] = [{"mode": "lockstep", "max_staleness": 0}, {"mode": "one_step_off", "max_staleness": 1}]
    out += [{"mode": "stream", "max_staleness": eta, "partial_rollout": pr} for eta in STALENESS for pr in PARTIAL]
    return out


def row_of(r: dict[str, Any], learner: int, engines: int, tp: int, change: dict[str, Any], w: Workload) -> dict[str, Any]:
    led = r["ledger"]
    if led["lost"] or led["duplicated"] or led["unadmitted"]:
        raise RuntimeError(f"the simulated ledger does not balance for {change} at {learner}/{engines}: {led}")
    return {"learner_gpus": learner, "engines": engines, "engine_gpus": engines * tp, "mode": r["mode"],
            "max_staleness": r["max_staleness"],
            "partial_rollout": change.get("partial_rollout", w.partial_rollout) if r["mode"] == "stream" else None,
            "schedule": change.get("schedule", "fifo"),
            **{k: r[k] for k in ("samples_per_s", "train_tokens_per_s", "tail_share", "engine_busy",
                                 "learner_utilisation", "staleness_mean", "staleness_max", "wasted_token_fraction")}}


def sweep(base: Workload, cluster_for: Callable[[int, int], Cluster], gpus: int, tp: int,
          progress: Callable[[int], None] = lambda n: None, processes: int = 1) -> list[dict[str, Any]]:
    """Every split x configuration, then the schedules on the recommended one and on the best lockstep;
    simulations spread over `processes` (each is independent and deterministic: same rows either way)."""
    jobs = [(learner, engines, {**change, "schedule": "fifo"}) for learner, engines in splits(gpus, tp)
            for change in configurations()]
    rows = _simulate_all(base, cluster_for, tp, jobs, progress, processes)
    jobs = []
    for pick in (recommend(rows), baseline(rows)):
        change = {k: pick[k] for k in ("mode", "max_staleness")}
        if pick["partial_rollout"]:
            change["partial_rollout"] = pick["partial_rollout"]
        jobs += [(pick["learner_gpus"], pick["engines"], {**change, "schedule": s}) for s in SCHEDULES]
    return rows + _simulate_all(base, cluster_for, tp, jobs, progress, processes)


def _simulate_all(base: Workload, cluster_for: Callable[[int, int], Cluster], tp: int,
                  jobs: list[tuple[int, int, dict[str, Any]]], progress: Callable[[int], None],
                  processes: int) -> list[dict[str, Any]]:
    runs = [(cluster_for(learner, engines), dataclasses.replace(base, **change)) for learner, engines, change in jobs]
    results: list[dict[str, Any] | None] = [None] * len(runs)
    if processes > 1 and len(runs) > 1:
        with ProcessPoolExecutor(min(processes, len(runs)), mp_context=get_context("spawn")) as ex:
            futures = {ex.submit(simulate, c, w): i for i, (c, w) in enumerate(runs)}
            for f in as_completed(futures):
                results[futures[f]] = f.result()
                progress(1)
    else:
        for i, (c, w) in enumerate(runs):
            results[i] = simulate(c, w)
            progress(1)
    return [row_of(r, learner, engines, tp, change, w) for r, (learner, engines, change), (_, w)
            in zip(results, jobs, runs) if r is not None]


def sweep_size(gpus: int, tp: int) -> int:
    return len(splits(gpus, tp)) * len(configurations()) + 2 * len(SCHEDULES)


def baseline(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Lockstep with fifo prompts at its best split."""
    lock = [r for r in rows if r["mode"] == "lockstep" and r["schedule"] == "fifo"]
    if not lock:
        raise PlanError("the sweep has no lockstep configuration to compare with")
    return max(lock, key=lambda r: r["train_tokens_per_s"])


def recommend(rows: Iterable[dict[str, Any]], tolerance: float = 0.05) -> dict[str, Any]:
    """The configuration to run (module docstring): within `tolerance` of the most tokens trained per
    second, the least staleness, then the least waste, then prompts in their drawn order (a schedule
    only where fifo is not near the best), then the most throughput."""
    rows = list(rows)
    best = max(r["train_tokens_per_s"] for r in rows)
    near = [r for r in rows if r["train_tokens_per_s"] >= (1 - tolerance) * best]
    return min(near, key=lambda r: (r["max_staleness"], r["wasted_token_fraction"] > 0.01, r["schedule"] != "fifo",
                                    -r["train_tokens_per_s"]))


def recipe_keys(pick: dict[str, Any], w: Workload) -> dict[str, Any]:
    """The recommendation as recipe keys (`streamrl run recipe.yaml KEY=VALUE ...`): with
    rollout.max_concurrency high enough that the staleness bound, not the workers, limits the groups
    in flight (the bound admits up to max_staleness + 1 steps of groups)."""
    per_worker = -(-w.groups_per_step * (pick["max_staleness"] + 1) // max(1, w.workers))
    keys = {"run.mode": pick["mode"], "staleness.max_staleness": pick["max_staleness"],
            "rollout.schedule": pick["schedule"], "engines.num": pick["engines"],
            "rollout.groups_per_step": w.groups_per_step, "rollout.n_samples": w.n_samples,
            "rollout.max_concurrency": per_worker}
    if pick["partial_rollout"]:
        keys["staleness.partial_rollout"] = pick["partial_rollout"]
    return keys


def plan_workload(p: RunProfile, steps: int, groups_per_step: int | None, n_samples: int | None) -> Workload:
    """The run's workload for the sweep: `steps` steps (the first quarter left out as warm-up); prompts
    that come back epoch after epoch (the run's distinct prompts where they came back in it, else 4
    steps of prompts) so that a schedule has a history to rank by; lengths counted in blocks of
    max_new_tokens / 128 tokens (at least 1), so long responses stay small in memory."""
    changes: dict[str, Any] = {"steps": steps, "warmup_steps": max(1, steps // 4)}
    if groups_per_step:
        changes["groups_per_step"] = groups_per_step
    if n_samples:
        changes["n_samples"] = n_samples
    w = workload(p, **changes)
    prompts = p.prompts if p.groups_per_prompt > 1 else 4 * w.groups_per_step
    # The run's rollout.max_concurrency was set for its own batch and machine; at the planned batch the
    # staleness bound alone limits what is in flight (recipe_keys says what to set).
    return dataclasses.replace(w, prompts=prompts, max_concurrency=1 << 30,
                               token_block=max(1, w.lengths.max_new_tokens // 128))


def cluster_maker(p: RunProfile, model_size: str) -> tuple[Callable[[int, int], Cluster], int, dict[str, Any]]:
    """(learner GPUs, engines) -> Cluster, GPUs per engine, and how the hardware was chosen."""
    if model_size == "run":
        # The run's learner was one device; k of them split its per-step work (data parallel, ideally).
        c, fitted = calibrated_cluster(p)
        tp, hardware = 1, {"hardware": "the run's own machine (measured)", **fitted}
    else:
        c, tp = preset(model_size)
        hardware = {"hardware": f"{model_size} in bf16 on H100s (preset scaled from the 7B defaults), tp {tp} per engine"}
    return (lambda learner, engines: dataclasses.replace(c, engines=engines, learner_gpus=learner)), tp, hardware


def calibration(p: RunProfile, others: list[RunProfile]) -> dict[str, Any]:
    """The run's own configuration on the machine it ran on: fitted on `p` alone, every mode predicted,
    set against the step time each given run (`p` and `others`, the same recipe in other modes) measured;
    and, where a lockstep run is among them, each other mode's speedup over it, predicted and measured."""
    c, fitted = calibrated_cluster(p)
    measured = {q.mode: q for q in [p, *others]}
    pred = {m: simulate(c, workload(p, mode=m))["wall_s"] / p.steps for m in ("lockstep", "one_step_off", "stream")}
    rows = []
    for mode, q in measured.items():
        row: dict[str, Any] = {"mode": mode, "run_dir": str(q.run_dir), "measured_step_s": q.step_s,
                               "predicted_step_s": pred[mode], "step_error": pred[mode] / q.step_s - 1}
        if mode != "lockstep" and "lockstep" in measured:
            meas = measured["lockstep"].step_s / q.step_s
            guess = pred["lockstep"] / pred[mode]
            row |= {"measured_speedup": meas, "predicted_speedup": guess, "speedup_error": guess / meas - 1}
        rows.append(row)
    return {"fitted_on": str(p.run_dir), "fitted_mode": p.mode, **fitted, "cluster": dataclasses.asdict(c),
            "predicted_step_s": pred, "rows": rows}
