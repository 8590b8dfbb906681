"""Every benchmark runs in a tiny form, so a refactor cannot break one silently (issue 45: `pool_throughput.py
--scale` hung for 26 minutes on main and nothing noticed): each script is started as a subprocess with its
smallest flags, must exit 0 within seconds and print one JSON object with the figures that matter (two
that start several whole runs are checked in process instead: REPORT_ONLY says why). A new
benchmarks/*.py that no smoke form covers fails `test_every_benchmark_has_a_smoke_form`. benchmarks/ has no
import circle (tests/test_layout.py checks that, with the packages).

Timing figures are never asserted (benchmarks/README.md: measurements, not tests); what is asserted is that
the run finished and its correctness checks (ledgers, parity, pushes verified) held.

Long file: every benchmark's smoke form and its check sit in one table (SMOKES), so that a new script is
covered in one place."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import background_eval, length_schedule, off_policy, time_to_accuracy
from streamrl.connectors.megatron.model_kit import build_tokenizer, init_model_dir
from streamrl.core.types import Sample, SampleGroup, VersionSpan
from streamrl.plugins.tasks import write_task
from streamrl.pools import LancePool
from streamrl.runtime.runlog import read_jsonl

from poolkit import make_group

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SMOKE_TIMEOUT_S = 120  # each form takes seconds; a hang (as --scale's) fails its test instead of stalling CI


@dataclass(frozen=True)
class Smoke:
    argv: tuple[str, ...]  # the script under benchmarks/ and its flags; "{tmp}" is the test's tmp_path
    check: Callable[[dict[str, Any]], None]
    covers: tuple[str, ...] = ()  # benchmark modules without a __main__ that this run exercises
    slow: bool = True  # the project's marker for tests over ~5 s
    # "{short_tmp}": a fresh directory under /tmp, removed afterwards. For TMPDIR where Ray starts: its
    # socket paths under pytest's tmp_path pass the 107-byte limit of AF_UNIX (and its work directory,
    # left for simulate_cluster.py --calibrate, lands there instead of in /tmp).
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], list[str]] | None = None  # builds inputs in tmp_path; returns more arguments


def _pool_throughput(d: dict[str, Any]) -> None:
    assert d["benchmark"] == "pool_throughput" and d["ledger_balanced"] is True
    assert d["claim"]["claims"] == 2 and d["append_concurrent"]["rows"] > 0 and d["arrow_ipc"]["rows"] > 0


def _pool_throughput_s3(d: dict[str, Any]) -> None:
    _pool_throughput(d)
    assert d["config"]["pool_store"].startswith("s3") and d["data"]["pool_mb_at_end"] > 0


def _pool_scale(d: dict[str, Any]) -> None:
    assert d["benchmark"] == "pool_throughput --scale" and [s["rows"] for s in d["sizes"]] == [2000]
    size = d["sizes"][0]
    assert size["ledger_balanced"] is True and size["claim"]["claims"] == 2 and size["pool_rows"] == size["stats_rows"]
    assert Path(d["png"]).is_file()


def _view_scale(d: dict[str, Any]) -> None:
    assert d["benchmark"] == "view_scale" and d["rows"] > 1000 and len(d["runs"]) == 1
    assert d["page_bytes"] < 100_000 and d["first_view_s"]["median"] > 0  # a page, not the pool


def _pool_processes(d: dict[str, Any]) -> None:
    assert d["commit"]["ledger_balanced"] is True and d["write_ahead"]["ledger_balanced"] is True


def _producer_ingest(d: dict[str, Any]) -> None:
    assert d["accepted"] > 0 and d["ledger"]["balanced"] is True and d["ledger"]["admitted_equals_accepted"] is True


def _simulate_cluster(d: dict[str, Any]) -> None:
    assert set(d["sizes"]) == {"8"} and d["sizes"]["8"]["lockstep"]["speedup"] == 1.0


def _weight_group_probe(d: dict[str, Any]) -> None:
    assert d["gloo"]["learner"]["ok"] is True and d["gloo"]["engine"]["ok"] is True, d["gloo"]


def _engine_devices(d: dict[str, Any]) -> None:
    assert d["tiny"]["cpu"]["parity"]["same_tokens"] == 1.0 and d["tiny"]["cpu"]["tokens_per_s"]["c8"] > 0


def _engine_throughput(d: dict[str, Any]) -> None:
    assert d["direct"]["c1"]["requests"] > 0 and d["router"]["c1"]["requests"] > 0, d


def _broadcast(d: dict[str, Any]) -> None:
    # Every push is checked on the engine (weight_version and log-probs) or the run fails.
    assert set(d["tiny"]["engines_1"]) >= {"distributed", "disk", "tensor"}, d["tiny"]
    lora = d["tiny"]["lora"]  # every adapter push is checked too (log-probs of base + adapter, its version)
    assert 0 < lora["push_bytes"]["lora"] < lora["push_bytes"]["full"] and lora["push_s"]["lora"] > 0, lora


def _learner_step(d: dict[str, Any]) -> None:
    agree = d["presets"]["tiny"]["agreement"]
    assert agree["grad_norm_rel_diff"] < 1e-3 and math.isfinite(agree["megatron"]["loss"]), agree


def _export_memory(d: dict[str, Any]) -> None:
    assert d["benchmark"] == "export_memory" and d["files_equal"] is True and d["params"] > 0, d
    assert all(d[side]["peak_extra_mb"] >= 0 for side in ("streamed", "reference")), d


def _learner_step_vocab(d: dict[str, Any]) -> None:
    m = d["vocab_memory"]
    for side in ("chunked", "reference"):
        assert m[side]["peak_rss_mb_per_1k_tokens"] > 0 and m[side]["tokens"] == m["tokens"] > 0, m
    # the same step on both sides, and the chunked one holds less
    assert m["loss_abs_diff"] < 1e-5 and m["grad_norm_rel_diff"] < 1e-5, m
    assert m["chunked_over_reference"] < 1, m


GPU_CHECKS = {"learner_fp32_cpu", "learner_fp32", "learner_agreement", "learner_bf16", "weight_group", "engine",
              "engine_cpu_parity", "engine_moe", "learner_moe", "learner_real_vocab", "learner_real_vocab_reference"}


def _gpu_check_shape(d: dict[str, Any]) -> None:
    """gpu_check's one JSON object: every check named, each ok / failed / skipped (a skip says why)."""
    assert d["benchmark"] == "gpu_check" and set(d["checks"]) == GPU_CHECKS, d
    for name, c in d["checks"].items():
        assert c["status"] in ("ok", "failed", "skipped") and c["s"] >= 0, (name, c)
        assert c["status"] != "skipped" or c["reason"], (name, c)
    assert d["ok"] is all(c["status"] != "failed" for c in d["checks"].values())


