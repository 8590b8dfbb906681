"""The chaos trials (benchmarks/chaos.py, docs/reliability.md): the draw of the faults, the checks that
judge a trial (each shown to fail on a run that breaks it), and the five-trial form with a fixed seed
that `make test` runs: a rollout worker stopped for seconds, the whole run powered off in a weight push
and resumed, the router killed, the pool's object store refusing writes while an engine is killed, a
rollout worker killed in a weight push."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _chaos_checks as checks
from benchmarks import chaos
from benchmarks._chaos_faults import Proc, alive, tree

REPO = Path(__file__).resolve().parent.parent
SEED = 1  # its five trials: worker.stop, run.kill (in a weight push), router.kill, storage.fail + engine.kill,
#           worker.kill (in a weight push)


def test_the_draw_is_the_seeds_and_goes_round_every_kind() -> None:
    n = len(chaos.KINDS)
    trials = [chaos.plan(3, i, 2 * n, 4) for i in range(2 * n)]
    assert trials == [chaos.plan(3, i, 2 * n, 4) for i in range(2 * n)]  # a failure reruns exactly
    assert trials != [chaos.plan(4, i, 2 * n, 4) for i in range(2 * n)]
    for block in (trials[:n], trials[n:]):  # each kind once as the first fault of every n trials
        assert sorted(t.faults[0].kind for t in block) == sorted(chaos.KINDS)
    assert [t.mode for t in trials[:3]] == list(chaos.MODES) and [t.moe for t in trials] == [False] * 16 + [True] * 4
    for t in trials:
        assert all(2 <= f.at_step <= chaos.STEPS - 8 and 1 <= f.hold_s <= 8 for f in t.faults)
        assert all(f.during in ("", "push") and (not f.during or f.kind in chaos.DURING_PUSH) for f in t.faults)
        if len(t.faults) == 2:  # at once, and never a power-off beside another fault
            assert t.faults[1].at_step == t.faults[0].at_step and "run.kill" not in {f.kind for f in t.faults}
    many = [chaos.plan(5, i, 200, 0) for i in range(200)]
    assert 30 <= sum(len(t.faults) == 2 for t in many) <= 70  # one trial in four
    assert 35 <= sum(t.faults[0].during == "push" for t in many) <= 80  # 0.4 of the 0.7 that can
    pushed = next(t for t in many if t.faults[0].during and t.weight_sync == "distributed")
    assert chaos.freeze_at(pushed)["STREAMRL_FREEZE_AT"].startswith("push_bucket:")
    assert chaos.recipe_for(pushed, Path("/w"))["engines"]["push_bucket_mb"] == chaos.PUSH_BUCKET_MB


def test_the_process_checks_see_a_process_left_behind(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        [p] = [p for p in tree(os.getpid()) if p.pid == child.pid]
        assert alive([p]) == [p]
        problems = checks.check_gone([p], tmp_path, grace_s=0.5)
        assert problems and str(child.pid) in problems[0]  # reported, then killed for the next trial
        child.wait(10)
        assert alive([p]) == [] and alive([Proc(p.pid, p.start + 1, p.cmd)]) == []  # a reused pid is another
    finally:
        child.kill()
    assert checks.clear_stop("Traceback (most recent call last):\n ...") == "a traceback on stderr"
    assert checks.clear_stop("streamrl: the run lost ...; `streamrl run --resume R` continues this run") is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_five_chaos_trials_lose_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    p = subprocess.run([sys.executable, "benchmarks/chaos.py", "--trials", "5", "--seed", str(SEED), "--jobs", "2",
                        "--keep", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=840)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    *trials, s = lines
    assert p.returncode == 0, json.dumps(s.get("failed"), indent=1) + p.stderr[-3000:]
    assert s["trials"] == s["passed"] == 5 and s["lost"] == 0 and s["duplicated"] == 0, s
    assert s["staleness_violations"] == 0 and s["faults_landed"] == 6 and s["two_at_once"] == 1, s
    assert set(s["by_kind"]) == {"worker.stop", "run.kill", "router.kill", "storage.fail", "engine.kill", "worker.kill"}
    assert s["survived_with_one_resume"] == 1 and [t["resumes"] for t in trials] == [0, 1, 0, 0, 0], trials
    assert all(t["consumed"] == chaos.STEPS * chaos.GROUPS for t in trials)

    # The checks fail a run that breaks what they check: a step logged twice and one missing, a
    # checkpoint file changed.
    run_dir = out / f"trial-{SEED}-004" / "run"
    t = chaos.plan(SEED, 4, 5, 0)
    args = (chaos.mode_bound(t.mode, t.max_staleness), chaos.STEPS, chaos.GROUPS)
    assert checks.check_run(run_dir, *args)[0] == []
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(metrics[:-1] + [metrics[0]]) + "\n")
    assert any("steps logged" in q or "versions out of order" in q for q in checks.check_run(run_dir, *args)[0])
    (run_dir / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    from connectors.megatron.checkpoint import list_checkpoints

    _, ck = list_checkpoints(run_dir / "checkpoints")[-1]
    victim = next(f for f in sorted((ck / "sharded").rglob("*")) if f.is_file() and f.stat().st_size)
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    assert any("does not verify" in q for q in checks.check_run(run_dir, *args)[0])
