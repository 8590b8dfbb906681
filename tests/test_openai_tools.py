"""What agent frameworks use, through the OpenAI proxy with the unmodified `openai` client and a real
embedded engine: tool calls parsed into `tool_calls` and answered with `tool` messages, streamed
responses that accumulate to the non-streamed one, `n` replies, `stop` strings, malformed tool-call
text returned as content with a flag, and the episode's exact tokens, masks and log-probs behind it.

A tiny model is trained here (transformers, a few seconds) to write scripted replies, so that
greedy decoding on the engine produces real tool-call text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from streamrl.core.chat import format_tool_call
from streamrl.producers.episode import Episode, to_samples
from streamrl.recipes.agents.tool_agent import TOOLS

openai = pytest.importorskip("openai")

CALL = format_tool_call("calculator", {"expression": "37*86"})
BAD_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 9*9}}\n</tool_call>'
USER = {"role": "user", "content": "37*86="}
# (messages, tools, the reply the scripted model writes)
SCRIPT: list[tuple[list[dict[str, Any]], Any, str]] = [
    ([USER], TOOLS, CALL),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "37*86"}'}}]},
      {"role": "tool", "content": "3182"}], TOOLS, "3182"),
    ([{"role": "user", "content": "9*9="}], TOOLS, BAD_CALL),
    ([{"role": "user", "content": "why?"}], None, "42 because. Observation: none"),
]


@pytest.fixture(scope="module")
def tok(model_dirs: tuple[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs[0])


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny model trained until its greedy replies are SCRIPT's."""
    import torch

    from streamrl.connectors.megatron.model_kit import init_model_dir
    from streamrl.runtime.rollout import encode_prompt

    from enginekit import hf_greedy, load_model

    out = init_model_dir(tmp_path_factory.mktemp("scripted"), "tiny", seed=0)
    model, tok_ = load_model(out).train(), __import__("transformers").AutoTokenizer.from_pretrained(out)
    rows = [(encode_prompt(tok_, m, t), list(tok_(r, add_special_tokens=False)["input_ids"]) + [tok_.eos_token_id])
            for m, t, r in SCRIPT]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 2001):
        loss = 0.0
        for p, r in rows:
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(r))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:  # checked often: it learned in 80 steps (2026-11-28), 100 were the old first check
            model.eval()
            if all(hf_greedy(model, p, len(r)) == r for p, r in rows):
                print(f"the scripted model learned its replies in {step} steps")
                break
            model.train()
    else:
        pytest.fail("the scripted model did not learn its replies")
    model.save_pretrained(out)
    return str(out)


