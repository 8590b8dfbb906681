"""One engine contract, two engines: every test here runs against the embedded engine and against real
SGLang 0.5.23 on this CPU (the reference; `make sglang` builds its venv), each started once per module
with the run's keys, and spoken to through StreamRL's own client (connectors/sglang/client.py), as the
runtime speaks to them. Where the two differ, the test names the difference (docs/engines.md lists them).

The model is the tiny Qwen2 with sharpened weights (enginekit.make_model_dir), float32 on both engines,
so log-probs are compared with a transformers forward at 1e-5.

Long file: the whole engine contract in one place, so that a difference between the engines shows in one file.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from streamrl.connectors.auth import Keys, bearer
from streamrl.connectors.sglang.client import EngineError, SGLangClient
from streamrl.connectors.sglang.router import Router
from streamrl.connectors.sglang.weight_sync import BUCKET_FORMAT, broadcast, create_group, dtype_name, open_store, pack
from streamrl.core import lora as names
from streamrl.core.types import VersionSpan
from streamrl.recipes.agents.tool_agent import TOOLS

from enginekit import EngineProc, SGLangProc, hf_greedy, prompt, reference_logprobs
from test_lora import _random_adapter
from test_openai_tools import CALL, USER, _agent, _trained, scripted_model  # scripted_model: a fixture

__all__ = ["scripted_model"]  # fixtures

pytestmark = pytest.mark.slow

TOL = 1e-5  # max |engine log-prob - transformers log-prob|, float32
LONG = 200  # tokens of a request meant to be in flight when an abort or pause lands
# Measured 2026-12-02 (the contract engine started with --enable-lora --max-lora-rank 2 --lora-target-modules ...):
SGLANG_CPU_NO_LORA = ("SGLang 0.5.23 cannot serve LoRA on a CPU: --enable-lora exits at start, its LoRA layers allocate "
                      "pinned memory (srt/lora/layers.py, torch.tensor(..., pin_memory=True)), which needs a CUDA driver")
DELAYS = (0.5, 0.25, 0.1, 0.05)  # waits before an abort / pause, tried in turn (SGLang's first tokens take longer)


@dataclasses.dataclass
class Engine:
    kind: str  # "embedded" | "sglang"
    proc: EngineProc
    keys: Keys
    seed0: str  # the model directory it serves at version "0"

    @property
    def url(self) -> str:
        return self.proc.url

    def client(self) -> SGLangClient:
        return SGLangClient(self.url, keys=self.keys)


@pytest.fixture(scope="module", params=["embedded", "sglang"])
def eng(request, model_dirs, tmp_path_factory):
    """One engine of each kind per module, with a fresh pair of keys, serving the seed-0 model."""
    keys = Keys.new()
    log = tmp_path_factory.mktemp(f"contract-{request.param}") / "engine.log"
    if request.param == "embedded":
        proc: EngineProc = EngineProc(model_dirs[0], log, env=keys.env())
    else:
        proc = SGLangProc(model_dirs[0], log, keys=keys)
    try:
        proc.wait_ready(600)
    except BaseException:
        proc.stop(5)
        raise
    yield Engine(request.param, proc, keys, model_dirs[0])
    proc.stop()


@pytest.fixture
def engine(eng):
    """The module's engine, reset: running, nothing in flight, seed-0 weights at version "0"."""

    async def reset() -> None:
        async with eng.client() as c:
            await c.resume()
            await c.abort()
            try:  # a weight-update session a failed test left open
                await c.end_weight_update()
            except EngineError:
                pass
            await c.update_weights_from_disk(eng.seed0, weight_version=0)

    asyncio.run(reset())
    return eng


@pytest.fixture(scope="module")
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs[0])


async def _greedy(c: SGLangClient, prompts: list[list[int]], n: int):
    return await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
                                  for p in prompts))


def _gap(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) for a, b in zip(got, want))


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_equal_a_transformers_forward(engine, ref0, temperature):
    """Each output token's log-prob is log_softmax(logits / temperature) of a transformers forward over
    prompt + output (raw logits at temperature 0), within 1e-5 in float32; greedy output is transformers'
    greedy output."""
    prompts, n = [prompt(i) for i in range(4)], 16

    async def main():
        async with engine.client() as c:
            return await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "temperature": temperature,
                                                         "ignore_eos": True}) for p in prompts))

    results = asyncio.run(main())
    for p, r in zip(prompts, results):
        assert r.finish_type == "length" and len(r.output_ids) == n == len(r.logprobs)
        assert _gap(r.logprobs, reference_logprobs(ref0, p, r.output_ids, temperature)) < TOL
        if temperature == 0.0:
            assert r.output_ids == hf_greedy(ref0, p, n)


