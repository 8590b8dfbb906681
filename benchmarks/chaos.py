"""Chaos trials: random faults in a running run, checked for loss, duplication and staleness after each
(docs/reliability.md has the fault model and the figures).

    python benchmarks/chaos.py --trials 50 --seed 1 --moe 10 --jobs 2   # 50 trials (10 of them MoE), two at once
    python benchmarks/chaos.py --seed 1 --only 17 --keep               # trial 17 of seed 1 again, run kept

Each trial runs the quick-start's task, cut small (no SFT, no evaluation, STEPS steps, a checkpoint every
CHECKPOINT_EVERY), in one of the three modes (trial i: stream, lockstep, one_step_off in turn), with the
staleness bound, partial-rollout policy and weight path drawn from the seed; `--moe K` makes the last K
trials the MoE quick-start's (ep 2, routing replay). Once the run has logged a drawn number of steps, a
fault drawn from the seed lands on one part (for four faults in ten of the kinds that can, in the
middle of that step's weight push instead: the run frozen there while it lands): SIGKILL, or SIGSTOP
then SIGCONT 1-8 s later, of an engine, a rollout worker, a learner rank or the router, the whole run
powered off, or the pool's object store answering every write with 503 SlowDown for 1-8 s
(benchmarks/_s3_faults.py); one trial in four gets a second fault at the same moment. A run that exits non-zero is resumed (`streamrl run --resume`) once.

A trial passes when the run finished, by itself or after one resume (and then only after a clear
message naming --resume: no traceback), and: every step trained once, in order (metrics.jsonl:
versions 1..STEPS); the ledger balances (`streamrl pool stats --json`: lost, duplicated, unadmitted,
in flight and partial 0, consumed = steps x groups); no step and no consumed group past the staleness
bound; every checkpoint verifies (checksums) and the pool reads as of every step; no process of the run is
left and its router's port is closed. A failed trial keeps its directory and prints the command that
runs it again. Progress on stderr, one JSON line per trial on stdout, then the summary (JSON, and a table
with --table). Exit 1 when a trial failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from benchmarks._s3 import BUCKET, CREDENTIALS  # noqa: E402
from benchmarks._chaos_checks import check_gone, check_run, clear_stop  # noqa: E402
from benchmarks._chaos_faults import Proc, power_off, signal_quietly, stop_for, tree  # noqa: E402
from benchmarks._common import git_rev, log  # noqa: E402
from streamrl.core.staleness import mode_bound  # noqa: E402
from streamrl.runtime import faultpoint  # noqa: E402

STEPS, CHECKPOINT_EVERY, GROUPS = 24, 6, 4
MODES = ("stream", "lockstep", "one_step_off")
KINDS = ("engine.kill", "engine.stop", "worker.kill", "worker.stop", "learner.kill", "learner.stop",
         "router.kill", "router.stop", "run.kill", "storage.fail")
RUN_TIMEOUT_S = 300  # one attempt; an undisturbed trial's run takes ~30 s on an idle 2-core machine
# Faults that may land in the middle of a weight push: the run freezes there (streamrl/runtime/faultpoint.py),
# the fault lands, the run goes on. Distributed pushes go in PUSH_BUCKET_MB buckets (the tiny model's 0.53 MB
# in ~6), and the freeze is after the 3rd bucket of the push; a disk push freezes with the engines paused.
DURING_PUSH = ("engine.kill", "engine.stop", "learner.kill", "learner.stop", "worker.kill", "router.kill", "run.kill")
PUSH_BUCKET_MB, BUCKETS_PER_PUSH = 0.1, 6
FIND_S = 15  # how long a fault waits for its part to be there (an engine being restarted, say)


@dataclass(frozen=True)
class Fault:
    kind: str  # <part>.<kill|stop>, or run.kill (every process at once)
    at_step: int  # lands once the run has logged this many steps ...
    delay_s: float  # ... and this much later
    hold_s: float  # a stop's length, a storage outage's
    pick: int  # which of the part's processes (modulo how many there are)
    during: str = ""  # "push": at that step's weight push instead, the run frozen there while it lands


@dataclass(frozen=True)
class Trial:
    seed: int
    index: int
    mode: str
    moe: bool
    max_staleness: int
    partial_rollout: str
    weight_sync: str
    faults: tuple[Fault, ...]


def plan(seed: int, index: int, trials: int, moe: int) -> Trial:
    """Trial `index` of `trials` under `seed`: a pure function of the three (so a failure is rerun
    exactly with --only)."""
    rng = random.Random(f"chaos/{seed}/{index}")
    # The first fault's kind goes round a shuffle of KINDS (every kind once in each len(KINDS) trials: five
    # trials try five kinds), the rest is drawn.
    order = random.Random(f"chaos/{seed}/kinds/{index // len(KINDS)}").sample(KINDS, len(KINDS))

    def fault(kind: str, at_step: int | None = None) -> Fault:
        return Fault(kind, at_step or rng.randint(2, STEPS - 8), round(rng.uniform(0, 1.0), 2),
                     round(rng.uniform(1, 8), 1), rng.randrange(8))

    faults = [fault(order[index % len(KINDS)])]
    if faults[0].kind in DURING_PUSH and rng.random() < 0.4:
        faults[0] = Fault(**{**asdict(faults[0]), "during": "push"})
    if rng.random() < 0.25 and faults[0].kind != "run.kill":
        second = fault(rng.choice([k for k in KINDS if k != "run.kill"]), faults[0].at_step)
        faults.append(Fault(**{**asdict(second), "during": faults[0].during}))
    return Trial(seed, index, MODES[index % len(MODES)], index >= trials - moe, rng.choice((1, 2)),
                 rng.choice(("abort_resume", "in_place", "restart")), rng.choice(("distributed", "disk")),
                 tuple(faults))


def recipe_for(t: Trial, work: Path) -> dict[str, Any]:
    """The quick-start's recipe (or the MoE one), cut small; its model and data shared by the trials."""
    name = "moe_quickstart" if t.moe else "quickstart"
    r = copy.deepcopy(yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text()))
    r.pop("sft", None)
    r["run"] = {"name": f"chaos-{t.index}", "seed": t.seed * 1000 + t.index, "mode": t.mode, "steps": STEPS,
                "checkpoint_every": CHECKPOINT_EVERY, "keep_checkpoints": 0}
    r["model"]["path"] = str(work / "models" / name)
    r["data"] = {**{k: v for k, v in r["data"].items() if not k.startswith("eval")},
                 "path": str(work / "data" / "train.jsonl")}
    r["rollout"].update(n_samples=4, groups_per_step=GROUPS)
    r["staleness"].update(max_staleness=t.max_staleness, partial_rollout=t.partial_rollout)
    r["engines"]["weight_sync"] = t.weight_sync
    if t.faults[0].during and t.weight_sync == "distributed":
        r["engines"]["push_bucket_mb"] = PUSH_BUCKET_MB
    if any(f.kind == "storage.fail" for f in t.faults):  # the pool on S3, behind a proxy that can fail writes
        r["pool"] = {"uri": f"s3://{BUCKET}/chaos-{t.seed}-{t.index}-{uuid.uuid4().hex[:8]}/pool",
                     "storage_options": {"aws_endpoint": object_store(t).url, "allow_http": "true"}}
    return r


