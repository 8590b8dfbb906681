"""The real sglang-router (PyPI sglang-router 0.3.2, round_robin) in front of two embedded
engines (session fixtures in tests/conftest.py): load spread over both workers with exact
log-probs, chat forwarding, control calls sent to each worker directly, worker removal,
loopback-only binding and a clean shutdown.

Both engines serve the same weights; to see which one served a request, each is given its
own weight version first (`/update_weight_version`) and responses are counted by
`meta_info.weight_version`."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import aiohttp
import pytest

from streamrl.connectors.sglang.router import Router
from streamrl.connectors.sglang.client import SGLangClient

from enginekit import (
    descendants,
    get_json,
    hf_greedy,
    listening_sockets,
    load_model,
    non_loopback_address,
    pid_alive,
    post_json,
    reference_logprobs,
    reset_engine,
)

pytestmark = pytest.mark.slow  # two engine processes and a router

TOL = 1e-4
TAGS = ("100", "200")


def prompt(i: int) -> list[int]:
    return [3 + (i * 53 + j * 17) % 500 for j in range(3 + i % 9)]


@pytest.fixture(scope="module")
def ref0(model_dirs):
    return load_model(model_dirs[0])


async def _reset_all(engines, model_dir: str) -> None:
    await asyncio.gather(*(reset_engine(e.url, model_dir) for e in engines))


@pytest.fixture
def tagged(engines, model_dirs):
    """Both engines reset, then tagged with their own weight version (TAGS); reset after."""

    async def tag() -> None:
        await _reset_all(engines, model_dirs[0])
        async with aiohttp.ClientSession() as s:
            for e, v in zip(engines, TAGS):
                st, out = await post_json(s, e.url + "/update_weight_version",
                                          {"new_version": v, "abort_all_requests": False})
                assert st == 200, out

    asyncio.run(tag())
    yield {v: e for v, e in zip(TAGS, engines)}
    asyncio.run(_reset_all(engines, model_dirs[0]))


async def _close_clients(router: Router) -> None:
    """The router's clients open aiohttp sessions in the running loop: close them before it ends."""
    await router.client.close()
    for c in router.workers.values():
        await c.close()


def test_router_registers_workers_and_binds_loopback(router_proc, engines):
    async def main():
        try:
            return await router_proc.list_workers()
        finally:
            await _close_clients(router_proc)

    workers = asyncio.run(main())
    assert sorted(w["url"] for w in workers) == sorted(e.url for e in engines)
    assert sorted(router_proc.workers) == sorted(e.url for e in engines)
    assert router_proc.host == "127.0.0.1" and router_proc.policy == "round_robin"
    pids = [router_proc.proc.pid, *descendants(router_proc.proc.pid)]
    socks = listening_sockets(pids)
    assert ("127.0.0.1", router_proc.port) in socks, socks
    assert all(addr == "127.0.0.1" for addr, _ in socks), f"router listens beyond loopback: {socks}"
    other = non_loopback_address()
    if other is not None:
        for _, port in socks:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=1).close()


def test_round_robin_64_concurrent_generate_exact_logprobs(router_proc, tagged, ref0):
    """64 concurrent /generate (return_logprob, temperature 1) through the router: both
    workers serve, every log-prob equals a transformers forward pass of the same tokens."""

    async def main():
        async with SGLangClient(router_proc.url) as c:
            return await asyncio.gather(*(c.generate(prompt(i), {"max_new_tokens": 16, "temperature": 1.0},
                                                     rid=f"rr-{i}", return_logprob=True) for i in range(64)))

    results = asyncio.run(main())
    served = Counter(r.meta_info.weight_version for r in results)
    assert set(served) == set(TAGS), served
    assert served == Counter({TAGS[0]: 32, TAGS[1]: 32}), served  # strict round robin
    worst = 0.0
    for i, r in enumerate(results):
        assert r.meta_info.id == f"rr-{i}"  # the router keeps our rid
        assert r.finish_type in ("length", "stop") and 0 < len(r.output_ids) <= 16
        assert len(r.logprobs) == len(r.output_ids)
        ref = reference_logprobs(ref0, prompt(i), r.output_ids, 1.0)
        worst = max(worst, max(abs(a - b) for a, b in zip(r.logprobs, ref)))
    assert worst < TOL, f"max |engine - transformers| log-prob = {worst:.2e} (served: {dict(served)})"


