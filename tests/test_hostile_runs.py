"""Hostile but realistic input at the edges of a run (issue 38): stand-alone engines and recipe
hosts, resume and replay of a run directory from elsewhere, a step waiting on producers that never
come, a tampered checkpoint on resume. In-process where it can be (one engine subprocess, for
SIGTERM)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray.exceptions

from streamrl.connectors.megatron.checkpoint import CheckpointError
from streamrl.connectors.sglang import engine_server
from streamrl.recipe import RecipeError, dump_recipe, load_recipe, parse_recipe
from streamrl.runtime import RunFailed, resume as resume_module
from streamrl.runtime import run as run_module
from streamrl.runtime import steps as steps_module
from streamrl.runtime.user_code import record_modules
from streamrl.tools import cli
from streamrl.tools.cli import main


# ---------------------------------------------------------------- engines and recipe hosts


def test_engine_serve_refuses_every_interface_and_a_keyless_public_host(
        model_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Today --host 0.0.0.0 served with no key and loaded weights from any path."""
    served: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_server, "serve", lambda model_dir, **kw: served.append({"model": model_dir, **kw}))
    monkeypatch.delenv("STREAMRL_API_KEY", raising=False)
    monkeypatch.delenv("STREAMRL_ADMIN_KEY", raising=False)
    model = model_dirs[0]
    assert main(["engine", "serve", "--model", model, "--host", "0.0.0.0"]) == 2
    assert "every interface" in capsys.readouterr().err
    assert main(["engine", "serve", "--model", model, "--host", "10.11.12.13"]) == 2
    assert "STREAMRL_API_KEY and STREAMRL_ADMIN_KEY" in capsys.readouterr().err and not served
    monkeypatch.setenv("STREAMRL_API_KEY", "a" * 32)
    monkeypatch.setenv("STREAMRL_ADMIN_KEY", "b" * 32)
    assert main(["engine", "serve", "--model", model, "--host", "10.11.12.13"]) == 0
    assert main(["engine", "serve", "--model", model]) == 0
    assert [s["weights_root"] for s in served] == [model, model]  # weights load only from the model's directory


@pytest.mark.parametrize("key", ["engines.host", "producer_api.host"])
def test_recipes_refuse_every_interface(key: str) -> None:
    """Today engines.host: 0.0.0.0 was refused only together with network.bind: node."""
    with pytest.raises(RecipeError, match=rf"{key}: is '0.0.0.0', every interface"):
        parse_recipe("model:\n  path: m\ndata:\n  path: d\n", "r.yaml", [f"{key}=0.0.0.0"])
    parse_recipe("model:\n  path: m\ndata:\n  path: d\n", "r.yaml", [f"{key}=10.1.2.3"])