_S3: list[Any] = []  # the local S3 server, started for the first trial that needs it
_PROXIES: dict[tuple[int, int], Any] = {}  # a trial's own failing proxy in front of it
_LOCK = threading.Lock()


def object_store(t: Trial) -> Any:
    from benchmarks._s3 import start_s3
    from benchmarks._s3_faults import FaultyS3

    with _LOCK:
        if not _S3:
            os.environ.update(CREDENTIALS)  # this process reads the pool too (check_run)
            _S3.append(start_s3(ARGS.out / "moto.log"))
        if (t.seed, t.index) not in _PROXIES:
            _PROXIES[t.seed, t.index] = FaultyS3(_S3[0].url)
        return _PROXIES[t.seed, t.index]


# ---------------------------------------------------------------- one trial


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS"):  # each run makes its own local Ray
        env.pop(k, None)
    return {**env, **CREDENTIALS}  # the S3 pool's (a recipe refuses credentials; the local server takes any)


class Attempt:
    """One `streamrl run` (or --resume) of the trial: its process, and every descendant it was seen to have."""

    def __init__(self, args: list[str], logs: Path, seen: list[Proc], env: dict[str, str] | None = None) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs, self.seen = logs, seen
        self.proc = subprocess.Popen([sys.executable, "-m", "streamrl", *args, "--quiet"], cwd=logs.parent,
                                     env={**_env(), **(env or {})}, stdout=(logs / "stdout").open("wb"),
                                     stderr=(logs / "stderr").open("wb"), start_new_session=True)
        self.powered_off = False

    def note(self) -> None:
        known = {(p.pid, p.start) for p in self.seen}
        self.seen += [p for p in tree(self.proc.pid) if (p.pid, p.start) not in known]

    def parts(self, role: str) -> list[Proc]:
        return sorted((p for p in tree(self.proc.pid) if p.role == role), key=lambda p: p.pid)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None when it did not exit in time (then it is powered off)."""
        t0 = time.monotonic()
        while self.proc.poll() is None:
            self.note()
            if time.monotonic() - t0 > timeout_s:
                self.power_off()
                return None
            time.sleep(0.5)
        return self.proc.returncode

    def power_off(self) -> None:
        self.note()
        power_off(self.proc.pid, self.seen)
        self.proc.wait()
        self.powered_off = True

    def stderr(self) -> str:
        return (self.logs / "stderr").read_text(errors="replace")


def steps_logged(run_dir: Path) -> int:
    from streamrl.runtime.runlog import read_jsonl

    return len(read_jsonl(run_dir / "metrics.jsonl"))


def inject(a: Attempt, t: Trial, run_dir: Path) -> list[dict[str, Any]]:
    """Land each fault when its step comes; returns what landed where (a fault whose moment the run never
    reached, it having stopped, is reported with landed false)."""
    done: list[dict[str, Any]] = []
    frozen = run_dir / faultpoint.FROZEN
    for f in sorted(t.faults, key=lambda f: (f.at_step, f.delay_s)):
        rec: dict[str, Any] = {**asdict(f), "landed": False}
        done.append(rec)
        while a.proc.poll() is None and not (frozen.exists() if f.during else steps_logged(run_dir) >= f.at_step):
            a.note()
            time.sleep(0.05)
        time.sleep(0 if f.during else f.delay_s)
        if a.proc.poll() is not None:
            continue
        rec["step"] = steps_logged(run_dir)
        if f.during:
            rec["frozen_at"] = frozen.read_text().split(" pid")[0]
        part, how = f.kind.split(".")
        if part in ("run", "storage"):
            a.power_off() if part == "run" else object_store(t).fail_writes(f.hold_s)
            rec["landed"] = True
            continue
        t0 = time.monotonic()
        while not (procs := a.parts(part)) and time.monotonic() - t0 < FIND_S and a.proc.poll() is None:
            time.sleep(0.2)
        if not procs:
            rec["missing"] = f"no {part} process found within {FIND_S} s"
            continue
        a.note()
        target = procs[f.pick % len(procs)]
        rec.update(pid=target.pid, of=len(procs), landed=True)
        if how == "kill":
            signal_quietly(target.pid, signal.SIGKILL)
        else:
            stop_for(target.pid, f.hold_s)
    if frozen.exists() and a.proc.poll() is None:  # the run goes on from the moment the faults landed
        (run_dir / faultpoint.THAW).write_text("")
    return done


def freeze_at(t: Trial) -> dict[str, str]:
    """The run's environment for a fault in a weight push: where it freezes (once) for the fault to land."""
    f = t.faults[0]
    if not f.during:
        return {}
    if t.weight_sync == "distributed":  # after the 3rd of the push's ~6 buckets
        return {faultpoint.ENV: f"push_bucket:{BUCKETS_PER_PUSH * (f.at_step - 1) + 3}:once"}
    return {faultpoint.ENV: f"publish:{f.at_step}:once"}  # engines paused, the new weights not yet loaded


