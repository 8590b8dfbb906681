"""slime's custom generate behind StreamRL's /generate proxy (streamrl/producers/generate_proxy.py):
each call served through the sample's episode with exact versions, `text` calls tokenizing only
what is new, and the hub reading the Sample the function returns. A fake engine stands in for
the router; tests/test_slime_e2e.py runs the real thing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from streamrl.core.types import VersionSpan
from streamrl.plugins.slime import slime_args
from streamrl.recipe import FnRef, load_recipe


def _recipe_obj(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"path": "d.jsonl"}}))
    return load_recipe(path)


class _FakeEngine:
    """Answers like SGLangClient.generate: the first call is aborted after 2 tokens by a version
    update (v0), the resubmission finishes on v1."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def generate(self, ids, params):
        from types import SimpleNamespace

        self.calls.append(list(ids))
        first = len(self.calls) == 1
        out = [11, 12] if first else [13]
        version = 0 if first else 1
        return SimpleNamespace(output_ids=out, logprobs=[-0.25] * len(out), finish_type="abort" if first else "stop",
                               version_spans=lambda: [VersionSpan(version, 0, len(out))])


class _Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) if i > 31 else "?" for i in ids)


def test_generate_proxy_serves_sglang_generate_with_exact_versions():
    import aiohttp

    from streamrl.producers.episode import Episode, to_samples
    from streamrl.producers.generate_proxy import GenerateProxy

    async def go():
        engine = _FakeEngine()
        ep = Episode(engine, _Tok(), sampling={"temperature": 1.0}, max_new_tokens=8, max_context=100)
        proxy = GenerateProxy()
        await proxy.start()
        try:
            port = await proxy.open(ep)
            url = f"http://127.0.0.1:{port}/generate"
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json={"input_ids": [1, 2], "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 5}}) as r:
                    first = await r.json()
                async with session.post(url, json={"input_ids": [9], "sampling_params": {}}) as r:
                    refused = (r.status, await r.json())
                async with session.post(url, json={"input_ids": [1, 2, 11, 12, 13, 40],
                                                   "sampling_params": {"max_new_tokens": 1}}) as r:
                    second = await r.json()
                proxy.close_session(port)
                async with session.post(url, json={"input_ids": [1]}) as r:
                    closed = r.status
        finally:
            await proxy.close()
        return engine, ep, first, refused, second, closed

    engine, ep, first, refused, second, closed = asyncio.run(go())
    # one answer for the call: the abort was resumed inside the proxy, as prompt + tokens so far
    assert engine.calls[:2] == [[1, 2], [1, 2, 11, 12]]
    assert first["output_ids"] == [11, 12, 13] and first["meta_info"]["finish_reason"] == {"type": "stop"}
    assert first["meta_info"]["output_token_logprobs"] == [[-0.25, 11, None], [-0.25, 12, None], [-0.25, 13, None]]
    assert first["meta_info"]["weight_version"] == "1"
    assert refused[0] == 400 and "do not extend" in refused[1]["error"]["message"]
    assert second["output_ids"] == [13] and "output_token_logprobs" not in second["meta_info"]
    assert closed == 404
    prompt, (s,) = to_samples([ep])
    assert prompt == [1, 2] and s.response_tokens.tolist() == [11, 12, 13, 40, 13]
    assert s.loss_mask.tolist() == [1, 1, 1, 0, 1]
    assert [(sp.version, sp.start, sp.end) for sp in s.spans] == [(0, 0, 2), (1, 2, 5)]


def test_generate_proxy_text_calls_tokenize_only_what_is_new():
    """slime's multi-turn examples send the whole text each turn: only the part after the text
    so far (sent + answered) is tokenized; the model's tokens stay the ones it sampled."""
    import aiohttp

    from streamrl.producers.episode import Episode, to_samples
    from streamrl.producers.generate_proxy import GenerateProxy

    async def go():
        engine = _FakeEngine()
        ep = Episode(engine, _Tok(), sampling={"temperature": 1.0}, max_new_tokens=8, max_context=100)
        proxy = GenerateProxy()
        await proxy.start()
        try:
            port = await proxy.open(ep)
            url = f"http://127.0.0.1:{port}/generate"
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json={"text": "ab", "sampling_params": {}}) as r:
                    first = await r.json()
                async with session.post(url, json={"text": "ab" + first["text"] + "Z",
                                                   "sampling_params": {"max_new_tokens": 1}}) as r:
                    second = await r.json()
                async with session.post(url, json={"text": "zz", "sampling_params": {}}) as r:
                    refused = (r.status, await r.json())
        finally:
            await proxy.close()
        return ep, first, second, refused

    ep, first, second, refused = asyncio.run(go())
    assert first["output_ids"] == [11, 12, 13] and first["text"] == "???"
    assert second["output_ids"] == [13]
    assert refused[0] == 400 and "does not extend this sample's text" in refused[1]["error"]["message"]
    prompt, (s,) = to_samples([ep])
    assert prompt == [ord("a"), ord("b")]
    assert s.response_tokens.tolist() == [11, 12, 13, ord("Z"), 13] and s.loss_mask.tolist() == [1, 1, 1, 0, 1]


def test_generate_hub_reads_the_returned_sample(tmp_path):
    import types

    from streamrl.producers.episode import Episode, to_samples
    from streamrl.producers.generate_proxy import SlimeGenerateHub

    mod = types.ModuleType("slimegen_kit")

    async def gen_eval(args, sample, sampling_params, evaluation=False):
        assert sampling_params["max_new_tokens"] == args.rollout_max_response_len == 32
        sample.reward = {"acc": 1.0 if evaluation else 0.0}
        return sample

    async def gen_fail(args, sample, sampling_params):
        sample.status = sample.Status.FAILED
        return sample

    async def gen_list(args, sample, sampling_params):
        return [sample, sample]

    async def gen_call(args, sample, sampling_params):  # one real call through the proxy, then masks more
        import aiohttp

        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        async with aiohttp.ClientSession() as session, session.post(url, json={"input_ids": [1, 2]}) as r:
            out = await r.json()
        sample.loss_mask = [0] + [1] * (len(out["output_ids"]) - 1)
        sample.response = "answer"
        return sample

    for f in (gen_eval, gen_fail, gen_list, gen_call):
        setattr(mod, f.__name__, f)
    import sys

    sys.modules["slimegen_kit"] = mod
    r = _recipe_obj(tmp_path)

    async def run(name, evaluation=False):
        hub = SlimeGenerateHub(FnRef(fn=f"slimegen_kit:{name}", style="slime"), slime_args(r), evaluation=evaluation)
        await hub.start()
        ep = Episode(_FakeEngine(), _Tok(), sampling={"temperature": 1.0}, max_new_tokens=8, max_context=100)
        try:
            out = await hub.run({"prompt": "p", "label": "l", "sample": 0}, ep)
        finally:
            await hub.close()
        return hub, ep, out

    assert asyncio.run(run("gen_eval", evaluation=True))[2] == ({"acc": 1.0}, None)
    assert asyncio.run(run("gen_eval"))[2] == ({"acc": 0.0}, None)
    assert asyncio.run(run("gen_fail"))[2] == (None, "slimegen_kit:gen_fail set the sample's status to failed")
    assert "returned a list of samples" in asyncio.run(run("gen_list"))[2][1]
    hub, ep, out = asyncio.run(run("gen_call"))
    assert out == ("answer", None)
    _, samples = to_samples([ep])
    hub.amend([ep], samples)
    assert samples[0].loss_mask.tolist() == [0, 1, 1]  # the returned mask masks more; it never unmasks