def test_engine_exits_promptly_on_sigterm_with_a_request_stuck_in_a_thread(model_dirs: tuple[str, str]) -> None:
    """Today an engine whose weight-group join waited on a master that never answers ignored
    SIGTERM for its whole store timeout (40 s and more)."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "engine", "serve", "--model", model_dirs[0],
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().split()[-1]  # type: ignore[union-attr]
        body = json.dumps({"master_address": "127.0.0.1", "master_port": silent.getsockname()[1], "rank_offset": 1,
                           "world_size": 2, "group_name": "g", "backend": "gloo"}).encode()
        client = subprocess.Popen([sys.executable, "-c", "import sys, urllib.request as u; u.urlopen(u.Request("
                                   "sys.argv[1], data=sys.argv[2].encode(), headers={'Content-Type': "
                                   "'application/json'}), timeout=60)", url + "/init_weights_update_group",
                                   body.decode()], stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=engine_server.EXIT_GRACE_S + 5)
        assert time.monotonic() - t0 < engine_server.EXIT_GRACE_S + 2
        client.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        silent.close()


# ---------------------------------------------------------------- resume from a run directory


@pytest.fixture
def stopped_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """(run dir, the reward module's file, its name): a run whose recipe names a reward kept next
    to the recipe, as `streamrl run` leaves it (recipe.yaml, user_modules.json); _run is stubbed."""
    project, d = tmp_path / "project", tmp_path / "run"
    project.mkdir(), d.mkdir()
    name = f"rw_{uuid.uuid4().hex[:8]}"  # a fresh module per test: sys.modules outlives the test
    (project / f"{name}.py").write_text("def score(prompt, response, label):\n    return 1.0\n")
    (project / "recipe.yaml").write_text(f"model:\n  path: m\ndata:\n  path: d\nreward:\n  fn: {name}:score\n")
    r = load_recipe(project / "recipe.yaml")
    (d / "recipe.yaml").write_text(dump_recipe(r))
    record_modules(r, d)
    monkeypatch.setattr(run_module, "_run", lambda r, d, progress, resume: {"resumed": True})
    monkeypatch.setattr(cli, "_print_summary", lambda summary: None)
    return d, project / f"{name}.py", name


def _plant(d: Path, marker: Path) -> str:
    """A module in the run directory that leaves `marker` when imported, named by its recipe."""
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    (d / f"{evil}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef score(*a):\n    return 1.0\n")
    text = (d / "recipe.yaml").read_text()
    (d / "recipe.yaml").write_text(text.replace(text[text.index("fn: rw_"):].split("\n")[0], f"fn: {evil}:score"))
    return evil


def test_resume_runs_no_module_the_run_directory_planted(stopped_run: tuple[Path, Path, str], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Today a run directory holding evil_mod.py with reward.fn: evil_mod:score ran it on --resume."""
    d, _, _ = stopped_run
    marker = tmp_path / "ran"
    evil = _plant(d, marker)
    monkeypatch.chdir(d)  # even from inside the run directory
    assert main(["run", "--resume", str(d), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and evil in err and "--trust-run-dir" in err, err
    assert not marker.exists()
    assert main(["replay", str(d), "--steps", "0"]) == 2 and evil in capsys.readouterr().err
    assert not marker.exists()
    # The record is in the run directory too: a forged one naming the planted module is no better.
    planted = d / f"{evil}.py"
    (d / "user_modules.json").write_text(json.dumps([{
        "module": evil, "path": str(planted.resolve()), "search_path": str(d.resolve()),
        "sha256": hashlib.sha256(planted.read_bytes()).hexdigest()}]))
    assert main(["run", "--resume", str(d), "--quiet"]) == 2 and not marker.exists()
    assert evil in capsys.readouterr().err
    assert main(["run", "--resume", str(d), "--trust-run-dir", "--quiet"]) == 0 and marker.exists()


def test_resume_refuses_a_changed_module_and_shows_an_unchanged_one(stopped_run: tuple[Path, Path, str],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    d, module, name = stopped_run
    assert run_module.resume(d) == {"resumed": True}
    assert f"user code: {name} from {module}" in capsys.readouterr().err
    module.write_text(module.read_text() + "x = 1\n")
    with pytest.raises(run_module.RunFailed, match=rf"{name} \(reward.fn\): {module} changed since the run"):
        run_module.resume(d)


# ---------------------------------------------------------------- a run that waits


class _Done(Exception):
    pass


class _Polls:
    """A learner whose claim finds no batch `n` times, then stops the test."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.train_step = SimpleNamespace(remote=self._claim)
        self.stale_dropped = SimpleNamespace(remote=self._zero)

    async def _claim(self, *_: Any) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Done

    async def _zero(self) -> int:
        return 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_waiting_for_producers_says_so_in_the_run_log(workers: int, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Today a run with rollout workers and a producer API share that no producer fills wrote
    nothing to run.log while it waited."""
    r = parse_recipe(f"model:\n  path: m\ndata:\n  path: d\nrollout: {{workers: {workers}}}\n"
                     "producer_api: {enabled: true}\n")
    lines: list[str] = []
    rt = steps_module.Steps.__new__(steps_module.Steps)
    rt.r, rt.per_step, rt.max_staleness, rt.learner = r, 4, 1, _Polls(3)
    rt.svc, rt.log = SimpleNamespace(dir=tmp_path), SimpleNamespace(info=lines.append, warn=lines.append)

    async def nothing(*_: Any) -> Any:
        return False

    rt.crew = SimpleNamespace(check_streams=nothing, hand_over_lost=nothing)
    monkeypatch.setattr(rt, "_grow_budget_if_starved", nothing, raising=False)
    monkeypatch.setattr(rt, "_count_stale_drops", nothing, raising=False)
    monkeypatch.setattr(steps_module, "STALL_LOG_S", 0.0)
    with pytest.raises(_Done):
        asyncio.run(rt.train_step(7, ["stream"] * workers or None))
    assert len(lines) == 3, lines
    assert lines[0].startswith("step 7: waiting") and "batch of 4 groups" in lines[0]
    assert "external producers" in lines[0] and str(tmp_path / "producer.json") in lines[0]
    assert ("rollout workers" in lines[0]) == bool(workers)


def test_a_tampered_checkpoint_on_resume_is_one_line(tmp_path: Path) -> None:
    """Today the learner's refusal reached the user as an 85-line Ray traceback with exit 1."""
    why = f"checkpoint {tmp_path}/step_00000003: file model.pt is damaged: sha256 mismatch"

    async def refuse(root: str) -> None:
        raise ray.exceptions.RayTaskError("restore", f"Traceback ...\nCheckpointError: {why}",
                                          CheckpointError(why)).as_instanceof_cause()

    learner = SimpleNamespace(restore=SimpleNamespace(remote=refuse))
    with pytest.raises(RunFailed) as ei:
        asyncio.run(resume_module.restore(learner, tmp_path, None, 1))
    assert str(ei.value).startswith(f"cannot resume {tmp_path}: {why}.") and "\n" not in str(ei.value)
