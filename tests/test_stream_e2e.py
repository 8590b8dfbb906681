"""End-to-end runs of `streamrl run` (Ray, sglang-router, embedded CPU engines, megatron learner,
rollout workers), each started as a subprocess and judged only by what it leaves for a user:
the exit code, stderr, RUN_DIR/metrics.jsonl, events.jsonl, run.log, logs/, weights/ and the
experience pool (read with pools.LancePool and `streamrl pool stats --json`).

Runs are expensive (25-60 s, mostly start-up), so a few runs are shared by several tests
(`runs` fixture) and every test checks several properties of its run:

| run                | recipe                                                       | tests |
|--------------------|--------------------------------------------------------------|-------|
| eta4_abort_resume  | stream, eta 4, abort_resume, 96 new tokens, disk sync, keep all weights | staleness[4], partial[abort_resume] |
| eta1_in_place      | stream, eta 1, in_place, 48 new tokens, disk sync, keep all weights     | staleness[1], partial[in_place] |
| eta1_finish_old    | stream, eta 1, finish_old (20 ms window), otherwise as eta1_in_place    | staleness[finish_old], partial[finish_old] |
| lockstep, one_step_off | the base recipe in those modes                           | modes[...] |
| (own runs)         | malformed dataset (fail; skip + a raising reward) | bad input tests |
| kill_run           | 2 engines, one SIGKILLed just before a weight update, restarted | engine_killed..., engine_death_shows... |

Helpers: tests/streamkit.py (running, reading a run directory, log-prob oracles), test reward
functions: tests/rewardkit.py. Run with `pytest tests/test_stream_e2e.py` (about 5 minutes on 2
busy cores; deselect with `-m 'not slow'`).

Long file: the runs are expensive, so several behaviours are checked on the same shared runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streamkit as sk
from streamkit import task_data, tiny_model  # noqa: F401 - session fixtures

pytestmark = pytest.mark.slow

STEPS = 8  # stream runs
GPS = 2  # groups_per_step
N = 4  # n_samples
TEMPERATURE = 1.0

RUN_OVERRIDES: dict[str, dict[str, Any]] = {
    # Long responses (the tiny model rarely emits eos) and a publish after every learner step:
    # most responses are interrupted by a version update at least once. Disk sync with every
    # version kept, so the test can recompute log-probs with each version's weights.
    # eta 4 lets generation run ahead: with 48 tokens it once finished every group the run claims before a
    # publish found a call in flight (CI of 2026-11-28, a loaded machine); 96 keeps calls longer in flight.
    "eta4_abort_resume": {"run.steps": STEPS, "staleness.max_staleness": 4, "staleness.partial_rollout": "abort_resume",
                          "rollout.max_new_tokens": 96, "engines.weight_sync": "disk", "engines.keep_weights": 0},
    "eta1_in_place": {"run.steps": STEPS, "staleness.max_staleness": 1, "staleness.partial_rollout": "in_place",
                      "rollout.max_new_tokens": 48, "engines.weight_sync": "disk", "engines.keep_weights": 0},
    # finish_old: the engines run 20 ms on the old weights before the abort; a short window, so
    # that responses are still interrupted and resumed (what the log-prob checks need).
    "eta1_finish_old": {"run.steps": STEPS, "staleness.max_staleness": 1, "staleness.partial_rollout": "finish_old",
                        "staleness.finish_window_s": 0.02, "rollout.max_new_tokens": 48,
                        "engines.weight_sync": "disk", "engines.keep_weights": 0},
    # lockstep with LoRA (docs/lora.md): every version push is the adapter alone, generations name it in
    # lora_path (the loop is the same as without; the stream runs cover full-weight pushes)
    "lockstep": {"run.mode": "lockstep", "run.steps": 4, "learner.lora.rank": 4, "learner.lr": 3e-3},
    "one_step_off": {"run.mode": "one_step_off", "run.steps": 4},
    # The learner claims 3 groups a step and trains on the 2 with the largest reward spread.
    "over_sampling": {"run.steps": 6, "staleness.max_staleness": 1, "rollout.over_sampling": 1.5},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, task_data: dict[str, Path]) -> sk.Runs:  # noqa: F811
    return sk.Runs(tmp_path_factory.mktemp("e2e-runs"), tiny_model, task_data["train"], RUN_OVERRIDES)


def bad_dataset(path: Path, train: Path) -> dict[str, int]:
    """A copy of the first 12 training rows with line 3 cut-off JSON, line 5 without the label
    key and line 7 an empty prompt; returns {what: line}."""
    lines = train.read_text().splitlines()[:12]
    lines[2] = '{"id": "broken", "prompt": "1+2=", "label": '
    lines[4] = '{"id": "nolabel", "prompt": "3+4="}'
    lines[6] = '{"id": "empty", "prompt": "", "label": "0"}'
    path.write_text("\n".join(lines) + "\n")
    return {"broken": 3, "nolabel": 5, "empty": 7}


# ---------------------------------------------------------------- 3a. bad dataset, fail fast


def test_malformed_dataset_fails_before_anything_starts(tmp_path: Path, tiny_model: Path,  # noqa: F811
                                                        task_data: dict[str, Path]) -> None:  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad_dataset(bad, task_data["train"])
    recipe = sk.write_recipe(tmp_path, tiny_model, bad, {"data.on_error": "fail"})
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    res = sk.run_recipe(recipe, run_dir, timeout_s=180, check=False)
    took = time.monotonic() - t0
    assert res.returncode == 2, sk.describe_run(run_dir, res.stderr, res.returncode)
    # The first bad row, by file and line, with what is wrong; no traceback.
    assert f"{bad}:3:" in res.stderr and "not valid JSON" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    # Nothing was started: no Ray cluster, no router, no engines, no pool.
    assert "Started a local Ray instance" not in res.stderr, res.stderr
    assert not (run_dir / "logs" / "router.log").exists()
    assert not (run_dir / "pool").exists() and not (run_dir / "metrics.jsonl").exists()
    # "Quickly": a full start-up takes 25-60 s here; 4-5 s is typical for this exit. The bound
    # is generous because other jobs share the CPU (the structural checks above are the proof).
    assert took < 60, f"exit 2 took {took:.0f}s"


# ---------------------------------------------------------------- 1. staleness


@pytest.mark.parametrize("eta,name", [(1, "eta1_in_place"), (4, "eta4_abort_resume"), (1, "eta1_finish_old")],
                         ids=["eta1", "eta4", "finish_old"])
def test_staleness_is_never_exceeded(runs: sk.Runs, eta: int, name: str) -> None:
    run = runs.get(name)
    where = run.where()

    # metrics.jsonl: one line per step with the documented keys, staleness within the bound.
    metrics = sk.read_metrics(run.dir)
    sk.check_step_metrics(metrics, run.steps)
    for m in metrics:
        assert m["staleness_max"] <= eta, (m["step"], m["staleness_max"], where)
        assert 0 <= m["staleness_mean"] <= m["staleness_max"], (m, where)

    # The pool: every consumed group within eta, consumed GPS per step, as metrics.jsonl says.
    groups = sk.group_rows(run.dir)
    consumed = {g: r for g, r in groups.items() if r["status"] == "consumed"}
    stal = sk.consumed_staleness(run.dir)
    assert len(consumed) == run.steps * GPS, (len(consumed), where)
    over = {g: s for g, s in stal.items() if s > eta or s < 0}
    assert not over, f"consumed groups over the bound eta={eta}: {over} {where}"
    for m in metrics:
        at_step = sorted(g for g, r in consumed.items() if r["consumed_step"] == m["step"])
        assert at_step == sorted(m["groups"]), (m["step"], at_step, m["groups"], where)
        assert all(consumed[g]["consumed_version"] == m["policy_version"] - 1 for g in at_step), where
        assert m["staleness_max"] == max(stal[g] for g in at_step), (m["step"], where)
    # eta=4 must actually be used, otherwise this test proves nothing about the bound.
    if eta > 1:
        assert max(stal.values()) > 1, f"no consumed group was more than 1 version stale: {stal} {where}"

    # Admission control, from the admissions table: what was started by version v fits (v + eta + 1) * GPS.
    problems = sk.admission_excess(run.dir, eta, GPS)
    assert not problems, "\n".join(problems) + " " + where

    # Conservation.
    stats = sk.assert_ledger_balanced(run.dir)
    assert stats["ledger"]["consumed"] == run.steps * GPS, stats["ledger"]
    assert stats["ledger"]["in_flight"] == 0 and stats["ledger"]["partial"] == 0, stats["ledger"]
    assert stats["ledger"]["complete"] == 0, stats["ledger"]  # nothing generated that no step trains on
    assert max(int(k) for k in stats["staleness_histogram"]) <= eta, stats["staleness_histogram"]


def test_over_sampling_streams_to_the_end(runs: sk.Runs) -> None:
    """`rollout.over_sampling: 1.5`: 3 groups claimed a step, 2 trained on. Admission grows by what
    a step claims (it grew by groups_per_step and the run hung at step 4), and the run admits
    exactly what its steps claim."""
    run = runs.get("over_sampling")
    where = run.where()
    k = 3
    metrics = sk.read_metrics(run.dir)
    sk.check_step_metrics(metrics, run.steps)
    assert all(m["dropped_over_sampling"] == k - GPS for m in metrics), ([m["dropped_over_sampling"] for m in metrics], where)
    led = sk.assert_ledger_balanced(run.dir)["ledger"]
    reasons = Counter(r["drop_reason"] for r in sk.group_rows(run.dir).values() if r["status"] == "dropped")
    assert reasons["over_sampling"] == run.steps * (k - GPS) and set(reasons) <= {"over_sampling", "stale"}, reasons
    # A group started early that completes after three newer ones can miss its step and go stale (CI of
    # 2026-11-29, a loaded machine: 2 of them); the learner asks for one more group for each, no other.
    stale = reasons["stale"]
    assert (led["consumed"], led["dropped"], led["complete"]) == (run.steps * GPS, run.steps * (k - GPS) + stale, 0), led
    assert led["admitted"] == run.steps * k + stale, (led, reasons)
    problems = sk.admission_excess(run.dir, 1, k)
    assert not problems, "\n".join(problems) + " " + where


# ---------------------------------------------------------------- 2. partial rollouts


def _tiles(spans: list[tuple[int, int, int]], n: int) -> bool:
    """Spans cover [0, n) contiguously with strictly increasing versions."""
    return (bool(spans) and spans[0][1] == 0 and spans[-1][2] == n
            and all(a[2] == b[1] and a[0] < b[0] for a, b in zip(spans, spans[1:]))
            and all(s < e for _, s, e in spans))


@pytest.mark.parametrize("policy,name", [("abort_resume", "eta4_abort_resume"), ("in_place", "eta1_in_place"),
                                         ("finish_old", "eta1_finish_old")])
def test_partial_rollouts_keep_exact_logprobs_per_version(runs: sk.Runs, tiny_model: Path,  # noqa: F811
                                                          policy: str, name: str) -> None:
    run = runs.get(name)
    where = run.where()
    metrics = sk.read_metrics(run.dir)
    sk.check_step_metrics(metrics, run.steps)

    # Every version was pushed over disk and kept (keep_weights 0).
    for v in range(1, run.steps + 1):
        assert (sk.weights_dir(run.dir, tiny_model, v) / "config.json").exists(), (v, where)

    # The engines were paused in the policy's mode for each update.
    mode = "in_place" if policy == "in_place" else "abort"
    paused = sk.read_events(run.dir, "engine_paused")
    assert paused and {e["mode"] for e in paused} == {mode}, ({e["mode"] for e in paused}, where)
    assert len({e["at"] for e in paused}) >= run.steps, where  # one pause per publish (x engines)
    interrupted = max(m["interrupted_calls"] for m in metrics)
    if policy != "in_place":
        assert interrupted > 0, f"no engine call was interrupted {where}"
    else:
        assert interrupted == 0, f"in_place must not abort engine calls; {interrupted} were {where}"
    # No policy but restart throws generated tokens away.
    assert metrics[-1]["gen_tokens"] > 0 and metrics[-1]["discarded_tokens"] == 0, (metrics[-1], where)
    # finish_old: each update waited its window before pausing the engines; the others did not wait.
    windows = [m["finish_window_s"] for m in metrics]
    if policy == "finish_old":
        assert min(windows) >= 0.019, (windows, where)  # asyncio may wake within its clock resolution
    else:
        assert max(windows) == 0.0, (windows, where)

    # Resumed samples: several version spans that tile the response.
    groups = sk.pool_groups(run.dir, "status IN ('consumed', 'complete')")
    assert not sk.pool_rows(run.dir, ["uid"], "status = 'partial'"), f"partial rows left after a clean run {where}"
    resumed = sk.resumed_samples(groups)
    assert len(resumed) >= 4, f"only {len(resumed)} samples span several versions {where}"
    for g, s in resumed:
        assert _tiles(sk.spans_of(s), s.num_tokens), (g.group_id, s.index, sk.spans_of(s), s.num_tokens)
        assert g.min_version <= sk.spans_of(s)[0][0] and g.max_version >= sk.spans_of(s)[-1][0], g.group_id

    # Pick resumed samples from as many groups as possible, the ones with most spans first.
    resumed.sort(key=lambda gs: (-len(gs[1].spans), gs[0].group_id, gs[1].index))
    first, seen = [], set()
    for i, (g, _) in enumerate(resumed):
        if g.group_id not in seen:
            first.append(i)
            seen.add(g.group_id)
    order = first + [i for i in range(len(resumed)) if i not in set(first)]
    picked = [resumed[i] for i in order[:8]]

    oracle = sk.LogprobOracle(run.dir, tiny_model, TEMPERATURE)
    report: list[str] = []

    def fail_text() -> str:
        return "\n".join(report) + f"\n{where}"

    for g, s in picked:
        prompt, resp, stored = g.prompt_tokens, s.response_tokens, s.rollout_logprobs
        spans = sk.spans_of(s)
        for k, (v, a, b) in enumerate(spans):
            same = np.abs(oracle.logprobs(v, prompt, resp[:b])[a:b] - stored[a:b])
            report.append(f"{g.group_id}[{s.index}] v{v}[{a}:{b}) recompute max|d| {same.max():.2e}")
            if policy != "in_place" or k == 0:
                # Prompt + tokens so far are recomputed by the span's version (abort_resume, finish_old), or
                # nothing was updated yet (first span): each log-prob is exactly its version's.
                assert same.max() < 1e-3, fail_text()
        if policy == "in_place":
            # Later spans are decoded by the new version on top of the KV cache the older versions
            # built (SGLang's in_place): exactly that, replayed with transformers.
            emu = np.abs(oracle.in_place_logprobs(prompt, resp, spans) - stored)
            report.append(f"{g.group_id}[{s.index}] in-place replay max|d| {emu.max():.2e}")
            assert emu.max() < 1e-3, fail_text()

    # Tokens after the first span, over every resumed sample: stored vs the span's own version
    # and vs the version before it.
    same_sum = prev_sum = 0.0
    prev_max, n_tok, nearer, n_spans = 0.0, 0, 0, 0
    for g, s in resumed[:48]:
        spans = sk.spans_of(s)
        for k in range(1, len(spans)):
            (pv, _, _), (v, a, b) = spans[k - 1], spans[k]
            head = s.response_tokens[:b]
            same = np.abs(oracle.logprobs(v, g.prompt_tokens, head)[a:b] - s.rollout_logprobs[a:b])
            prev = np.abs(oracle.logprobs(pv, g.prompt_tokens, head)[a:b] - s.rollout_logprobs[a:b])
            same_sum, prev_sum, n_tok = same_sum + same.sum(), prev_sum + prev.sum(), n_tok + (b - a)
            prev_max = max(prev_max, float(prev.max()))
            nearer, n_spans = nearer + int(same.mean() < prev.mean()), n_spans + 1
    report.append(f"later spans: mean |stored - own version| {same_sum / n_tok:.3e}, "
                  f"|stored - previous version| {prev_sum / n_tok:.3e}; {nearer}/{n_spans} spans nearer their own")
    # The checks can tell versions apart: the previous version's log-probs are far off.
    assert prev_max > 1e-2, "versions are indistinguishable by log-prob; the check is vacuous\n" + fail_text()
    # Nearer the span's version than the previous one (pooled over tokens: single short spans
    # can go either way with in_place, whose old KV cache pulls toward the previous version).
    assert same_sum < prev_sum, fail_text()


# ---------------------------------------------------------------- 3a/3b. skipped rows, raising reward


def test_skipped_rows_and_raising_reward_do_not_stop_training(tmp_path: Path, tiny_model: Path,  # noqa: F811
                                                              task_data: dict[str, Path]) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    import rewardkit

    bad = tmp_path / "bad.jsonl"
    lines = bad_dataset(bad, task_data["train"])
    steps = 6
    recipe = sk.write_recipe(tmp_path, tiny_model, bad, {
        "data.on_error": "skip", "data.epochs": 10, "reward.fn": "rewardkit:flaky", "run.steps": steps})
    run_dir = tmp_path / "run"
    res = sk.run_recipe(recipe, run_dir)
    print(f"\n[e2e] run skip+flaky: {res.wall_s:.0f}s")  # type: ignore[attr-defined]
    where = f"(run in {run_dir})"

    # (a) run.log names each skipped line.
    log = sk.run_log(run_dir)
    for what, line in lines.items():
        hits = [x for x in log.splitlines() if f"{bad}:{line}:" in x]
        assert hits and all("skip" in x for x in hits), f"run.log does not name skipped line {line} ({what}):\n{log}"
    rows = sk.pool_rows(run_dir, ["group_id", "prompt_id", "status", "failed", "error", "reward", "response_tokens"])
    assert not {r["prompt_id"] for r in rows} & set(lines), "a skipped row reached the pool"

    # (b) samples the reward function raised on are failed, with the exception in `error`.
    failed = [r for r in rows if r["failed"]]
    assert failed, f"no failed samples {where}"
    for r in failed:
        assert r["error"] and "RewardKitError" in r["error"] and rewardkit.FLAKY_MESSAGE in r["error"], r["error"]
        assert r["reward"] is None, r
    assert any(not r["failed"] and r["reward"] is not None for r in rows)
    # Exactly the responses the function raises on failed (the text is what the worker decodes).
    tok = AutoTokenizer.from_pretrained(tiny_model)
    finished = [r for r in rows if r["status"] != "partial"]
    wrong = [(r["group_id"], r["failed"]) for r in finished
             if r["failed"] != rewardkit.flaky_fails(tok.decode(r["response_tokens"], skip_special_tokens=True))]
    assert not wrong, f"failed flag disagrees with the reward function for {wrong[:5]} {where}"

    # Training went on: a metrics line for every step, each trained on the scored samples of its
    # groups only (failed samples are left out of the batch).
    metrics = sk.read_metrics(run_dir)
    sk.check_step_metrics(metrics, steps)
    assert sum(m["samples"] for m in metrics) == steps * GPS * N
    scored_tokens: dict[int, int] = {}
    for r in sk.pool_rows(run_dir, ["consumed_step", "failed", "reward", "num_tokens"], "status = 'consumed'"):
        if not r["failed"] and r["reward"] is not None:
            scored_tokens[r["consumed_step"]] = scored_tokens.get(r["consumed_step"], 0) + r["num_tokens"]
    assert [m["train_tokens"] for m in metrics] == [scored_tokens.get(i, 0) for i in range(steps)], where
    stats = sk.assert_ledger_balanced(run_dir)
    assert stats["ledger"]["consumed"] == steps * GPS, stats["ledger"]
    # A failed group releases its admission slot, and the bound still holds.
    assert not sk.admission_excess(run_dir, 1, GPS)


# ---------------------------------------------------------------- 3c. an engine dies mid-run


def _gated_kill_recipe(tmp_path: Path, model: Path, train: Path, steps: int) -> tuple[Path, Path, Path]:
    """Two engines, default (distributed) weight sync, and the `gated` reward: while the gate
    file exists, scoring stops once metrics.jsonl has as many lines as the file says (2 at
    first), so the learner waits at a known step and the run cannot end before the test is
    done with it. Returns (recipe, run dir, gate)."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("2\n")
    recipe = sk.write_recipe(tmp_path, model, train, {
        "run.steps": steps, "engines.num": 2, "engines.weight_sync": "distributed", "rollout.max_new_tokens": 24,
        "reward": {"fn": "rewardkit:gated", "args": {"gate": str(gate), "metrics": str(run_dir / "metrics.jsonl")}}})
    return recipe, run_dir, gate