def test_weight_version_tags_every_token(engine, model_dirs):
    """The served version is in /model_info and on every token of a response (meta_info.weight_versions
    spans, read by the client as VersionSpans), before and after an update from disk."""

    async def main():
        async with engine.client() as c:
            before = await c.generate(prompt(1), {"max_new_tokens": 6, "ignore_eos": True})
            await c.update_weights_from_disk(model_dirs[1], weight_version=3)
            return before, await c.weight_version(), await c.generate(prompt(1), {"max_new_tokens": 6, "ignore_eos": True})

    before, v, after = asyncio.run(main())
    assert before.version_spans() == [VersionSpan(0, 0, 6)] and before.meta_info.weight_version == "0"
    assert v == "3" and after.version_spans() == [VersionSpan(3, 0, 6)] and after.meta_info.weight_version == "3"


def test_keys_are_required_and_never_logged(engine):
    """Generation needs the API key, control the admin key (the API key is refused there), probes need
    none; the keys never appear in the engine's log (SGLang prints its server arguments: blanked)."""

    async def main():
        out = {}
        async with aiohttp.ClientSession() as s:
            for name, path, key, body in (
                    ("health", "/health", None, None),
                    ("generate_no_key", "/generate", None, {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}),
                    ("generate_wrong_key", "/generate", "nope", {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}),
                    ("generate_api_key", "/generate", engine.keys.api, {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}),
                    ("flush_api_key", "/flush_cache", engine.keys.api, {}),
                    ("flush_admin_key", "/flush_cache", engine.keys.admin, {})):
                method = "GET" if body is None else "POST"
                async with s.request(method, engine.url + path, json=body, headers=bearer(key)) as r:
                    out[name] = r.status
        return out

    status = asyncio.run(main())
    assert status == {"health": 200, "generate_no_key": 401, "generate_wrong_key": 401, "generate_api_key": 200,
                      "flush_api_key": 401, "flush_admin_key": 200}, status
    log = engine.proc.log_path.read_text(errors="replace")
    assert engine.keys.api not in log and engine.keys.admin not in log
    if engine.kind == "sglang":  # it did print them, and the pipe blanked them
        assert "'api_key': '<redacted>'" in log and "'admin_api_key': '<redacted>'" in log


# ---------------------------------------------------------------- abort, pause, resume


async def _in_flight(c: SGLangClient, prompts: list[list[int]], act, temperature: float = 0.0):
    """Start long requests and run `act()` while all are mid-generation; when some finished or had not
    begun first, let them finish and try again with another wait. Returns (tasks, act's result)."""
    sp = {"max_new_tokens": LONG, "temperature": temperature, "ignore_eos": True}
    for delay in DELAYS:
        tasks = [asyncio.create_task(c.generate(p, sp, rid=f"flight-{i}-{delay}")) for i, p in enumerate(prompts)]
        await asyncio.sleep(delay)
        if any(t.done() for t in tasks):
            await asyncio.gather(*tasks)
            continue
        return tasks, await act()
    pytest.fail(f"could not act with requests in flight after waits of {DELAYS} s")


async def _pause_then_continue(engine: Engine, prompts: list[list[int]], mode: str, meanwhile=None):
    """Pause with `mode` while long greedy requests run, `await meanwhile(client)` if given, continue;
    returns (which requests were still unfinished 0.3 s into the pause, their results)."""
    async with engine.client() as c:
        tasks, _ = await _in_flight(c, prompts, lambda: c.pause(mode))
        await asyncio.sleep(0.3)
        still = [not t.done() for t in tasks]
        if meanwhile is not None:
            await meanwhile(c)
        await c.resume()
        return still, await asyncio.gather(*tasks)