async def _load(url: str, model_dir: str) -> None:
    import aiohttp

    from enginekit import post_json

    async with aiohttp.ClientSession() as s:
        status, body = await post_json(s, url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"})
        assert status == 200, body


@asynccontextmanager
async def _agent(engine_url: str, tok: Any, temperature: float = 0.0, keys: Any = None) -> AsyncIterator[Callable[[], Any]]:
    """A factory of (episode, openai client for it) pairs served by one proxy (`keys`: the engine's)."""
    from streamrl.connectors.sglang.client import SGLangClient
    from streamrl.producers.openai_proxy import OpenAIProxy

    proxy = OpenAIProxy()
    await proxy.start()
    clients = []
    async with SGLangClient(engine_url, keys=keys) as c:
        def new() -> tuple[Episode, Any]:
            ep = Episode(c, tok, sampling={"temperature": temperature}, max_new_tokens=64, max_context=256)
            oa = openai.AsyncOpenAI(base_url=proxy.url, api_key=proxy.open(ep), max_retries=0)
            clients.append(oa)
            return ep, oa

        try:
            yield new
        finally:
            for oa in clients:
                await oa.close()
            await proxy.close()


def _trained(ep: Episode) -> tuple[list[int], list[float]]:
    return ([t for t, m in zip(ep.tokens, ep.mask) if m], [lp for lp, m in zip(ep.logprobs, ep.mask) if m])


# ---------------------------------------------------------------- tool calls


def test_a_tool_call_is_parsed_answered_and_recorded_exactly(engine: Any, tok: Any, scripted_model: str) -> None:
    from streamrl.recipes.agents.tool_agent import run as run_agent

    async def go() -> tuple[Episode, list[Any], list[Any], list[str | None]]:
        await _load(engine.url, scripted_model)
        async with _agent(engine.url, tok) as new:
            ep, oa = new()
            msgs: list[Any] = [USER]
            first = await oa.chat.completions.create(model="x", messages=msgs, tools=TOOLS, logprobs=True)
            call = first.choices[0].message.tool_calls[0]
            msgs += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "3182"}]
            second = await oa.chat.completions.create(model="x", messages=msgs, tools=TOOLS, logprobs=True)
            answers = []
            for stream in (False, True):  # the example agent, unmodified, plain and streaming
                other, _ = new()
                answers.append(await run_agent("37*86=", other.base_url, other.api_key, stream=stream))
            return ep, [first, second], msgs + [second.choices[0].message], answers

    ep, (first, second), convo, answers = asyncio.run(go())
    c = first.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("function", "calculator", {"expression": "37*86"})] and c.message.tool_calls[0].id.startswith("call_")
    assert c.model_extra["streamrl"] == {"tool_call_error": None}
    assert second.choices[0].message.content == "3182" and second.choices[0].finish_reason == "stop"
    assert answers == ["3182", "3182"]
    # the episode is exactly the conversation as the chat template renders it, tools and tool call included
    rendered = tok.apply_chat_template([m if isinstance(m, dict) else m.model_dump() for m in convo], tools=TOOLS,
                                       tokenize=False)
    text = tok.decode(ep.tokens, skip_special_tokens=False)
    assert rendered == text + "\n"
    # trained: exactly the model's two replies, with the log-probs the client was given
    ids, lps = _trained(ep)
    assert tok.decode(ids, skip_special_tokens=False) == CALL + "<|im_end|>" + "3182<|im_end|>"
    assert lps == [e.logprob for r in (first, second) for e in r.choices[0].logprobs.content]
    # and the stored sequence is what the model saw: one forward pass over it gives the same log-probs
    from enginekit import load_model, reference_logprobs

    ref = reference_logprobs(load_model(scripted_model), ep.tokens[:1], ep.tokens[1:], temperature=0)
    assert ref[ep.mask.index(1) - 1:] and [r for r, m in zip(ref, ep.mask[1:]) if m] == pytest.approx(lps, abs=1e-4)
    masked = tok.decode([t for t, m in zip(ep.tokens, ep.mask) if m == 0], skip_special_tokens=False)
    assert "<|im_start|>tool\n3182<|im_end|>" in masked and "<tools>\ncalculator(expression)\n</tools>" in masked
    assert all(v == 0 for v, m in zip(ep.versions, ep.mask) if m)
    _, (sample,) = to_samples([ep])
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["malformed_tool_calls"] == 0


def test_malformed_tool_call_text_comes_back_as_content_with_a_flag(engine: Any, tok: Any, scripted_model: str) -> None:
    async def go() -> tuple[Episode, Any, Any]:
        await _load(engine.url, scripted_model)
        async with _agent(engine.url, tok) as new:
            ep, oa = new()
            bad = await oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "9*9="}], tools=TOOLS)
            _, oa2 = new()
            off = await oa2.chat.completions.create(model="x", messages=[USER], tools=TOOLS, tool_choice="none")
            return ep, bad, off

    ep, bad, off = asyncio.run(go())
    c = bad.choices[0]
    assert c.message.content == BAD_CALL and not c.message.tool_calls and c.finish_reason == "stop"
    assert "tool call 0: not JSON" in c.model_extra["streamrl"]["tool_call_error"]
    _, (sample,) = to_samples([ep])
    assert sample.metadata["malformed_tool_calls"] == 1 and sample.metadata["tool_calls"] == 0
    # tool_choice "none": the model's text is content, nothing is parsed
    assert off.choices[0].message.content == CALL and not off.choices[0].message.tool_calls


# ---------------------------------------------------------------- streaming


