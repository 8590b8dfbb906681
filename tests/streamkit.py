"""Helpers for the end-to-end tests of `streamrl run` (tests/test_stream_e2e.py).

Everything here looks at a run the way a user does: it starts `streamrl run` as a subprocess
and reads what the run leaves behind (exit code, stderr, RUN_DIR/metrics.jsonl, events.jsonl,
run.log, the experience pool, `streamrl pool stats --json`, the pushed weights). Of the runtime it
uses only the run logs' own reader (`read_jsonl`: complete lines of a log still being written) and
the CLI's `main`.

    recipe = write_recipe(tmp_path, model_dir, train_path, {"staleness.max_staleness": 4})
    res = run_recipe(recipe, run_dir)          # fails the test with stderr/run.log/engine log tails
    metrics = read_metrics(run_dir)
    stats = assert_ledger_balanced(run_dir)    # `streamrl pool stats RUN_DIR --json`

Long file: the shared helpers every end-to-end test reads a run through.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from streamrl.runtime.runlog import read_jsonl

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

RUN_TIMEOUT_S = 480  # one `streamrl run` (start-up alone takes 25-60 s on a busy 2-core machine)

STEP_KEYS = ("step", "policy_version", "wall_time_s", "reward_mean", "staleness_mean", "staleness_max",
             "dropped_stale", "loss", "kl", "entropy", "grad_norm", "gen_tokens_per_s", "train_tokens_per_s")


# ---------------------------------------------------------------- session inputs


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model directory (streamrl.connectors.megatron.model_kit.init_model_dir, preset tiny, seed 0)
    with its 2-D weights sharpened (enginekit.make_model_dir): a fresh tiny model samples from
    an almost uniform distribution, so every version's log-probs would be ~-log(vocab) and a
    log-prob check could not tell versions apart."""
    from enginekit import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("e2e-model") / "model", seed=0)


@pytest.fixture(scope="session")
def task_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """streamrl.plugins.tasks.write_task: train.jsonl (400 prompts), eval.jsonl, sft.jsonl (unused)."""
    from streamrl.plugins.tasks import write_task

    return write_task(tmp_path_factory.mktemp("e2e-data"), seed=0, n_train=400, n_eval=16, n_sft=1)


# ---------------------------------------------------------------- recipes


def base_recipe(model_dir: str | Path, train_path: str | Path) -> dict[str, Any]:
    """A small streaming recipe: no SFT, no eval, 1 engine, checkpoint only at the end. The
    reward varies within groups and the learning rate is high, so every step moves the weights
    enough for consecutive versions to give measurably different log-probs."""
    return {
        "run": {"name": "e2e", "seed": 0, "mode": "stream", "steps": 6, "checkpoint_every": 0},
        "model": {"path": str(model_dir), "init": {"preset": "tiny", "seed": 0}},
        "data": {"path": str(train_path), "epochs": 4},
        "rollout": {"n_samples": 4, "groups_per_step": 2, "max_new_tokens": 8, "temperature": 1.0},
        "staleness": {"max_staleness": 1, "policy": "drop", "partial_rollout": "abort_resume"},
        "reward": {"fn": "rewardkit:digit_fraction"},
        "learner": {"lr": 1.0e-2, "micro_batch_size": 64},
        "engines": {"num": 1, "weight_sync": "disk"},
    }


