"""The in_place cache rule (streamrl/core/prefix_cache.py): no generation keeps a prompt prefix
that older weights cached. The pure rule, then SGLangClient against a server over real HTTP that
answers as SGLang would when a request hit such a prefix: the client sends it again under a fresh
cache key and returns only clean answers. The embedded engine's side (it caches no prefix across
requests) is in tests/test_engine.py::test_request_queued_in_an_in_place_pause_runs_on_new_weights."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.connectors.sglang.client import EngineError, SGLangClient
from streamrl.core.prefix_cache import cache_key, newest, reused_older_prefix
from streamrl.core.types import VersionSpan as S


@pytest.mark.parametrize("key,spans,cached,stale", [
    (3, [S(3, 0, 5)], 7, False),            # keyed and run under 3: its cache entries were made under 3
    (3, [S(4, 0, 5)], 7, True),             # keyed 3, run under 4, hit the cache: made under 3 or earlier
    (3, [S(4, 0, 5)], 0, False),            # nothing came from the cache
    (3, [S(3, 0, 2), S(4, 2, 5)], 7, False),  # an in_place request: its prefix was computed under 3, as tagged
    (3, [], 7, False),                       # no output (max_new_tokens 0 or an abort before any token)
])
def test_rule(key, spans, cached, stale):
    assert reused_older_prefix(key, spans, cached) is stale


def test_keys_and_newest():
    assert cache_key(0) == "v0" and cache_key(12) == "v12" and cache_key(3) != cache_key(4)
    assert newest([S(2, 0, 1), S(5, 1, 3)], 4) == 5 and newest([], 4) == 4 and newest([S(1, 0, 2)], 4) == 4


def _answer(i: int, version: int, cached: int) -> dict:
    return {"text": "", "output_ids": [1, 2], "meta_info": {
        "id": f"r{i}", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 8, "completion_tokens": 2,
        "cached_tokens": cached, "weight_version": str(version),
        "weight_versions": [{"version": str(version), "start": 0, "end": 2}],
        "output_token_logprobs": [[-0.5, 1, None], [-0.25, 2, None]]}}


async def _serve(answers):
    """A /generate server that records each body and answers with `answers(body)`."""
    seen: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response(answers(body))

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = listen_socket()
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{port_of(sock)}", seen


def test_client_sends_a_stale_hit_again_under_a_fresh_key():
    """The engine moved to version 1 while the client still keyed v0: a batch whose second request
    hit the cache comes back with that one request sent again, alone, under a key nobody used."""
    def answers(body):
        if isinstance(body["input_ids"][0], list):
            return [_answer(i, 1, cached=8 if i == 1 and body["extra_key"] == "v0" else 0)
                    for i in range(len(body["input_ids"]))]
        return _answer(0, 1, cached=0)

    async def main():
        runner, url, seen = await _serve(answers)
        try:
            async with SGLangClient(url) as c:
                out = await c.generate_batch([[5, 6], [7, 8], [9]], {"max_new_tokens": 2})
                one = await c.generate([5, 6], {"max_new_tokens": 2})
                return out, one, seen, c.seen_version, c.stale_prefix_retries
        finally:
            await runner.cleanup()

    out, one, seen, version, retries = asyncio.run(main())
    assert [b["extra_key"] for b in seen[:1]] == ["v0"] and seen[0]["input_ids"] == [[5, 6], [7, 8], [9]]
    assert seen[1]["input_ids"] == [[7, 8]] and seen[1]["extra_key"].startswith("v1-")
    assert seen[2]["extra_key"] == "v1" and seen[2]["input_ids"] == [5, 6]  # the newest version seen keys the next
    assert len(out) == 3 and all(r.meta_info.cached_tokens == 0 for r in out) and one.meta_info.cached_tokens == 0
    assert (version, retries) == (1, 1)


def test_client_gives_up_after_fresh_keys_keep_hitting_old_prefixes():
    """An engine that always reports a newer version than the key and a cache hit: the client
    stops after its fresh keys with an error that says why (the rollout resubmits on it)."""
    async def main():
        runner, url, seen = await _serve(lambda body: _answer(0, int(body["extra_key"].split("-")[0][1:]) + 1, 4))
        try:
            async with SGLangClient(url) as c:
                with pytest.raises(EngineError, match="older weights") as e:
                    await c.generate([1], {"max_new_tokens": 2})
                return e.value, seen
        finally:
            await runner.cleanup()

    err, seen = asyncio.run(main())
    assert err.status == 503 and len(seen) == 4
    assert len({json.dumps(b["extra_key"]) for b in seen}) == 4