def test_streamed_chunks_equal_the_non_streamed_response(engine: Any, tok: Any, scripted_model: str) -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState

    async def turns(oa: Any, stream: bool) -> tuple[list[Any], list[Any]]:
        """Both turns of the tool conversation; with `stream`, each accumulated from its chunks."""
        msgs: list[Any] = [USER]
        out, chunks = [], []
        for _ in range(2):
            kw = {"model": "x", "messages": msgs, "tools": TOOLS, "logprobs": True}
            if stream:
                state = ChatCompletionStreamState()
                async for chunk in await oa.chat.completions.create(**kw, stream=True,
                                                                    stream_options={"include_usage": True}):
                    chunks.append(chunk)
                    state.handle_chunk(chunk)
                r = state.get_final_completion()
            else:
                r = await oa.chat.completions.create(**kw)
            out.append(r)
            m = r.choices[0].message
            msgs.append({"role": "assistant", "content": m.content,
                         **({"tool_calls": [t.model_dump(include={"id", "type", "function"}) for t in m.tool_calls]}
                            if m.tool_calls else {})})
            msgs.append({"role": "tool", "tool_call_id": "x", "content": "3182"})
        return out, chunks

    async def go() -> tuple[Episode, Episode, list[Any], list[Any], list[Any]]:
        await _load(engine.url, scripted_model)
        async with _agent(engine.url, tok) as new:
            (ep_a, oa_a), (ep_b, oa_b) = new(), new()
            plain, _ = await turns(oa_a, stream=False)
            streamed, chunks = await turns(oa_b, stream=True)
            return ep_a, ep_b, plain, streamed, chunks

    ep_a, ep_b, plain, streamed, chunks = asyncio.run(go())

    def view(r: Any) -> Any:
        c = r.choices[0]
        return (c.message.content, [(t.type, t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                c.finish_reason, [(e.token, e.logprob) for e in c.logprobs.content],
                (r.usage.prompt_tokens, r.usage.completion_tokens))

    assert [view(r) for r in streamed] == [view(r) for r in plain]
    assert plain[0].choices[0].finish_reason == "tool_calls" and plain[1].choices[0].message.content == "3182"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert sum(1 for d in deltas if d.tool_calls and d.tool_calls[0].function.arguments) > 1  # arguments in pieces
    assert sum(1 for d in deltas if d.content) > 1 and chunks[-1].usage is not None  # the answer token by token
    assert (ep_a.tokens, ep_a.mask, ep_a.logprobs) == (ep_b.tokens, ep_b.mask, ep_b.logprobs)


# ---------------------------------------------------------------- stop and n


def test_a_stop_string_ends_the_turn_after_its_token(engine: Any, tok: Any, scripted_model: str) -> None:
    why = {"role": "user", "content": "why?"}

    async def go() -> tuple[Episode, Any, Any]:
        await _load(engine.url, scripted_model)
        async with _agent(engine.url, tok) as new:
            ep, oa = new()
            r = await oa.chat.completions.create(model="x", messages=[why], stop=["Observation", "zzz"])
            nxt = await oa.chat.completions.create(model="x", messages=[
                why, r.choices[0].message, {"role": "user", "content": "ok"}], max_tokens=2)
            return ep, r, nxt

    ep, r, nxt = asyncio.run(go())
    assert r.choices[0].message.content == "42 because. " and r.choices[0].finish_reason == "stop"
    first = ep.replies[0].tokens
    assert "Observation" in tok.decode(first) and "Observation" not in tok.decode(first[:-1])  # cut after its token
    # the next turn follows the model's own tokens: the end of turn is context, not a model token
    start = ep.mask.index(1) + len(first)
    between = ep.tokens[start:start + ep.mask[start:].index(1)]
    assert tok.decode(between, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    assert nxt.choices[0].finish_reason == "length"


def test_n_replies_and_the_conversation_continues_from_the_one_sent_back(engine: Any, tok: Any,
                                                                         model_dirs: tuple[str, str]) -> None:
    user = {"role": "user", "content": "12+3="}

    async def go() -> tuple[Episode, Any, int, Episode, Any]:
        async with _agent(engine.url, tok, temperature=1.0) as new:
            for _ in range(5):  # sampled: find a reply (not the first) unlike the others
                ep, oa = new()
                r = await oa.chat.completions.create(model="x", messages=[user], n=4, max_tokens=6, logprobs=True)
                texts = [c.message.content for c in r.choices]
                k = next((i for i in range(1, 4) if texts.count(texts[i]) == 1), None)
                if k is not None:
                    break
            else:
                pytest.fail(f"4 sampled replies were never distinct: {texts}")
            await oa.chat.completions.create(model="x", messages=[user, r.choices[k].message,
                                                                   {"role": "tool", "tool_call_id": "t", "content": "15+4="}], max_tokens=3)
            ended, oa2 = new()
            last = await oa2.chat.completions.create(model="x", messages=[user], n=2, max_tokens=6, logprobs=True)
            return ep, r, k, ended, last

    ep, r, k, ended, last = asyncio.run(go())
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    chosen = r.choices[k].logprobs.content
    assert ep.replies[0].text == r.choices[k].message.content
    assert ep.logprobs[ep.mask.index(1):][:len(chosen)] == [e.logprob for e in chosen]
    assert len(ep.replies) == 2 and sum(ep.mask) == len(chosen) + len(ep.replies[1].tokens)
    # the stored sequence is what the model saw in both turns: a forward pass over it gives their log-probs
    from enginekit import load_model, reference_logprobs

    ref = reference_logprobs(load_model(model_dirs[0]), ep.tokens[:1], ep.tokens[1:])
    assert [r for r, m in zip(ref, ep.mask[1:]) if m] == pytest.approx(_trained(ep)[1], abs=1e-4)
    # an episode that ends after an n > 1 turn keeps the first reply
    assert _trained(ended)[1] == [e.logprob for e in last.choices[0].logprobs.content]


# ---------------------------------------------------------------- refusals


def test_requests_the_proxy_cannot_serve_are_refused_with_the_reason(engine: Any, tok: Any, scripted_model: str) -> None:
    async def go() -> dict[str, tuple[int, str]]:
        await _load(engine.url, scripted_model)
        errors = {}
        async with _agent(engine.url, tok) as new:
            ep, oa = new()
            first = await oa.chat.completions.create(model="x", messages=[USER], tools=TOOLS)
            call = first.choices[0].message.tool_calls[0].model_dump()
            edited = {**call, "function": {"name": "calculator", "arguments": '{"expression": "37*87"}'}}
            then = [{"role": "tool", "tool_call_id": call["id"], "content": "3182"}]
            for name, kw in {
                "n": {"messages": [USER], "n": 0},
                "stop": {"messages": [USER], "stop": [""]},
                "tools": {"messages": [USER], "tools": [{"type": "function", "function": {"description": "x"}}]},
                "changed_tools": {"messages": [USER, first.choices[0].message, *then], "tools": None},
                "edited_call": {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [edited]}, *then],
                                "tools": TOOLS},
            }.items():
                try:
                    await new()[1].chat.completions.create(model="x", **kw) if name in ("n", "stop", "tools") else \
                        await oa.chat.completions.create(model="x", **kw)
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, str(e))
        return errors

    errors = asyncio.run(go())
    assert {k: v[0] for k, v in errors.items()} == dict.fromkeys(("n", "stop", "tools", "changed_tools", "edited_call"), 400)
    assert "n is 0" in errors["n"][1] and "stop strings must not be empty" in errors["stop"][1]
    assert "tools[0]" in errors["tools"][1] and "tools differ" in errors["changed_tools"][1]
    assert "message 1" in errors["edited_call"][1] and "calling calculator" in errors["edited_call"][1]