def test_abort_returns_partial_tokens_and_the_resumed_rollout_continues_exactly(engine, ref0):
    """/abort_request by rid mid-generation: the partial tokens and their log-probs come back with finish
    type abort; prompt + partial, resubmitted greedily, continues exactly as an uninterrupted greedy run
    (the partial-rollout resumption the runtime does)."""
    p = prompt(38)

    async def main():
        async with engine.client() as c:
            for delay in DELAYS:
                victim = asyncio.create_task(c.generate(p, {"max_new_tokens": LONG, "temperature": 0.0,
                                                            "ignore_eos": True}, rid="victim"))
                await asyncio.sleep(delay)
                try:
                    await c.abort("victim")
                except EngineError as e:  # the embedded engine: 404 for a rid that already finished
                    assert e.status == 404 and engine.kind == "embedded", e
                partial = await victim
                if partial.finish_type == "abort" and 1 < len(partial.output_ids) < LONG:
                    break
            else:
                pytest.fail(f"could not abort mid-generation with waits of {DELAYS} s")
            k = len(partial.output_ids)
            cont = await c.generate(p + partial.output_ids, {"max_new_tokens": LONG - k, "temperature": 0.0,
                                                             "ignore_eos": True})
            return partial, cont

    partial, cont = asyncio.run(main())
    k = len(partial.output_ids)
    assert len(partial.logprobs) == k and cont.finish_type == "length" and len(cont.output_ids) == LONG - k
    full = hf_greedy(ref0, p, LONG)
    assert partial.output_ids + cont.output_ids == full
    assert _gap(partial.logprobs + cont.logprobs, reference_logprobs(ref0, p, full, 0)) < 1e-4


