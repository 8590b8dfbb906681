"""What the cluster simulator takes from a finished run: its workload (the recipe's batch, staleness and
partial-rollout settings; the response lengths its pool holds, how much of their spread each prompt
explains, how many prompts it cycled through) and what it measured (seconds per learner step and per
token trained, the weight push, the step time), read from RUN_DIR's recipe.yaml, pool and metrics.jsonl.
`calibrated_cluster` models the machine the run ran on from those measurements."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.core.lengths import within_share
from streamrl.pools import RECORDED_RECIPE, open_pool
from streamrl.pools.queries import group_lengths, pool_query
from streamrl.recipe import load_recipe
from streamrl.sim.cluster import Cluster, Lengths, Workload, simulate

# The embedded CPU engine's decode curve on this project's 2-core box (benchmarks/engine_throughput.py
# --quick, 2026-11-23): output tokens/s at 1 and at 64 running requests. `calibrated_cluster` scales it.
CPU_ENGINE_TOK_S = (1055.0, 7600.0)
CPU_ENGINE_MAX_RUNNING = 64


class RunReadError(ValueError):
    """A run directory the simulator cannot be fed from (what is missing, and how to get it)."""


@dataclass
class RunProfile:
    run_dir: Path
    recipe: Any
    mode: str
    steps: int  # learner steps the run logged
    step_s: float  # RL wall time per step (summary.json rl_s, else the last step's wall time)
    train_s: list[float]  # per step: learner training seconds
    train_tokens: list[int]  # per step: prompt + response tokens trained on
    push_s: float  # mean weight push (seconds per step)
    pause_s: float  # mean engine pause per step
    wait_s: float  # mean learner wait for a batch
    lengths: Lengths  # the finished responses' lengths; `within` from the groups
    prompts: int  # distinct prompts among finished groups
    groups_per_prompt: float  # finished groups per distinct prompt (> 1: prompts came back, history exists)
    prompt_tokens: float  # mean prompt length


def read_run(run_dir: str | Path) -> RunProfile:
    d = Path(run_dir)
    if not (d / RECORDED_RECIPE).is_file():
        raise RunReadError(f"{d}: no {RECORDED_RECIPE}: not a StreamRL run directory (streamrl run --run-dir DIR)")
    recipe = load_recipe(str(d / RECORDED_RECIPE), resolve=False)  # settings only: no user code imported
    metrics = _steps(d)
    if len(metrics) < 2:
        raise RunReadError(f"{d}/metrics.jsonl: {len(metrics)} learner step(s) logged; a profile needs at least 2")
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    try:
        pool = open_pool(d)
    except Exception as e:  # noqa: BLE001 - LanceDB raises several kinds; all mean "no pool to read"
        raise RunReadError(f"{d}: cannot open the run's pool ({e})") from None
    try:
        groups = group_lengths(pool)
        prompt_tokens = pool_query(pool, "SELECT avg(len(prompt_tokens)) AS p FROM pool").to_pydict()["p"][0] or 0.0
    finally:
        pool.close()
    lens = [n for _, ls in groups for n in ls if n > 0]
    if not lens:
        raise RunReadError(f"{d}: the pool holds no finished response to take lengths from")
    values, counts = np.unique(np.asarray(lens), return_counts=True)
    within = within_share([ls for _, ls in groups])
    lengths = Lengths(recipe.rollout.max_new_tokens, values=values.tolist(), counts=counts.tolist(),
                      within=1.0 if within is None else within)
    prompts = len({p for p, _ in groups})
    n = len(metrics)
    # summary.json's RL time covers the steps this process trained (a resumed run: those after its checkpoint)
    trained = int(summary.get("policy_version") or 0) - int(summary.get("start_step") or 0)
    step_s = summary["rl_s"] / trained if summary.get("rl_s") and trained > 0 else metrics[-1].get("wall_time_s", 0.0) / n
    if step_s <= 0:
        raise RunReadError(f"{d}: neither summary.json nor metrics.jsonl says how long the steps took")
    return RunProfile(
        run_dir=d, recipe=recipe, mode=recipe.run.mode, steps=n, step_s=step_s,
        train_s=[float(m["train_s"]) for m in metrics],
        train_tokens=[int(m.get("train_tokens", 0)) + round(m.get("samples", 0) * prompt_tokens) for m in metrics],
        push_s=statistics.fmean(m.get("push_s", 0.0) for m in metrics),
        pause_s=statistics.fmean(m.get("pause_s", 0.0) for m in metrics),
        wait_s=statistics.fmean(m.get("wait_s", 0.0) for m in metrics),
        lengths=lengths, prompts=prompts, groups_per_prompt=len(groups) / max(1, prompts),
        prompt_tokens=float(prompt_tokens))


def _steps(d: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, one row per step (a resumed run's re-trained step: the last row wins)."""
    try:
        lines = (d / "metrics.jsonl").read_text().splitlines()
    except OSError:
        raise RunReadError(f"{d}: no metrics.jsonl: the run logged no learner step") from None
    rows: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            m = json.loads(line)
            rows[int(m["step"])] = m
        except (ValueError, KeyError, TypeError):
            continue  # blank, or the half-written last line of a killed run
    rows = {k: m for k, m in rows.items() if "train_s" in m}
    return [rows[k] for k in sorted(rows)]