def test_the_tool_agent_recipe_data_render_as_the_agent_asks(tmp_path: Path, tok: Any) -> None:
    """The SFT rows carry the agent's tools and teach the call in the format the proxy parses."""
    from streamrl.core.chat import parse_tool_calls
    from streamrl.plugins.tool_tasks import write_tool_task

    paths = write_tool_task(tmp_path, n_train=20, n_eval=8, n_sft=40)
    rows = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    assert all(r["tools"] == TOOLS for r in rows)
    calls = [parse_tool_calls(r["response"], ["calculator"]) for r in rows[::2] if r["response"].startswith("<tool_call>")]
    assert calls and all(c.error is None and c.calls[0]["name"] == "calculator" for c in calls)
    second = rows[1]["prompt"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"] and second[1]["tool_calls"]
    from streamrl.recipe import parse_recipe
    from streamrl.runtime.inputs import sft_rows

    recipe = parse_recipe(f"model: {{path: m}}\ndata: {{path: {paths['train']}}}\nsft: {{path: {paths['sft']}}}\n", "r.yaml")
    prompt, response = sft_rows(recipe, tok)[1]
    assert tok.decode(prompt, skip_special_tokens=False) == tok.apply_chat_template(second, tools=TOOLS, tokenize=False,
                                                                                   add_generation_prompt=True)
    assert tok.decode(response, skip_special_tokens=False) == rows[1]["response"] + "<|im_end|>"
    train = json.loads(paths["train"].read_text().splitlines()[0])
    assert train["label"] == str(eval(train["prompt"][0]["content"].rstrip("=")))  # noqa: S307 - digits and *
