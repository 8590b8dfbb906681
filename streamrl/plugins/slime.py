"""slime-style user functions, run as they are, without slime installed (`style: slime` on a
recipe function reference; docs/slime.md).

    reward:  {fn: "my_rm:reward_func", style: slime, args: {reward_key: acc}}
    filters: [{fn: "my_filters:check_reward_nonzero_std", style: slime}]

- reward: `async def reward_func(args, sample, **kwargs)` returns a number or a dict (the reward is
  `dict[args.reward_key]`, other numeric entries are stored as components); with
  `args: {group_rm: true}` it is `fn(args, samples, **kwargs)` returning one value per sample
  (slime's --group-rm).
- filter: `fn(args, samples, **kwargs)` returns a bool (a 0-d numpy/torch bool too) or an object
  with `keep` and `reason` (slime's DynamicFilterOutput); a dropped group's reason is `reason`.

They get what slime gives them: `args`, an argparse.Namespace with slime's names for what the
recipe knows (`slime_args`) plus the reference's own `args`, and `Sample` objects with slime's
field names and methods, filled from the group being scored. The samples are views: what a
function writes to them is not stored.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import numpy as np

from streamrl.core.types import Sample as StoredSample
from streamrl.core.types import SampleGroup, number_problem
from streamrl.plugins.rewards import RewardHub, Scored, _as_float, _head
from streamrl.recipe import FnRef, Recipe, resolve_fn


class Status(Enum):
    """slime's Sample.Status values."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Sample:
    """A sample as slime's user functions see it: slime's field names (slime/utils/types.py)."""

    Status = Status  # slime code writes Sample.Status.COMPLETED

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)  # prompt + response token ids
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict[str, Any] | None = None,
                               text: str | None = None, update_terminal_info: bool = True) -> None:
        """Add response tokens (the model's with their log-probs, or a tool's with trainable=False),
        keeping tokens, response_length, loss_mask and rollout_log_probs aligned, as slime's does."""
        tokens = [int(t) for t in (tokens or [])]
        lps = None if log_probs is None else [float(x) for x in log_probs]
        if lps is not None and len(lps) != len(tokens):
            raise ValueError(f"{len(lps)} log-probs for {len(tokens)} tokens")
        if tokens and trainable and lps is None:
            raise ValueError("trainable response tokens need their rollout log-probs")
        if not trainable:
            if lps is not None and tokens:
                raise ValueError("tokens that are not trainable take no log-probs")
            lps = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        self.tokens += tokens
        self.response_length += len(tokens)
        self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * before) + \
            [1 if trainable else 0] * len(tokens)
        if lps is not None:
            self.rollout_log_probs = (self.rollout_log_probs if self.rollout_log_probs is not None else
                                      [0.0] * before) + lps
        if meta_info is not None and update_terminal_info:
            self.update_from_meta_info(args, meta_info)

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """The weight version and finish reason of an engine answer."""
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = (meta_info.get("finish_reason") or {}).get("type")
        if finish in _STATUS:
            self.status = _STATUS[finish]

    def get_reward_value(self, args: Any) -> Any:
        """The reward: `reward[args.reward_key]` when the namespace names a key, else `reward`."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        return out


@dataclass
class DynamicFilterOutput:
    """What a slime dynamic-sampling filter may return (any object with keep/reason works too)."""

    keep: bool
    reason: str | None = None


class Dropped(NamedTuple):
    """A slime-style filter said keep=False; `reason` is its reason (or the filter's name)."""

    reason: str


def slime_args(recipe: Recipe, extras: dict[str, Any] | None = None, router_url: str | None = None) -> argparse.Namespace:
    """slime's argument names for what the recipe knows, then `extras` (a reference's `args`)."""
    ro, r = recipe.rollout, recipe
    url = urlsplit(router_url) if router_url else None
    ns = argparse.Namespace(
        hf_checkpoint=r.model.path, prompt_data=r.data.path, input_key=r.data.prompt_key, label_key=r.data.label_key,
        metadata_key="metadata", rollout_shuffle=r.data.shuffle, num_epoch=r.data.epochs,
        n_samples_per_prompt=ro.n_samples, rollout_batch_size=ro.groups_per_step,
        global_batch_size=ro.groups_per_step * ro.n_samples, num_rollout=r.run.steps,
        rollout_max_response_len=ro.max_new_tokens, rollout_temperature=ro.temperature, rollout_top_p=ro.top_p,
        rollout_top_k=ro.top_k, rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        rollout_seed=r.run.seed, seed=r.run.seed, over_sampling_batch_size=None,
        reward_key=None, eval_reward_key=None, group_rm=False, rm_type=None, rm_url=None,
        custom_rm_path=r.reward.fn if r.reward.style == "slime" else None,
        dynamic_sampling_filter_path=next((f.fn for f in r.filters if f.style == "slime"), None),
        # StreamRL resumes interrupted generations itself (staleness.partial_rollout): user code never sees an abort
        custom_generate_function_path=r.env.fn if r.env is not None and r.env.style == "slime" else None,
        partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False, sglang_router_ip=url.hostname if url else None,
        sglang_router_port=url.port if url else None, sglang_dp_size=None, sglang_speculative_algorithm=None,
        sglang_server_concurrency=ro.max_concurrency, rollout_num_gpus_per_engine=r.engines.tp,
        lr=r.learner.lr, eps_clip=r.learner.eps_clip_low, eps_clip_high=r.learner.eps_clip_high,
        kl_coef=r.learner.kl_coef, use_kl_loss=r.learner.kl_coef > 0, entropy_coef=r.learner.entropy_coef,
        advantage_estimator=r.learner.advantage, ci_test=False, use_rollout_routing_replay=False,
    )
    for k, v in (extras or {}).items():
        setattr(ns, k, v)
    return ns


def sample_view(index: int, prompt: Any, label: Any, response: str, stored: StoredSample | None = None,
                prompt_tokens: list[int] | None = None, group_index: int | None = None,
                metadata: dict[str, Any] | None = None, reward: Any = None) -> Sample:
    """A slime Sample for one response; token fields come from `stored` when given."""
    s = Sample(group_index=group_index, index=index, prompt=prompt, label=label, response=response,
               metadata=dict(metadata or {}), reward=reward, tokens=list(prompt_tokens or []))
    if stored is not None:
        resp = stored.response_tokens.tolist()
        s.tokens += resp
        s.response_length = len(resp)
        s.loss_mask = stored.loss_mask.tolist() if stored.loss_mask is not None else [1] * len(resp)
        s.rollout_log_probs = stored.rollout_logprobs.tolist()
        s.weight_versions = sorted({str(sp.version) for sp in stored.spans}, key=int)
        s.status = Status.FAILED if stored.failed else _STATUS.get(stored.finish_reason, Status.PENDING)
    return s


def prompt_text(prompt: Any, tokenizer: Any = None) -> Any:
    """The prompt as slime's samples hold it: a message list rendered with the tokenizer's chat
    template (slime's --apply-chat-template), a text prompt as it is."""
    if isinstance(prompt, list) and tokenizer is not None and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def _metadata(record: dict[str, Any] | None) -> dict[str, Any]:
    meta = (record or {}).get("metadata")
    return dict(meta) if isinstance(meta, dict) else {}


class SlimeRewardHub(RewardHub):
    """RewardHub for `style: slime` reward functions: fn(args, sample) or, with group_rm,
    fn(args, samples). Never raises for anything the function does."""

    def __init__(self, ref: FnRef, args: argparse.Namespace, timeout_s: float = 60, tokenizer: Any = None) -> None:
        try:
            self.fn = resolve_fn(ref.fn)
        except ValueError as e:
            raise ValueError(f"reward.fn {ref.fn!r}: {e}") from None
        self.path, self.args, self.timeout_s, self.ns = ref.fn, {}, timeout_s, args
        self.tokenizer = tokenizer
        self.name = getattr(self.fn, "__name__", ref.fn.rpartition(":")[2])
        self.per_group = bool(getattr(args, "group_rm", False))
        self._is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)
        self._warned = False

    def convert(self, value: Any) -> Scored:
        """A slime reward value: a number, or a dict read at args.reward_key (its other numeric
        entries become components)."""
        if not isinstance(value, dict):
            return super().convert(value)
        key = getattr(self.ns, "reward_key", None) or ("reward" if "reward" in value else None)
        if key is None or key not in value:
            return self._bad(f"returned a dict without {'the reward_key ' + repr(key) if key else 'a reward_key'}: "
                             f"{_head(value)}; set reward_key under reward.args (slime's --reward-key)")
        comps = {str(k): f for k, v in value.items() if k != key and (f := _as_float(v)) is not None
                 and not number_problem(f)}
        return super().convert({"reward": value[key], **comps})

    async def score(self, prompt: Any, label: Any, responses: list[str], record: dict[str, Any] | None = None,
                    samples: list[Any] | None = None, prompt_tokens: list[int] | None = None) -> list[Scored]:
        if not responses:
            return []
        group_index, prompt = (record or {}).get("index"), prompt_text(prompt, self.tokenizer)
        views = [sample_view(i, prompt, label, text, samples[i] if samples else None, prompt_tokens, group_index,
                             _metadata(record)) for i, text in enumerate(responses)]
        if not self.per_group:
            return list(await asyncio.gather(*(self._one_view(v) for v in views)))
        n = len(views)
        try:
            values = await self._call({}, (self.ns, views))
        except Exception as e:  # noqa: BLE001 - a reward bug fails its group, never the run
            msg = self._error(e)
            return [Scored(None, {}, msg) for _ in range(n)]
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != n:
            bad = self._bad(f"returned {_head(values)} for {n} samples; a group_rm function returns one value "
                            "per sample")
            return [Scored(None, {}, bad.error) for _ in range(n)]
        return [self.convert(v) for v in values]

    async def _one_view(self, view: Sample) -> Scored:
        try:
            value = await self._call({}, (self.ns, view))
        except Exception as e:  # noqa: BLE001 - a reward bug fails its sample, never the run
            return Scored(None, {}, self._error(e))
        return self.convert(value)


