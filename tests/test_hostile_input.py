"""Hostile but realistic input at every edge (issue 38): the OpenAI proxy's message shapes and
max_tokens, the pool's SQL, stand-alone engines and recipe hosts, resume from a run directory
from elsewhere, and the producer API's metadata. In-process and fast: a fake engine stands in
where only the proxy's own checks are under test."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from streamrl.core.types import VersionSpan
from streamrl.pools import LancePool
from streamrl.producers.episode import Episode
from streamrl.producers.openai_proxy import OpenAIProxy
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
        if n < 1:  # what the router answers to a bad budget: a 4xx naming its own address
            raise aiohttp.ClientResponseError(None, (), status=400,  # type: ignore[arg-type]
                                              message="bad max_new_tokens, url=http://127.0.0.1:31000/generate")
        return SimpleNamespace(output_ids=[self.token] * n, logprobs=[-0.5] * n, finish_type="length",
                               version_spans=lambda: [VersionSpan(0, 0, n)])


async def _ask(tok: Any, bodies: list[dict[str, Any]], max_new_tokens: int = 8,
               max_context: int = 256) -> tuple[list[tuple[int, dict[str, Any]]], Episode, FakeEngine]:
    """Send `bodies` in order as turns of one episode; (status, JSON) of each."""
    engine = FakeEngine(tok("a", add_special_tokens=False)["input_ids"][0])
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