def _gpu_check(d: dict[str, Any]) -> None:
    """--cpu: the CPU parts ran and held, the CUDA-only ones are skipped with the reason."""
    _gpu_check_shape(d)
    c = d["checks"]
    assert d["mode"] == "cpu" and d["ok"] is True, c
    assert c["learner_fp32_cpu"]["status"] == "ok" and c["learner_fp32_cpu"]["param_dtype"] == "float32", c
    assert c["weight_group"]["status"] == "ok" and c["weight_group"]["sha256_equal"] is True, c
    assert c["engine"]["status"] == "ok" and c["engine"]["max_logprob_diff_vs_reference"] < 1e-3, c
    assert c["engine_moe"]["status"] == "ok" and c["engine_moe"]["rows_differing_from_reference"] == 0, c
    assert c["learner_moe"]["status"] == "ok" and c["learner_moe"]["routing_mismatch"] == 0.0, c
    v = c["learner_real_vocab"]  # the same step both ways: equal loss, the chunked one holds less
    assert v["status"] == "ok" and c["learner_real_vocab_reference"]["status"] == "ok", c
    assert v["loss_abs_diff_vs_reference"] < 1e-5 and v["over_reference"] < 1 and v["peak_mb_per_1k_tokens"] > 0, v
    for name in ("learner_fp32", "engine_cpu_parity", "learner_agreement"):
        assert c[name]["status"] == "skipped", (name, c[name])
    assert c["learner_bf16"]["status"] in ("ok", "skipped"), c["learner_bf16"]  # skipped where learner.dtype is not