class SlimeFilter:
    """A `style: slime` dynamic-sampling filter as a FilterHub filter: True keeps the group,
    Dropped(reason) drops it; anything else it returns is an error (raised)."""

    def __init__(self, fn: Any, args: argparse.Namespace | None, extras: dict[str, Any],
                 decode: Any = None, tokenizer: Any = None) -> None:
        self.fn, self.decode, self.tokenizer = fn, decode, tokenizer
        self.ns = argparse.Namespace(**{**vars(args or argparse.Namespace()), **extras})
        self.name = getattr(fn, "__name__", "filter")

    def views(self, group: SampleGroup) -> list[Sample]:
        meta, key = group.metadata, getattr(self.ns, "reward_key", None)
        out = []
        for s in group.samples:
            reward: Any = s.reward
            if key and s.reward is not None:
                reward = {**s.rewards, key: s.reward}
            text = self.decode(s.response_tokens.tolist()) if self.decode is not None else ""
            out.append(sample_view(s.index, prompt_text(meta.get("prompt"), self.tokenizer), meta.get("label"), text, s,
                                   list(group.prompt_tokens),
                                   meta.get("index"), _metadata(meta), reward))
        return out

    def __call__(self, group: SampleGroup, **_: Any) -> bool | Dropped:
        out = self.fn(self.ns, self.views(group))
        keep, reason = (out.keep, getattr(out, "reason", None)) if hasattr(out, "keep") else (out, None)
        if getattr(keep, "ndim", None) == 0 and hasattr(keep, "item"):  # a 0-d numpy / torch bool
            keep = keep.item()
        if not isinstance(keep, (bool, np.bool_)):
            raise TypeError(f"returned keep={type(keep).__name__} {keep!r:.80}; a slime filter returns a bool or "
                            "an object with keep (bool) and reason")
        return True if keep else Dropped(str(reason) if reason else self.name)


def reward_hub(recipe: Recipe, router_url: str | None = None, tokenizer: Any = None) -> RewardHub:
    """The recipe's reward hub, in the style its reference names."""
    ref = recipe.reward
    if ref.style == "slime":
        return SlimeRewardHub(ref, slime_args(recipe, ref.args, router_url), tokenizer=tokenizer)
    return RewardHub(ref.fn, ref.args)