def run_trial(t: Trial, work: Path) -> dict[str, Any]:
    tdir = work / f"trial-{t.seed}-{t.index:03d}"
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir(parents=True)
    recipe = tdir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(t, work), sort_keys=False))
    run_dir = tdir / "run"
    seen: list[Proc] = []
    problems: list[str] = []
    t0 = time.monotonic()
    a = Attempt(["run", str(recipe), "--run-dir", str(run_dir)], tdir / "attempt-0", seen, freeze_at(t))
    faults = inject(a, t, run_dir)
    rc = a.wait(RUN_TIMEOUT_S)
    codes = [rc]
    if rc is None:
        problems.append(f"the run did not end within {RUN_TIMEOUT_S} s of its start")
    elif rc != 0 and not a.powered_off and (why := clear_stop(a.stderr())):
        problems.append(f"the run stopped (exit {rc}) unclearly: {why}")
    if rc != 0:  # one resume, whatever stopped it
        a = Attempt(["run", "--resume", str(run_dir)], tdir / "attempt-1", seen)
        rc = a.wait(RUN_TIMEOUT_S)
        codes.append(rc)
        if rc != 0:
            problems.append(f"--resume did not finish the run (exit {rc})")
    t_runs = time.monotonic() - t0
    ledger: dict[str, Any] = {}
    if rc == 0:
        try:
            found, ledger = check_run(run_dir, mode_bound(t.mode, t.max_staleness), STEPS, GROUPS)
            problems += found
        except Exception as e:  # noqa: BLE001 - a check that cannot read the run is a failed trial, not a stop
            problems.append(f"the checks could not read the run: {e!r}")
    t_checks = time.monotonic() - t0 - t_runs
    problems += check_gone(seen, run_dir)
    res = {"seed": t.seed, "trial": t.index, "mode": t.mode, "moe": t.moe, "max_staleness": t.max_staleness,
           "partial_rollout": t.partial_rollout, "weight_sync": t.weight_sync, "faults": faults,
           "exit_codes": codes, "resumes": len(codes) - 1, "wall_s": round(time.monotonic() - t0, 1),
           "runs_s": round(t_runs, 1), "checks_s": round(t_checks, 1),
           "passed": not problems, "problems": problems}
    res.update(ledger)
    if problems:
        res["rerun"] = f"python benchmarks/chaos.py --seed {t.seed} --trials {ARGS.trials} --moe {ARGS.moe} " \
                       f"--only {t.index} --keep --out {work}"
        res["kept"] = str(tdir)
    elif not ARGS.keep:
        shutil.rmtree(tdir, ignore_errors=True)
    return res