def test_router_forwards_chat(router_proc, tagged, model_dirs, ref0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[0])
    messages = [{"role": "user", "content": "What is 7*6?"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)

    async def main():
        async with SGLangClient(router_proc.url) as c:
            return await asyncio.gather(*(c.chat(messages, max_tokens=8, temperature=0) for _ in range(4)))

    chats = asyncio.run(main())
    assert Counter(ch["weight_versions"][0]["version"] for ch in chats) == Counter({"100": 2, "200": 2})
    for ch in chats:
        assert ch["prompt_token_ids"] == expected
        out = ch["output_token_ids"]
        assert out == hf_greedy(ref0, expected, len(out))


def test_control_calls_reach_every_worker(router_proc, tagged, engines):
    """The router does not forward abort/pause/update calls; Router.broadcast sends them to
    each worker. Abort-all while requests run through the router ends all of them."""

    async def running(s: aiohttp.ClientSession) -> int:
        n = 0
        for e in engines:
            n += (await get_json(s, e.url + "/get_load"))[1][0]["num_reqs"]
        return n

    async def main():
        try:
            async with aiohttp.ClientSession() as s:
                st_router, _ = await post_json(s, router_proc.url + "/abort_request", {"abort_all": True})
                async with SGLangClient(router_proc.url) as c:
                    for _attempt in range(3):  # retried if a request finished before the abort reached it
                        tasks = [asyncio.create_task(c.generate(prompt(i), {"max_new_tokens": 200, "ignore_eos": True}))
                                 for i in range(6)]
                        seen = 0
                        for _ in range(500):  # until all six have reached their engines
                            seen = await running(s)
                            if seen == 6:
                                break
                            await asyncio.sleep(0.01)
                        aborted = await router_proc.broadcast("abort")
                        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
                        if seen == 6 and all(r.finish_type == "abort" for r in results):
                            break
                await router_proc.broadcast("update_weight_version", "5")
                versions = [(await get_json(s, e.url + "/model_info"))[1]["weight_version"] for e in engines]
                return st_router, seen, aborted, results, versions
        finally:
            await _close_clients(router_proc)

    st_router, seen, aborted, results, versions = asyncio.run(main())
    assert st_router == 404  # sglang-router 0.3.2 has no /abort_request route
    assert seen == 6
    assert sorted(a["num_aborted"] for a in aborted) == [3, 3]
    assert all(r.finish_type == "abort" and len(r.output_ids) < 200 for r in results)
    assert Counter(r.meta_info.weight_version for r in results) == Counter({"100": 3, "200": 3})
    assert versions == ["5", "5"]


def test_remove_worker_and_close(tagged, engines):
    """A second router: after remove_worker every request goes to the remaining engine;
    close() stops the router process (no orphan)."""
    router = Router(policy="round_robin").start()
    pid = router.proc.pid
    kids = descendants(pid)

    async def main():
        try:
            for e in engines:
                await router.add_worker(e.url)
            await router.remove_worker(engines[1].url)
            left = [w["url"] for w in await router.list_workers()]
            async with SGLangClient(router.url) as c:
                rs = await asyncio.gather(*(c.generate(prompt(i), {"max_new_tokens": 4}) for i in range(8)))
            return left, rs
        finally:
            await router.close()

    try:
        left, rs = asyncio.run(main())
    finally:
        router.stop()
    assert left == [engines[0].url]
    assert sorted(router.workers) == []  # close() dropped the direct clients
    assert Counter(r.meta_info.weight_version for r in rs) == Counter({TAGS[0]: 8})
    assert not pid_alive(pid) and not [k for k in kids if pid_alive(k)]