def test_gpu_check_sh_runs_here(tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh, the device machine's one prepared run, on this CPU machine: one check."""
    p = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--cpu", "--only", "weight_group"], cwd=tmp_path,
                       env={**os.environ, "PY": sys.executable}, capture_output=True, text=True,
                       timeout=SMOKE_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    _gpu_check_shape(d)
    assert d["checks"]["weight_group"]["status"] == "ok" and d["checks"]["engine"]["reason"] == "not in --only"


def _stream_vs_lockstep(d: dict[str, Any]) -> None:
    stream = d["modes"]["stream"]
    assert d["steps"] == 1 and stream["samples"] == 4 and stream["rl_wall_s"] > 0, stream


def _routing_replay(d: dict[str, Any]) -> None:
    (replay,) = d["runs"]["replay"]
    assert set(d["runs"]) == {"replay"}, d["runs"]  # --only replay
    # the engine sent routing for every sample (past the router: it drops the field); replayed, the
    # learner routed exactly as the engine did
    assert replay["routing_missing_rows"] == 0, replay
    assert d["routing_mismatch_frac"]["replay"] == 0.0 and replay["logprob_gap"] >= 0, d


def tiny_quickstart(root: Path, preset: str = "tiny") -> list[str]:
    """Overrides that make recipes/quickstart.yaml a 1-step run of 2 groups of 2 on the tiny model, with a
    1-step SFT and 2 evaluation prompts, on a model and task built in `root` (not in the checkout's runs/)."""
    init_model_dir(root / "model", preset, 0)
    data = write_task(root / "data", seed=0, n_train=64, n_eval=2, n_sft=16)
    return [f"model.path={root / 'model'}", f"data.path={data['train']}", f"data.eval_path={data['eval']}",
            f"sft.path={data['sft']}", "sft.steps=1", "sft.batch_size=4", "data.eval_size=2", "data.eval_samples=1",
            "rollout.groups_per_step=2", "rollout.n_samples=2"]


def _countdown_pool(root: Path) -> list[str]:
    """A run directory whose pool holds two groups of long-tail answers to "312-5=" (steps 307 borrow,
    302 not, 297 borrow), by policy versions 0 and 2; the check below has their rates by hand."""
    tok = build_tokenizer()
    ids = lambda text: np.array(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)  # noqa: E731
    answers = {0: ["307;307-5=302;302-5=297", "307;307-5=303"],  # borrow, other: right; other: wrong
               2: ["308", "307;307-5=302;302-5=298"]}            # borrow wrong; borrow, other right, borrow wrong
    groups = [SampleGroup(group_id=f"g{v}", prompt_id="p", prompt_tokens=ids("312-5="), producer_id="t", samples=[
        Sample(index=i, response_tokens=ids(a), rollout_logprobs=np.zeros(len(ids(a)), np.float32),
               spans=[VersionSpan(v, 0, len(ids(a)))], reward=0.0, finish_reason="stop")
        for i, a in enumerate(texts)]) for v, texts in answers.items()]
    with LancePool(str(root / "run" / "pool"), create=True) as pool:
        pool.append(groups)
    return [str(root / "run"), "--bucket", "2"]


def _longtail_steps(d: dict[str, Any]) -> None:
    first, second = d["buckets"]
    assert first["versions"] == [0, 1] and second["versions"] == [2, 3], d
    assert (first["borrow_steps"], first["borrow_right"], first["other_steps"], first["other_right"]) == (3, 1.0, 2, 0.5)
    assert first["opening_right"] == 1.0 and second["opening_right"] == 0.5
    assert (second["borrow_steps"], second["borrow_right"], second["other_right"]) == (3, 0.3333, 1.0)


def _learner_parallel(d: dict[str, Any]) -> None:
    one = d["parallel"]["tiny"]["1"]
    assert one["world_size"] == 1 and one["state_bytes_per_rank_max"] > 0 and len(one["step_s_by_round"]) == 1
    # host memory: the rank's peak over a step and its publish, against the model-free baseline
    assert one["dtype"] == "fp32" and not one["snapshot"] and one["snapshot_bytes"] == 0, one
    assert one["peak_rss_bytes_by_rank"][0] > one["baseline_rss_bytes_by_rank"][0] > 0, one
    assert one["state_bytes_per_param"] == 12.0 and one["accounted_bytes_per_param"] >= 16.0, one
    assert one["extrapolated_7b"]["accounted_gb_per_rank"] > 100, one


TINY_BATCH = ("--presets", "tiny", "--warmup", "1", "--steps", "1", "--samples", "4", "--group-size", "2",
              "--prompt-len", "8", "--response-len", "8")
TINY_POOL = ("--response-tokens", "10,20", "--dir", "{tmp}")
SMOKES: dict[str, Smoke] = {
    "pool_throughput": Smoke(("pool_throughput.py", "--rows", "1000", "--single-groups", "2", "--claims", "2",
                              "--rounds", "1", "--backlog-rows", "256", "--fresh-fragments", "1", *TINY_POOL),
                             _pool_throughput, slow=False),
    # The pool on a local S3 server (moto): Store's object-store side.
    "pool_throughput_s3": Smoke(("pool_throughput.py", "--s3-local", "--rows", "1000", "--single-groups", "2",
                                 "--claims", "2", "--rounds", "1", "--backlog-rows", "256", "--fresh-fragments", "1",
                                 *TINY_POOL), _pool_throughput_s3),
    # The form issue 45 is about: --scale hung when pool_scale.py passed append_phase a Path.
    "pool_scale": Smoke(("pool_throughput.py", "--scale", "--sizes", "2000", "--rounds", "1", "--claims", "2",
                         "--dir", "{tmp}", "--png", "{tmp}/scale.png"), _pool_scale, slow=False),
    "view_scale": Smoke(("view_scale.py", "--rows", "2000", "--runs", "1", "--dir", "{tmp}"), _view_scale),
    "pool_processes": Smoke(("pool_processes.py", "--producers", "1", "--groups", "2", "--runs", "1", *TINY_POOL),
                            _pool_processes),
    "producer_ingest": Smoke(("producer_ingest.py", "--seconds", "1", "--producers", "1", "--dir", "{tmp}"),
                             _producer_ingest),
    "simulate_cluster": Smoke(("simulate_cluster.py", "--quick", "--gpus", "8", "--steps", "2", "--out-dir", "{tmp}",
                               "groups_per_step=8"), _simulate_cluster, slow=False),
    "weight_group_probe": Smoke(("weight_group_probe.py", "gloo"), _weight_group_probe),
    "engine_devices": Smoke(("engine_devices.py", "--presets", "tiny", "--max-new-tokens", "2", "--parity-requests",
                             "2", "--rounds", "1"), _engine_devices),
    "engine_throughput": Smoke(("engine_throughput.py", "--preset", "tiny", "--rounds", "1", "--seconds", "0.5",
                                "--max-new-tokens", "4", "--group-n", "2", "--group-clients", "1",
                                "--group-prompt-tokens", "8"), _engine_throughput),
    "broadcast": Smoke(("broadcast.py", "--presets", "tiny", "--engines", "1", "--repeats", "1",
                        "--memcopy-repeats", "1", "--lora"), _broadcast, covers=("broadcast_lora",)),
    "learner_step": Smoke(("learner_step.py", *TINY_BATCH), _learner_step),
    "learner_step_vocab": Smoke(("learner_step.py", "--vocab", "32768", "--samples", "8", "--response-len", "96",
                                 "--threads", "1"), _learner_step_vocab, covers=("_vocab_memory",)),
    "export_memory": Smoke(("export_memory.py", "--preset", "tiny", "--shard-mb", "1"), _export_memory),
    "longtail_steps": Smoke(("longtail_steps.py",), _longtail_steps, prepare=_countdown_pool),
    # Every check of the GPU machine's run that the CPU can do (~25 s); gpu_check.sh itself: test above.
    "gpu_check": Smoke(("gpu_check.py", "--cpu", "--steps", "1", "--new-tokens", "4", "--real-vocab", "8192"), _gpu_check),
    # learner_parallel.py is each rank's process, started by learner_step.py --parallel.
    "learner_parallel": Smoke(("learner_step.py", *TINY_BATCH, "--parallel", "1"), _learner_parallel),
    # One mode of one step: a whole `streamrl run` (Ray, router, engine, learner actor), ~20 s.
    "stream_vs_lockstep": Smoke(("stream_vs_lockstep.py", "--quickstart", "--steps", "1", "--modes", "stream",
                                 "--no-pin"), _stream_vs_lockstep, env={"TMPDIR": "{short_tmp}"},
                                prepare=tiny_quickstart),
    # A 2-step MoE run (ep 2, replay): engine -> pool -> learner routing end to end, ~40 s.
    "routing_replay": Smoke(("routing_replay.py", "--steps", "2", "--repeats", "1", "--only", "replay"), _routing_replay,
                            env={"TMPDIR": "{short_tmp}"}, prepare=lambda root: tiny_quickstart(root, "tiny-moe")),
}
# A whole `streamrl run` costs 20-45 s on this 2-core machine (stream_vs_lockstep's form above runs one);
# these three would add one or two more (off_policy's loop over corrections is stream_vs_lockstep's;
# background_eval starts `streamrl run` subprocesses; time_to_accuracy's and length_schedule's runs are
# stream_vs_lockstep's with background evaluations or a rollout.schedule): over the ~150 s the suite grants
# all smoke runs.
# Their smoke forms run in this process instead: the argument parser on tiny flags and the reports
# they build from a run directory (test_report_only_benchmarks below).
REPORT_ONLY = ("off_policy", "background_eval", "time_to_accuracy", "length_schedule")
# Benchmarks whose short form is a test file of its own (chaos.py: five whole trials, with its checks
# shown to fail on a doctored run), which runs them with their helper modules.
OWN_TESTS = {"chaos": ("tests/test_chaos.py", ("_chaos_checks", "_chaos_faults", "_s3_faults"))}


def benchmark_modules() -> dict[str, Path]:
    return {f.stem: f for f in sorted(BENCH.glob("*.py")) if f.stem != "__init__"}


def test_every_benchmark_has_a_smoke_form() -> None:
    """Every benchmark module (the _helpers run inside them) has a smoke form, a script its own."""
    covered = set(SMOKES) | set(REPORT_ONLY) | {m for s in SMOKES.values() for m in s.covers}
    covered |= set(OWN_TESTS) | {m for _, helpers in OWN_TESTS.values() for m in helpers}
    assert all((REPO / test).exists() for test, _ in OWN_TESTS.values())
    public = {m: f for m, f in benchmark_modules().items() if not m.startswith("_")}
    missing = sorted(set(public) - covered)
    assert not missing, f"benchmarks without a smoke form in tests/test_benchmarks.py: {missing}"
    scripts = {m for m, f in public.items() if 'if __name__ == "__main__":' in f.read_text()}
    assert scripts <= set(SMOKES) | set(REPORT_ONLY) | set(OWN_TESTS), "a script needs its own smoke form"


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if s.slow else [])
                                  for n, s in SMOKES.items()])
