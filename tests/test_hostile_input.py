"""Hostile but realistic input at every edge (issue 38): the OpenAI proxy's message shapes and
max_tokens, the pool's SQL, stand-alone engines and recipe hosts, resume from a run directory
from elsewhere, and the producer API's metadata. In-process and fast: a fake engine stands in
where only the proxy's own checks are under test."""

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

import aiohttp
import pytest
import ray.exceptions
import yaml
from aiohttp.test_utils import TestClient, TestServer

from streamrl.core.types import VersionSpan, to_json
from streamrl.connectors.megatron.checkpoint import CheckpointError
from streamrl.connectors.sglang import engine_server
from streamrl.connectors.sglang.client import EngineError
from streamrl.pools import LancePool
from streamrl.producers.api_process import open_service
from streamrl.producers.episode import Episode
from streamrl.producers.openai_proxy import OpenAIProxy
from streamrl.recipe import RecipeError, dump_recipe, load_recipe, parse_recipe
from streamrl.runtime import RunFailed, resume as resume_module
from streamrl.runtime import run as run_module
from streamrl.runtime import steps as steps_module
from streamrl.runtime.user_code import record_modules
from streamrl.tools import cli
from streamrl.tools.cli import main

from poolkit import make_group


@pytest.fixture(scope="module")
def tok(model_dirs: tuple[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs[0])


class FakeEngine:
    """Generates as many copies of one token as it is asked for, and remembers how many."""

    def __init__(self, token: int) -> None:
        self.token, self.asked = token, []

    async def generate(self, ids: list[int], sp: Any) -> Any:
        n = sp.max_new_tokens
        self.asked.append(n)
        if n < 1:  # what the client raises for the router's 4xx: it names the router's address
            raise EngineError("http://127.0.0.1:31000/generate", 400, "max_new_tokens must be positive")
        return SimpleNamespace(output_ids=[self.token] * n, logprobs=[-0.5] * n, finish_type="length",
                               version_spans=lambda: [VersionSpan(0, 0, n)])


class ScriptEngine(FakeEngine):
    """Writes `text` (as far as it is asked to)."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(0)
        self.ids = ids

    async def generate(self, ids: list[int], sp: Any) -> Any:
        out = self.ids[:sp.max_new_tokens]
        return SimpleNamespace(output_ids=out, logprobs=[-0.5] * len(out), finish_type="stop",
                               version_spans=lambda: [VersionSpan(0, 0, len(out))])


async def _ask(tok: Any, bodies: list[dict[str, Any]], max_new_tokens: int = 8, max_context: int = 256,
               engine: Any = None) -> tuple[list[tuple[int, dict[str, Any]]], Episode, FakeEngine]:
    """Send `bodies` in order as turns of one episode; (status, JSON) of each."""
    engine = engine or FakeEngine(tok("a", add_special_tokens=False)["input_ids"][0])
    ep = Episode(engine, tok, sampling={"temperature": 1.0}, max_new_tokens=max_new_tokens, max_context=max_context)
    proxy = OpenAIProxy()
    await proxy.start()
    key = proxy.open(ep)
    out = []
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
            for body in bodies:
                async with s.post(proxy.url + "/chat/completions", json={"model": "x", **body}) as r:
                    out.append((r.status, await r.json()))
    finally:
        await proxy.close()
    return out, ep, engine


USER = {"role": "user", "content": "12+3="}


@pytest.mark.parametrize("messages, path", [
    ([], "messages"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}],
     "messages[1].tool_calls[0]"),
])
def test_malformed_messages_are_a_400_naming_the_field_and_train_nothing(tok: Any, messages: list[Any],
                                                                         path: str) -> None:
    (status, body), = asyncio.run(_ask(tok, [{"messages": messages}]))[0]
    assert status == 400, body
    assert body["error"]["message"].startswith(path + (" " if "[" in path or path == "messages" else ".")), body


def test_a_malformed_message_in_a_later_turn_leaves_the_episode_going(tok: Any) -> None:
    """Today a user message without content was trained on as empty and `content: 5` was taken,
    then the next turn failed with a 500; a tool message without tool_call_id was accepted."""
    (status, first), = asyncio.run(_ask(tok, [{"messages": [USER]}]))[0]
    assert status == 200
    reply = first["choices"][0]["message"]
    results, ep, _ = asyncio.run(_ask(tok, [
        {"messages": [USER]},
        {"messages": [USER, reply, {"role": "user"}]},
        {"messages": [USER, reply, {"role": "user", "content": 5}]},
        {"messages": [USER, reply, {"role": "tool", "content": "15"}]},
        {"messages": [USER, reply, {"role": "user", "content": "and 4?"}]},
    ]))
    assert [s for s, _ in results] == [200, 400, 400, 400, 200], results
    assert "messages[2].content" in results[1][1]["error"]["message"]
    assert "messages[2].tool_call_id" in results[3][1]["error"]["message"]
    assert len(ep.replies) == 2  # the refused turns added nothing


def test_max_tokens_is_capped_by_the_recipe_and_must_be_positive(tok: Any) -> None:
    """Today max_tokens 1000 generated to the end of the context, 0 became the default and -1
    returned the engine's error with the router's URL."""
    results, ep, engine = asyncio.run(_ask(tok, [
        {"messages": [USER], "max_tokens": 1000},
        {"messages": [USER], "max_tokens": 0},
        {"messages": [USER], "max_completion_tokens": -1},
    ], max_new_tokens=8))
    assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 8 and engine.asked == [8]
    assert [s for s, _ in results[1:]] == [400, 400]
    assert "max_tokens is 0" in results[1][1]["error"]["message"]
    assert "max_completion_tokens is -1" in results[2][1]["error"]["message"]
    assert all("http" not in r[1]["error"]["message"] for r in results[1:])


class BrokenEngine(FakeEngine):
    async def generate(self, ids: list[int], sp: Any) -> Any:
        raise EngineError("http://127.0.0.1:31000/generate", 400, "bad sampling parameter")  # as the client does


def test_engine_errors_reach_the_agent_without_internal_addresses(tok: Any) -> None:
    ((status, body),), _, _ = asyncio.run(_ask(tok, [{"messages": [USER]}], engine=BrokenEngine(0)))
    assert status == 400 and "generation failed" in body["error"]["message"], body
    assert "127.0.0.1" not in body["error"]["message"] and "<engine>" in body["error"]["message"]


def test_a_tool_call_cut_by_a_stop_string_says_so(tok: Any) -> None:
    """Today the reason given was "cut by max_tokens?"."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}} END more'
    engine = ScriptEngine(tok(text, add_special_tokens=False)["input_ids"])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ((status, body),), _, _ = asyncio.run(_ask(tok, [{"messages": [USER], "tools": tools, "stop": ["END"]}],
                                               max_new_tokens=64, engine=engine))
    assert status == 200, body
    assert body["choices"][0]["streamrl"]["tool_call_error"] == \
        "tool call 0 has no </tool_call> (the reply ended at a stop string)"


# ---------------------------------------------------------------- pool SQL


@pytest.fixture
def small_run(run_dir: Path) -> Path:
    with LancePool(run_dir / "pool") as pool:
        groups = [make_group(f"g{i}", n=2) for i in range(2)]
        pool.append(groups, admit=True)
    return run_dir


@pytest.mark.parametrize("sql", [
    "COPY (SELECT 42) TO '{out}'",
    "SELECT * FROM read_csv('/etc/hostname')",
    "SELECT * FROM glob('/etc/*')",
    "ATTACH '{out}.db'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SELECT 1; COPY (SELECT 42) TO '{out}'",
    "",
])
def test_pool_query_is_one_read_only_select(small_run: Path, tmp_path: Path, sql: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Today COPY wrote the file, ATTACH and read_csv worked, and an empty query was a traceback."""
    out = tmp_path / "x.csv"
    assert main(["pool", "query", str(small_run), sql.format(out=out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("streamrl: error:") and len(err.splitlines()) == 1, err
    assert not out.exists() and not Path(f"{out}.db").exists()


def test_pool_export_where_is_one_expression(small_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Today the first half of "reward > 0; DROP TABLE pool" ran and the export succeeded."""
    out = tmp_path / "out.parquet"
    assert main(["pool", "export", str(small_run), str(out), "--quiet", "--where",
                 "sample_index >= 0; DROP TABLE pool"]) == 2
    assert "2 SQL statements" in capsys.readouterr().err and not out.exists()
    assert main(["pool", "query", str(small_run), "SELECT count(*) AS n FROM pool WHERE sample_index >= 0",
                 "--json"]) == 0
    assert '"n": 4' in capsys.readouterr().out  # still answers ordinary queries


# ---------------------------------------------------------------- engines and recipe hosts


def test_engine_serve_refuses_every_interface_and_a_keyless_public_host(
        model_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Today --host 0.0.0.0 served with no key and loaded weights from any path."""
    served: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_server, "serve", lambda model, **kw: served.append({"model": model, **kw}))
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


# ---------------------------------------------------------------- producer API


@pytest.fixture
def producer_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run directory the producer API can serve (paths relative to tmp_path, the working directory)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 50_000, "max_position_embeddings": 256}))
    (tmp_path / "run").mkdir()
    recipe = {"run": {"name": "ext", "dir": "run", "mode": "stream"}, "model": {"path": "model"},
              "data": {"path": "train.jsonl"}, "rollout": {"workers": 0, "n_samples": 2, "groups_per_step": 2},
              "producer_api": {"enabled": True}}
    (tmp_path / "run" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run"


def test_produce_serve_imports_no_user_code(producer_run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    (producer_run / f"{evil}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef score(*a):\n    return 1\n")
    recipe = yaml.safe_load((producer_run / "recipe.yaml").read_text())
    (producer_run / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "reward": {"fn": f"{evil}:score"}}))
    open_service(producer_run, quiet=True).pool.close()
    assert not marker.exists()


def test_producer_metadata_is_bounded_and_unknown_group_fields_are_refused(producer_run: Path) -> None:
    """Today a submission nested 100,000 levels deep was a 500 and unknown fields inside a group
    (a misspelt `loss_mask`) were stored silently."""
    good = json.loads(to_json(make_group("env:e0:p0", n=2)))

    def body(**change: Any) -> bytes:
        g = json.loads(json.dumps(good))
        for path, value in change.items():
            node, *keys = path.split("__")
            target = g if node == "group" else g["samples"][0]
            for k in keys[:-1]:
                target = target[k]
            target[keys[-1]] = value
        return json.dumps({"lease_id": "none", "group": g}).encode()

    deep = b'{"lease_id": "x", "group": {"metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}"

    async def go() -> list[tuple[int, str]]:
        svc = open_service(producer_run, quiet=True)
        token = (producer_run / "producer_token").read_text().strip()
        out = []
        async with TestClient(TestServer(svc.app())) as c:
            for b in (deep, body(group__metadata={"a": json.loads("[" * 40 + "]" * 40)}),
                      body(group__metadata={"blob": "x" * 100_000}), body(group__lossmask=[1]),
                      body(sample__los_mask=[1, 1])):
                r = await c.post("/v1/groups", data=b, headers={"Authorization": f"Bearer {token}",
                                                                 "Content-Type": "application/json"})
                out.append((r.status, (await r.json())["error"]["reason"]))
        svc.pool.close()
        return out

    (s_deep, deep_why), (s_nest, nest_why), (s_big, big_why), (s_g, g_why), (s_s, s_why) = asyncio.run(go())
    assert s_deep == 400 and "nests too deeply" in deep_why
    assert s_nest == 422 and "group.metadata nests more than 16 levels" in nest_why
    assert s_big == 422 and "group.metadata is 100011 bytes" in big_why
    assert s_g == 422 and "lossmask" in g_why
    assert s_s == 422 and "los_mask" in s_why


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
