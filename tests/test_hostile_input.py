"""Hostile but realistic input from agents, producers and pool queries (issue 38): the OpenAI
proxy's message shapes and max_tokens, the pool's SQL, the producer API's metadata and fields.
In-process and fast: a fake engine stands in where only the proxy's own checks are under test.
Run directories, engines and recipe hosts: tests/test_hostile_runs.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from streamrl.connectors.sglang.client import EngineError
from streamrl.core.types import VersionSpan, to_json
from streamrl.pools import LancePool
from streamrl.producers.api_process import open_service
from streamrl.producers.episode import Episode
from streamrl.producers.openai_proxy import OpenAIProxy
from streamrl.tools.cli import main

from poolkit import make_group


@pytest.fixture(scope="module")
def tok(model_dirs: tuple[str, str]) -> Any:
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
    assert s_deep == 400 and "recursion depth" in deep_why
    assert s_nest == 422 and "group.metadata nests more than 16 levels" in nest_why
    assert s_big == 422 and "group.metadata is 100011 bytes" in big_why
    assert s_g == 422 and "lossmask" in g_why
    assert s_s == 422 and "los_mask" in s_why
