"""A weight push that an engine's death interrupts, in a run (issue: the learner at real size, item 3).

The run (two embedded engines, a two-rank learner, the distributed weight sync in ~20 KB buckets so a
push has many) freezes itself once both engines took the 2nd bucket of its first push
(streamrl/runtime/faultpoint.py `push_bucket`); the test SIGKILLs one engine and lets the run go on.
The learner's side fails at the 3rd bucket at once (not at `engines.push_timeout_s`), the other
engine is released, run.log carries one warning naming the dead engine and the bucket, the version
reaches the live engine from disk, and the run trains every step
once, in order, with nothing lost; the two learner ranks (dp 2) went on together (a step is a
collective of both)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import streamkit as sk
from streamkit import task_data, tiny_model  # noqa: F401 - fixtures
from streamrl.runtime import faultpoint

pytestmark = pytest.mark.slow

STEPS, GPS = 4, 2
TIMEOUT_S = 60


def test_an_engine_killed_mid_push_fails_it_at_once_with_one_error_and_the_run_goes_on(
        tmp_path: Path, tiny_model: Path, task_data: dict[str, Path]) -> None:  # noqa: F811
    run_dir, io = tmp_path / "run", tmp_path / "io"
    recipe = sk.write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": STEPS, "engines.num": 2, "engines.weight_sync": "distributed",
        "engines.push_bucket_mb": 0.02, "engines.push_timeout_s": TIMEOUT_S, "learner.parallel.dp": 2})
    proc = sk.start_streamrl(["run", str(recipe), "--run-dir", str(run_dir)], io,
                             env={faultpoint.ENV: "push_bucket:2"})
    done = threading.Event()

    def thaw() -> None:
        while not done.wait(0.05):
            if (run_dir / faultpoint.FROZEN).exists() and not (run_dir / faultpoint.THAW).exists():
                (run_dir / faultpoint.THAW).write_text("")

    thawing = threading.Thread(target=thaw, daemon=True)
    try:
        sk.wait_for(lambda: (run_dir / faultpoint.FROZEN).exists(), 400, "the run to freeze mid-push", alive=proc)
        pids = sk.engine_pids(tiny_model)
        assert len(pids) == 2, f"expected 2 engine processes for {tiny_model}, found {pids}"
        victim, port = pids[0], sk.engine_port(pids[0])
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        pattern = re.compile(r"warning: weight push of version 1 failed at bucket (\d+) of (\d+): engine "
                             rf"http://127\.0\.0\.1:{port} did not answer")

        thawing.start()  # from now on the run goes on: the seam freezes again at every later bucket
        sk.wait_for(lambda: pattern.search(sk.run_log(run_dir)), 120, "the push's one warning", alive=proc)
        failed_after = time.monotonic() - t0
        res = sk.finish_streamrl(proc, io, 400, run_dir, check=False)
    except BaseException:
        sk.kill_session(proc, run_dir)
        raise
    finally:
        done.set()
    assert res.returncode == 0, sk.describe_run(run_dir, res.stderr, res.returncode)
    log = sk.run_log(run_dir)
    warnings = [line for line in log.splitlines() if "weight push of version 1 failed" in line]
    assert len(warnings) == 1, warnings  # one error for the push, not one per engine or rank
    at, buckets = map(int, pattern.search(log).groups())
    print(f"\n[e2e] push failure: bucket {at} of {buckets}, warned {failed_after:.1f} s after the kill")
    # The engine had taken 2 buckets (it may have taken the 3rd before it died: the frozen driver held
    # its answer); it was to blame, not the engine released after it nor the learner.
    assert 3 <= at < buckets, (at, buckets)
    assert failed_after < TIMEOUT_S / 2, failed_after  # at once, not at engines.push_timeout_s
    assert "using disk" in warnings[0]
    metrics = sk.read_metrics(run_dir)
    sk.check_step_metrics(metrics, STEPS)
    led = sk.assert_ledger_balanced(run_dir)["ledger"]
    assert led["consumed"] == STEPS * GPS and led["lost"] == 0 and led["in_flight"] == 0, led
    # Version 1 reached the live engine (from disk) and every later version went over the weight group again.
    resumed = {e["version"] for e in sk.read_events(run_dir, "engine_resumed")}
    assert resumed >= set(range(1, STEPS + 1)), resumed
    assert sum("weight push of version" in line and "failed" in line for line in log.splitlines()) == 1, log