def workload(p: RunProfile, **changes: Any) -> Workload:
    """The run's recipe as a simulated workload (token by token: block 1); `changes` replace fields."""
    r = p.recipe
    w = Workload(mode=p.mode, steps=p.steps, groups_per_step=r.rollout.groups_per_step, n_samples=r.rollout.n_samples,
                 prompt_tokens=max(1, round(p.prompt_tokens)), lengths=p.lengths,
                 max_staleness=r.staleness.max_staleness, policy=r.staleness.policy,
                 partial_rollout=r.staleness.partial_rollout, workers=r.rollout.workers,
                 max_concurrency=r.rollout.max_concurrency, prompts=p.prompts if p.groups_per_prompt > 1 else 0,
                 schedule=r.rollout.schedule, schedule_window=r.rollout.schedule_window,
                 tail_fraction=r.rollout.tail_fraction, token_block=1, warmup_steps=0, seed=r.run.seed)
    return dataclasses.replace(w, **changes)


def learner_rate(p: RunProfile) -> tuple[float, float]:
    """(seconds per step, tokens per second) of the learner: a least-squares line through the run's
    (tokens trained, training seconds) steps; a flat cost alone where the steps do not tell them apart."""
    x, y = np.asarray(p.train_tokens, dtype=float), np.asarray(p.train_s)
    if np.ptp(x) > 0:
        slope, fixed = np.polyfit(x, y, 1)
        if slope > 0 and fixed >= 0:
            return float(fixed), float(1.0 / slope)
    return float(y.mean()), 1e12


def calibrated_cluster(p: RunProfile, mode: str | None = None, tok_s: tuple[float, float] = CPU_ENGINE_TOK_S,
                       max_running: int = CPU_ENGINE_MAX_RUNNING) -> tuple[Cluster, dict[str, float]]:
    """The machine the run ran on: its engines on the CPU decode curve `tok_s`, its learner and weight push
    as measured; then one parameter fitted (`fit_step`) so that the simulated run (in `mode`, default its
    own) takes the step time it measured."""
    fixed, rate = learner_rate(p)
    t1, t64 = 1 / tok_s[0], 64 / tok_s[1]
    per_seq = (t64 - t1) / 63
    c = Cluster(engines=p.recipe.engines.num, decode_base_s=t1 - per_seq, decode_per_seq_s=per_seq,
                prefill_tokens_per_s=1e12, max_running=max_running, learner_gpus=1,
                learner_tokens_per_s_per_gpu=rate, learner_step_overhead_s=fixed,
                model_bytes=0.0, broadcast_latency_s=max(p.push_s, p.pause_s))
    return fit_step(c, workload(p, mode=mode or p.mode), p.step_s)


def fit_step(c: Cluster, w: Workload, target_step_s: float) -> tuple[Cluster, dict[str, float]]:
    """`c` with one parameter fitted so that `w` simulated takes `target_step_s` a step: the engine's
    seconds per request outside decoding (0-0.1 s); or, where `w` is too slow even without any (the
    decode curve was measured on another occasion, on a slower day), a factor (0.05-1) on the curve."""
    def step_s(c2: Cluster) -> float:
        return simulate(c2, w)["wall_s"] / w.steps

    def bisect(make: Any, lo: float, hi: float) -> float:
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step_s(make(mid)) < target_step_s else (lo, mid)
        return (lo + hi) / 2

    def overhead(x: float) -> Cluster:
        return dataclasses.replace(c, request_overhead_s=x)

    def scaled(k: float) -> Cluster:
        return dataclasses.replace(c, decode_base_s=c.decode_base_s * k, decode_per_seq_s=c.decode_per_seq_s * k)

    if step_s(c) <= target_step_s:
        x = bisect(overhead, 0.0, 0.1)
        return overhead(x), {"fitted_request_overhead_s": x, "fitted_decode_scale": 1.0}
    k = bisect(scaled, 0.05, 1.0)
    return scaled(k), {"fitted_request_overhead_s": 0.0, "fitted_decode_scale": k}