def _wait_learner_blocked(run_dir: Path, proc: Any, at_least: int) -> int:
    """Lines in metrics.jsonl once it has >= `at_least`, fewer than a batch of complete groups
    waits in the pool and neither has changed for 3 s: the learner is waiting for groups (no
    publish can start until the gate lets more groups through)."""
    sk.wait_for(lambda: len(sk.read_metrics(run_dir)) >= at_least, 400, f"{at_least} lines in metrics.jsonl",
                alive=proc)

    def state() -> tuple[int, int]:
        complete = {r["group_id"] for r in sk.pool_rows(run_dir, ["group_id"], "status = 'complete'")}
        return len(sk.read_metrics(run_dir)), len(complete)

    for _ in range(10):
        lines, complete = sk.wait_stable(state, 3, 120, "metrics.jsonl and the pool", alive=proc)
        if complete < GPS:
            return lines
    raise AssertionError(f"the learner does not wait: {complete} complete groups stay in the pool")


@dataclass
class KillRun:
    dir: Path
    steps: int
    killed_at: int  # steps finished when the engine was killed; step `killed_at` published to it dead
    new_port: int  # the restarted engine
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,  # noqa: F811
             task_data: dict[str, Path]) -> KillRun:  # noqa: F811
    """One of two engines is SIGKILLed mid-run, right before a weight update.

    1. The learner waits at step >= 2 (gated reward). The engine's Ray actor (its parent, which
       answers the launcher's once-a-second liveness poll) is SIGSTOPped and the engine
       SIGKILLed: it is dead but still registered, as in the second after any engine death.
    2. The gate lets exactly one more step through: its publish meets the dead engine.
    3. The actor is continued; the launcher restarts the engine on a new port (logs/engine-<i>.log
       "start #2"), which loads the current version before rejoining the router.
    4. The gate opens; the run trains its remaining steps with both engines."""
    tmp_path = tmp_path_factory.mktemp("e2e-kill")
    steps = 8
    recipe, run_dir, gate = _gated_kill_recipe(tmp_path, tiny_model, task_data["train"], steps)
    io = tmp_path / "io"
    t0 = time.monotonic()
    proc = sk.start_streamrl(["run", str(recipe), "--run-dir", str(run_dir)], io)
    actor = None
    try:
        done = _wait_learner_blocked(run_dir, proc, 2)
        pids = sk.engine_pids(tiny_model)
        assert len(pids) == 2, f"expected 2 engine processes for {tiny_model}, found {pids}"
        victim, port = pids[0], sk.engine_port(pids[0])
        actor = sk.parent_pid(victim)
        os.kill(actor, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        gate.write_text(f"{done + 1}\n")
        _wait_learner_blocked(run_dir, proc, done + 1)
        os.kill(actor, signal.SIGCONT)
        actor = None
        new_port = sk.wait_for(lambda: sk.restarted_engine_port(run_dir), 240,
                               "a restarted engine in logs/engine-*.log", poll_s=0.5, alive=proc)
        assert new_port != port
        # The version it must serve is the learner's (one line per published version; the
        # learner may still take a step with groups that were scored before the gate closed).
        model_info = f"http://127.0.0.1:{new_port}/model_info"
        sk.wait_for(lambda: (sk.http_json(model_info, run_dir=run_dir) or {}).get("weight_version")
                    == str(len(sk.read_metrics(run_dir))), 240,
                    f"the restarted engine on port {new_port} to serve the current version", poll_s=0.5, alive=proc)
        time.sleep(2)  # it joins the router right after loading the weights
        assert victim not in sk.engine_pids(tiny_model) and len(sk.engine_pids(tiny_model)) == 2
    except BaseException:
        if actor is not None:
            try:
                os.kill(actor, signal.SIGCONT)
            except ProcessLookupError:
                pass
        gate.unlink(missing_ok=True)
        sk.kill_session(proc, run_dir)
        raise
    gate.unlink()
    res = sk.finish_streamrl(proc, io, 400, run_dir, check=False)
    print(f"\n[e2e] run engine-kill: {time.monotonic() - t0:.0f}s (killed after {done} steps)")
    return KillRun(run_dir, steps, done, new_port, res.returncode, res.stderr)


def test_engine_killed_mid_run_is_restarted_and_nothing_is_lost(kill_run: KillRun) -> None:
    r = kill_run
    assert r.returncode == 0, sk.describe_run(r.dir, r.stderr, r.returncode)
    assert "Traceback" not in r.stderr, sk.tail(r.stderr)
    metrics = sk.read_metrics(r.dir)
    sk.check_step_metrics(metrics, r.steps)
    assert metrics[-1]["engine_restarts"] >= 1 or max(m["engine_errors"] for m in metrics) > 0, (
        [(m["step"], m["engine_restarts"], m["engine_errors"]) for m in metrics])
    assert metrics[-1]["engine_restarts"] >= 1, [(m["step"], m["engine_restarts"]) for m in metrics]
    led = sk.assert_ledger_balanced(r.dir)["ledger"]
    assert led["consumed"] == r.steps * GPS and led["lost"] == 0 and led["in_flight"] == 0, led
    # run.log says which engine missed the version published while it was dead.
    log = sk.run_log(r.dir)
    assert re.search(rf"engine http://127\.0\.0\.1:\d+ did not take version {r.killed_at + 1}\b", log), log
    # The restarted engine got every version published after it came back.
    resumed = [e for e in sk.read_events(r.dir, "engine_resumed") if e["engine"].endswith(f":{r.new_port}")]
    versions = [e["version"] for e in resumed]
    assert versions and versions == list(range(versions[0], r.steps + 1)), resumed


def test_engine_death_shows_in_the_metrics_of_the_step_it_hit(kill_run: KillRun) -> None:
    r = kill_run
    assert r.returncode == 0, sk.describe_run(r.dir, r.stderr, r.returncode)
    hit = next(m for m in sk.read_metrics(r.dir) if m["step"] == r.killed_at)
    shown = {k: hit.get(k) for k in ("engine_restarts", "engine_errors", "failed_engines")}
    assert hit["engine_restarts"] >= 1 or hit["engine_errors"] > 0 or (hit.get("failed_engines") or 0) > 0, (
        f"step {r.killed_at} published to a dead engine, its metrics show {shown}")


def test_running_out_of_prompts_ends_the_run_with_a_reason(tmp_path: Path, tiny_model: Path,  # noqa: F811
                                                          task_data: dict[str, Path]) -> None:  # noqa: F811
    # 6 prompts, one epoch, 2 groups per step: 3 steps fit, but a filter drops the groups of two
    # prompts, so step 2 can have no batch. The run must stop with exit 2 and say why, not wait
    # forever for groups that will never come; the evaluations it held for after training are still
    # made (they were lost with the exports once: a 1,200-step run kept only version 0's).
    lines = task_data["train"].read_text().splitlines()[:6]
    small = tmp_path / "six.jsonl"
    small.write_text("\n".join(lines) + "\n")
    dropped = [json.loads(line)["id"] for line in lines[:2]]
    recipe = sk.write_recipe(tmp_path, tiny_model, small, {
        "data.epochs": 1, "data.shuffle": False, "filters": [{"fn": "rewardkit:drop_ids", "args": {"ids": dropped}}],
        "run.eval_every": 1, "run.eval_mode": "after", "data.eval_path": str(task_data["eval"]), "data.eval_size": 4,
        "data.eval_samples": 1})
    run_dir = tmp_path / "run"
    res = sk.run_recipe(recipe, run_dir, ["run.mode=lockstep", "run.steps=3"], timeout_s=300, check=False)
    assert res.returncode == 2, sk.describe_run(run_dir, res.stderr, res.returncode)
    assert "ran out of prompts" in res.stderr and "data.epochs" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert len(sk.read_metrics(run_dir)) == 2
    sk.assert_ledger_balanced(run_dir)
    evals = sk.read_jsonl(run_dir / "eval.jsonl")
    assert sorted(e["policy_version"] for e in evals) == [0, 1, 2], evals
    assert not list((run_dir / "weights").glob("eval-*")), "evaluated exports are removed"

    # Asking for more groups than the prompts make at all is refused before anything starts.
    again = tmp_path / "run-too-long"
    res = sk.run_recipe(recipe, again, ["run.mode=lockstep", "run.steps=4"], timeout_s=120, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert ("6 usable prompts x data.epochs 1 = 6 groups, fewer than run.steps 4 x 2 groups a step = 8" in res.stderr
            and "raise data.epochs to 2 or more, or lower run.steps to 3 or less" in res.stderr), res.stderr
    assert not (again / "pool").exists() and not (again / "logs").exists(), sorted(p.name for p in again.iterdir())


# ---------------------------------------------------------------- 4. lockstep and one-step-off


@pytest.mark.parametrize("mode,bound", [("lockstep", 0), ("one_step_off", 1)])
def test_lockstep_and_one_step_off_modes(runs: sk.Runs, mode: str, bound: int) -> None:
    run = runs.get(mode)
    where = run.where()
    metrics = sk.read_metrics(run.dir)
    sk.check_step_metrics(metrics, run.steps)
    assert all(m["staleness_max"] <= bound for m in metrics), ([m["staleness_max"] for m in metrics], where)
    stal = sk.consumed_staleness(run.dir)
    assert len(stal) == run.steps * GPS, (stal, where)
    assert max(stal.values()) <= bound, (stal, where)
    if bound:
        assert max(stal.values()) == bound, f"one_step_off never trained one version behind: {stal} {where}"
    # Weights change only between batches: nothing is paused or interrupted.
    assert not sk.read_events(run.dir, "engine_paused"), where
    assert max(m["interrupted_calls"] for m in metrics) == 0, where
    # Every consumed sample was generated by one version (no partial rollouts).
    for g in sk.pool_groups(run.dir, "status = 'consumed'"):
        assert g.min_version == g.max_version, (g.group_id, g.min_version, g.max_version)
    stats = sk.assert_ledger_balanced(run.dir)
    assert stats["ledger"]["consumed"] == run.steps * GPS, stats["ledger"]
    if mode == "lockstep":
        # On-policy: the engines, serving each version's adapter on the base, give the learner's
        # log-probs (so they apply the adapter the learner trained, version by version) ...
        assert all(m["logprob_gap"] < 1e-4 for m in metrics), ([m["logprob_gap"] for m in metrics], where)
        # ... and the tokens carry the adapter's version, not the base weights' 0
        versions = {g.min_version for g in sk.pool_groups(run.dir, "status = 'consumed'")}
        assert versions == set(range(run.steps)), (versions, where)
        assert (run.dir / "adapter" / "adapter_config.json").exists() and (run.dir / "model" / "config.json").exists()
        assert not list((run.dir / "weights").glob("v0*")), "a LoRA run pushed full weights"