def set_key(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def write_recipe(tmp_path: Path, model_dir: str | Path, train_path: str | Path,
                 overrides: Mapping[str, Any] | None = None, name: str = "recipe.yaml") -> Path:
    """base_recipe with `{"section.key": value}` overrides (value None removes the key), as YAML."""
    data = copy.deepcopy(base_recipe(model_dir, train_path))
    for k, v in (overrides or {}).items():
        if v is None:
            *parents, last = k.split(".")
            node = data
            for p in parents:
                node = node.get(p, {})
            node.pop(last, None)
        else:
            set_key(data, k, v)
    path = Path(tmp_path) / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---------------------------------------------------------------- running


def child_env() -> dict[str, str]:
    """The environment of a `streamrl run` child: tests/ and the repo on PYTHONPATH (the run
    hands PYTHONPATH on to its Ray workers, so `rewardkit:fn` imports there too)."""
    env = dict(os.environ)
    # An in-process test that started StreamRL's own local Ray left its private token and token
    # mode in this process's environment (launcher.ensure_ray); a child that inherited them and
    # joined another cluster (ray.address) would demand that token of the cluster's GCS, which
    # then takes the child for dead and destroys its actors. Each run makes its own.
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def streamrl_cmd(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "streamrl", *map(str, args)]


def tail(text: str | bytes | None, n: int = 4000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = text.replace("\r", "\n")
    return text if len(text) <= n else "..." + text[-n:]


def file_tail(path: Path, n: int = 3000) -> str:
    try:
        return tail(path.read_bytes(), n)
    except OSError:
        return "(missing)"


def describe_run(run_dir: Path | None, proc_stderr: str | bytes | None = None, rc: int | None = None) -> str:
    """Exit code, stderr tail, run.log tail and engine/router log tails: what to read when a run fails."""
    parts = [f"exit code {rc}"] if rc is not None else []
    if proc_stderr is not None:
        parts.append("---- stderr (tail) ----\n" + tail(proc_stderr))
    if run_dir is not None:
        parts.append("---- run.log (tail) ----\n" + file_tail(run_dir / "run.log"))
        for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
            parts.append(f"---- {log.name} (tail) ----\n" + file_tail(log, 1500))
    return "\n".join(parts)


def run_processes(run_dir: Path) -> list[int]:
    """Processes holding a file under `run_dir` open (a run's router, engines, Ray workers write
    their logs and the pool there): what is left of that run."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if any(os.readlink(f).startswith(str(run_dir)) for f in (d / "fd").iterdir()):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def kill_session(proc: subprocess.Popen[Any], run_dir: Path | None = None) -> None:
    """Stop a run this test started: SIGINT to the driver (it stops Ray, the router and the
    engines in its `finally`), then SIGTERM, then SIGKILL to its process group, then SIGKILL to
    any process still holding files of its run directory open (the sglang-router runs in a
    session of its own and has no parent watchdog, so a killed driver can leave it behind)."""
    for sig, grace_s in ((signal.SIGINT, 20), (signal.SIGTERM, 20)):
        if proc.poll() is not None:
            break
        try:
            os.kill(proc.pid, sig)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if run_dir is not None:
        for pid in run_processes(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def power_off(proc: subprocess.Popen[Any], run_dir: Path) -> int:
    """SIGKILL the whole run at once, as a power cut would: every process is stopped first (so
    none reacts to another's death: no clean-up, no final writes), then killed. Returns how
    many processes were killed."""
    from enginekit import descendants

    killed: set[int] = set()
    for _ in range(5):  # a process may have been forking while we looked
        pids = [p for p in {proc.pid, *descendants(proc.pid), *run_processes(run_dir)} if p not in killed]
        if not pids:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in pids:
                try:
                    os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        killed |= set(pids)
    proc.wait()
    return len(killed)


def start_streamrl(args: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`streamrl ARGS` in the background (own session), stdout/stderr to files under log_dir."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / "streamrl.stdout", "wb")  # noqa: SIM115 - closed with the process
    err = open(log_dir / "streamrl.stderr", "wb")  # noqa: SIM115
    proc = subprocess.Popen(streamrl_cmd(args), cwd=REPO, env={**child_env(), **(env or {})}, stdout=out, stderr=err,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    err.close()
    return proc


def finish_streamrl(proc: subprocess.Popen[bytes], log_dir: Path, timeout_s: float = RUN_TIMEOUT_S,
                    run_dir: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc, run_dir)
        pytest.fail(f"streamrl {proc.args[3:]} did not finish within {timeout_s}s\n"
                    + describe_run(run_dir, (log_dir / "streamrl.stderr").read_bytes()))
    res = subprocess.CompletedProcess(proc.args, proc.returncode,
                                      (log_dir / "streamrl.stdout").read_text(errors="replace"),
                                      (log_dir / "streamrl.stderr").read_text(errors="replace"))
    if check and res.returncode != 0:
        pytest.fail(f"streamrl {list(proc.args[3:])} failed\n" + describe_run(run_dir, res.stderr, res.returncode))
    return res


def run_streamrl(args: Sequence[str], timeout_s: float = RUN_TIMEOUT_S, run_dir: Path | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `streamrl ARGS` to the end. check=True fails the test (with stderr, run.log and
    engine log tails) on a non-zero exit code."""
    if run_dir is not None:
        log_dir = run_dir.parent / f".{run_dir.name}-io"
    else:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="streamrl-io-"))
    t0 = time.monotonic()
    proc = start_streamrl(args, log_dir)
    res = finish_streamrl(proc, log_dir, timeout_s, run_dir, check)
    res.wall_s = time.monotonic() - t0  # type: ignore[attr-defined]
    return res


def run_recipe(recipe: Path, run_dir: Path, overrides: Sequence[str] = (), timeout_s: float = RUN_TIMEOUT_S,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_streamrl(["run", str(recipe), *overrides, "--run-dir", str(run_dir)], timeout_s, run_dir, check)


@dataclass
class Run:
    name: str
    dir: Path
    recipe: Path
    overrides: dict[str, Any]
    wall_s: float

    @property
    def steps(self) -> int:
        return int(self.overrides.get("run.steps", 6))

    def where(self) -> str:
        return f"(run {self.name} in {self.dir})"


class Runs:
    """Runs shared by the tests of a module (a module-scoped fixture holds one): each named run
    (`recipes`: name -> write_recipe overrides) is made on first use; a failed run fails every
    test that needs it with the same message."""

    def __init__(self, root: Path, model: Path, train: Path, recipes: Mapping[str, dict[str, Any]]) -> None:
        self.root, self.model, self.train, self.recipes = root, model, train, recipes
        self._done: dict[str, Run | str] = {}

    def get(self, name: str) -> Run:
        if name not in self._done:
            ov = self.recipes[name]
            d = self.root / name
            d.mkdir(parents=True, exist_ok=True)
            recipe = write_recipe(d, self.model, self.train, ov)
            try:
                res = run_recipe(recipe, d / "run")
            except pytest.fail.Exception as e:
                self._done[name] = f"run {name} failed: {e}"
            else:
                self._done[name] = Run(name, d / "run", recipe, ov, res.wall_s)  # type: ignore[attr-defined]
                print(f"\n[e2e] run {name}: {res.wall_s:.0f}s")  # type: ignore[attr-defined]
        got = self._done[name]
        if isinstance(got, str):
            pytest.fail(got, pytrace=False)
        return got


# ---------------------------------------------------------------- reading a run directory


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def read_events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    evs = read_jsonl(run_dir / "events.jsonl")
    return [e for e in evs if kind is None or e.get("type") == kind]


def run_log(run_dir: Path) -> str:
    p = run_dir / "run.log"
    return p.read_text(errors="replace") if p.exists() else ""


def open_pool(run_dir: Path) -> Any:
    """The run's pool: its pool/ directory, or the pool.uri its recorded recipe names (S3)."""
    from streamrl.pools import open_pool as open_run_pool

    return open_run_pool(str(run_dir))


def pool_rows(run_dir: Path, columns: list[str] | None = None, where: str | None = None,
              table: str = "pool") -> list[dict[str, Any]]:
    pool = open_pool(run_dir)
    try:
        return pool.scan(columns, where=where, table=table).to_pylist()
    finally:
        pool.close()


def pool_groups(run_dir: Path, where: str | None = None) -> list[Any]:
    """SampleGroups (streamrl.pools.schema.table_to_groups) of the rows matching `where`."""
    from streamrl.pools.schema import table_to_groups

    pool = open_pool(run_dir)
    try:
        return table_to_groups(pool.scan(where=where))
    finally:
        pool.close()


def group_rows(run_dir: Path) -> dict[str, dict[str, Any]]:
    """group_id -> its (group-level) columns, from the first row of each group."""
    out: dict[str, dict[str, Any]] = {}
    for r in pool_rows(run_dir, ["group_id", "status", "min_version", "max_version", "consumed_step",
                                 "consumed_version", "drop_reason"]):
        out.setdefault(r["group_id"], r)
    return out


def pool_stats(run_dir: Path) -> dict[str, Any]:
    """`streamrl pool stats RUN_DIR --json` (exit code 0 = ledger balanced, 3 = not), run by the CLI's
    `main` in this process: a process of its own per check cost CI 3-5 s of CPU each, ~35 times."""
    from streamrl.tools.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["pool", "stats", str(run_dir), "--json"])
    assert code in (0, 3), f"pool stats failed ({code}):\n{tail(err.getvalue())}"
    stats = json.loads(out.getvalue())
    stats["_exit_code"] = code
    return stats


def assert_ledger_balanced(run_dir: Path) -> dict[str, Any]:
    stats = pool_stats(run_dir)
    led = stats["ledger"]
    assert led["lost"] == 0 and led["duplicated"] == 0 and led["unadmitted"] == 0, led
    assert led["balanced"] is True and stats["_exit_code"] == 0, led
    return stats


def consumed_staleness(run_dir: Path) -> dict[str, int]:
    """group_id -> consumed_version - min_version for every consumed group."""
    return {g: r["consumed_version"] - r["min_version"] for g, r in group_rows(run_dir).items()
            if r["status"] == "consumed" and r["min_version"] is not None}


def admission_excess(run_dir: Path, eta: int, groups_per_step: int) -> list[str]:
    """Violations of the admission invariant, read from the pool only: for every version v,
    groups admitted at versions <= v, minus those that ended dropped by a filter (any reason
    but `stale`) or failed, must be <= (v + eta + 1) * groups_per_step."""
    adm = pool_rows(run_dir, ["group_id", "version"], table="admissions")
    released = {g for g, r in group_rows(run_dir).items()
                if r["status"] == "failed" or (r["status"] == "dropped" and r["drop_reason"] != "stale")}
    versions = [a["version"] for a in adm]
    problems = []
    for v in range(0, max(versions, default=0) + 1):
        count = sum(1 for a in adm if a["version"] <= v and a["group_id"] not in released)
        cap = (v + eta + 1) * groups_per_step
        if count > cap:
            problems.append(f"version {v}: {count} groups admitted at versions <= {v} (not released) > capacity {cap}")
    return problems


def check_step_metrics(metrics: list[dict[str, Any]], steps: int) -> None:
    assert [m["step"] for m in metrics] == list(range(steps)), [m.get("step") for m in metrics]
    for m in metrics:
        missing = [k for k in STEP_KEYS if k not in m]
        assert not missing, f"step {m.get('step')}: metrics.jsonl lacks {missing}"
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))