def test_smoke(name: str, tmp_path: Path) -> None:
    smoke = SMOKES[name]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in smoke.argv]
    argv += smoke.prepare(tmp_path) if smoke.prepare else []
    short_tmp = tempfile.mkdtemp(prefix="smoke-", dir="/tmp")
    try:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TQDM_DISABLE": "1",
               **{k: v.replace("{short_tmp}", short_tmp) for k, v in smoke.env.items()}}
        run_smoke(name, smoke, argv, env, tmp_path)
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)


def run_smoke(name: str, smoke: Smoke, argv: list[str], env: dict[str, str], tmp_path: Path) -> None:
    # Its own process group, so a hang ends with everything in it; SIGTERM first: the benchmarks
    # stop the engines they started (in their own sessions) on the way out.
    proc = subprocess.Popen([sys.executable, str(BENCH / argv[0]), *argv[1:]], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{name} did not finish in {SMOKE_TIMEOUT_S} s (a hang?):\n{err[-3000:]}")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err[-4000:]}"
    smoke.check(json.loads(out))


# ---------------------------------------------------------------- the two whose runs are too long


def _length_schedule_report(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """length_schedule's report of a run: 3 steps of 2 groups (the first from epoch 0), ending at 1, 3 and
    4 s; groups from admission (the pool's created_ns) to storage (group_appended events)."""
    T0 = 1e6  # seconds since the epoch (make_group reads a created_at of 0 as now)
    steps = [(["rollout-0:e0:p0", "rollout-0:e0:p1"], (0, 0), (1, 2)),
             (["rollout-0:e1:p0", "rollout-0:e1:p1"], (1, 1), (2, 4)),
             (["rollout-0:e1:p2", "rollout-0:e1:p3"], (3, 3), (3.5, 3.5))]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r, (gids, _, _), wall in zip(rows, steps, (1.0, 3.0, 4.0)):
        r.update(groups=gids, wall_time_s=wall)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with LancePool(str(run_dir / "pool"), create=True) as pool:
        pool.append([make_group(g, n=5, num_tokens=10 * (k + 1), created_at=int((T0 + t0) * 1e9), prompt_id=f"q{g[-1]}")
                     for gids, starts, _ in steps for k, (g, t0) in enumerate(zip(gids, starts))], admit=True)
    (run_dir / "events.jsonl").write_text("".join(
        json.dumps({"type": "group_appended", "group_ids": [g], "at": int((T0 + t1) * 1e9)}) + "\n"
        for gids, _, ends in steps for g, t1 in zip(gids, ends)))
    rep = length_schedule.run_report(summary, run_dir)
    # 2 groups a step: the tail is the last one alone: (1 + 2 + 0) s of (2 + 3 + 0.5) s
    assert rep["tail_share"] == pytest.approx(3 / 5.5)
    # each step's responses: 10-14 and 20-24 tokens; the 90th percentile is 23 of 24
    assert rep["tail_share_tokens"] == pytest.approx(1 / 24)
    assert rep["steps_after_epoch_1"] == 2 and rep["samples_per_s_after_epoch_1"] == pytest.approx(8 / 3)
    assert rep["step_s_mean"] == pytest.approx(4 / 3) and rep["samples_per_s"] == summary["samples_per_s"]
    return rep


def fake_run_dir(root: Path, steps: int = 3) -> tuple[Path, dict[str, Any]]:
    """A run directory as `streamrl run` leaves it (rows pared down from a real quick-start run's), and
    the summary run_async returns (also written as summary.json, as the CLI does)."""
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "policy_version": s + 1, "wait_s": 0.1, "train_s": 0.08, "push_s": 0.2, "pause_s": 0.2,
             "finish_window_s": 0.0, "reward_mean": 0.25 * s, "staleness_mean": 0.5, "staleness_max": 1,
             "dropped_stale": 0, "samples": 4, "gen_tokens_per_s": 46.0, "train_tokens_per_s": 409.0,
             "grad_norm": 0.5, "clip_frac": 0.0, "is_weight_mean": 1.0, "is_masked_tokens": 0.0,
             "is_capped_tokens": 0.0, "is_ratio_mean": 1.0, "nonfinite_skipped": 0, "interrupted_calls": 0,
             "discarded_token_frac": 0.0} for s in range(steps)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"policy_version": 0, "step": 0, "wall_time_s": 0.0, "mode": "inline", "accuracy": 0.0,
              "greedy_accuracy": 0.0, "eval_s": 0.2},
             {"policy_version": 2, "step": 2, "wall_time_s": 0.5, "finished_wall_s": 0.9, "mode": "background",
              "accuracy": 0.5, "greedy_accuracy": 0.5, "eval_s": 0.3},
             {"policy_version": steps, "step": steps, "wall_time_s": 1.0, "mode": "inline", "accuracy": 0.5,
              "greedy_accuracy": 1.0, "eval_s": 0.1}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    summary = {"rl_s": 1.5, "policy_version": steps, "samples": 4 * steps, "samples_per_s": 8.0,
               "eval_before": {"accuracy": 0.0, "greedy_accuracy": 0.0},
               "eval_after": {"accuracy": 0.5, "greedy_accuracy": 1.0}, "reward_first": 0.0,
               "reward_last": 0.5, "staleness_max": 1, "engine_restarts": 0}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir, summary