# ---------------------------------------------------------------- the whole benchmark


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    landed = Counter(f["kind"] for r in results for f in r["faults"] if f["landed"])
    return {
        "trials": len(results), "passed": sum(r["passed"] for r in results),
        "faults_landed": sum(landed.values()), "by_kind": dict(sorted(landed.items())),
        "two_at_once": sum(sum(f["landed"] for f in r["faults"]) == 2 for r in results),
        "survived_without_resume": sum(r["passed"] and r["resumes"] == 0 for r in results),
        "survived_with_one_resume": sum(r["passed"] and r["resumes"] == 1 for r in results),
        "lost": sum(r.get("lost", 0) for r in results), "duplicated": sum(r.get("duplicated", 0) for r in results),
        "staleness_violations": sum(any("staleness" in p for p in r["problems"]) for r in results),
        "by_mode": {m: sum(r["mode"] == m for r in results) for m in MODES}, "moe": sum(r["moe"] for r in results),
        "failed": [{"trial": r["trial"], "problems": r["problems"], "rerun": r.get("rerun")}
                   for r in results if not r["passed"]],
        "wall_s": round(sum(r["wall_s"] for r in results), 1), "git_rev": git_rev(),
    }


def table(results: list[dict[str, Any]]) -> str:
    """Per fault kind (a trial with two faults counts under both), then per trial."""
    kinds: dict[str, Counter[str]] = {}
    for r in results:
        for f in r["faults"]:
            if f["landed"]:
                c = kinds.setdefault(f["kind"], Counter())
                c["trials"] += 1
                c["passed" if r["passed"] else "failed"] += 1
                c["resumed"] += r["passed"] and r["resumes"] == 1
    lines = ["| fault | trials | passed | of them after one --resume | failed |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {c['trials']} | {c['passed']} | {c['resumed']} | {c['failed']} |"
              for k, c in sorted(kinds.items())]
    lines += ["", "| trial | mode | faults (at step) | exits | result |", "|---|---|---|---|---|"]
    for r in results:
        fs = ", ".join(f"{f['kind']}@{f.get('frozen_at') or f.get('step', f['at_step'])}"
                       + ("" if f["landed"] else " (not reached)")
                       for f in r["faults"])
        lines.append(f"| {r['trial']}{' moe' if r['moe'] else ''} | {r['mode']} | {fs} | {r['exit_codes']} | "
                     + ("ok" if r["passed"] else "FAIL: " + "; ".join(r["problems"])) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--trials", type=int, default=50, help="how many trials (default 50)")
    ap.add_argument("--seed", type=int, default=1, help="draws every trial's faults (default 1)")
    ap.add_argument("--moe", type=int, default=0, help="the last K trials run the MoE quick-start (default 0)")
    ap.add_argument("--only", type=int, nargs="*", help="run only these trial indices (as a failure prints)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "chaos", help="work directory (default runs/chaos)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's run directory (failed ones always are)")
    ap.add_argument("--table", action="store_true", help="also print a markdown table of the trials")
    ap.add_argument("--jobs", type=int, default=1, help="trials run at once (default 1; each is a whole run)")
    ARGS = ap.parse_args(argv)
    ARGS.out = ARGS.out.resolve()
    ARGS.out.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> dict[str, Any]:
        t = plan(ARGS.seed, i, ARGS.trials, ARGS.moe)
        log(f"trial {i}: {t.mode}{' moe' if t.moe else ''}, " + ", ".join(
            f"{f.kind} at step {f.at_step}{' (in its weight push)' if f.during else ''}" for f in t.faults))
        try:
            r = run_trial(t, ARGS.out)
        finally:
            if (proxy := _PROXIES.pop((t.seed, t.index), None)) is not None:
                proxy.close()
        log(f"trial {i}: {'ok' if r['passed'] else 'FAILED'} in {r['wall_s']} s, exits {r['exit_codes']}"
            + "".join(f"\n  {p}" for p in r["problems"]) + (f"\n  again: {r['rerun']}" if "rerun" in r else ""))
        print(json.dumps(r), flush=True)
        return r

    with ThreadPoolExecutor(ARGS.jobs) as pool:  # trials are processes of their own: threads only wait on them
        results = sorted(pool.map(one, ARGS.only if ARGS.only is not None else range(ARGS.trials)),
                         key=lambda r: r["trial"])
    for server in _S3:
        server.stop()
    s = summary(results)
    print(json.dumps(s), flush=True)
    if ARGS.table:
        print(table(results))
    return 0 if s["passed"] == s["trials"] else 1


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
