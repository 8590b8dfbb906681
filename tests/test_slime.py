"""slime-style user functions (`style: slime`, streamrl/plugins/slime.py) and the load-time check
of every function reference against the call its hub makes (streamrl/recipe/contracts.py).

The functions below are written exactly in slime's documented signatures and return types
(--custom-rm-path, --group-rm, --dynamic-sampling-filter-path), with a local stand-in for
slime's DynamicFilterOutput: slime is not installed here."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from streamrl.core.types import Sample as Stored
from streamrl.core.types import SampleGroup, VersionSpan
from streamrl.plugins.filters import FilterHub
from streamrl.plugins.slime import SlimeFilter, SlimeRewardHub, slime_args
from streamrl.recipe import FnRef, RecipeError, load_recipe
from streamrl.tools.cli import main

SLIME_FNS = '''
import asyncio
from dataclasses import dataclass

import torch


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


async def reward_func(args, sample, **kwargs):
    await asyncio.sleep(0)
    right = sample.response.strip() == str(sample.label)
    return {"acc": float(right), "len": sample.response_length, "pred": sample.response}


async def batched_reward(args, samples, **kwargs):
    return [float(len(s.response) % 2) for s in samples]


def check_reward_nonzero_std(args, samples, **kwargs):
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float64).std() > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


async def generate(args, sample, sampling_params):
    return sample


def streamrl_filter(group, threshold):
    return True


def sync_env(task, llm):
    return 1.0


def make_data(out_dir, size):
    pass
'''


def _module(tmp_path: Path) -> str:
    name = f"slimefns_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SLIME_FNS)
    return name


def _recipe(tmp_path: Path, **sections: object) -> Path:
    data = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, **sections}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _load_error(path: Path) -> str:
    """`streamrl check` exits 2 before any work starts; its message (load_recipe raises the same)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["check", str(path)]) == 2
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value) in err.getvalue()
    return str(e.value)


# ---------------------------------------------------------------- load-time checks, one per hub


def test_slime_reward_without_style_exits_2_naming_both_signatures(tmp_path, capsys):
    m = _module(tmp_path)
    path = _recipe(tmp_path, reward={"fn": f"{m}:reward_func"})
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"r.yaml:6: reward.fn: async {m}:reward_func(args, sample, **kwargs) does not fit" in err, err
    assert "expected fn(response, label, prompt, record, **reward.args)" in err
    assert "This looks like a slime-style function: add `style: slime` to reward" in err


def test_slime_group_reward_needs_group_rm(tmp_path):
    m = _module(tmp_path)
    err = _load_error(_recipe(tmp_path, reward={"fn": f"{m}:batched_reward", "style": "slime"}))
    assert "takes `samples` (a whole group) but reward.args.group_rm is not true" in err, err
    err = _load_error(_recipe(tmp_path, reward={"fn": f"{m}:reward_func", "style": "slime",
                                                "args": {"group_rm": True}}))
    assert "takes one `sample` but reward.args.group_rm is true" in err, err
    load_recipe(_recipe(tmp_path, reward={"fn": f"{m}:batched_reward", "style": "slime", "args": {"group_rm": True}}))
    load_recipe(_recipe(tmp_path, reward={"fn": f"{m}:reward_func", "style": "slime", "args": {"reward_key": "acc"}}))


def test_streamrl_reward_marked_slime_is_told_to_drop_the_style(tmp_path):
    err = _load_error(_recipe(tmp_path, reward={"fn": "streamrl.plugins.rewards:exact_match", "style": "slime"}))
    assert "does not fit the call the reward hub makes" in err and "remove `style: slime` from reward" in err, err


def test_filter_signatures_are_checked_at_load(tmp_path):
    m = _module(tmp_path)
    err = _load_error(_recipe(tmp_path, filters=[{"fn": "streamrl.plugins.filters:nonzero_std"},
                                                 {"fn": f"{m}:check_reward_nonzero_std"}]))
    assert f"filters[1].fn: {m}:check_reward_nonzero_std(args, samples, **kwargs) does not fit the call the filter " \
           "hub makes" in err and "add `style: slime` to filters[1]" in err, err
    err = _load_error(_recipe(tmp_path, filters=[{"fn": f"{m}:streamrl_filter"}]))
    assert "missing a required argument: 'threshold'" in err and "expected fn(group, **args) -> bool" in err, err
    err = _load_error(_recipe(tmp_path, filters=[{"fn": f"{m}:reward_func", "style": "slime"}]))
    assert "it is async" in err, err
    load_recipe(_recipe(tmp_path, filters=[{"fn": f"{m}:check_reward_nonzero_std", "style": "slime"},
                                           {"fn": f"{m}:streamrl_filter", "args": {"threshold": 1}}]))