def test_pause_abort_returns_partials_and_holds_new_requests(engine):
    """pause_generation mode abort: requests in flight come back aborted with their partial tokens; a
    request sent while paused waits until continue_generation."""

    async def main():
        async with engine.client() as c:
            tasks, _ = await _in_flight(c, [prompt(232), prompt(234)], lambda: c.pause("abort"))
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            late = asyncio.create_task(c.generate(prompt(1), {"max_new_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(1.0)
            waited = not late.done()
            await c.resume()
            return results, waited, await asyncio.wait_for(late, 60)

    results, waited, late = asyncio.run(main())
    for r in results:
        assert r.finish_type == "abort" and 0 < len(r.output_ids) < LONG and len(r.logprobs) == len(r.output_ids)
    assert waited, "a request sent while paused was served before continue_generation"
    assert late.finish_type == "length" and len(late.output_ids) == 4


def test_pause_in_place_update_then_continue_spans_two_versions(engine, model_dirs, ref0, ref1):
    """pause mode in_place + an update from disk with flush_cache false (as the broadcaster sends it
    for in_place) + continue: the requests run to their end, their tokens tagged with two version
    spans that meet where the update landed. The tokens after it are the new weights' decoding over
    the KV cache the old weights wrote (in_place keeps it): transformers with seed 0's cache of
    prompt + all but the last old token, then seed 1 from that token on, gives the same greedy tokens.

    Where they differ: SGLang's overlap scheduler (its default, on GPU too) has already sampled the next
    token from the old weights' forward when the update lands, and tags that token with the new version:
    its version-1 span starts one token early (with --disable-overlap-schedule it does not; the embedded
    engine never does). The old weights' span is right either way, so a sample's oldest version, which
    staleness is measured by, is right; docs/engines.md."""
    p = [prompt(232), prompt(234)]
    still, results = asyncio.run(_pause_then_continue(
        engine, p, "in_place", lambda c: c.update_weights_from_disk(model_dirs[1], weight_version=1, flush_cache=False)))
    assert all(still), "a request finished while the engine was paused in place"
    for q, r in zip(p, results):
        assert r.finish_type == "length" and len(r.output_ids) == LONG
        spans = r.version_spans()
        assert [s.version for s in spans] == [0, 1] and spans[0].start == 0 and spans[1].end == LONG, spans
        assert 0 < spans[0].end == spans[1].start < LONG
        assert r.meta_info.weight_version == "1"
        cut = spans[0].end + (1 if engine.kind == "sglang" else 0)  # the token SGLang tags early
        assert r.output_ids[:cut] == hf_greedy(ref0, q, cut)
        assert r.output_ids[cut:] == _greedy_after_in_place_update(ref0, ref1, q + r.output_ids[:cut], LONG - cut)
        assert r.output_ids[cut:] != hf_greedy(ref1, q + r.output_ids[:cut], LONG - cut)  # not a fresh prefill


def _greedy_after_in_place_update(old, new, context: list[int], n: int) -> list[int]:
    """n greedy tokens of `new` after `context`, where the KV of every context token but the last was
    written by `old` (the last token was sampled, not yet fed, when the update landed)."""
    out: list[int] = []
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([context[:-1]]), use_cache=True).past_key_values
        tok = context[-1]
        for _ in range(n):
            step = new(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, tok = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(tok)
    return out


def test_pause_retract_then_continue_finishes_every_request(engine, ref0):
    """pause mode retract: the running requests are taken off the batch (KV freed) and, after
    continue_generation, finish with all their tokens; greedy output equals an uninterrupted run."""
    p = [prompt(232), prompt(234)]
    still, results = asyncio.run(_pause_then_continue(engine, p, "retract"))
    assert all(still)
    for q, r in zip(p, results):
        assert r.finish_type == "length" and r.output_ids == hf_greedy(ref0, q, LONG)


def test_flush_cache(engine):
    """flush_cache succeeds on an idle engine (the broadcaster flushes between versions)."""

    async def main():
        async with engine.client() as c:
            await c.generate(prompt(3), {"max_new_tokens": 4})
            return await c.flush_cache()

    assert asyncio.run(main()) is not None


# ---------------------------------------------------------------- weights over a group


def _learner_state(model) -> dict:
    """The weights as the learner sends them: the tied lm_head is the embedding, not sent twice."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


async def _push(c: SGLangClient, state: dict, group, name: str, version: int, bucketed: bool) -> None:
    names = list(state)
    dtypes, shapes = [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]
    async with c.weight_update():
        await asyncio.gather(asyncio.to_thread(broadcast, group, list(state.values()), bucketed),
                             c.update_weights_from_distributed(names, dtypes, shapes, version, name,
                                                               load_format=BUCKET_FORMAT if bucketed else None))


def test_weight_group_push_destroy_and_reform(engine, ref0, ref1):
    """The test process is the learner (rank 0 of a gloo group of 2): the engine joins through
    /init_weights_update_group; a flattened-bucket push of the seed-1 weights inside begin/end makes
    its outputs and log-probs transformers' on them; the group is destroyed, a new one formed under
    another name, and a per-tensor push brings seed 0 back."""
    prompts, n = [prompt(i) for i in range(3)], 24

    async def main():
        async with engine.client() as c:
            out = {}
            for name, state, version, bucketed in (("wu-a", pack(_learner_state(ref1)), 7, True),
                                                    ("wu-b", _learner_state(ref0), 8, False)):
                store = open_store(2)
                group, _ = await asyncio.gather(
                    asyncio.to_thread(create_group, store, 2, name, "gloo", 60),
                    c.init_weights_update_group("127.0.0.1", store.port, 1, 2, name, "gloo"))
                await _push(c, state, group, name, version, bucketed)
                out[version] = (await c.weight_version(), await _greedy(c, prompts, n))
                await c.destroy_weights_update_group(name)
                del group, store
            return out

    out = asyncio.run(main())
    for version, ref in ((7, ref1), (8, ref0)):
        v, results = out[version]
        assert v == str(version)
        for p, r in zip(prompts, results):
            assert r.output_ids == hf_greedy(ref, p, n) and r.version_spans() == [VersionSpan(version, 0, n)]
            assert _gap(r.logprobs, reference_logprobs(ref, p, r.output_ids, 0)) < TOL


def test_distributed_update_outside_a_session_is_refused(engine, ref1):
    """SGLang 0.5.23 takes /update_weights_from_distributed only between begin_weight_update and
    end_weight_update (400 otherwise, before anything is received); the embedded engine does the same."""
    state = pack(_learner_state(ref1))
    names = list(state)
    dtypes, shapes = [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]

    async def main():
        async with engine.client() as c:
            store = open_store(2)
            group, _ = await asyncio.gather(asyncio.to_thread(create_group, store, 2, "wu-out", "gloo", 60),
                                            c.init_weights_update_group("127.0.0.1", store.port, 1, 2, "wu-out", "gloo"))
            with pytest.raises(EngineError) as outside:
                await c.update_weights_from_distributed(names, dtypes, shapes, 9, "wu-out", load_format=BUCKET_FORMAT)
            v = await c.weight_version()
            await c.destroy_weights_update_group("wu-out")
            del group
            return outside.value, v

    err, v = asyncio.run(main())
    assert err.status == 400 and "begin_weight_update" in err.message and v == "0"


def test_a_push_the_learner_drops_releases_the_engine_at_once(engine, ref0, ref1):
    """A learner whose push failed drops its end of the group (WeightSource.push_weights): an engine
    waiting in that push's receive fails it at once, with success false (SGLang's group timeout is
    30 min), and goes on serving its old weights at its old version; a new group then pushes as usual.
    The pushed weights are bf16 (the learner casts to a bf16 engine's dtype): a float32 engine takes them too."""
    state = {k: v.to(torch.bfloat16) for k, v in _learner_state(ref1).items()}
    names_ = list(state)
    dtypes, shapes = [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]
    prompts, n = [prompt(i) for i in range(2)], 12

    async def main():
        async with engine.client() as c:
            store = open_store(2)
            group, _ = await asyncio.gather(asyncio.to_thread(create_group, store, 2, "wu-drop", "gloo", 600),
                                            c.init_weights_update_group("127.0.0.1", store.port, 1, 2, "wu-drop", "gloo"))
            async with c.weight_update():
                update = asyncio.ensure_future(c.update_weights_from_distributed(
                    names_, dtypes, shapes, 9, "wu-drop", load_format=BUCKET_FORMAT))
                await asyncio.sleep(2)  # the engine is in its receive (or about to be)
                group = store = None  # the sender's last references: its connections close
                gc.collect()
                t0 = time.monotonic()
                with pytest.raises(EngineError) as dropped:
                    await asyncio.wait_for(update, 60)
                released_s = time.monotonic() - t0
            after = (await c.weight_version(), await _greedy(c, prompts, n))
            await c.destroy_weights_update_group("wu-drop")
            store = open_store(2)
            group, _ = await asyncio.gather(asyncio.to_thread(create_group, store, 2, "wu-again", "gloo", 60),
                                            c.init_weights_update_group("127.0.0.1", store.port, 1, 2, "wu-again", "gloo"))
            await _push(c, pack(state), group, "wu-again", 10, True)
            again = (await c.weight_version(), await _greedy(c, prompts, n))
            await c.destroy_weights_update_group("wu-again")
            return dropped.value, released_s, after, again

    err, released_s, (v, results), (v2, results2) = asyncio.run(main())
    assert err.status == 400 and "Failed to receive weights" in err.message, err
    assert released_s < 10, released_s
    assert v == "0" and all(r.output_ids == hf_greedy(ref0, p, n) for p, r in zip(prompts, results))
    ref1_bf16 = copy.deepcopy(ref1).to(torch.bfloat16).to(torch.float32)  # what the engine holds now
    assert v2 == "10" and all(r.output_ids == hf_greedy(ref1_bf16, p, n) for p, r in zip(prompts, results2))


# ---------------------------------------------------------------- in front of the engine: the router, the OpenAI proxy


def test_the_sglang_router_in_front(engine, ref0):
    """The real sglang-router (round robin, the run's keys) with the engine registered: /generate through
    it gives the engine's own greedy tokens, log-probs and version; without the API key it refuses."""
    router = Router(policy="round_robin", keys=engine.keys).start()

    async def main():
        try:
            await router.add_worker(engine.url)
            async with SGLangClient(router.url, keys=engine.keys) as c:
                via = await _greedy(c, [prompt(5), prompt(6)], 12)
            async with aiohttp.ClientSession() as s:
                async with s.post(router.url + "/generate", json={"input_ids": prompt(5)}) as r:
                    refused = r.status
            return via, refused
        finally:
            await router.client.close()
            for w in router.workers.values():
                await w.close()

    try:
        via, refused = asyncio.run(main())
    finally:
        router.stop()
    for p, r in zip([prompt(5), prompt(6)], via):
        assert r.output_ids == hf_greedy(ref0, p, 12) and r.version_spans() == [VersionSpan(0, 0, 12)]
        assert _gap(r.logprobs, reference_logprobs(ref0, p, r.output_ids, 0)) < TOL
    assert refused == 401


def test_openai_proxy_tool_call_round_trip(engine, tok, scripted_model):
    """What agent frameworks use: the unmodified `openai` client through StreamRL's OpenAI proxy to the
    engine; a model trained to call a tool writes the call, it is parsed into `tool_calls`, answered with
    a `tool` message and the model's answer comes back; the episode holds exactly the tokens the engine
    generated, with their log-probs."""
    async def go():
        async with engine.client() as c:
            await c.update_weights_from_disk(scripted_model, weight_version=0)
        async with _agent(engine.url, tok, keys=engine.keys) as new:
            ep, oa = new()
            msgs = [USER]
            first = await oa.chat.completions.create(model="x", messages=msgs, tools=TOOLS, logprobs=True)
            call = first.choices[0].message.tool_calls[0]
            msgs += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "3182"}]
            second = await oa.chat.completions.create(model="x", messages=msgs, tools=TOOLS, logprobs=True)
            return ep, first, second

    ep, first, second = asyncio.run(go())
    c = first.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "calculator"
    assert second.choices[0].message.content == "3182"
    ids, lps = _trained(ep)
    assert tok.decode(ids, skip_special_tokens=False) == CALL + "<|im_end|>" + "3182<|im_end|>"
    assert lps == [e.logprob for r in (first, second) for e in r.choices[0].logprobs.content]


# ---------------------------------------------------------------- LoRA adapters


def test_lora_adapter_load_generate_unload(engine, model_dirs, ref0):
    """/load_lora_adapter of a PEFT directory, /generate with its name as lora_path: log-probs equal
    transformers' on the merged weights (base + alpha/r B A); without lora_path the base model answers;
    after /unload_lora_adapter the name is refused."""
    if engine.kind == "sglang":
        pytest.skip(SGLANG_CPU_NO_LORA)
    root = Path(model_dirs[0]).parent
    path = _random_adapter(Path(model_dirs[0]), root / "lora-v000007")
    merged, ad = copy.deepcopy(ref0), load_file(str(path / "adapter_model.safetensors"))
    with torch.no_grad():
        for layer in range(merged.config.num_hidden_layers):
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = merged.model.layers[layer].self_attn.get_submodule(m).weight
                w += names.scaling(2, 4.0) * ad[names.peft_name(layer, m, "B")] @ ad[names.peft_name(layer, m, "A")]
    p, n = prompt(9), 12

    async def main():
        async with engine.client() as c:
            await c.load_lora_adapter("v7", str(path))
            adapted = await c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}, lora_path="v7")
            base = await c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
            await c.unload_lora_adapter("v7")
            with pytest.raises(EngineError) as gone:
                await c.generate(p, {"max_new_tokens": 2}, lora_path="v7")
            return adapted, base, gone.value

    adapted, base, gone = asyncio.run(main())
    assert adapted.output_ids == hf_greedy(merged, p, n) != base.output_ids == hf_greedy(ref0, p, n)
    assert _gap(adapted.logprobs, reference_logprobs(merged, p, adapted.output_ids, 0)) < 1e-4
    assert adapted.version_spans() == [VersionSpan(7, 0, n)]  # the client reads the version off the adapter's name
    assert gone.status == 400


