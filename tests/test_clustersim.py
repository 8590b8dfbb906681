"""The cluster simulator: its engine model against hand-computed times, and StreamRL's rules
(staleness bound, ledger, partial rollouts) holding in the runs it simulates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from streamrl.sim.cluster import Cluster, Lengths, Workload, simulate
from benchmarks.simulate_cluster import read_lengths
from streamrl.sim.fromrun import fit_step

SCRIPT = str(Path(__file__).resolve().parent.parent / "benchmarks" / "simulate_cluster.py")

FIXED = Lengths(64, values=[40], counts=[1])  # every response 40 tokens
TAIL = Lengths(2048, median=100, sigma=1.2)


def _cluster(**kw) -> Cluster:
    base = dict(engines=1, decode_base_s=0.01, decode_per_seq_s=0.001, prefill_tokens_per_s=10_000.0,
                max_running=1000, learner_gpus=2, learner_tokens_per_s_per_gpu=1000.0,
                learner_step_overhead_s=0.5, model_bytes=1e9, broadcast_bytes_per_s=1e9, broadcast_latency_s=0.25)
    return Cluster(**(base | kw))


def _work(**kw) -> Workload:
    base = dict(mode="lockstep", steps=3, groups_per_step=2, n_samples=4, prompt_tokens=20, lengths=FIXED,
                max_staleness=0, workers=1, token_block=1)
    return Workload(**(base | kw))


def test_lockstep_step_time_is_the_sum_of_its_phases():
    c, w = _cluster(), _work()
    r = simulate(c, w)
    seqs = w.groups_per_step * w.n_samples
    prefill = seqs * w.prompt_tokens / c.prefill_tokens_per_s
    decode = 40 * (c.decode_base_s + c.decode_per_seq_s * seqs)
    train = c.learner_step_overhead_s + seqs * (20 + 40) / (c.learner_gpus * c.learner_tokens_per_s_per_gpu)
    push = c.broadcast_latency_s + c.model_bytes / c.broadcast_bytes_per_s
    assert r["wall_s"] == pytest.approx(w.steps * (prefill + decode + train + push), rel=1e-9)
    assert r["staleness_max"] == 0 and r["interrupted_calls"] == 0
    assert r["ledger"] == {"admitted": 6, "in_flight": 0, "complete": 0, "consumed": 6, "dropped": 0, "lost": 0,
                           "duplicated": 0, "unadmitted": 0}


def test_max_running_queues_requests():
    one = simulate(_cluster(max_running=8), _work(steps=1))["wall_s"]
    half = simulate(_cluster(max_running=4), _work(steps=1))["wall_s"]
    # Two waves of 4 instead of one of 8: decode iterations are cheaper but there are twice as many.
    decode8, decode4 = 40 * (0.01 + 0.008), 2 * 40 * (0.01 + 0.004)
    assert half - one == pytest.approx(decode4 - decode8, rel=1e-6)


@pytest.mark.parametrize("eta", [1, 2, 4])
@pytest.mark.parametrize("partial", ["abort_resume", "restart", "in_place"])
def test_stream_keeps_the_bound_and_the_ledger(eta, partial):
    w = _work(mode="stream", steps=12, groups_per_step=4, lengths=TAIL, max_staleness=eta, partial_rollout=partial,
              workers=3, token_block=4)
    r = simulate(_cluster(engines=4, learner_step_overhead_s=0.05), w)
    led = r["ledger"]
    assert r["staleness_max"] <= eta
    assert led["lost"] == led["duplicated"] == led["unadmitted"] == 0
    assert led["consumed"] == w.steps * w.groups_per_step
    # Admission control: never more started than (V + eta + 1) * groups_per_step at the last version,
    # and no more than the run's steps claim plus what the learner dropped: nothing is left over.
    assert led["admitted"] <= (w.steps + eta + 1) * w.groups_per_step
    assert led["admitted"] == led["consumed"] + led["dropped"] and led["complete"] == led["in_flight"] == 0
    assert (r["interrupted_calls"] == 0) == (partial == "in_place")


def test_drop_policy_discards_groups_past_the_bound_and_keep_trains_them():
    w = _work(mode="stream", steps=10, groups_per_step=4, lengths=TAIL, max_staleness=1, token_block=4)
    c = _cluster(engines=2, learner_step_overhead_s=0.02)
    drop = simulate(c, dataclasses.replace(w, policy="drop"))
    keep = simulate(c, dataclasses.replace(w, policy="keep"))
    assert drop["ledger"]["dropped"] > 0 and drop["staleness_max"] <= 1
    assert keep["ledger"]["dropped"] == 0 and keep["staleness_max"] > 1


def test_restart_wastes_tokens_abort_resume_keeps_them():
    w = _work(mode="stream", steps=10, groups_per_step=4, lengths=TAIL, max_staleness=4, policy="keep", token_block=4)
    c = _cluster(engines=2, learner_step_overhead_s=0.02)
    assert simulate(c, dataclasses.replace(w, partial_rollout="abort_resume"))["wasted_token_fraction"] == 0
    assert simulate(c, dataclasses.replace(w, partial_rollout="restart"))["wasted_token_fraction"] > 0.05


def test_stream_overlaps_a_long_tail_that_lockstep_waits_for():
    c = _cluster(engines=4, learner_step_overhead_s=1.0)
    lock = simulate(c, _work(steps=8, groups_per_step=8, lengths=TAIL, token_block=4))
    stream = simulate(c, _work(mode="stream", steps=8, groups_per_step=8, lengths=TAIL, max_staleness=2,
                               token_block=4, warmup_steps=2))
    assert stream["samples_per_s"] > 1.3 * lock["samples_per_s"]
    assert stream["engine_busy"] > lock["engine_busy"]


def test_the_step_fit_recovers_a_known_request_cost_or_a_faster_decode():
    c, w = _cluster(), _work()
    target = simulate(dataclasses.replace(c, request_overhead_s=0.003), w)["wall_s"] / w.steps
    fitted, how = fit_step(c, w, target)
    assert how["fitted_request_overhead_s"] == pytest.approx(0.003, rel=1e-4) and how["fitted_decode_scale"] == 1.0
    assert fitted.request_overhead_s == how["fitted_request_overhead_s"]
    # an engine that decodes at 60% of the curve's time: no per-request cost can fit that, the scale does
    fast = dataclasses.replace(c, decode_base_s=c.decode_base_s * 0.6, decode_per_seq_s=c.decode_per_seq_s * 0.6)
    target = simulate(fast, w)["wall_s"] / w.steps
    fitted, how = fit_step(c, w, target)
    assert how["fitted_request_overhead_s"] == 0.0 and how["fitted_decode_scale"] == pytest.approx(0.6, rel=1e-3)
    assert simulate(fitted, w)["wall_s"] / w.steps == pytest.approx(target, rel=1e-4)


def test_read_lengths(tmp_path):
    p = tmp_path / "h.json"
    p.write_text('{"3": 2, "10": 1}')
    assert (read_lengths(str(p), 8).values, read_lengths(str(p), 8).counts) == ([3, 10], [2, 1])
    p = tmp_path / "h.txt"
    p.write_text("5\n7 3\n\n5\n")
    assert (read_lengths(str(p), 8).values, read_lengths(str(p), 8).counts) == ([5, 7], [2, 3])
    p.write_text("5\nseven\n")
    with pytest.raises(SystemExit, match=r"h.txt:2: expected `length \[count\]`, got 'seven'"):
        read_lengths(str(p), 8)


def test_cli_writes_json_and_png(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, SCRIPT, "--gpus", "2,4", "--steps", "4",
         "--modes", "stream_eta2_abort_resume", "--median", "40", "--max-new-tokens", "256",
         "--out-dir", str(tmp_path), "groups_per_step=4", "n_samples=2", "learner_step_overhead_s=0.1"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert json.loads((tmp_path / "simulate_cluster.json").read_text()) == res
    assert (tmp_path / "simulate_cluster.png").stat().st_size > 10_000
    assert set(res["sizes"]) == {"2", "4"}
    for size in res["sizes"].values():
        assert set(size) == {"lockstep", "stream_eta2_abort_resume"}
        assert size["lockstep"]["speedup"] == 1.0 and size["stream_eta2_abort_resume"]["staleness_max"] <= 2
    assert res["workload"]["groups_per_step"] == 4


def test_cli_refuses_an_unknown_override():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, SCRIPT, "gpus_per_node=8"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "override 'gpus_per_node=8'" in out.stderr


def test_lengths_at_is_the_quantile_of_the_normal_score():
    assert Lengths(10_000, median=100, sigma=1.0).at(0.0) == 100
    assert Lengths(10_000, median=100, sigma=1.0).at(1.0) == 271  # int(100 e)
    assert Lengths(150, median=100, sigma=1.0).at(3.0) == 150  # capped
    hist = Lengths(1000, values=[10, 20, 30], counts=[1, 2, 1])
    assert (hist.at(-3.0), hist.at(0.0), hist.at(3.0)) == (10, 20, 30)


PER_PROMPT = Lengths(2048, median=100, sigma=1.2, within=0.2)  # a prompt's own scale explains 80%


@pytest.mark.parametrize("mode", ["lockstep", "one_step_off", "stream"])
@pytest.mark.parametrize("schedule", ["fifo", "longest_first", "tail_batching"])
def test_every_schedule_keeps_the_bound_and_the_ledger(mode, schedule):
    w = _work(mode=mode, steps=16, groups_per_step=4, lengths=PER_PROMPT, max_staleness=2, workers=2, token_block=4,
              prompts=16, schedule=schedule)
    r = simulate(_cluster(engines=2, max_running=8), w)
    bound = {"lockstep": 0, "one_step_off": 1, "stream": 2}[mode]
    assert r["staleness_max"] <= bound
    led = r["ledger"]
    assert led["consumed"] == 16 * 4 and led["lost"] == 0 and led["duplicated"] == 0 and led["unadmitted"] == 0, led
    assert 0.0 <= r["tail_share"] <= 1.0


def test_longest_first_groups_long_prompts_into_the_same_lockstep_steps():
    """From the second epoch on, history orders each chunk: lockstep steps of like lengths wait for
    shorter tails than steps that each hold one long prompt (virtual time: deterministic)."""
    w = _work(steps=24, groups_per_step=8, lengths=PER_PROMPT, workers=2, token_block=4, prompts=32, n_samples=4)
    c = _cluster(engines=2, max_running=64)
    fifo, longest = simulate(c, w), simulate(c, dataclasses.replace(w, schedule="longest_first"))
    assert longest["samples_per_s"] > 1.1 * fifo["samples_per_s"], (fifo["samples_per_s"], longest["samples_per_s"])
    assert longest["tail_share"] < fifo["tail_share"]
