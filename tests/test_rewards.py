"""Reward functions (exact_match, math_boxed, f1, remote_rm against a local server) and the
RewardHub call contract: per-sample / per-group, sync / async, argument filtering, errors
that never propagate, bad return values and timeouts.

Long file: each reward function and every RewardHub calling convention and failure.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.plugins.rewards import (
    RewardHub,
    Scored,
    exact_match,
    f1,
    last_boxed,
    math_boxed,
    remote_rm,
)


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- built-ins


def test_exact_match():
    assert exact_match(" 5\n", "5") == 1.0
    assert exact_match("5", 5) == 1.0
    assert exact_match("5.0", "5") == 0.0


@pytest.mark.parametrize("text,inner", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last one counts
    (r"\boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),  # nested braces
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not grouping
    (r"\boxed 7 apples", "7"),
    (r"\fbox{3}", "3"),
    (r"\boxed{12", None),  # cut off by max_new_tokens
    ("no box", None),
])
def test_last_boxed(text: str, inner: str | None):
    assert last_boxed(text) == inner


@pytest.mark.parametrize("response,label,want", [
    (r"The answer is $\boxed{\dfrac{1}{2}}$", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{12.0}", "12", 1.0),
    (r"\boxed{ 12 }", 12, 1.0),  # numeric label
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\text{Paris}}", "Paris", 1.0),
    (r"\boxed{5}", r"Final: \boxed{5}", 1.0),  # label may be boxed itself
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
    (r"\boxed{1} or maybe \boxed{2}", "1", 0.0),  # only the last box counts
    (r"\boxed{1,2}", "12", 0.0),  # a pair, not a thousands separator
    (r"\boxed{\frac{1}{3}}", "0.333", 0.0),  # exact, not approximate
    (r"\boxed{\frac{1}{0}}", "1/0", 0.0),  # no value and different text: no crash, no match
    (r"\boxed{}", "", 0.0),  # an empty answer matches nothing
    ("42", "42", 0.0),  # no box, no credit
    (r"\boxed{4", "4", 0.0),
])
def test_math_boxed(response: str, label: Any, want: float):
    assert math_boxed(response, label) == want


@pytest.mark.parametrize("response,label,want", [
    ("The Eiffel Tower!", "eiffel tower", 1.0),
    ("a cat sat", "the cat sat down", 2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3)),
    ("Paris", ["London", "paris"], 1.0),
    ("dog", "cat", 0.0),
    ("the", "a", 1.0),  # both empty after normalisation
    ("the", "cat", 0.0),
    ("cat cat", "cat", 2 * 0.5 * 1 / 1.5),  # repeated tokens count once per match
])
def test_f1(response: str, label: Any, want: float):
    assert f1(response, label) == pytest.approx(want)


def test_f1_empty_label_list_raises():
    with pytest.raises(ValueError, match="empty list"):
        f1("x", [])


# ---------------------------------------------------------------- remote_rm against a local server


@asynccontextmanager
async def server(handler: Callable[[web.Request], Any]) -> AsyncIterator[tuple[str, list[dict]]]:
    seen: list[dict] = []

    async def wrapped(request: web.Request) -> web.StreamResponse:
        seen.append({"json": await request.json(), "auth": request.headers.get("Authorization")})
        return await handler(request)

    app = web.Application()
    app.router.add_post("/score", wrapped)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = listen_socket()
    await web.SockSite(runner, sock).start()
    port = port_of(sock)
    try:
        yield f"http://127.0.0.1:{port}/score", seen
    finally:
        await runner.cleanup()


def test_remote_rm_number_and_components(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RM_KEY", "s3cret")

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if body["response"] == "plain":
            return web.json_response(0.25)
        return web.json_response({"reward": 1, "format": 0.5, "note": "ignored"})

    async def main() -> None:
        async with server(handler) as (url, seen):
            assert await remote_rm("plain", "5", url=url) == 0.25
            got = await remote_rm("x", {"a": 1}, url=url, prompt=[{"role": "user", "content": "q"}],
                                  api_key_env="RM_KEY")
            assert got == {"reward": 1.0, "format": 0.5}
            assert seen[1] == {"json": {"prompt": [{"role": "user", "content": "q"}], "response": "x",
                                        "label": {"a": 1}}, "auth": "Bearer s3cret"}
            assert seen[0]["auth"] is None
            # through the hub, with the url from the recipe args
            hub = RewardHub("streamrl.plugins.rewards:remote_rm", {"url": url})
            assert await hub.score("p", "5", ["plain", "y"]) == [Scored(0.25, {}, None),
                                                                  Scored(1.0, {"format": 0.5}, None)]

    run(main())


def test_remote_rm_errors(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)

    async def handler(request: web.Request) -> web.Response:
        kind = (await request.json())["response"]
        if kind == "500":
            return web.Response(status=500, text="model exploded")
        if kind == "slow":
            await asyncio.sleep(0.5)
        return web.Response(text='{"score": 1}' if kind == "obj" else "not json")

    async def main() -> None:
        async with server(handler) as (url, _):
            with pytest.raises(RuntimeError, match=rf"POST {url} answered HTTP 500: 'model exploded'"):
                await remote_rm("500", "", url=url)
            with pytest.raises(ValueError, match=rf"{url} answered HTTP 200 with 'not json'"):
                await remote_rm("bad", "", url=url)
            with pytest.raises(ValueError, match=r"with '\{\"score\": 1\}'; expected a JSON number"):
                await remote_rm("obj", "", url=url)
            with pytest.raises(TimeoutError, match=rf"{url} did not answer within 0.2s"):
                await remote_rm("slow", "", url=url, timeout_s=0.2)
            with pytest.raises(RuntimeError, match="NO_SUCH_KEY_VAR"):
                await remote_rm("x", "", url=url, api_key_env="NO_SUCH_KEY_VAR")
            hub = RewardHub("streamrl.plugins.rewards:remote_rm", {"url": url})
            (s,) = await hub.score("p", "", ["500"])
            assert s.reward is None and s.error.startswith("remote_rm: RuntimeError: POST") and "500" in s.error
            await asyncio.sleep(0.4)  # let the "slow" handler finish before the server stops
        with pytest.raises(ConnectionError, match=f"cannot reach {url}"):
            await remote_rm("x", "", url=url)  # the server is gone

    run(main())


# ---------------------------------------------------------------- the hub

# User reward functions live in a throwaway module so the hub resolves them by dotted path.
mod = types.ModuleType("hubfns")
sys.modules["hubfns"] = mod


def register(fn: Callable) -> str:
    setattr(mod, fn.__name__, fn)
    return f"hubfns:{fn.__name__}"


def test_per_sample_sync_gets_only_accepted_kwargs():
    calls: list[dict] = []

    def only_response(response):
        calls.append({"response": response})
        return len(response)

    hub = RewardHub(register(only_response))
    assert not hub.per_group
    out = run(hub.score("prompt", "label", ["a", "bbb"], record={"k": 1}))
    assert out == [Scored(1.0, {}, None), Scored(3.0, {}, None)]
    assert calls == [{"response": "a"}, {"response": "bbb"}]


def test_kwargs_function_gets_everything_plus_args():
    seen: list[dict] = []

    def everything(**kw):
        seen.append(kw)
        return {"reward": 0.5, "length": float(len(kw["response"])), "flag": True}

    hub = RewardHub(register(everything), {"scale": 2})
    out = run(hub.score("P", "L", ["xy"], record={"id": 1}))
    assert out == [Scored(0.5, {"length": 2.0, "flag": 1.0}, None)]
    assert seen == [{"response": "xy", "label": "L", "prompt": "P", "record": {"id": 1}, "scale": 2}]


def test_async_per_sample_runs_concurrently():
    async def slow_async(response, label, delay):
        await asyncio.sleep(delay)
        return float(response == label)

    hub = RewardHub(register(slow_async), {"delay": 0.2})
    t0 = time.monotonic()
    out = run(hub.score(None, "b", ["a", "b", "c", "d", "e", "f", "g", "h"]))
    assert time.monotonic() - t0 < 0.6  # 8 x 0.2 s sequentially
    assert [s.reward for s in out] == [0, 1, 0, 0, 0, 0, 0, 0]


def test_sync_functions_run_off_the_event_loop():
    def blocking(response):
        time.sleep(0.2)
        return 1.0

    async def main() -> float:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        out = await RewardHub(register(blocking)).score(None, None, ["a", "b", "c", "d"])
        t.cancel()
        assert [s.reward for s in out] == [1.0] * 4
        return ticks

    assert run(main()) >= 5  # the loop kept running while the function slept


def test_per_group():
    seen: list[dict] = []

    def group_rank(responses, label, prompt, *, bonus=0.0):
        seen.append({"responses": responses, "label": label, "prompt": prompt})
        return [len(r) + bonus for r in responses[:-1]] + [{"reward": 9, "judge": 1}]

    hub = RewardHub(register(group_rank), {"bonus": 0.5})
    assert hub.per_group
    out = run(hub.score("P", "L", ["a", "bb", "ccc"]))
    assert out == [Scored(1.5, {}, None), Scored(2.5, {}, None), Scored(9.0, {"judge": 1.0}, None)]
    assert seen == [{"responses": ["a", "bb", "ccc"], "label": "L", "prompt": "P"}]
    assert run(hub.score("P", "L", [])) == []


def test_async_per_group_numpy_result():
    async def np_group(responses, **_):
        return np.array([1.0, 0.0], dtype=np.float32)

    assert [s.reward for s in run(RewardHub(register(np_group)).score(None, None, ["a", "b"]))] == [1.0, 0.0]


def test_raising_function_marks_samples_never_propagates():
    def flaky(response):
        if response == "boom":
            raise KeyError("no answer")
        return 1.0

    out = run(RewardHub(register(flaky)).score(None, None, ["ok", "boom"]))
    assert out[0] == Scored(1.0, {}, None)
    assert out[1] == Scored(None, {}, "flaky: KeyError: 'no answer'")

    def broken_group(responses):
        raise RuntimeError("judge down")

    out = run(RewardHub(register(broken_group)).score(None, None, ["a", "b"]))
    assert out == [Scored(None, {}, "broken_group: RuntimeError: judge down")] * 2
    assert out[0].components is not out[1].components


@pytest.mark.parametrize("value,expect", [
    (float("nan"), "returned the reward nan is not a finite number"),
    (math.inf, "returned the reward inf is not a finite number"),
    (1e39, "returned the reward 1e+39 is not a finite number within +-1e+06"),  # inf once in float32
    ({"reward": 1.0, "len": -1e7}, "component 'len' is -10000000.0; components must be finite numbers within"),
    ("1.0", "returned str '1.0'"),
    (None, "returned NoneType None"),
    ([1.0], "returned list [1.0]"),
    ({"score": 1.0}, "without a 'reward' key"),
    ({"reward": "high"}, "returned str 'high'"),
    ({"reward": 1.0, "judge": "good"}, "component 'judge' is 'good'"),
    ({"reward": 1.0, "judge": float("nan")}, "component 'judge' is nan"),
    (np.array([1.0, 2.0]), "returned ndarray"),
])
def test_bad_return_values_are_errors(value: Any, expect: str):
    def bad_value(response):
        return value

    (s,) = run(RewardHub(register(bad_value)).score(None, None, ["x"]))
    assert s.reward is None and s.components == {}
    assert s.error.startswith("bad_value: ValueError: ") and expect in s.error


def test_numpy_and_bool_scalars_are_rewards():
    def np_scalar(response):
        return np.float32(0.5) if response == "a" else response == "b"

    out = run(RewardHub(register(np_scalar)).score(None, None, ["a", "b", "c"]))
    assert [s.reward for s in out] == [0.5, 1.0, 0.0] and all(type(s.reward) is float for s in out)


@pytest.mark.parametrize("value,expect", [
    ([1.0], "returned 1 values for 2 responses"),
    (1.0, "returned float 1.0; a per-group function returns one value per response"),
    ("ab", "returned str 'ab'"),
])
def test_per_group_wrong_shape(value: Any, expect: str):
    def bad_group(responses):
        return value

    out = run(RewardHub(register(bad_group)).score(None, None, ["a", "b"]))
    assert all(s.reward is None and expect in s.error and s.error.startswith("bad_group: ") for s in out)


def test_per_group_one_bad_element_fails_only_that_sample():
    def half_bad(responses):
        return [1.0, float("nan")]

    out = run(RewardHub(register(half_bad)).score(None, None, ["a", "b"]))
    assert out[0] == Scored(1.0, {}, None) and out[1].reward is None and "nan" in out[1].error


def test_timeout_sync_and_async():
    async def hangs(response):
        await asyncio.sleep(30)

    def sleeps(response):
        time.sleep(0.5 if response == "slow" else 0)
        return 1.0

    t0 = time.monotonic()
    (s,) = run(RewardHub(register(hangs), timeout_s=0.1).score(None, None, ["x"]))
    assert s == Scored(None, {}, "hangs: TimeoutError: no result within 0.1s (RewardHub timeout_s)")
    out = run(RewardHub(register(sleeps), timeout_s=0.1).score(None, None, ["fast", "slow"]))
    assert out[0] == Scored(1.0, {}, None) and "no result within 0.1s" in out[1].error
    assert time.monotonic() - t0 < 2


def test_function_raising_its_own_timeout_is_its_error():
    async def own_timeout(response):
        raise TimeoutError("upstream judge timed out")

    (s,) = run(RewardHub(register(own_timeout)).score(None, None, ["x"]))
    assert s.error == "own_timeout: TimeoutError: upstream judge timed out"


def test_sync_function_returning_awaitable_is_awaited():
    async def inner(response):
        return 0.75

    def wrapper(response):
        return inner(response)

    assert run(RewardHub(register(wrapper)).score(None, None, ["x"]))[0].reward == 0.75


def test_builtins_through_the_hub():
    hub = RewardHub("streamrl.plugins.rewards:math_boxed")
    out = run(hub.score("q", r"\boxed{2}", [r"\boxed{2.0}", r"\boxed{3}", "none"]))
    assert [s.reward for s in out] == [1.0, 0.0, 0.0]
    assert run(RewardHub("streamrl.plugins.rewards:f1").score("q", ["a cat"], ["cat"]))[0].reward == 1.0
    assert run(RewardHub("streamrl.plugins.rewards:exact_match").score("q", "5", ["5 "]))[0].reward == 1.0


def test_construction_errors():
    def strict(response, label, *, threshold):
        return 1.0

    with pytest.raises(ValueError, match=r"needs \['threshold'\].*reward\.args"):
        RewardHub(register(strict))
    with pytest.raises(ValueError, match=r"reward\.args \['treshold'\] are not parameters of hubfns:strict"):
        RewardHub(register(strict), {"threshold": 1, "treshold": 2})
    with pytest.raises(ValueError, match=r"reward\.args \['label'\] clash"):
        RewardHub(register(strict), {"threshold": 1, "label": "x"})
    with pytest.raises(ValueError, match=r"reward\.fn 'hubfns:missing'.*no attribute 'missing'"):
        RewardHub("hubfns:missing")
    with pytest.raises(ValueError, match=r"needs \['url'\]"):
        RewardHub("streamrl.plugins.rewards:remote_rm")
    assert RewardHub(register(strict), {"threshold": 1}).per_group is False


def test_callable_object_with_async_call():
    class Judge:
        def __init__(self) -> None:
            self.calls = 0

        async def __call__(self, response, label):
            self.calls += 1
            await asyncio.sleep(0)
            return float(response == label)

    mod.judge = Judge()
    hub = RewardHub("hubfns:judge")
    assert hub._is_async and hub.name == "judge"
    assert [s.reward for s in run(hub.score(None, "a", ["a", "b"]))] == [1.0, 0.0] and mod.judge.calls == 2
