"""slime-style user functions for the end-to-end tests (tests/test_slime_e2e.py), written in
slime's documented signatures and return types (--custom-rm-path, --group-rm,
--dynamic-sampling-filter-path) as a slime user has them. slime is not installed, so
DynamicFilterOutput is a local dataclass of the same shape; everything else is slime's contract:
`args` is slime's argument namespace, `sample(s)` are slime Samples."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


def _digits(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def reward_func(args, sample, **kwargs):
    """Per-sample reward returning a dict read at args.reward_key (slime's --reward-key)."""
    await asyncio.sleep(0)
    assert args.n_samples_per_prompt >= 1 and len(sample.tokens) > sample.response_length > 0
    return {"score": _digits(sample.response), "response_length": float(sample.response_length),
            "pred": sample.response}


async def group_reward(args, samples, **kwargs):
    """--group-rm: one call per group, one reward per sample."""
    assert len(samples) == args.n_samples_per_prompt
    return [_digits(s.response) for s in samples]


def check_reward_nonzero_std(args, samples, **kwargs):
    """slime's DAPO filter: drop groups whose rewards are all equal, with the reason."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float64).std() > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def broken_filter(args, samples, **kwargs):
    """A filter with a bug: it raises on every group."""
    return DynamicFilterOutput(keep=samples[0].no_such_field > 0)


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


async def _post(url: str, payload: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as resp:
        resp.raise_for_status()
        return await resp.json()


TOOL_TEXT = ";ok;"  # what the "tool" appends between the two model turns (loss mask 0)


async def generate(args, sample, sampling_params):
    """A custom generate as slime users write them (--custom-generate-function-path): it POSTs
    SGLang's /generate to the router address in `args` itself, twice, with a tool observation in
    between, and fills tokens, response, loss_mask and rollout_log_probs."""
    tok = _tokenizer(args.hf_checkpoint)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = tok(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    sample.loss_mask, sample.rollout_log_probs = [], []
    for turn in range(2):
        if turn:
            tool = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"]
            sample.tokens += tool
            sample.response += TOOL_TEXT
            sample.response_length += len(tool)
            sample.loss_mask += [0] * len(tool)
            sample.rollout_log_probs += [0.0] * len(tool)
        params = dict(sampling_params, max_new_tokens=sampling_params["max_new_tokens"] // 2)
        output = await _post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        new = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        sample.tokens += new
        sample.response += output["text"]
        sample.response_length += len(new)
        sample.loss_mask += [1] * len(new)
        sample.rollout_log_probs += [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        sample.weight_versions.append(output["meta_info"]["weight_version"])
        finish = output["meta_info"]["finish_reason"]["type"]
        sample.status = {"length": sample.Status.TRUNCATED, "abort": sample.Status.ABORTED}.get(
            finish, sample.Status.COMPLETED)
    return sample


async def generate_text(args, sample, sampling_params):
    """The same two turns the way slime's multi-turn examples (search-r1) write them: each call
    sends the whole conversation as `text`, and the sample is filled with append_response_tokens."""
    tok = _tokenizer(args.hf_checkpoint)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = tok(sample.prompt, add_special_tokens=False)["input_ids"]
    response = ""
    for turn in range(2):
        if turn:
            tool = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"]
            response += TOOL_TEXT
            sample.append_response_tokens(args, tokens=tool, trainable=False, text=TOOL_TEXT)
        params = dict(sampling_params, max_new_tokens=sampling_params["max_new_tokens"] // 2)
        output = await _post(url, {"text": sample.prompt + response, "sampling_params": params, "return_logprob": True})
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = sample.Status.ABORTED
            return sample
        items = output["meta_info"]["output_token_logprobs"]
        response += output["text"]
        sample.append_response_tokens(args, tokens=[i[1] for i in items], log_probs=[i[0] for i in items],
                                      trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample
