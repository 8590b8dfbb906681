"""The embedded engine's SGLang sampling features: `n > 1` (one prefill per group, SGLang's
list-of-n answer), stop strings (finish reason, trimmed text), prompt log-probs
(`input_token_logprobs` from `logprob_start_len`), each against transformers and SGLang's
JSON contract (api_types.py from the sglang wheel), over real HTTP where the shape matters and
on EngineCore where the cost does (prefill tokens counted).
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from enginekit import (
    check_generate_response,
    hf_greedy,
    load_model,
    post_json,
    prompt,
    reference_logprobs,
    sglang_api_types,
)

TOL = 1e-4  # max |engine log-prob - transformers log-prob|, fp32


@pytest.fixture(scope="module")
def ref0(model_dirs):
    return load_model(model_dirs[0])


@pytest.fixture(scope="module")
def sgl():
    return sglang_api_types()


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs[0])


def _generate(url: str, *bodies: dict) -> list[tuple[int, object]]:
    async def main():
        async with aiohttp.ClientSession() as s:
            return [await post_json(s, url + "/generate", b) for b in bodies]

    return asyncio.run(main())


def _run_core(core, reqs) -> None:
    """Submit `reqs` to `core` together (as the server does for one /generate) and run until all are done."""
    done = threading.Semaphore(0)
    for r in reqs:
        r.on_done = lambda _r: done.release()
    core.submit_many(reqs)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        for _ in reqs:
            assert done.acquire(timeout=120)
    finally:
        core.stop()
        thread.join(timeout=30)


# ---------------------------------------------------------------- n > 1


def test_group_of_n_costs_one_prefill(model_dirs, ref0):
    """n samples of one prompt are prefilled as one row (their KV shared) and each still gets
    the log-probs transformers gives its own tokens; n different prompts cost n prefills."""
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    p = prompt(5, 12)
    core = EngineCore(model_dirs[0], max_running=16)
    group = [GenRequest(rid=f"g{j}", input_ids=list(p), max_new_tokens=10, ignore_eos=True, sampling_seed=j)
             for j in range(8)]
    _run_core(core, group)
    assert core.prefill_tokens == len(p)  # one prefill for the group of 8
    for r in group:
        assert len(r.output_ids) == 10
        assert max(abs(a - b) for a, b in zip(r.logprobs, reference_logprobs(ref0, p, r.output_ids, 1.0))) < TOL
    assert len({tuple(r.output_ids) for r in group}) > 1  # eight seeds, not one sample copied

    core = EngineCore(model_dirs[0], max_running=16)
    separate = [GenRequest(rid=f"s{j}", input_ids=prompt(j, 12), max_new_tokens=10, ignore_eos=True) for j in range(8)]
    _run_core(core, separate)
    assert core.prefill_tokens == 8 * len(p)


def test_engine_on_the_gpu_gives_the_cpus_tokens(model_dirs):
    """The engine runs on the GPU when torch sees one: greedy and seeded samples there are the
    CPU's tokens (seeded generators stay on the CPU), log-probs within fp32 noise."""
    import torch

    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runs = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(model_dirs[0], max_running=16, device=device)
        assert next(core.model.parameters()).device.type == device
        reqs = [GenRequest(rid=f"r{j}", input_ids=prompt(j, 9), max_new_tokens=12, ignore_eos=True,
                           temperature=0.0 if j % 2 else 1.0, sampling_seed=j) for j in range(8)]
        _run_core(core, reqs)
        runs[device] = reqs
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert a.output_ids == b.output_ids, a.rid
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL


def test_group_larger_than_free_slots_is_prefilled_per_admission(model_dirs, ref0):
    """A group bigger than max_running is admitted as slots free up: each admission turn
    prefills its part once, and every sample is still right."""
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    p = prompt(6, 10)
    core = EngineCore(model_dirs[0], max_running=3)
    group = [GenRequest(rid=f"g{j}", input_ids=list(p), max_new_tokens=4, ignore_eos=True, temperature=0.0)
             for j in range(7)]
    _run_core(core, group)
    greedy = hf_greedy(ref0, p, 4)
    assert all(r.output_ids == greedy for r in group)
    assert core.prefill_tokens == 3 * len(p)  # 3 + 3 + 1 samples: three admissions