@pytest.mark.parametrize("name", REPORT_ONLY)
def test_report_only_benchmarks(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, summary = fake_run_dir(tmp_path)
    if name == "off_policy":
        # Its per-run report is stream_vs_lockstep's (run for real above) plus the correction's metrics.
        a = off_policy.parse_args(["--quick", "--corrections", "tis,icepop"])
        assert a.names == ["tis", "icepop"]
        with pytest.raises(SystemExit):
            off_policy.parse_args(["--corrections", "nope"])
        runs = [{"off_policy": n, "seed": 0, **off_policy.run_report(summary, run_dir)} for n in a.names]
        assert runs[0]["reward_by_version"] == [[1, 0.0], [2, 0.25], [3, 0.5]]
        rep = {"recipe": a.recipe, "max_staleness": a.max_staleness, "steps": 3, "default": "tis", "runs": runs,
               "options": {n: off_policy.option_summary([r for r in runs if r["off_policy"] == n]) for n in a.names}}
        assert rep["options"]["tis"]["accuracy_gain_median"] == 0.5
        off_policy.plot(rep, tmp_path / "off_policy.png")
        assert (tmp_path / "off_policy.png").stat().st_size > 0
    elif name == "time_to_accuracy":
        a = time_to_accuracy.parse_args(["--quickstart", "--repeats", "2", "--modes", "lockstep,stream"])
        assert a.modes == ["lockstep", "stream"] and a.recipe == "recipes/quickstart.yaml"
        for bad in (["--modes", "nope"], ["--modes", "stream"]):  # unknown mode; no lockstep and no --target
            with pytest.raises(SystemExit):
                time_to_accuracy.parse_args(bad)
        fast = time_to_accuracy.curve(read_jsonl(run_dir / "eval.jsonl"), samples_per_step=4)
        assert [(p["version"], p["wall_s"], p["samples"], p["accuracy"]) for p in fast] == [
            (0, 0.0, 0, 0.0), (2, 0.5, 8, 0.5), (3, 1.0, 12, 0.5)]
        slow = [{**p, "wall_s": 3 * p["wall_s"], "accuracy": p["accuracy"] * 0.8} for p in fast]
        # lockstep's median final accuracy is 0.4: its slow runs reach it exactly at version 2 (1.5 s); a fast
        # run goes 0.0 -> 0.5 between 0 s and 0.5 s, so it crosses 0.4 at 0.8 of the way (0.4 s); a target
        # most runs never reach gives None
        rep = time_to_accuracy.summarize({"lockstep": [slow, slow, fast], "stream": [fast, fast, fast]}, None)
        assert rep["target_accuracy"] == pytest.approx(0.4)
        assert rep["time_to_target_runs_s"]["lockstep"] == pytest.approx([1.5, 1.5, 0.4])
        assert rep["time_to_target_s"] == pytest.approx({"lockstep": 1.5, "stream": 0.4})
        assert rep["speedup_vs_lockstep"]["stream"] == pytest.approx(3.75)
        assert rep["speedup_vs_lockstep_per_repeat"]["stream"] == pytest.approx([3.75, 3.75, 1.0])
        assert time_to_accuracy.time_to_target(fast, 0.0) == 0.0  # reached where it starts
        assert rep["final_accuracy"] == {"lockstep": pytest.approx(0.4), "stream": 0.5}
        high = time_to_accuracy.summarize({"lockstep": [slow, slow, fast]}, 0.5)
        assert high["time_to_target_s"] == {"lockstep": None}  # 2 of 3 runs never reached 0.5
        time_to_accuracy.plot({"lockstep": [slow], "stream": [fast]}, 0.4, tmp_path / "tta.png", "smoke")
        assert (tmp_path / "tta.png").stat().st_size > 0
        rows = [{"policy_version": 0, "accuracy": 0.1, "accuracy_ci95": 0.02, "greedy_accuracy": 0.0, "greedy_ci95": 0.0},
                {"policy_version": 9, "accuracy": 0.15, "accuracy_ci95": 0.03, "greedy_accuracy": 0.2,
                 "greedy_ci95": 0.034}]
        g = time_to_accuracy.gains(rows[::-1])  # in version order whatever the file's
        assert g["sampled"] == {"first": 0.1, "last": 0.15, "gain": pytest.approx(0.05), "ci95": 0.03,
                                "over_2x_ci95": False}  # 0.05 is not over 2 x 0.03
        assert g["greedy"]["gain"] == 0.2 and g["greedy"]["over_2x_ci95"] is True
        # --report: the same JSON from run directories left before (here: the fake run as two modes' runs)
        for label in ("lockstep-0", "stream-0"):
            shutil.copytree(run_dir, tmp_path / "work" / label)
        monkeypatch.chdir(tmp_path)  # main() works from the checkout
        time_to_accuracy.main(["--quickstart", "--report", str(tmp_path / "work"), "--repeats", "1",
                               "--modes", "lockstep,stream", "--out", str(tmp_path / "r.json")])
        rep = json.loads((tmp_path / "r.json").read_text())
        assert rep["target_accuracy"] == 0.5 and rep["time_to_target_s"] == {"lockstep": 0.5, "stream": 0.5}
        assert rep["gains"]["stream"][0]["greedy"]["gain"] == 1.0 and (tmp_path / "r.png").stat().st_size > 0
        assert rep["cpu_probe_s"] == {"lockstep": [], "stream": []}  # --report ran nothing
        with pytest.raises(SystemExit, match="no evaluations"):
            time_to_accuracy.main(["--quickstart", "--report", str(tmp_path / "work"), "--repeats", "2"])
    elif name == "length_schedule":
        a = length_schedule.parse_args(["--quick", "--schedules", "fifo,tail_batching"])
        assert a.quick and a.schedules == "fifo,tail_batching" and a.modes == "lockstep,stream"
        rep = _length_schedule_report(run_dir, summary)
    else:
        a = background_eval.parse_args(["--steps", "2", "--configs", "none,background"])
        assert a.config_names == ["none", "background"]
        with pytest.raises(SystemExit):
            background_eval.parse_args(["--configs", "nope"])
        rep = background_eval.report(run_dir, process_s=3.0)
        assert rep["steps"] == 3 and rep["periodic_evals"] == 1 and rep["eval_modes"] == ["background"]
        assert rep["eval_lag_s_mean"] == pytest.approx(0.4)
    json.dumps(rep)  # what the script prints