def test_env_and_custom_generate_are_checked_at_load(tmp_path):
    m = _module(tmp_path)
    err = _load_error(_recipe(tmp_path, env={"fn": f"{m}:sync_env"}))
    assert "env.fn:" in err and "it is not async" in err and "expected async fn(task, llm, **env.args)" in err, err
    err = _load_error(_recipe(tmp_path, env={"fn": f"{m}:generate"}))
    assert "missing a required argument: 'sampling_params'" in err and "add `style: slime` to env" in err, err
    load_recipe(_recipe(tmp_path, env={"fn": f"{m}:generate", "style": "slime"}))


def test_data_generate_is_checked_at_load(tmp_path):
    m = _module(tmp_path)
    err = _load_error(_recipe(tmp_path, data={"path": "d.jsonl", "generate": {"fn": f"{m}:make_data"}}))
    assert "data.generate.fn:" in err and "missing a required argument: 'size'" in err, err
    err = _load_error(_recipe(tmp_path, data={"path": "d.jsonl", "generate": {"fn": f"{m}:make_data",
                                                                             "args": {"size": 1}, "style": "slime"}}))
    assert "style 'slime' is not available here" in err, err
    load_recipe(_recipe(tmp_path, data={"path": "d.jsonl", "generate": {"fn": f"{m}:make_data", "args": {"size": 1}}}))


# ---------------------------------------------------------------- the hubs


def _stored(i: int, tokens: list[int], reward: float | None = None, versions: tuple[int, ...] = (0,)) -> Stored:
    n = len(tokens)
    cut = n // 2 if len(versions) > 1 else n
    spans = [VersionSpan(versions[0], 0, cut)] + ([VersionSpan(versions[1], cut, n)] if len(versions) > 1 else [])
    return Stored(index=i, response_tokens=np.asarray(tokens), rollout_logprobs=np.full(n, -0.5), spans=spans,
                  reward=reward, finish_reason="stop")


def _recipe_obj(tmp_path: Path, **sections: object):
    return load_recipe(_recipe(tmp_path, **sections))


def test_slime_reward_hub_passes_samples_and_reads_reward_key(tmp_path):
    m = _module(tmp_path)
    r = _recipe_obj(tmp_path, reward={"fn": f"{m}:reward_func", "style": "slime", "args": {"reward_key": "acc"}},
                    rollout={"n_samples": 2, "max_new_tokens": 5})
    hub = SlimeRewardHub(r.reward, slime_args(r, r.reward.args, "http://127.0.0.1:3456"))
    assert hub.ns.sglang_router_ip == "127.0.0.1" and hub.ns.sglang_router_port == 3456
    assert hub.ns.n_samples_per_prompt == 2 and hub.ns.rollout_max_response_len == 5 and hub.ns.reward_key == "acc"
    stored = [_stored(0, [7, 8, 9], versions=(0, 1)), _stored(1, [5])]
    out = asyncio.run(hub.score("1+1=", "2", ["2", "3"], {"index": 4}, samples=stored, prompt_tokens=[1, 2]))
    assert [s.reward for s in out] == [1.0, 0.0] and all(s.error is None for s in out)
    assert out[0].components == {"len": 3.0}  # numeric entries besides the key; "pred" (text) is left out
    v = hub  # the views the function saw
    seen = []

    async def spy(args, sample, **kwargs):
        seen.append(sample)
        return 1
    v.fn, v._is_async = spy, True
    asyncio.run(v.score("1+1=", "2", ["2", "3"], {"index": 4}, samples=stored, prompt_tokens=[1, 2]))
    s = seen[0]
    assert (s.prompt, s.label, s.response, s.index, s.group_index) == ("1+1=", "2", "2", 0, 4)
    assert s.tokens == [1, 2, 7, 8, 9] and s.response_length == 3 and s.loss_mask == [1, 1, 1]
    assert s.rollout_log_probs == [-0.5] * 3 and s.weight_versions == ["0", "1"]
    assert s.status is s.Status.COMPLETED and s.reward is None


