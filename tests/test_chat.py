"""The chat-completions rules (streamrl/core/chat.py): the Hermes tool-call format written and
parsed, stop strings cut on a token boundary, incremental detokenization, and SSE chunks that the
`openai` SDK accumulates back into the non-streamed completion; the tiny model's chat template
renders tool calls in the same format and renders tool-free conversations as it always did."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamrl.core import chat

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "exact arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


# ---------------------------------------------------------------- tool calls


def test_a_formatted_call_parses_back() -> None:
    text = chat.format_tool_call("calculator", {"expression": "37*86"})
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*86"}}\n</tool_call>'
    p = chat.parse_tool_calls(text, ["calculator"])
    assert p.content is None and p.error is None and p.calls == [{"name": "calculator", "arguments": {"expression": "37*86"}}]


def test_content_before_calls_several_calls_and_arguments_as_a_string() -> None:
    text = ("Let me compute.\n" + chat.format_tool_call("calculator", {"expression": "1+1"}) + "\n"
            + '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call> trailing')
    p = chat.parse_tool_calls(text)
    assert p.error is None and p.content == "Let me compute."
    assert [c["arguments"] for c in p.calls] == [{"expression": "1+1"}, {"expression": "2*3"}]


def test_text_without_calls_is_content() -> None:
    assert chat.parse_tool_calls("405", ["calculator"]) == chat.ParsedReply("405")


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+', "has no </tool_call>"),
    ('<tool_call>{"name": calculator}</tool_call>', "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown function 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call> and <tool_call>{"name": "calculator", '
     '"arguments": {}}</tool_call>', "text between tool calls"),
    ("405</tool_call>", "without <tool_call>"),
])
def test_malformed_calls_come_back_as_content_with_the_reason(text: str, why: str) -> None:
    p = chat.parse_tool_calls(text, ["calculator"])
    assert p.content == text and p.calls == [] and why in (p.error or ""), p


def test_the_tiny_chat_template_renders_calls_in_the_parsed_format() -> None:
    from streamrl.connectors.megatron.model_kit import build_tokenizer

    tok = build_tokenizer()
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*86"}}}
    convo = [{"role": "user", "content": "37*86="}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "3182"}]
    text = tok.apply_chat_template(convo, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\n<tools>\ncalculator(expression)\n</tools><|im_end|>\n"
                    "<|im_start|>user\n37*86=<|im_end|>\n<|im_start|>assistant\n"
                    + chat.format_tool_call("calculator", {"expression": "37*86"}) + "<|im_end|>\n"
                    "<|im_start|>tool\n3182<|im_end|>\n<|im_start|>assistant\n")
    # without tools and tool calls: the template the tiny models always had
    plain = [{"role": "system", "content": "Be brief."}, *convo[:1], {"role": "assistant", "content": "3182"}]
    assert tok.apply_chat_template(plain, tokenize=False) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain)


# ---------------------------------------------------------------- tokens and text


class _Bytes:
    """A decoder over byte tokens, where a multi-byte character spans tokens."""

    def __call__(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_pieces_join_to_the_text_and_wait_for_whole_characters() -> None:
    ids = list("a€b".encode())  # € is 3 bytes
    pieces = chat.text_pieces(_Bytes(), ids)
    assert pieces == ["a", "", "", "€", "b"] and "".join(pieces) == "a€b"


def test_stop_cut_keeps_the_token_that_completes_the_stop_string() -> None:
    pieces = ["The", " answer", " is", " 4", "2.\n", "Obs", "ervation"]
    assert chat.stop_cut(pieces, ["Observation"]) == (7, len("The answer is 42.\n"))
    assert chat.stop_cut(pieces, ["\n", "answer"]) == (2, len("The "))  # the earliest stop wins
    assert chat.stop_cut(pieces, ["4"]) == (4, len("The answer is "))
    assert chat.stop_cut(pieces, ["xyz"]) is None


# ---------------------------------------------------------------- streaming


def _completion(message: dict[str, Any], finish: str, entries: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": {"content": entries, "refusal": None} if entries is not None else None,
                         "streamrl": {"tool_call_error": None}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def _entries(tokens: list[str]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": -0.5 * i, "bytes": None, "top_logprobs": []} for i, t in enumerate(tokens)]


def _accumulate(chunks: list[dict[str, Any]]) -> Any:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for c in chunks:
        list(state.handle_chunk(ChatCompletionChunk.model_validate(c)))
    return state.current_completion_snapshot


@pytest.mark.parametrize("logprobs", [True, False])
def test_chunks_accumulate_to_the_completion_text(logprobs: bool) -> None:
    tokens = ["40", "5", "<|im_end|>"]
    body = _completion({"role": "assistant", "content": "405"}, "stop", _entries(tokens) if logprobs else None)
    chunks = chat.completion_chunks(body, [["40", "5", ""]], include_usage=True)
    got = _accumulate(chunks)
    assert got.choices[0].message.content == "405" and got.choices[0].finish_reason == "stop"
    assert got.usage is not None and got.usage.total_tokens == 9 and chunks[-1]["choices"] == []
    if logprobs:
        assert [e.model_dump() for e in got.choices[0].logprobs.content] == body["choices"][0]["logprobs"]["content"]
    assert got.choices[0].model_extra["streamrl"] == {"tool_call_error": None}


def test_chunks_accumulate_to_the_completion_tool_calls() -> None:
    args = json.dumps({"expression": "37*86+1234*5678"})
    calls = [{"id": "call_a", "type": "function", "function": {"name": "calculator", "arguments": args}},
             {"id": "call_b", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]
    text = "Let me see.\n" + chat.format_tool_call("calculator", json.loads(args))
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    body = _completion({"role": "assistant", "content": "Let me see.", "tool_calls": calls}, "tool_calls",
                       _entries(pieces))
    chunks = chat.completion_chunks(body, [pieces])
    got = _accumulate(chunks).choices[0]
    assert got.message.content == "Let me see." and got.finish_reason == "tool_calls"
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c["id"], "function", c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert len(got.logprobs.content) == len(pieces)  # every token's log-prob, the call's tokens included
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert sum("tool_calls" in d and "id" in d["tool_calls"][0] for d in deltas) == 2  # id + name once per call
    assert sum("tool_calls" in d for d in deltas) > 3  # the arguments arrive in pieces


def test_chunks_of_several_choices_keep_their_index() -> None:
    body = _completion({"role": "assistant", "content": "1"}, "stop", None)
    body["choices"].append({"index": 1, "message": {"role": "assistant", "content": "22"}, "finish_reason": "length",
                            "logprobs": None})
    got = _accumulate(chat.completion_chunks(body, [["1"], ["2", "2"]]))
    assert [(c.message.content, c.finish_reason) for c in got.choices] == [("1", "stop"), ("22", "length")]
