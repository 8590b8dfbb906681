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
from streamrl.recipe import RecipeError, load_recipe
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
