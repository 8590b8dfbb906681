"""Agent environments (streamrl/producers/episode.py, streamrl/producers/openai_proxy.py): the chat-template delta,
group assembly from episodes, and episodes against a real embedded engine, through the proxy
with the real `openai` client."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from streamrl.producers.chat_template import ConversationError, chat_delta
from streamrl.producers.episode import Episode, EpisodeError, Turn, to_samples


@pytest.fixture(scope="module")
def tok(model_dirs: tuple[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs[0])


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- chat_delta


def _reply(tok: Any, ids_: list[int]) -> tuple[list[int], dict[str, Any]]:
    return ids_, {"role": "assistant", "content": tok.decode(ids_, skip_special_tokens=True)}


def test_chat_delta_adds_only_what_follows_the_models_tokens(tok: Any) -> None:
    first = [{"role": "user", "content": "397+8="}]
    assert chat_delta(tok, None, [], first) == ("<|im_start|>user\n397+8=<|im_end|>\n<|im_start|>assistant\n", 0)
    then = [*first, {"role": "assistant", "content": "405"}, {"role": "tool", "content": "405+5="}]
    # the reply ended with the stop token the model generated: only the newline after it is new
    stopped = ids(tok, "405") + [tok.eos_token_id]
    assert chat_delta(tok, first, [_reply(tok, stopped)], then) == (
        "\n<|im_start|>tool\n405+5=<|im_end|>\n<|im_start|>assistant\n", 0)
    # cut by max_new_tokens: the end-of-turn marker is context, not a model token
    assert chat_delta(tok, first, [_reply(tok, ids(tok, "405"))], then)[0].startswith("<|im_end|>\n<|im_start|>tool\n")


def test_chat_delta_continues_the_reply_sent_back_and_keeps_the_models_tokens(tok: Any) -> None:
    first = [{"role": "user", "content": "12+3="}]
    replies = [_reply(tok, ids(tok, "15") + [tok.eos_token_id]), _reply(tok, ids(tok, "16"))]
    then = [*first, {"role": "assistant", "content": "16"}, {"role": "tool", "content": "16+1="}]
    delta, chosen = chat_delta(tok, first, replies, then)
    assert chosen == 1 and delta.startswith("<|im_end|>\n<|im_start|>tool\n")
    # a reply the template writes differently (the agent saw "15" but the model wrote "15 Obs", cut at a
    # stop string): its tokens stay, the template's end of turn follows them
    cut = (ids(tok, "15 Obs"), {"role": "assistant", "content": "15"})
    delta, _ = chat_delta(tok, first, [cut], [*first, {"role": "assistant", "content": "15"},
                                              {"role": "tool", "content": "x"}])
    assert delta == "<|im_end|>\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"


def test_chat_delta_refuses_an_edited_history(tok: Any) -> None:
    first = [{"role": "user", "content": "397+8="}]
    edited = [*first, {"role": "assistant", "content": "406"}, {"role": "tool", "content": "x"}]
    with pytest.raises(ConversationError, match=r"message 1 \('assistant': '406'\) differs"):
        chat_delta(tok, first, [_reply(tok, ids(tok, "405") + [tok.eos_token_id])], edited)
    with pytest.raises(ConversationError, match="must add at least one message"):
        chat_delta(tok, first, [_reply(tok, ids(tok, "405"))], [*first, {"role": "assistant", "content": "405"}])
    with pytest.raises(ConversationError, match=r"message 0 \('user': '397\+9='\) differs"):
        chat_delta(tok, first, [_reply(tok, ids(tok, "405"))], [{"role": "user", "content": "397+9="}, *edited[1:]])


# ---------------------------------------------------------------- to_samples


def _episode(tok: Any, parts: list[tuple[str, int]]) -> Episode:
    """An episode built from (text, version) parts; version -1 = context (observe)."""
    ep = Episode(None, tok, sampling={}, max_new_tokens=8, max_context=256)
    for text, v in parts:
        t = ids(tok, text)
        if v < 0:
            ep.observe(t)
        else:
            ep._commit(Turn(t, [-0.5] * len(t), [v] * len(t), "stop", text))
    return ep


def test_to_samples_prompt_masks_and_versions(tok: Any) -> None:
    a = _episode(tok, [("12+3=", -1), ("15", 2), ("15+4=", -1), ("19", 3)])
    b = _episode(tok, [("12+3=", -1), ("16", 2), ("15+4=", -1), ("20", 2)])
    prompt, samples = to_samples([a, b])
    assert tok.decode(prompt) == "12+3="
    s = samples[0]
    assert tok.decode(s.response_tokens) == "1515+4=19"
    assert s.loss_mask.tolist() == [1] * len(ids(tok, "15")) + [0] * len(ids(tok, "15+4=")) + [1] * len(ids(tok, "19"))
    assert np.all(s.rollout_logprobs[s.loss_mask == 0] == 0) and np.all(s.rollout_logprobs[s.loss_mask == 1] == -0.5)
    n15, nobs = len(ids(tok, "15")), len(ids(tok, "15+4="))
    # tool tokens carry the version before them, so the spans tile the response in order
    assert [(x.version, x.start, x.end) for x in s.spans] == [(2, 0, n15 + nobs), (3, n15 + nobs, s.num_tokens)]
    assert [(x.version) for x in samples[1].spans] == [2]


def test_to_samples_fails_episodes_without_a_model_turn_or_a_shared_prompt(tok: Any) -> None:
    a = _episode(tok, [("12+3=", -1), ("15", 0)])
    idle = _episode(tok, [("12+3=", -1)])
    _, samples = to_samples([a, idle])
    assert not samples[0].failed and samples[1].failed and "without a model turn" in samples[1].error
    other = _episode(tok, [("9+9=", -1), ("18", 0)])
    prompt, samples = to_samples([a, other])
    assert prompt == [] and all(s.failed and "no common prompt" in s.error for s in samples)


# ---------------------------------------------------------------- against a real engine


def _client(url: str) -> Any:
    from streamrl.connectors.sglang.client import SGLangClient

    return SGLangClient(url)


def test_episode_generates_exact_tokens_with_logprobs_and_versions(engine: Any, tok: Any) -> None:
    async def go() -> Episode:
        async with _client(engine.url) as c:
            ep = Episode(c, tok, sampling={"temperature": 1.0}, max_new_tokens=6, max_context=256)
            ep.observe("12+3=")
            await ep.generate()
            ep.observe("7+1=")
            await ep.generate(max_new_tokens=4)
            return ep

    ep = asyncio.run(go())
    gen = [i for i, m in enumerate(ep.mask) if m]
    assert len(ep.turns) == 2 and 2 <= len(gen) <= 10
    assert all(ep.versions[i] == 0 for i in gen) and all(ep.versions[i] == -1 for i, m in enumerate(ep.mask) if not m)
    assert all(ep.logprobs[i] < 0 for i in gen)
    first = ids(tok, "12+3=")
    assert ep.tokens[: len(first)] == first and ep.stats["calls"] >= 2


def test_episode_refuses_a_full_context(engine: Any, tok: Any) -> None:
    async def go() -> None:
        async with _client(engine.url) as c:
            ep = Episode(c, tok, sampling={}, max_new_tokens=6, max_context=4)
            ep.observe("123+456=")
            await ep.generate()

    with pytest.raises(EpisodeError, match="the model's limit is 4"):
        asyncio.run(go())


def test_a_refused_chat_turn_leaves_the_episode_as_it_was(engine: Any, tok: Any) -> None:
    async def go() -> tuple[list[int], Episode, str]:
        async with _client(engine.url) as c:
            ep = Episode(c, tok, sampling={"temperature": 1.0}, max_new_tokens=4, max_context=24)
            first = [{"role": "user", "content": "12+3="}]
            reply = await ep.chat(first)
            before = list(ep.tokens)
            with pytest.raises(EpisodeError, match="the model's limit is 24") as ei:
                await ep.chat([*first, {"role": "assistant", "content": reply}, {"role": "tool", "content": "15+4=" * 3}])
            return before, ep, str(ei.value)

    before, ep, _ = asyncio.run(go())
    assert ep.tokens == before and len(ep.replies) == 1 and len(ep.mask) == len(before)


def test_openai_client_through_the_proxy_records_the_conversation(engine: Any, tok: Any) -> None:
    import openai

    from streamrl.producers.openai_proxy import OpenAIProxy

    async def go() -> tuple[Episode, list[str], dict[str, Any]]:
        proxy = OpenAIProxy()
        await proxy.start()
        async with _client(engine.url) as c:
            ep = Episode(c, tok, sampling={"temperature": 1.0}, max_new_tokens=6, max_context=256)
            key = proxy.open(ep)
            oa = openai.AsyncOpenAI(base_url=ep.base_url, api_key=key, max_retries=0)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
            answers = []
            for tool in ("15+4=", None):
                r = await oa.chat.completions.create(model="x", messages=msgs, logprobs=True)
                answers.append(r.choices[0].message.content)
                if tool:
                    msgs += [{"role": "assistant", "content": answers[-1]}, {"role": "tool", "tool_call_id": "t", "content": tool}]
            errors = {}
            for name, call in {
                "bad_key": openai.AsyncOpenAI(base_url=ep.base_url, api_key="nope", max_retries=0)
                .chat.completions.create(model="x", messages=msgs),
                "n": oa.chat.completions.create(model="x", messages=msgs, n=0),
                "edited": oa.chat.completions.create(model="x", messages=[
                    {"role": "user", "content": "12+3="}, {"role": "assistant", "content": "999"},
                    {"role": "tool", "tool_call_id": "t", "content": "1"}]),
            }.items():
                try:
                    await call
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, str(e))
            proxy.close_session(key)
            await oa.close()
        await proxy.close()
        return ep, answers, errors

    ep, answers, errors = asyncio.run(go())
    assert ep.turns == answers and len(answers) == 2
    convo = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": answers[0]},
             {"role": "tool", "content": "15+4="}, {"role": "assistant", "content": answers[1]}]
    rendered = tok.apply_chat_template(convo, tokenize=False)
    text = tok.decode(ep.tokens, skip_special_tokens=False)
    assert rendered.startswith(text) and rendered[len(text):] in ("\n", "<|im_end|>\n")  # the exact conversation
    masked = tok.decode([t for t, m in zip(ep.tokens, ep.mask) if m == 0], skip_special_tokens=False)
    assert "<|im_start|>tool\n15+4=<|im_end|>" in masked  # the tool's message is context, never trained
    assert errors["bad_key"][0] == 401 and errors["n"][0] == 400 and "n is 0" in errors["n"][1]
    assert errors["edited"][0] == 400 and "differs" in errors["edited"][1]


@pytest.mark.parametrize("policy", ["abort_resume", "restart"])
def test_a_version_update_mid_turn_follows_the_partial_rollout_policy(engine: Any, tok: Any, policy: str) -> None:
    """Pause the engine (abort) in the middle of a long turn, move it to version 1 and continue:
    abort_resume keeps the version-0 tokens and finishes on version 1; restart starts the turn
    again on version 1."""
    import aiohttp

    from enginekit import get_json, post_json

    async def go() -> Episode | None:
        async with _client(engine.url) as c, aiohttp.ClientSession() as s:
            for _ in range(5):  # the turn must still be running when the pause lands
                ep = Episode(c, tok, sampling={"temperature": 1.0, "ignore_eos": True}, max_new_tokens=200,
                             max_context=256, policy=policy)
                ep.observe("12+3=")
                turn = asyncio.ensure_future(ep.generate())
                # pause as soon as the engine runs the request: the tiny model decodes 200 tokens in ~0.1 s on an idle
                # machine, so a fixed 0.15 s missed all 5 tries (CI of 2026-12-02; here too when idle)
                for _ in range(500):
                    if turn.done() or (await get_json(s, engine.url + "/get_load"))[1][0]["num_reqs"]:
                        break
                    await asyncio.sleep(0.005)
                await post_json(s, engine.url + "/pause_generation", {"mode": "abort"})
                await post_json(s, engine.url + "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
                await post_json(s, engine.url + "/continue_generation", {})
                await turn
                await post_json(s, engine.url + "/update_weight_version", {"new_version": "0", "abort_all_requests": False})
                kept = [v for v, m in zip(ep.versions, ep.mask) if m][:1]
                if ep.stats["interruptions"] and (policy == "restart" or kept == [0]):
                    return ep  # (abort_resume: a pause before the first token kept nothing: try again)
        return None

    ep = asyncio.run(go())
    assert ep is not None, "the turn finished before the pause in 5 tries"
    gen = [v for v, m in zip(ep.versions, ep.mask) if m]
    assert len(gen) == 200
    if policy == "abort_resume":
        assert gen[0] == 0 and gen[-1] == 1 and sorted(gen) == gen
    else:
        assert set(gen) == {1}