# ---------------------------------------------------------------- weights and log-probs


def weights_dir(run_dir: Path, model_dir: Path, version: int) -> Path:
    """The HF weights of `version` as pushed to the engines (disk sync with keep_weights=0)."""
    d = run_dir / "weights" / f"v{version:06d}"
    if (d / "config.json").exists():
        return d
    if version == 0:
        return model_dir
    raise FileNotFoundError(f"no weights for version {version} under {run_dir / 'weights'}")


class LogprobOracle:
    """Token log-probs recomputed with transformers (float32) from each version's weights."""

    def __init__(self, run_dir: Path, model_dir: Path, temperature: float) -> None:
        self.run_dir, self.model_dir, self.temperature = run_dir, model_dir, temperature
        self._models: dict[int, Any] = {}

    def model(self, version: int) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        if version not in self._models:
            path = weights_dir(self.run_dir, self.model_dir, version)
            self._models[version] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[version]

    def logprobs(self, version: int, prompt: Sequence[int], response: Sequence[int]) -> np.ndarray:
        """log_softmax(logits / T) of each response token given prompt + the tokens before it."""
        import torch

        ids = torch.tensor([list(map(int, prompt)) + list(map(int, response))])
        with torch.no_grad():
            logits = self.model(version)(input_ids=ids).logits[0].float()
        p = len(prompt)
        lp = torch.log_softmax(logits[p - 1: p - 1 + len(response)] / self.temperature, -1)
        return lp.gather(1, torch.tensor(list(map(int, response)))[:, None])[:, 0].numpy()

    def in_place_logprobs(self, prompt: Sequence[int], response: Sequence[int],
                          spans: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """What an engine that updates weights in place (keeping its KV cache) computes: the
        prompt and the first span run under the first span's version; the tokens of span k are
        then decoded by version v_k on top of the KV cache built so far (by older versions).
        The KV entry of response token i-1 is computed in the step that samples token i, so
        span k (tokens [a, b)) feeds tokens [a-1, b-1) through version v_k."""
        import torch
        from transformers import DynamicCache

        prompt, response = list(map(int, prompt)), list(map(int, response))
        cache = DynamicCache()
        out = []
        for k, (v, a, b) in enumerate(spans):
            feed = prompt + response[: b - 1] if k == 0 else response[a - 1: b - 1]
            with torch.no_grad():
                logits = self.model(v)(input_ids=torch.tensor([feed]), past_key_values=cache,
                                       use_cache=True).logits[0].float()
            lp = torch.log_softmax(logits[len(logits) - (b - a):] / self.temperature, -1)
            out.append(lp.gather(1, torch.tensor(response[a:b])[:, None])[:, 0].numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)


# ---------------------------------------------------------------- processes


def engine_pids(model_dir: Path) -> list[int]:
    """Embedded-engine processes serving `model_dir`: their command line (connectors/sglang/launcher.py
    engine_command) holds the model directory and `serve_embedded` (what the shim calls)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(model_dir) in cmd and "serve_embedded" in cmd:
            pids.append(int(d.name))
    return sorted(pids)


def wait_for(cond: Any, timeout_s: float, what: str, poll_s: float = 0.1,
             alive: subprocess.Popen[Any] | None = None) -> Any:
    """Poll `cond()` until truthy; fails with `what` on timeout (or when `alive` exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the run exited ({alive.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def wait_stable(value: Any, stable_s: float, timeout_s: float, what: str,
                alive: subprocess.Popen[Any] | None = None) -> Any:
    """Poll `value()` until it has not changed for `stable_s` seconds; returns it."""
    deadline = time.monotonic() + timeout_s
    last, since = value(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the run exited ({alive.returncode}) while waiting for {what}")
        v = value()
        if v != last:
            last, since = v, time.monotonic()
        elif time.monotonic() - since >= stable_s:
            return v
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} to settle (last {last!r})")


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def engine_port(pid: int) -> int | None:
    """The port in an embedded engine's command line (its JSON argument)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for part in cmd:
        if part.startswith(b"{"):
            return int(json.loads(part)["port"])
    return None


def http_json(url: str, timeout_s: float = 2, run_dir: Path | None = None) -> Any:
    """GET url -> decoded JSON, or None when it cannot be reached. With `run_dir`, as a client of
    that run's engines (its API key from RUN_DIR/endpoints.json)."""
    import urllib.request

    headers = {}
    if run_dir is not None:
        headers["Authorization"] = "Bearer " + json.loads((run_dir / "endpoints.json").read_text())["api_key"]
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
            return json.loads(r.read() or b"null")
    except (OSError, ValueError):
        return None


def restarted_engine_port(run_dir: Path, start: int = 2) -> int | None:
    """The port of the engine the launcher (re)started as `start #N` (logs/engine-<i>.log header)."""
    import re

    for log in sorted((run_dir / "logs").glob("engine-*.log")):
        m = re.findall(rf"start #{start} backend=\w+ port=(\d+)".encode(), log.read_bytes())
        if m:
            return int(m[-1])
    return None


def spans_of(sample: Any) -> list[tuple[int, int, int]]:
    return [(int(s.version), int(s.start), int(s.end)) for s in sample.spans]


def resumed_samples(groups: Iterable[Any]) -> list[tuple[Any, Any]]:
    """(group, sample) for every sample whose tokens span several policy versions."""
    return [(g, s) for g in groups for s in g.samples if len({sp.version for sp in s.spans}) > 1]


# ---------------------------------------------------------------- somebody's Ray cluster

RAY = str(Path(sys.executable).with_name("ray"))
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # where `ray start` records its cluster for ray.init()


@contextlib.contextmanager
def ray_head(log: Path, num_cpus: int, resources: str = "{}") -> Iterator[str]:
    """A Ray cluster as a user starts one (`ray start --head --block`, no auth), its address;
    killed on exit, and /tmp/ray/ray_current_cluster (which `ray start` overwrites) put back."""
    before = RAY_ADDRESS_FILE.read_text() if RAY_ADDRESS_FILE.exists() else None
    try:
        with _ray_start(["--head", "--port=0", f"--num-cpus={num_cpus}", f"--resources={resources}",
                         "--include-dashboard=false", "--disable-usage-stats"], log,
                        r"ray start --address='([^']+)'") as address:
            yield address
    finally:
        if before is None:
            RAY_ADDRESS_FILE.unlink(missing_ok=True)
        else:
            RAY_ADDRESS_FILE.write_text(before)


@contextlib.contextmanager
def ray_node(address: str, log: Path, num_cpus: int, resources: str = "{}", kill: bool = False,
             node_ip: str | None = None) -> Iterator[None]:
    """A second node of that cluster on this machine (`ray start --address`), stopped on exit;
    `kill`: SIGKILLed at once, its raylet and every process on it (a node lost, not stopped);
    `node_ip`: the address it registers (another loopback address, e.g. 127.0.0.2: a second host to Ray)."""
    with _ray_start([f"--address={address}", f"--num-cpus={num_cpus}", f"--resources={resources}",
                     "--disable-usage-stats", *([f"--node-ip-address={node_ip}"] if node_ip else [])],
                    log, r"(Ray runtime started)", kill):
        yield


@contextlib.contextmanager
def _ray_start(args: list[str], log: Path, ready: str, kill: bool = False) -> Iterator[str]:
    """`ray start ARGS --block` in a session of its own, until `ready` (a regex) shows in its
    output; yields the regex's group; SIGTERM then SIGKILL (`kill`: SIGKILL only) to the whole
    session on exit."""
    import re

    with open(log, "wb") as out:
        proc = subprocess.Popen([RAY, "start", *args, "--block"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline, found = time.monotonic() + 120, None
        while found is None:
            m = re.search(ready, log.read_text(errors="replace"))
            found = m.group(1) if m else None
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield found
    finally:
        for sig in (signal.SIGKILL,) if kill else (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def short_quickstart(root: Path) -> list[str]:
    """Overrides that make recipes/quickstart.yaml a 4-step run, on a model and task built in
    `root` (build them once per module: two runs at once must not both generate them)."""
    from streamrl.connectors.megatron.model_kit import init_model_dir

    from streamrl.plugins.tasks import write_task

    init_model_dir(root / "model", "tiny", 0)
    data = write_task(root / "data", seed=0, n_train=300, n_eval=8, n_sft=200)
    return [f"model.path={root / 'model'}", f"data.path={data['train']}", f"data.eval_path={data['eval']}",
            f"sft.path={data['sft']}", "sft.steps=10", "sft.batch_size=16", "run.steps=4", "run.checkpoint_every=2",
            "run.eval_every=0", "data.eval_size=4", "data.eval_samples=1", "rollout.groups_per_step=4",
            "engines.num=1"]