def test_slime_reward_dict_without_key_and_group_rm(tmp_path):
    m = _module(tmp_path)
    r = _recipe_obj(tmp_path, reward={"fn": f"{m}:reward_func", "style": "slime"})
    out = asyncio.run(SlimeRewardHub(r.reward, slime_args(r, r.reward.args)).score("p", "2", ["2"]))
    assert out[0].reward is None and "set reward_key under reward.args" in out[0].error
    r = _recipe_obj(tmp_path, reward={"fn": f"{m}:batched_reward", "style": "slime", "args": {"group_rm": True}})
    out = asyncio.run(SlimeRewardHub(r.reward, slime_args(r, r.reward.args)).score("p", "2", ["a", "ab", "abc"]))
    assert [s.reward for s in out] == [1.0, 0.0, 1.0]


def _group(rewards: list[float | None]) -> SampleGroup:
    return SampleGroup(group_id="g", prompt_id="p", prompt_tokens=[1], producer_id="t",
                       samples=[_stored(i, [3, 4], r) for i, r in enumerate(rewards)],
                       metadata={"prompt": "q", "label": "a", "index": 0})


def test_slime_filter_keep_reason_and_torch_bool(tmp_path):
    m = _module(tmp_path)
    r = _recipe_obj(tmp_path, filters=[{"fn": f"{m}:check_reward_nonzero_std", "style": "slime"}])
    hub = FilterHub(r.filters, slime_args(r), decode=lambda ids: " ".join(map(str, ids)))
    assert hub.check_error(_group([1.0, 0.0])) == (None, None)
    assert hub.check_error(_group([1.0, 1.0])) == ("zero_std_1.0", None)
    # reward_key: the sample's reward is a dict again, get_reward_value reads the key
    r = _recipe_obj(tmp_path, filters=[{"fn": f"{m}:check_reward_nonzero_std", "style": "slime",
                                        "args": {"reward_key": "acc"}}])
    assert FilterHub(r.filters, slime_args(r)).check(_group([0.0, 0.0])) == "zero_std_0.0"
    f = SlimeFilter(lambda args, samples: torch.tensor(True), slime_args(r), {})
    assert f(_group([1.0])) is True
    f = SlimeFilter(lambda args, samples: False, slime_args(r), {})
    assert f(_group([1.0])) == ("<lambda>",)


def test_a_raising_filter_reports_its_error(tmp_path):
    m = _module(tmp_path)
    r = _recipe_obj(tmp_path, filters=[{"fn": f"{m}:check_reward_nonzero_std", "style": "slime"}])
    reason, error = FilterHub(r.filters, slime_args(r)).check_error(_group([None, None]))
    assert reason == "check_reward_nonzero_std_error" and error.startswith("filter check_reward_nonzero_std: ")


def test_views_are_slime_samples():
    from streamrl.plugins.slime import Sample

    s = Sample(reward={"acc": 1.0}, loss_mask=[1, 0, 1], response_length=3)
    assert s.get_reward_value(type("A", (), {"reward_key": "acc"})()) == 1.0
    assert s.effective_response_length == 2 and s.to_dict()["status"] == "pending"


# ---------------------------------------------------------------- the custom generate's proxy


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


def test_sample_append_response_tokens_keeps_fields_aligned():
    from streamrl.plugins.slime import Sample

    s = Sample(tokens=[1, 2])
    s.append_response_tokens(None, tokens=[5, 6], log_probs=[-0.1, -0.2], text="hi",
                             meta_info={"weight_version": "3", "finish_reason": {"type": "length"}})
    s.append_response_tokens(None, tokens=[7], trainable=False, text="!")
    assert s.tokens == [1, 2, 5, 6, 7] and s.response == "hi!" and s.response_length == 3
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs == [-0.1, -0.2, 0.0]
    assert s.weight_versions == ["3"] and s.status is Sample.Status.TRUNCATED
    with pytest.raises(ValueError, match="need their rollout log-probs"):
        s.append_response_tokens(None, tokens=[8])


def test_message_prompts_are_rendered_as_slime_does():
    from streamrl.plugins.slime import prompt_text

    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    assert prompt_text([{"role": "user", "content": "1+1="}], Tok()) == "<user>1+1=<assistant>"
    assert prompt_text("1+1=", Tok()) == "1+1=" and prompt_text([{"role": "user"}], None) == [{"role": "user"}]


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
    m = _module(tmp_path)
    r = _recipe_obj(tmp_path, reward={"fn": f"{m}:reward_func", "style": "slime"})

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
