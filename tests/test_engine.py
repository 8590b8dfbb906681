"""The embedded engine (connectors/sglang/engine_server.py + engine_core.py) over real HTTP, in
subprocesses: log-probs against transformers, abort + greedy resume, weight updates from disk
and over a gloo group, pause modes, bad input, SGLang's JSON contract (loaded from the sglang
wheel), loopback binding and the chat template.

Engines are started once per session (tests/conftest.py `engines`); `engine` resets the first
one before each test. The model is the tiny Qwen2 with sharpened weights (see
enginekit.make_model_dir: a freshly initialised tiny model only ever repeats its last prompt
token under greedy decoding).

Long file: the embedded engine's whole HTTP API against real engine processes started once per session.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import socket
import zipfile

import aiohttp
import msgspec
import pytest
from aiohttp import web

from streamrl.connectors.sglang import api
from streamrl.connectors.sglang.engine_server import FLUSH_REFUSED
from streamrl.connectors.ports import listen_socket, port_of
from streamrl.connectors.sglang.client import EngineError, SGLangClient
from streamrl.core.types import VersionSpan

from enginekit import (
    CACHE_DIR,
    EngineProc,
    check_generate_response,
    get_json,
    hf_greedy,
    listening_sockets,
    non_loopback_address,
    post_json,
    prompt,
    reference_logprobs,
    sglang_api_types,
)

TOL = 1e-4  # max |engine log-prob - transformers log-prob|, fp32
# Waits (s) before an abort or pause meant to land mid-generation, tried in turn: a request
# that already finished is retried with the next, shorter wait (machines differ ~100x in speed).
DELAYS = (0.12, 0.05, 0.02)
# Prompts whose long greedy runs have no near-tie (top-2 logit gap > 2e-4 at every step), so
# comparing the engine's greedy tokens with transformers' cannot flip on fp32 rounding.
ABORT_PROMPT = 38  # 200 tokens
FLIGHT_PROMPTS = (232, 234, 237, 220)  # 240 tokens


async def _version(s: aiohttp.ClientSession, url: str) -> str:
    status, info = await get_json(s, url + "/model_info")
    assert status == 200
    return info["weight_version"]


async def _greedy(c: SGLangClient, prompts: list[list[int]], n: int):
    return await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
                                  for p in prompts))


# ---------------------------------------------------------------- generation and log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_transformers(engine, ref0, temperature):
    """Concurrent requests (continuous batching, left-padded decode) return the log-probs a
    plain transformers forward pass gives the same tokens: log_softmax(logits / T)."""

    async def main():
        async with SGLangClient(engine.url) as c:
            sp = [{"max_new_tokens": 24, "temperature": temperature, "sampling_seed": i} for i in range(12)]
            return await asyncio.gather(*(c.generate(prompt(i, 4 + i), sp[i]) for i in range(12)))

    results = asyncio.run(main())
    worst = 0.0
    for i, r in enumerate(results):
        assert r.finish_type in ("length", "stop")
        assert len(r.logprobs) == len(r.output_ids) == r.meta_info.completion_tokens > 0
        assert [t for _, t, _ in r.meta_info.output_token_logprobs] == r.output_ids
        ref = reference_logprobs(ref0, prompt(i, 4 + i), r.output_ids, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(r.logprobs, ref)))
    assert worst < TOL, f"max |engine - transformers| log-prob = {worst:.2e}"
    if temperature == 0:  # greedy really is greedy
        assert results[0].output_ids == hf_greedy(ref0, prompt(0, 4), len(results[0].output_ids))


def test_batch_cache_survives_requests_leaving_and_joining(model_dirs, ref0):
    """The engine's batch KV cache (rows dropped when requests finish, new ones padded in while
    others decode) gives every request the log-probs transformers gives it alone, and is rebuilt
    only when the batch changes, not on every decode step."""
    import threading

    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    core = EngineCore(model_dirs[0], max_running=8)
    core.prefill_batch = 2  # joins arrive over several steps, while earlier requests decode
    done = threading.Semaphore(0)
    # Budgets from 3 to 40 tokens: rows leave at different steps; prompts of different lengths.
    reqs = [GenRequest(rid=str(i), input_ids=prompt(i, 3 + 2 * i), max_new_tokens=3 + 6 * (i % 7), ignore_eos=True,
                       temperature=0.0, on_done=lambda _r: done.release()) for i in range(12)]
    for r in reqs:
        core.submit(r)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    for _ in reqs:
        assert done.acquire(timeout=120)
    core.stop()
    thread.join(timeout=30)
    for i, r in enumerate(reqs):
        assert r.finish == {"type": "length", "length": r.max_new_tokens} and len(r.output_ids) == r.max_new_tokens
        ref = reference_logprobs(ref0, r.input_ids, r.output_ids, 0.0)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < TOL, i
        assert r.output_ids == hf_greedy(ref0, r.input_ids, r.max_new_tokens), i
    assert core.max_batch_seen == 8  # capped: the last requests joined as others left
    assert 1 < core.rebatches < core.steps


def test_decode_writes_the_batch_cache_in_place(model_dirs, ref0):
    """A decode step writes its token's keys/values into the batch cache's buffers instead of
    copying the cache (transformers' DynamicCache concatenates): while the batch is unchanged the
    buffers stay the same storage until they fill up, and then grow by half, not by one token."""
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    core = EngineCore(model_dirs[0], max_running=4)
    reqs = [GenRequest(rid=str(i), input_ids=prompt(i, 40), max_new_tokens=60, ignore_eos=True, temperature=0.0)
            for i in range(4)]
    core.submit_many(reqs)
    core._admit()
    storages, sizes = [], []
    for _ in range(45):
        core._decode()
        layer = core._cache[0]
        storages.append(layer.keys.untyped_storage().data_ptr())
        sizes.append(layer.keys.untyped_storage().nbytes())
    assert core.rebatches == 1 and core.steps == 45
    assert len(set(storages)) == 2  # room for 40 + 20 positions, then one growth by half
    assert sizes[-1] > sizes[0] * 1.4
    for r in reqs:
        assert r.output_ids == hf_greedy(ref0, r.input_ids, len(r.output_ids))


def test_sampling_seed_reproducible(engine):
    async def main():
        async with SGLangClient(engine.url) as c:
            sp = {"max_new_tokens": 16, "sampling_seed": 1234}
            a = await c.generate(prompt(1), sp)
            b = await c.generate(prompt(1), sp)
            d = await c.generate(prompt(1), {**sp, "sampling_seed": 99})
            return a, b, d

    a, b, d = asyncio.run(main())
    assert a.output_ids == b.output_ids
    assert a.output_ids != d.output_ids


def test_stop_token_and_batch_input(engine, ref0):
    greedy = hf_greedy(ref0, prompt(2), 12)
    stop_tok = greedy[5]
    first = greedy.index(stop_tok)

    async def main():
        async with aiohttp.ClientSession() as s:
            st, one = await post_json(s, engine.url + "/generate", {
                "input_ids": prompt(2), "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                            "stop_token_ids": [stop_tok]}})
            st2, batch = await post_json(s, engine.url + "/generate", {
                "input_ids": [prompt(2), prompt(3)], "rid": ["b0", "b1"],
                "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
            return st, one, st2, batch

    st, one, st2, batch = asyncio.run(main())
    assert st == 200 and st2 == 200
    assert one["output_ids"] == greedy[: first + 1]
    assert one["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b0", "b1"]
    assert batch[0]["output_ids"] == greedy[:5]
    assert batch[1]["output_ids"] == hf_greedy(ref0, prompt(3), 5)


# ---------------------------------------------------------------- abort and resume


def test_abort_mid_generation_then_greedy_resume(engine, ref0):
    """Abort by rid while a 200-token greedy request runs (beside other requests):
    partial tokens + log-probs come back with finish type abort; prompt + partial resubmitted
    greedily continues exactly as an uninterrupted greedy run (engine's and transformers')."""
    p, n = prompt(ABORT_PROMPT), 200

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            for delay in DELAYS:
                fillers = [asyncio.create_task(c.generate(prompt(100 + i), {"max_new_tokens": n, "ignore_eos": True},
                                                          rid=f"filler-{i}")) for i in range(4)]
                victim = asyncio.create_task(c.generate(p, {"max_new_tokens": n, "temperature": 0,
                                                            "ignore_eos": True}, rid="victim"))
                await asyncio.sleep(delay)
                st, out = await post_json(s, engine.url + "/abort_request", {"rid": "victim"})
                partial = await victim
                assert (await post_json(s, engine.url + "/abort_request", {"abort_all": True}))[0] == 200
                filled = await asyncio.gather(*fillers)
                if st == 200 and len(partial.output_ids) > 1:
                    assert out["success"] is True and out["num_aborted"] == 1, out
                    break
                assert st in (200, 404), (st, out)  # 404: it had finished; try again, aborting sooner
            else:
                pytest.fail(f"could not abort mid-generation with waits of {DELAYS} s")
            k = len(partial.output_ids)
            cont = await c.generate(p + partial.output_ids, {"max_new_tokens": n - k, "temperature": 0,
                                                             "ignore_eos": True})
            full = (await _greedy(c, [p], n))[0]
            return partial, filled, cont, full

    partial, filled, cont, full = asyncio.run(main())
    k = len(partial.output_ids)
    assert partial.finish_type == "abort"
    assert 1 < k < n, k
    assert len(partial.logprobs) == partial.meta_info.completion_tokens == k
    assert all(f.finish_type == "abort" and len(f.output_ids) < n for f in filled)
    assert cont.finish_type == "length" and len(cont.output_ids) == n - k
    assert partial.output_ids + cont.output_ids == full.output_ids
    assert full.output_ids == hf_greedy(ref0, p, n)
    got = partial.logprobs + cont.logprobs
    assert max(abs(a - b) for a, b in zip(got, full.logprobs)) < TOL
    assert max(abs(a - b) for a, b in zip(got, reference_logprobs(ref0, p, full.output_ids, 0))) < TOL


# ---------------------------------------------------------------- weight updates

def test_weight_sync_broadcast_roundtrip():
    """weight_sync alone, two ranks in two threads of this process."""
    import concurrent.futures as cf

    import torch

    from streamrl.connectors.sglang.weight_sync import broadcast, create_group, join_group, open_store, receive

    store = open_store(2)
    sent = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int64)]
    with cf.ThreadPoolExecutor(2) as ex:
        f0 = ex.submit(create_group, store, 2, "rt", "gloo", 20)
        f1 = ex.submit(join_group, "127.0.0.1", store.port, 1, 2, "rt", "gloo", 20)
        g0, g1 = f0.result(), f1.result()
        fb = ex.submit(broadcast, g0, sent)
        fr = ex.submit(receive, g1, ["a", "b"], ["float32", "int64"], [[2, 3], [2]])
        got = fr.result(30)
        fb.result(30)
    assert torch.equal(got["a"].cpu(), sent[0]) and torch.equal(got["b"].cpu(), sent[1])  # received on the GPU there is one



def test_update_weights_from_disk(engine, model_dirs, ref0, ref1):
    prompts = [prompt(i) for i in range(3)]
    n = 24

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            before = await _greedy(c, prompts, n)
            v0 = await _version(s, engine.url)
            st, bad = await post_json(s, engine.url + "/update_weights_from_disk",
                                      {"model_path": model_dirs[1] + "-missing", "weight_version": "9"})
            v_after_bad = await _version(s, engine.url)
            st_ok, ok = await post_json(s, engine.url + "/update_weights_from_disk",
                                        {"model_path": model_dirs[1], "weight_version": "1"})
            _, info = await get_json(s, engine.url + "/model_info")
            after = await _greedy(c, prompts, n)
            return before, v0, (st, bad, v_after_bad), (st_ok, ok), info, after

    before, v0, (st, bad, v_bad), (st_ok, ok), info, after = asyncio.run(main())
    assert [r.output_ids for r in before] == [hf_greedy(ref0, p, n) for p in prompts]
    assert v0 == "0" and all(r.meta_info.weight_version == "0" for r in before)
    # a failed load is reported (SGLang's {success: false, message}) and changes nothing
    assert st == 400 and bad["success"] is False and "missing" in bad["message"]
    assert v_bad == "0"
    assert st_ok == 200 and ok["success"] is True
    assert info["weight_version"] == "1" and info["model_path"] == model_dirs[1]
    assert [r.output_ids for r in after] == [hf_greedy(ref1, p, n) for p in prompts]
    assert all(a.output_ids != b.output_ids for a, b in zip(after, before))
    assert all(r.meta_info.weight_version == "1" for r in after)
    assert all(r.version_spans() == [VersionSpan(1, 0, n)] for r in after)


@pytest.mark.slow
def test_update_weights_from_distributed(engine, ref0, ref1):
    """The test process is the trainer (rank 0 of a gloo group, world size 2); the engine joins
    through /init_weights_update_group and receives every tensor of the seed-1 model."""
    from streamrl.connectors.sglang.weight_sync import broadcast, create_group, dtype_name, open_store

    store = open_store(2)
    port = store.port
    state = ref1.state_dict()
    names = list(state)
    prompts = [prompt(i) for i in range(3)]
    n = 24

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            before = await _greedy(c, prompts, n)
            group, (st, out) = await asyncio.gather(
                asyncio.to_thread(create_group, store, 2, "wu-test", "gloo", 60),
                post_json(s, engine.url + "/init_weights_update_group", {
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "wu-test", "backend": "gloo"}))
            assert st == 200 and out["success"] is True, out
            assert (await post_json(s, engine.url + "/begin_weight_update", {}))[0] == 200
            _, (st, out) = await asyncio.gather(
                asyncio.to_thread(broadcast, group, [state[k] for k in names]),
                post_json(s, engine.url + "/update_weights_from_distributed", {
                    "names": names, "dtypes": [dtype_name(state[k].dtype) for k in names],
                    "shapes": [list(state[k].shape) for k in names], "group_name": "wu-test",
                    "weight_version": "7"}))
            assert st == 200 and out["success"] is True, out
            assert (await post_json(s, engine.url + "/end_weight_update", {}))[0] == 200
            v = await _version(s, engine.url)
            after = await _greedy(c, prompts, n)
            del group
            return before, v, after

    before, v, after = asyncio.run(main())
    assert [r.output_ids for r in before] == [hf_greedy(ref0, p, n) for p in prompts]
    assert v == "7"
    assert [r.output_ids for r in after] == [hf_greedy(ref1, p, n) for p in prompts]
    assert all(a.output_ids != b.output_ids for a, b in zip(after, before))
    assert all(r.meta_info.weight_version == "7" for r in after)


def _learner_state(model) -> dict:
    """The weights as the learner sends them: the tied lm_head is the embedding, not sent twice."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.mark.slow
def test_update_weights_from_distributed_bucketed(engine, ref0, ref1):
    """load_format "flattened_bucket" (as VersionBroadcaster sends it): the learner's packed
    weights in one broadcast; a layout the engine cannot take is a 400 before anything is
    received, and the engine keeps serving."""
    from streamrl.connectors.sglang.weight_sync import BUCKET_FORMAT, broadcast, create_group, dtype_name, open_store, pack

    store = open_store(2)
    port = store.port
    state = pack(_learner_state(ref1))
    names = list(state)
    dtypes, shapes = [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]
    prompts = [prompt(i) for i in range(3)]
    n = 24

    async def main():
        async with SGLangClient(engine.url) as c:
            group, _ = await asyncio.gather(
                asyncio.to_thread(create_group, store, 2, "wu-bucket", "gloo", 60),
                c.init_weights_update_group("127.0.0.1", port, 1, 2, "wu-bucket", "gloo"))
            with pytest.raises(EngineError) as outside:  # SGLang takes it only inside a weight-update session
                await c.update_weights_from_distributed(names, dtypes, shapes, 9, "wu-bucket", load_format=BUCKET_FORMAT)
            async with c.weight_update():
                with pytest.raises(EngineError) as bad:
                    await c.update_weights_from_distributed(names, ["float8"] + dtypes[1:], shapes, 9, "wu-bucket",
                                                            load_format=BUCKET_FORMAT)
                still = await _greedy(c, prompts[:1], n)
                v_bad = await c.weight_version()
                _, out = await asyncio.gather(
                    asyncio.to_thread(broadcast, group, list(state.values()), True),
                    c.update_weights_from_distributed(names, dtypes, shapes, 7, "wu-bucket", load_format=BUCKET_FORMAT))
            assert outside.value.status == 400 and "must run between begin_weight_update()" in outside.value.message
            return bad.value, still, v_bad, out, await c.weight_version(), await _greedy(c, prompts, n)

    bad, still, v_bad, out, v, after = asyncio.run(main())
    assert bad.status == 400 and "unsupported dtype 'float8'" in bad.message
    assert still[0].output_ids == hf_greedy(ref0, prompts[0], n) and v_bad == "0"
    assert out["success"] is True and v == "7"
    assert [r.output_ids for r in after] == [hf_greedy(ref1, p, n) for p in prompts]
    for p, r in zip(prompts, after):
        assert max(abs(a - b) for a, b in zip(r.logprobs, reference_logprobs(ref1, p, r.output_ids, 0))) < TOL


@pytest.mark.slow
def test_tp2_engine_joins_both_ranks(model_dirs, ref1, tmp_path):
    """An embedded engine started with tp=2 joins the weight group as SGLang's two TP ranks would
    (rank_offset + 0 and + 1 of world 1 + 2, streamrl/core/weight_group.py), both receive every
    broadcast, and the pushed weights are served."""
    from streamrl.connectors.sglang.weight_sync import BUCKET_FORMAT, broadcast, create_group, dtype_name, open_store, pack
    from streamrl.core.weight_group import weight_group

    g = weight_group([2])
    state = pack(_learner_state(ref1))
    names = list(state)
    dtypes, shapes = [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]
    prompts = [prompt(i) for i in range(2)]
    n = 16
    proc = EngineProc(model_dirs[0], tmp_path / "tp2.log", tp=2)

    async def main():
        async with SGLangClient(proc.url) as c, aiohttp.ClientSession() as s:
            _, info = await get_json(s, proc.url + "/server_info")
            store = open_store(g.world_size)
            group, joined = await asyncio.gather(
                asyncio.to_thread(create_group, store, g.world_size, "wu-tp2", "gloo", 60),
                c.init_weights_update_group("127.0.0.1", store.port, g.rank_offsets[0], g.world_size, "wu-tp2"))
            async with c.weight_update():
                _, out = await asyncio.gather(
                    asyncio.to_thread(broadcast, group, list(state.values()), True),
                    c.update_weights_from_distributed(names, dtypes, shapes, 3, "wu-tp2", load_format=BUCKET_FORMAT))
            served = await c.weight_version(), await _greedy(c, prompts, n)
            # SGLang keeps groups by name until /destroy_weights_update_group (the broadcaster drops old ones)
            dropped = await c.destroy_weights_update_group("wu-tp2")
            again = await post_json(s, proc.url + "/destroy_weights_update_group", {"group_name": "wu-tp2"})
            async with c.weight_update():
                gone = await post_json(s, proc.url + "/update_weights_from_distributed", {
                    "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "wu-tp2"})
            return info, joined, out, served, (dropped, again, gone)

    try:
        proc.wait_ready()
        info, joined, out, (v, after), (dropped, again, gone) = asyncio.run(main())
    finally:
        proc.stop()
    assert info["tp_size"] == 2 and g.world_size == 3
    assert joined["success"] is True and out["success"] is True and v == "3"
    assert [r.output_ids for r in after] == [hf_greedy(ref1, p, n) for p in prompts]
    assert dropped["success"] is True
    assert again == (400, {"success": False, "message": "The group to be destroyed does not exist."})
    assert gone[0] == 400 and "init_weights_update_group" in str(gone[1])


def test_embedded_engine_refuses_bad_tp(model_dirs):
    from streamrl.connectors.sglang.engine_server import EngineServer

    with pytest.raises(ValueError, match="tp must be an int >= 1, got 0"):
        EngineServer(model_dirs[0], tp=0)


def test_update_weights_from_tensor(engine, ref0, ref1):
    """SGLang's /update_weights_from_tensor with safetensors blobs: the pushed weights are served
    (greedy tokens and log-probs equal transformers on them) under the new version. Pickled
    payloads (SGLang's own load_formats) and bad blobs are refused with a 400 and the engine
    keeps serving its weights."""
    import base64
    import pickle

    pickled = base64.b64encode(pickle.dumps([("model.norm.weight", [0.0] * 64)])).decode()
    prompts = [prompt(i) for i in range(3)]
    n = 24

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            outside = await post_json(s, engine.url + "/update_weights_from_tensor",
                                      {"serialized_named_tensors": [], "load_format": "safetensors"})
            sessions = [(await post_json(s, engine.url + p, {}))[0] for p in
                        ("/end_weight_update", "/begin_weight_update", "/begin_weight_update")]
            refused = [await post_json(s, engine.url + "/update_weights_from_tensor",
                                       {"serialized_named_tensors": [pickled], "weight_version": "9",
                                        **({"load_format": f} if f else {})})
                       for f in (None, "direct", "flattened_bucket")]
            garbage = await post_json(s, engine.url + "/update_weights_from_tensor", {
                "serialized_named_tensors": [pickled], "load_format": "safetensors", "weight_version": "9"})
            still = await _greedy(c, prompts[:1], n)
            v_refused = await c.weight_version()
            ok = await c.update_weights_from_tensor(_learner_state(ref1), weight_version=5)
            sessions.append((await post_json(s, engine.url + "/end_weight_update", {}))[0])
            return (outside, sessions, refused, garbage, still, v_refused, ok, await c.weight_version(),
                    await _greedy(c, prompts, n))

    outside, sessions, refused, garbage, still, v_refused, ok, v, after = asyncio.run(main())
    assert outside == (400, {"success": False, "message": "update_weights_from_tensor must run between "
                             "begin_weight_update() and end_weight_update()"})
    assert sessions == [400, 200, 400, 200]  # end without begin, begin, begin again while open, end
    for st, out in refused:
        msg = out["error"]["message"]
        assert st == 400 and "refused" in msg and "unpickle" in msg and "'safetensors'" in msg, out
    assert garbage[0] == 400 and "not a safetensors blob" in garbage[1]["error"]["message"]
    assert still[0].output_ids == hf_greedy(ref0, prompts[0], n) and v_refused == "0"
    assert ok["success"] is True and v == "5"
    assert [r.output_ids for r in after] == [hf_greedy(ref1, p, n) for p in prompts]
    assert after[0].output_ids != still[0].output_ids
    for p, r in zip(prompts, after):
        assert r.meta_info.weight_version == "5"
        assert max(abs(a - b) for a, b in zip(r.logprobs, reference_logprobs(ref1, p, r.output_ids, 0))) < TOL


# ---------------------------------------------------------------- pause / continue


async def _pause_mid_flight(c: SGLangClient, s: aiohttp.ClientSession, url: str, mode: str, count: int, n: int,
                            temperature: float = 1.0, raw: bool = False) -> tuple[list, dict, list]:
    """Start `count` long requests and pause with `mode` while every one of them is
    mid-generation; when the machine is fast enough that some finished (or had not started)
    first, let them finish and retry with a shorter wait. Returns (tasks, internal state right
    after the pause, results already in: for mode abort). `raw`: the tasks give (status, JSON)."""
    sp = {"max_new_tokens": n, "ignore_eos": True, "temperature": temperature}
    for delay in DELAYS:
        if raw:
            tasks = [asyncio.create_task(post_json(s, url + "/generate", {
                "input_ids": prompt(FLIGHT_PROMPTS[i]), "rid": f"flight-{i}", "return_logprob": True,
                "sampling_params": sp})) for i in range(count)]
        else:
            tasks = [asyncio.create_task(c.generate(prompt(FLIGHT_PROMPTS[i]), sp, rid=f"flight-{i}"))
                     for i in range(count)]
        await asyncio.sleep(delay)
        st, out = await post_json(s, url + "/pause_generation", {"mode": mode})
        assert st == 200, out
        state = await _state(s, url)
        if mode == "abort":
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            if all(r.finish_type == "abort" and r.output_ids for r in results):
                return tasks, state, results
        elif state["num_requests"] == count and not any(t.done() for t in tasks):
            return tasks, state, []
        assert (await post_json(s, url + "/continue_generation", {}))[0] == 200
        await asyncio.gather(*tasks)
    pytest.fail(f"could not pause ({mode}) with {count} requests mid-generation after waits of {DELAYS} s")


async def _state(s: aiohttp.ClientSession, url: str) -> dict:
    st, info = await get_json(s, url + "/server_info")
    assert st == 200
    return info["internal_states"][0]


def test_request_queued_in_an_in_place_pause_runs_on_new_weights(engine, model_dirs, ref1):
    """The in_place cache rule on the embedded engine: a request that arrives while an in_place
    pause holds the running ones, and starts after the update, is tagged with the new version
    only, takes nothing from a cache (cached_tokens 0: this engine keeps no prefix across
    requests) and its tokens and log-probs are the new model's own, prompt included."""
    n, late = 240, prompt(7)

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            tasks, _, _ = await _pause_mid_flight(c, s, engine.url, "in_place", 2, n)
            queued = asyncio.create_task(c.generate(late, {"max_new_tokens": 12, "temperature": 0.0}))
            await asyncio.sleep(0.3)
            assert not queued.done()
            st, out = await post_json(s, engine.url + "/update_weights_from_disk",
                                      {"model_path": model_dirs[1], "weight_version": "1", "flush_cache": False})
            assert st == 200, out
            assert (await post_json(s, engine.url + "/continue_generation", {}))[0] == 200
            await asyncio.gather(*tasks)
            return await queued, c.seen_version

    r, seen = asyncio.run(main())
    assert r.version_spans() == [VersionSpan(1, 0, 12)] and r.meta_info.cached_tokens == 0 and seen == 1
    assert r.output_ids == hf_greedy(ref1, late, 12)
    assert max(abs(a - b) for a, b in zip(r.logprobs, reference_logprobs(ref1, late, r.output_ids, 0))) < TOL

def test_pause_in_place_update_continue(engine, model_dirs):
    n = 240

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            tasks, paused, _ = await _pause_mid_flight(c, s, engine.url, "in_place", 4, n)
            await asyncio.sleep(0.3)
            still = [not t.done() for t in tasks]
            # SGLang fails a flushing update while requests run (in_place keeps them running) ...
            refused = await post_json(s, engine.url + "/update_weights_from_disk",
                                      {"model_path": model_dirs[1], "weight_version": "1"})
            flush = await post_json(s, engine.url + "/flush_cache", {})
            # ... and takes it with flush_cache false, as VersionBroadcaster sends it for in_place
            st, out = await post_json(s, engine.url + "/update_weights_from_disk",
                                      {"model_path": model_dirs[1], "weight_version": "1", "flush_cache": False})
            assert st == 200 and out["success"], out
            assert await _version(s, engine.url) == "1"
            st, _ = await post_json(s, engine.url + "/continue_generation", {})
            assert st == 200
            return paused, still, refused, flush, await asyncio.gather(*tasks)

    paused, still, refused, flush, results = asyncio.run(main())
    assert refused == (400, {"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0})
    assert flush[0] == 400
    assert paused == {"paused": "in_place", "num_requests": 4}
    assert all(still), "a request finished while the engine was paused"
    for r in results:
        assert r.finish_type == "length" and len(r.output_ids) == n
        spans = [(w.version, w.start, w.end) for w in r.meta_info.weight_versions]
        assert len(spans) == 2 and spans[0][0] == "0" and spans[1][0] == "1", spans
        assert spans[0][1] == 0 and 0 < spans[0][2] == spans[1][1] < n and spans[1][2] == n, spans
        assert r.meta_info.weight_version == "1"
        assert r.version_spans() == [VersionSpan(0, 0, spans[0][2]), VersionSpan(1, spans[0][2], n)]
        assert r.meta_info.num_retractions == 0


def test_pause_abort(engine):
    n = 240

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            _, state, results = await _pause_mid_flight(c, s, engine.url, "abort", 4, n)
            late = asyncio.create_task(c.generate(prompt(1), {"max_new_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            waited = not late.done()
            st, _ = await post_json(s, engine.url + "/continue_generation", {})
            return results, state, waited, await asyncio.wait_for(late, 10)

    results, state, waited, late = asyncio.run(main())
    for r in results:
        assert r.finish_type == "abort"
        assert 0 < len(r.output_ids) < n and len(r.logprobs) == len(r.output_ids)
    assert state == {"paused": "abort", "num_requests": 0}
    assert waited, "a request sent while paused was served before continue_generation"
    assert late.finish_type == "length" and len(late.output_ids) == 4


def test_pause_retract(engine, ref0):
    n = 240

    async def main():
        async with SGLangClient(engine.url) as c, aiohttp.ClientSession() as s:
            tasks, state, _ = await _pause_mid_flight(c, s, engine.url, "retract", 3, n, temperature=0)
            await asyncio.sleep(0.3)
            still = [not t.done() for t in tasks]
            st, _ = await post_json(s, engine.url + "/continue_generation", {})
            return state, still, await asyncio.gather(*tasks)

    state, still, results = asyncio.run(main())
    assert state == {"paused": "retract", "num_requests": 3}
    assert all(still)
    for i, r in enumerate(results):
        assert r.finish_type == "length" and len(r.output_ids) == n
        assert r.meta_info.num_retractions >= 1
        # KV recomputed from prompt + output: greedy output as if never interrupted
        assert r.output_ids == hf_greedy(ref0, prompt(FLIGHT_PROMPTS[i]), n)


# ---------------------------------------------------------------- bad input

BAD_INPUT = [
    # (case, path, JSON body or raw bytes, status, words the error message must contain)
    ("unknown top-level field", "/generate", {"input_ids": [1, 2], "bogus_field": 1}, 400, ["bogus_field"]),
    ("unknown sampling param", "/generate", {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, 400,
     ["temprature"]),
    ("input_ids not a list", "/generate", {"input_ids": "1 2 3"}, 400, ["input_ids"]),
    ("temperature not a number", "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, 400,
     ["temperature"]),
    ("rid not a string", "/generate", {"input_ids": [1, 2], "rid": 5}, 400, ["rid"]),
    ("return_logprob not a bool", "/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, 400,
     ["return_logprob"]),
    ("empty input_ids", "/generate", {"input_ids": []}, 400, ["input_ids", "empty"]),
    ("neither input_ids nor text", "/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, ["input_ids"]),
    ("max_new_tokens over the context", "/generate",
     {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 250}}, 400, ["max_new_tokens", "context", "256"]),
    ("negative max_new_tokens", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, 400,
     ["max_new_tokens"]),
    ("token id out of vocab", "/generate", {"input_ids": [1, 512]}, 400, ["input_ids", "512"]),
    ("negative token id", "/generate", {"input_ids": [-1, 2]}, 400, ["input_ids"]),
    ("fewer rids than prompts", "/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, 400, ["rid"]),
    ("stream: true", "/generate", {"input_ids": [1, 2], "stream": True}, 400, ["stream"]),
    ("invalid JSON body", "/generate", b'{"input_ids": [1, 2', 400, ["JSON"]),
    ("abort an unknown rid", "/abort_request", {"rid": "no-such-rid"}, 404, ["no-such-rid"]),
    ("abort with neither rid nor abort_all", "/abort_request", {}, 400, ["rid"]),
    ("unknown pause mode", "/pause_generation", {"mode": "nap"}, 400, ["nap"]),
    ("weight version as a number", "/update_weight_version", {"new_version": 3}, 400, ["new_version"]),
    ("chat stream: true", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True},
     400, ["stream"]),
]


async def _normal_request(s: aiohttp.ClientSession, url: str) -> dict:
    body = {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    st, out = await post_json(s, url + "/generate", body, timeout_s=10)
    assert st == 200, out
    return out


@pytest.mark.parametrize("case,path,body,status,words", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_refused_with_json_error(engine, case, path, body, status, words):
    async def main():
        async with aiohttp.ClientSession() as s:
            if isinstance(body, bytes):
                got = await post_json(s, engine.url + path, data=body, timeout_s=10)
            else:
                got = await post_json(s, engine.url + path, body, timeout_s=10)
            return got, await _normal_request(s, engine.url)

    (st, out), normal = asyncio.run(main())
    assert st == status, (st, out)
    assert isinstance(out, dict) and isinstance(out.get("error"), dict), out
    msg = out["error"]["message"]
    assert isinstance(msg, str)
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in error message {msg!r}"
    assert out["error"].get("code") == status
    assert len(normal["output_ids"]) == 3


# Values SGLang's SamplingParams.verify refuses (sglang 0.5.23, srt/sampling/sampling_params.py):
# the embedded engine accepts them and generates anyway.
SGLANG_REFUSES = [
    ("negative temperature", {"temperature": -1.0}),
    ("top_p above 1", {"top_p": 1.5}),
    ("top_k 0", {"top_k": 0}),
    ("min_new_tokens above max_new_tokens", {"min_new_tokens": 5, "max_new_tokens": 3}),
]


@pytest.mark.parametrize("case,sp", SGLANG_REFUSES, ids=[c[0] for c in SGLANG_REFUSES])
def test_invalid_sampling_values_refused(engine, case, sp):
    async def main():
        async with aiohttp.ClientSession() as s:
            got = await post_json(s, engine.url + "/generate",
                                  {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, **sp}}, timeout_s=10)
            await _normal_request(s, engine.url)
            return got

    st, out = asyncio.run(main())
    assert st == 400 and "error" in out, (st, out)


def test_mixed_nesting_input_ids_is_a_400(engine):
    async def main():
        async with aiohttp.ClientSession() as s:
            got = await post_json(s, engine.url + "/generate", {"input_ids": [[1, 2], 3]}, timeout_s=10)
            await _normal_request(s, engine.url)
            return got

    st, out = asyncio.run(main())
    assert st == 400, (st, out)


def test_boolean_token_ids_refused(engine):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await post_json(s, engine.url + "/generate",
                                   {"input_ids": [True, 5], "sampling_params": {"max_new_tokens": 2}}, timeout_s=10)

    st, out = asyncio.run(main())
    assert st == 400, (st, out)


def test_max_new_tokens_zero_generates_nothing(engine):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await post_json(s, engine.url + "/generate", {
                "input_ids": prompt(0), "return_logprob": True, "sampling_params": {"max_new_tokens": 0}})

    st, out = asyncio.run(main())
    assert st == 200, out
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


@pytest.mark.slow
def test_top_p_zero_does_not_kill_the_engine(model_dirs, tmp_path):
    """On a throwaway engine: the shared ones must survive the defect."""
    proc = EngineProc(model_dirs[0], tmp_path / "engine.log").wait_ready()
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                try:
                    bad = await post_json(s, proc.url + "/generate", {
                        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "top_p": 0.0}}, timeout_s=3)
                except asyncio.TimeoutError:
                    bad = (None, "no answer within 3 s")
                try:
                    ok = await post_json(s, proc.url + "/generate", {
                        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}, timeout_s=3)
                except asyncio.TimeoutError:
                    ok = (None, "no answer within 3 s")
                return bad, ok

        (st_bad, out_bad), (st_ok, out_ok) = asyncio.run(main())
        assert st_bad == 400, out_bad
        assert st_ok == 200, out_ok
    finally:
        proc.stop(grace_s=3)
        assert not proc.leftovers()


@pytest.mark.slow
def test_sigterm_stops_a_paused_engine(model_dirs, tmp_path):
    """On a throwaway engine. A launcher stopping engines during a weight update (paused)
    expects them to exit."""
    import subprocess

    proc = EngineProc(model_dirs[0], tmp_path / "engine.log").wait_ready()
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                body = {"input_ids": prompt(1), "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
                tasks = [asyncio.create_task(post_json(s, proc.url + "/generate", body, timeout_s=60))
                         for _ in range(2)]
                for _ in range(500):
                    if (await get_json(s, proc.url + "/get_load"))[1][0]["num_reqs"] == 2:
                        break
                    await asyncio.sleep(0.005)
                assert (await post_json(s, proc.url + "/pause_generation", {"mode": "in_place"}))[0] == 200
                assert (await _state(s, proc.url))["num_requests"] == 2
                proc.proc.terminate()
                try:
                    await asyncio.to_thread(proc.proc.wait, 10)
                    exited = True
                except subprocess.TimeoutExpired:
                    exited = False
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return exited

        assert asyncio.run(main()), "engine still running 10 s after SIGTERM"
    finally:
        proc.stop(grace_s=3)
        assert not proc.leftovers()


# ---------------------------------------------------------------- SGLang's JSON contract


@pytest.fixture(scope="module")
def sgl():
    """sglang.api.v1.api_types from the sglang 0.5.23 wheel (downloaded once; a failed download
    fails the tests that use it, with pip's output)."""
    return sglang_api_types()


@contextlib.asynccontextmanager
async def _recording_server(handler):
    """An HTTP server on a free port (connectors/ports.py) answering every path with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = listen_socket()
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{port_of(sock)}"
    finally:
        await runner.cleanup()


def _wheel_source(path: str) -> str:
    """A source file of the sglang 0.5.23 wheel (`sgl` downloads it), read without importing sglang."""
    wheel = sorted(CACHE_DIR.glob("sglang-0.5.23-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        return z.read(f"sglang/srt/{path}").decode()


def _function(source: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    return next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _io_struct_fields() -> dict[str, set[str]]:
    """Field names of SGLang's control-request structs (srt/managers/io_struct.py in the same
    wheel), read with `ast` without importing sglang."""
    tree = ast.parse(_wheel_source("managers/io_struct.py"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


FULL_SAMPLING = dict(max_new_tokens=7, min_new_tokens=1, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, stop=["x"],
                     stop_token_ids=[3], ignore_eos=True, skip_special_tokens=False,
                     spaces_between_special_tokens=False, no_stop_trim=True, n=2, sampling_seed=11,
                     frequency_penalty=0.1, presence_penalty=0.2, repetition_penalty=1.1)


def test_client_requests_match_sglang_schema(sgl):
    """Every body SGLangClient sends, captured by a stand-in server, decodes with SGLang's own
    contract: /generate as GenerateRequest (its SamplingParams rejects unknown keys), abort as
    AbortRequest; control bodies use only fields of SGLang's io_struct request types."""
    assert set(FULL_SAMPLING) == set(msgspec.structs.asdict(api.SamplingParams())), \
        "api.SamplingParams gained a field: add it to FULL_SAMPLING"
    seen: list[tuple[str, object]] = []

    async def handler(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        seen.append((request.path, body))
        if request.path == "/generate":
            one = {"text": "", "output_ids": [4], "meta_info": {"id": "x", "weight_version": "0",
                                                                "finish_reason": {"type": "length", "length": 1}}}
            ids = body["input_ids"]
            return web.json_response([one] * len(ids) if isinstance(ids[0], list) else one)
        return web.json_response({"success": True, "message": ""})

    async def main():
        async with _recording_server(handler) as url, SGLangClient(url) as c:
            await c.generate([1, 2, 3], FULL_SAMPLING, rid="r-full")
            await c.generate([1, 2, 3])
            await c.generate_batch([[1, 2], [3, 4]], api.SamplingParams(temperature=0.5), rids=["a", "b"])
            await c.abort("r-full")
            await c.abort()
            await c.pause("retract")
            await c.resume()
            await c.update_weights_from_disk("/models/x", 3)
            await c.update_weight_version(4)
            await c.init_weights_update_group("127.0.0.1", 1234, 1, 2)
            await c.destroy_weights_update_group("old")
            await c.update_weights_from_distributed(["w"], ["float32"], [[2, 3]], 5)
            await c.begin_weight_update()
            await c.end_weight_update()

    asyncio.run(main())
    gens = [b for p, b in seen if p == "/generate"]
    assert len(gens) == 3
    full = sgl.GenerateRequest.from_json_value(gens[0])
    assert full.input_ids == [1, 2, 3] and full.rid == "r-full" and full.return_logprob is True
    for k, v in FULL_SAMPLING.items():
        assert getattr(full.sampling_params, k) == v, k
    plain = sgl.GenerateRequest.from_json_value(gens[1])
    assert plain.input_ids == [1, 2, 3]
    batch = sgl.GenerateRequest.from_json_value(gens[2])
    assert batch.input_ids == [[1, 2], [3, 4]] and batch.rid == ["a", "b"]
    assert batch.sampling_params.temperature == 0.5

    aborts = [sgl.AbortRequest.from_json_value(b) for p, b in seen if p == "/abort_request"]
    assert [(a.rid, a.abort_all) for a in aborts] == [("r-full", False), ("", True)]

    fields = _io_struct_fields()
    base = {"rid", "http_worker_ipc"}
    expect = {"/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
              "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
              "/update_weight_version": "UpdateWeightVersionReqInput",
              "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
              "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
              "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
              "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput"}
    for path, cls in expect.items():
        bodies = [b for p, b in seen if p == path]
        assert len(bodies) == 1, path
        unknown = set(bodies[0] or {}) - fields[cls] - base
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of SGLang's {cls}"
    by_path = dict(seen)
    # versions travel as strings (SGLang's weight_version is a str)
    assert by_path["/update_weights_from_disk"]["weight_version"] == "3"
    assert by_path["/update_weight_version"]["new_version"] == "4"
    assert by_path["/update_weights_from_distributed"]["weight_version"] == "5"
    assert by_path["/pause_generation"] == {"mode": "retract"}
    assert by_path["/destroy_weights_update_group"] == {"group_name": "old"}
    assert all(b["extra_key"] == "v0" for b in gens)  # the cache namespace of the newest version seen (prefix_cache)


def _bodies(calls) -> list[tuple[str, dict]]:
    """(path, JSON body) of each request `await calls(client)` sends, to a server that answers success."""
    seen: list[tuple[str, dict]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, json.loads(await request.read())))
        return web.json_response({"success": True, "message": ""})

    async def main():
        async with _recording_server(handler) as url, SGLangClient(url) as c:
            await calls(c)

    asyncio.run(main())
    return seen


def test_tensor_and_bucket_requests_use_sglang_fields(sgl):
    """The bodies of update_weights_from_tensor and a bucketed update_weights_from_distributed use
    only fields of SGLang's request types (the values differ by design: no pickle)."""
    import torch

    async def calls(c: SGLangClient) -> None:
        await c.update_weights_from_tensor({"w": torch.ones(2)}, weight_version=3)
        await c.update_weights_from_distributed(["w"], ["float32"], [[2]], 4, load_format="flattened_bucket")

    seen = _bodies(calls)
    fields = _io_struct_fields()
    by_path = dict(seen)
    tensor, dist = by_path["/update_weights_from_tensor"], by_path["/update_weights_from_distributed"]
    assert not set(tensor) - fields["UpdateWeightsFromTensorReqInput"]
    assert not set(dist) - fields["UpdateWeightsFromDistributedReqInput"]
    assert tensor["load_format"] == "safetensors" and tensor["weight_version"] == "3"
    assert dist["load_format"] == "flattened_bucket" and dist["weight_version"] == "4"
    import base64

    from safetensors.torch import load
    assert torch.equal(load(base64.b64decode(tensor["serialized_named_tensors"][0]))["w"], torch.ones(2))


def test_weight_update_rules_match_sglang(sgl):
    """The rules of SGLang 0.5.23 that the embedded engine and VersionBroadcaster follow, read from
    the wheel's source: fails when SGLang changes them or when our side drifts from them."""
    from streamrl.core.weight_group import weight_group

    # Each engine TP rank joins the weight group as rank_offset + tp_rank, world_size as sent.
    init = _function(_wheel_source("model_executor/model_runner_components/weight_updater.py"),
                     "init_weights_update_group")
    rank = next(n.value for n in ast.walk(init) if isinstance(n, ast.Assign) and
                [getattr(t, "id", None) for t in n.targets] == ["rank"])
    assert ast.unparse(rank) == "rank_offset + self.tp_rank"
    assert "world_size=world_size" in ast.unparse(init)
    for tps in [(1, 1), (2, 2), (1, 2, 4)]:
        g = weight_group(tps)
        ranks = [off + tp_rank for off, tp in zip(g.rank_offsets, tps) for tp_rank in range(tp)]  # SGLang's formula
        assert sorted([0, *ranks]) == list(range(g.world_size))

    # flush_cache defaults to true in SGLang's update requests and ours (unset: not sent)
    io = ast.parse(_wheel_source("managers/io_struct.py"))
    for cls, ours in [("UpdateWeightsFromDistributedReqInput", api.UpdateFromDistributedReq(names=[], dtypes=[], shapes=[])),
                      ("UpdateWeightFromDiskReqInput", api.UpdateFromDiskReq(model_path="m")),
                      ("UpdateWeightsFromTensorReqInput", api.UpdateFromTensorReq(serialized_named_tensors=[]))]:
        node = next(n for n in io.body if isinstance(n, ast.ClassDef) and n.name == cls)
        default = next(a.value for a in node.body if isinstance(a, ast.AnnAssign) and a.target.id == "flush_cache")
        assert ast.literal_eval(default) is True and ours.flush_cache is True, cls

    # A flushing update fails (success false, SGLang's words) when the flush is refused ...
    after = _function(_wheel_source("managers/scheduler_components/weight_updater.py"), "flush_cache_after_weight_update")
    assert "if recv_req.flush_cache and (not self.flush_cache(" in ast.unparse(after)
    refused = next(n.value for n in ast.walk(after) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)
                   and isinstance(n.value.elts[0], ast.Constant))
    assert ast.literal_eval(refused) == (False, FLUSH_REFUSED)
    # ... which it is unless the scheduler is idle, waiting requests aside while paused (EngineCore.can_flush)
    assert "self.is_fully_idle(ignore_waiting=self._engine_paused)" in ast.unparse(
        _function(_wheel_source("managers/scheduler.py"), "flush_cache"))
    # ... and the HTTP server answers a failed update 400
    http = _wheel_source("entrypoints/http_server.py")
    for name in ("update_weights_from_distributed", "update_weights_from_disk", "begin_weight_update"):
        assert "HTTPStatus.BAD_REQUEST" in ast.unparse(_function(http, name)), name

    # Distributed and tensor updates only inside /begin_weight_update .. /end_weight_update
    # (VersionBroadcaster opens one per push; the embedded engine refuses them outside one)
    updater = _wheel_source("managers/scheduler_components/weight_updater.py")
    for name in ("update_weights_from_distributed", "update_weights_from_tensor"):
        body = ast.unparse(_function(updater, name))
        assert "if self._session is None" in body and \
            f"{name} must run between begin_weight_update() and end_weight_update()" in body, name
    assert "update_weights_from_disk must run" not in updater  # disk needs no session
    for path in ("/begin_weight_update", "/end_weight_update"):
        assert f'@app.post("{path}")' in http


def test_client_sends_flush_cache_false(sgl):
    """flush_cache: false reaches SGLang's request fields when asked (VersionBroadcaster asks under in_place)."""
    async def calls(c: SGLangClient) -> None:
        await c.update_weights_from_distributed(["w"], ["float32"], [[2]], 4, flush_cache=False)
        await c.update_weights_from_disk("/m", 4, flush_cache=False)
        await c.update_weights_from_disk("/m", 5)

    seen = _bodies(calls)
    fields = _io_struct_fields()
    assert [(p, b.get("flush_cache")) for p, b in seen] == [
        ("/update_weights_from_distributed", False), ("/update_weights_from_disk", False),
        ("/update_weights_from_disk", None)]  # None: not sent, SGLang's default (true)
    assert "flush_cache" in fields["UpdateWeightsFromDistributedReqInput"] & fields["UpdateWeightFromDiskReqInput"]


def test_engine_responses_match_sglang_schema(engine, sgl, ref0):
    greedy = hf_greedy(ref0, prompt(4), 10)

    async def main():
        async with aiohttp.ClientSession() as s, SGLangClient(engine.url) as c:
            u = engine.url
            out = {}
            out["length"] = await post_json(s, u + "/generate", {
                "input_ids": prompt(4), "return_logprob": True, "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
            out["stop"] = await post_json(s, u + "/generate", {
                "input_ids": prompt(4), "return_logprob": True,
                "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [greedy[3]]}})
            out["batch"] = await post_json(s, u + "/generate", {
                "input_ids": [prompt(1), prompt(2)], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
            out["text"] = await post_json(s, u + "/generate", {"text": "What is 1+2?",
                                                               "sampling_params": {"max_new_tokens": 3,
                                                                                   "ignore_eos": True}})
            # an aborted request and one spanning a version change (paused in place mid-generation,
            # one aborted by rid, new version, continue)
            (t_abort, t_span), _, _ = await _pause_mid_flight(c, s, u, "in_place", 2, 240, raw=True)
            out["abort_resp"] = await post_json(s, u + "/abort_request", {"rid": "flight-0"})
            out["abort"] = await t_abort
            out["version"] = await post_json(s, u + "/update_weight_version",
                                             {"new_version": "3", "abort_all_requests": False})
            assert (await post_json(s, u + "/continue_generation", {}))[0] == 200
            out["span"] = await t_span
            out["model_info"] = await get_json(s, u + "/model_info")
            out["server_info"] = await get_json(s, u + "/server_info")
            out["error"] = await post_json(s, u + "/generate", {"input_ids": []})
            return out

    out = asyncio.run(main())
    assert all(st == 200 for k, (st, _) in out.items() if k != "error"), {k: v[0] for k, v in out.items()}
    check_generate_response(sgl, out["length"][1], sgl.FinishLength)
    assert all(isinstance(e.text, str) for e in sgl.GenerateResponse.from_json_value(
        out["length"][1]).meta_info.output_token_logprobs)  # return_text_in_logprobs
    check_generate_response(sgl, out["stop"][1], sgl.FinishStop)
    assert sgl.GenerateResponse.from_json_value(out["stop"][1]).meta_info.finish_reason.matched == greedy[3]
    assert isinstance(out["batch"][1], list) and len(out["batch"][1]) == 2
    for raw in out["batch"][1]:
        check_generate_response(sgl, raw, sgl.FinishLength)
    check_generate_response(sgl, out["text"][1], sgl.FinishLength)
    assert out["text"][1]["meta_info"]["prompt_tokens"] > 0
    check_generate_response(sgl, out["abort"][1], sgl.FinishAbort)
    assert sgl.AbortResponse.from_json_value(out["abort_resp"][1]).success is True
    check_generate_response(sgl, out["span"][1], sgl.FinishLength)
    spans = sgl.GenerateResponse.from_json_value(out["span"][1]).meta_info.weight_versions
    assert [s.version for s in spans] == ["0", "3"]

    info = sgl.GetModelInfoResponse.from_json_value(out["model_info"][1])
    assert info.weight_version == "3" and info.model_path and info.is_generation is True
    server = sgl.GetServerInfoResponse.from_json_value(out["server_info"][1])
    assert server.model_path == info.model_path and server.version
    assert server.max_total_num_tokens and server.internal_states
    st, err = out["error"]
    assert st == 400
    body = sgl.ErrorBody.from_json_value(err["error"])
    assert body.message and body.code == 400


def test_sglang_contract_loaded_from_cached_wheel(sgl):
    """The wheel is fetched once; later runs load the cached copy (no network)."""
    assert sorted(CACHE_DIR.glob("sglang-0.5.23-*.whl"))
    assert hasattr(sgl, "GenerateRequest") and hasattr(sgl, "JsonContractError")
    with pytest.raises(sgl.JsonContractError, match="weight_version|string"):
        sgl.GenerateMetaInfo.from_json_value({"id": "x", "weight_version": 3})  # an int version is not SGLang's


# ---------------------------------------------------------------- binding and chat


def test_engine_binds_loopback_only(engine):
    socks = listening_sockets([engine.pid])
    assert ("127.0.0.1", engine.port) in socks, socks
    # every listening socket, the HTTP one and any a weight-update group opened, is loopback only
    assert all(addr == "127.0.0.1" for addr, _ in socks), socks
    other = non_loopback_address()
    if other is not None:  # reachable on loopback, refused on the machine's other address
        with pytest.raises(OSError):
            socket.create_connection((other, engine.port), timeout=1).close()


def test_chat_completions_apply_the_chat_template(engine, model_dirs, ref0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[0])
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 12+30? Answer with the number only."}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)

    async def main():
        async with SGLangClient(engine.url) as c:
            chat = await c.chat(messages, max_tokens=12, temperature=0, logprobs=True)
            gen = await c.generate(expected, {"max_new_tokens": 12, "temperature": 0})
            try:
                await c.chat([{"role": "user", "content": "hi"}], n=2)
                err = None
            except EngineError as e:
                err = e
            return chat, gen, err

    chat, gen, err = asyncio.run(main())
    assert chat["prompt_token_ids"] == expected
    assert tok.decode(expected).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert tok.decode(expected).endswith("<|im_start|>assistant\n")
    out = chat["output_token_ids"]
    choice = chat["choices"][0]
    stopped = choice["finish_reason"] == "stop"
    content_ids = out[:-1] if stopped else out
    assert out == gen.output_ids == hf_greedy(ref0, expected, len(out))
    assert stopped == (out[-1] == tok.eos_token_id)
    assert choice["message"] == {"role": "assistant", "content": tok.decode(content_ids, skip_special_tokens=True)}
    assert chat["usage"] == {"prompt_tokens": len(expected), "completion_tokens": len(out),
                             "total_tokens": len(expected) + len(out)}
    assert max(abs(a - b) for a, b in zip(chat["output_token_logprobs"], gen.logprobs)) < TOL
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == chat["output_token_logprobs"]
    assert err is not None and err.status == 400 and "n > 1" in err.message