def test_no_prefix_cached_under_older_weights_is_reused(engine, model_dirs, ref1):
    """The extra_key rule (streamrl/core/prefix_cache.py): an update that does not flush the cache (as
    under in_place) leaves the old weights' prefix KV in SGLang's radix cache. A client that has not yet
    seen the new version sends its next request under the old key, so real SGLang serves that prompt
    from the stale cache (cached_tokens > 0, tokens tagged with the new version); the client sees it and
    sends the request again under a fresh key, and the answer is the new weights' own, exactly. The
    embedded engine keeps no prefix across requests: nothing to retry, the same answer."""
    p, n = prompt(11, 24), 8

    async def main():
        async with engine.client() as c:
            await c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})  # cached under v0
            await c.update_weights_from_disk(model_dirs[1], weight_version=1, flush_cache=False)
            r = await c.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
            return r, c.stale_prefix_retries, c.seen_version

    r, retries, seen = asyncio.run(main())
    assert retries == (1 if engine.kind == "sglang" else 0)
    assert r.meta_info.cached_tokens == 0 and seen == 1 and r.version_spans() == [VersionSpan(1, 0, n)]
    assert r.output_ids == hf_greedy(ref1, p, n)
    assert _gap(r.logprobs, reference_logprobs(ref1, p, r.output_ids, 0)) < TOL