def test_generate_n_answers_a_list_of_n(engine, sgl, ref0):
    """SGLang's shape for n > 1: a list of n results (prompt-major for a batch), each with its
    own meta_info and a fresh rid, each decoding as SGLang's GenerateResponse."""
    p1, p2 = prompt(7), prompt(8, 11)
    (st1, one), (st2, batch), (st3, greedy) = _generate(
        engine.url,
        {"input_ids": p1, "rid": "grp", "return_logprob": True,
         "sampling_params": {"n": 4, "max_new_tokens": 6, "ignore_eos": True}},
        {"input_ids": [p1, p2], "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 0}},
        {"text": "What is 1+2?", "sampling_params": {"n": 3, "max_new_tokens": 5, "temperature": 0}})
    assert (st1, st2, st3) == (200, 200, 200), (one, batch, greedy)
    assert isinstance(one, list) and len(one) == 4
    for raw in one:
        check_generate_response(sgl, raw, sgl.FinishLength)
        assert raw["meta_info"]["prompt_tokens"] == len(p1)
        ref = reference_logprobs(ref0, p1, raw["output_ids"], 1.0)
        assert max(abs(lp - r) for (lp, _, _), r in zip(raw["meta_info"]["output_token_logprobs"], ref)) < TOL
    ids = [raw["meta_info"]["id"] for raw in one]
    assert len(set(ids)) == 4 and "grp" not in ids
    assert [r["output_ids"] for r in batch] == [hf_greedy(ref0, p1, 5)] * 2 + [hf_greedy(ref0, p2, 5)] * 2
    assert len(greedy) == 3 and len({tuple(r["output_ids"]) for r in greedy}) == 1


def test_n_stop_and_prompt_logprobs_pass_through_sglang_router(router_proc, engine):
    """The real sglang-router forwards the new request fields and the list answer unchanged."""
    body = {"input_ids": prompt(9), "return_logprob": True, "logprob_start_len": 2,
            "sampling_params": {"n": 3, "max_new_tokens": 4, "stop": ["never-here"], "ignore_eos": True}}
    [(st, out)] = _generate(router_proc.url, body)
    assert st == 200 and isinstance(out, list) and len(out) == 3, out
    for raw in out:
        assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert [t for _, t, _ in raw["meta_info"]["input_token_logprobs"]] == prompt(9)[2:]


def test_bad_n_is_a_400(engine):
    [(st, body)] = _generate(engine.url, {"input_ids": prompt(1), "sampling_params": {"n": 0}})
    assert st == 400 and "n must be >= 1" in body["error"]["message"]


# ---------------------------------------------------------------- stop strings


def test_stop_string_finishes_and_is_trimmed(engine, sgl, ref0, tokenizer):
    """A stop string spanning tokens ends generation at the token that completes it; the finish
    reason names it; `text` is cut before it, or after it with no_stop_trim; output_ids keep
    every generated token. A listed string that never appears does not match."""
    p = prompt(4)
    greedy = hf_greedy(ref0, p, 24)
    stop = tokenizer.decode(greedy[2:4])  # two tokens' text
    k = next(k for k in range(1, 25) if stop in tokenizer.decode(greedy[:k]))
    full = tokenizer.decode(greedy[:k], skip_special_tokens=True)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": ["never-here", stop]}
    (st, trimmed), (st2, kept), (st3, single) = _generate(
        engine.url, {"input_ids": p, "sampling_params": sp},
        {"input_ids": p, "sampling_params": {**sp, "no_stop_trim": True}},
        {"input_ids": p, "sampling_params": {**sp, "stop": stop}})
    assert (st, st2, st3) == (200, 200, 200), (trimmed, kept, single)
    for raw in (trimmed, kept, single):
        check_generate_response(sgl, raw, sgl.FinishStop)
        assert raw["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert raw["output_ids"] == greedy[:k]
    assert trimmed["text"] == single["text"] == full[: full.find(stop)]
    assert kept["text"] == full[: full.find(stop) + len(stop)]


@pytest.mark.parametrize("stop, words", [(["x"] * 33, "at most 32 stop strings"), ([""], "must not be empty")])
def test_bad_stop_strings_are_a_400(engine, stop, words):
    [(st, body)] = _generate(engine.url, {"input_ids": prompt(1), "sampling_params": {"stop": stop}})
    assert st == 400 and words in body["error"]["message"]


# ---------------------------------------------------------------- prompt log-probs


def test_input_token_logprobs(engine, sgl, ref0):
    """SGLang's input_token_logprobs: [logprob, token_id, text|null] for input_ids[logprob_start_len:],
    log_softmax of the raw logits (whatever the temperature), None for the first entry only;
    none with the default -1; a start past the prompt is a 400."""
    p1, p2 = prompt(2, 9), prompt(3, 5)
    sp = {"max_new_tokens": 2, "temperature": 0.7, "ignore_eos": True}
    (st, batch), (st2, later), (st3, default), (st4, bad) = _generate(
        engine.url,
        {"input_ids": [p1, p2], "return_logprob": True, "logprob_start_len": 0, "sampling_params": sp},
        {"input_ids": p1, "return_logprob": True, "logprob_start_len": 3, "return_text_in_logprobs": True,
         "sampling_params": sp},
        {"input_ids": p1, "return_logprob": True, "sampling_params": sp},
        {"input_ids": p1, "return_logprob": True, "logprob_start_len": len(p1) + 1, "sampling_params": sp})
    assert (st, st2, st3) == (200, 200, 200), (batch, later, default)
    for raw, p, start in ((batch[0], p1, 0), (batch[1], p2, 0), (later, p1, 3)):
        check_generate_response(sgl, raw, sgl.FinishLength)
        entries = raw["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in entries] == p[start:]
        ref = reference_logprobs(ref0, p[:1], p[1:], 0.0)  # log P(p[i] | p[:i]) for i >= 1, raw logits
        assert entries[0][0] is None
        assert max(abs(lp - r) for (lp, _, _), r in zip(entries[1:], ref[start:])) < TOL
    assert all(isinstance(text, str) for _, _, text in later["meta_info"]["input_token_logprobs"])
    assert default["meta_info"]["input_token_logprobs"] == []
    assert st4 == 400 and "logprob_start_len" in bad["error"]["message"]


def _req(seed: int | None, **sp):
    import torch

    from streamrl.connectors.sglang.engine_core import GenRequest

    r = GenRequest(rid=str(seed), input_ids=[1], sampling_seed=seed, **sp)
    r.generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return r


def test_batched_sampling_follows_the_softmax_of_each_row():
    """The decode step samples every plain row in one batch (inverse CDF, engine_core._pick_many):
    the frequencies of 4000 draws match softmax(logits / T) per row, and each log-prob is
    log_softmax(logits / T) of the token drawn."""
    import torch

    from streamrl.connectors.sglang.engine_core import _pick_many

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")], [0.0, 0.0, 3.0, 0.0, 0.0]])
    temps = (1.0, 0.7)
    counts = torch.zeros(2, 5)
    reqs = [_req(s, temperature=t) for s, t in zip((1, 2), temps)]
    for _ in range(4000):
        for row, (tok, lp) in enumerate(_pick_many(logits, reqs)):
            counts[row, tok] += 1
            assert lp == pytest.approx(float(torch.log_softmax(logits[row] / temps[row], -1)[tok]), abs=1e-6)
    want = torch.softmax(logits / torch.tensor(temps)[:, None], -1)
    assert counts[0, 4] == 0  # probability 0 is never drawn
    assert torch.allclose(counts / 4000, want, atol=0.03), (counts / 4000, want)


def test_a_seeded_row_samples_the_same_alone_or_in_any_batch():
    import torch

    from streamrl.connectors.sglang.engine_core import _pick_many

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = _pick_many(logits[3:4], [_req(7)])[0]
    assert _pick_many(logits, [_req(s) for s in (11, 12, 13, 7, 14, 15)])[3] == alone
    mixed = [_req(11, top_k=5), _req(None), _req(13, temperature=0.0), _req(7), _req(14, top_p=0.9), _req(15)]
    assert _pick_many(logits, mixed)[3] == alone


def test_top_k_top_p_greedy_and_bad_rows_in_one_batch():
    """Rows with top-k / top-p go through the per-row sampler, greedy rows take the argmax, and a
    row whose logits are NaN fails alone (an exception in its place, the others sampled)."""
    import torch

    from streamrl.connectors.sglang.engine_core import _pick_many

    logits = torch.tensor([[0.0, 5.0, 4.9, -2.0], [0.0, 5.0, 4.9, -2.0], [float("nan")] * 4, [1.0, 0.0, 0.0, 3.0]])
    reqs = [_req(1, top_k=1), _req(2, temperature=0.0), _req(3), _req(4, top_p=1e-6)]
    out = _pick_many(logits, reqs)
    assert out[0][0] == 1 and out[1][0] == 1 and out[3][0] == 3, out
    assert isinstance(out[2], RuntimeError), out
    assert out[1][1] == pytest.approx(float(torch.log_softmax(logits[1], -1)[1]))
