"""The chat-completions rules an agent's turn goes through, as pure functions: the tool-call text
format (Qwen/Hermes `<tool_call>{json}</tool_call>`, written and parsed), stop strings cut on a
token boundary, incremental detokenization, and the SSE chunks of a completion.

The OpenAI proxy (streamrl/producers/openai_proxy.py) and agent episodes (streamrl/producers/episode.py)
call these; the tiny model's chat template (connectors/megatron/model_kit.py) renders tool calls in the same
format, and the SFT data that teaches it (streamrl/plugins/tool_tasks.py) is written with
`format_tool_call`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it (and the chat template renders an assistant's tool_calls)."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def check_tools(tools: Any) -> str | None:
    """Why `tools` is not a list of OpenAI function tools, or None when it is."""
    if not isinstance(tools, list):
        return f"tools is {type(tools).__name__}, not a list of function tools"
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return f'tools[{i}] is not {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}: {t!r:.120}'
    return None


ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_problem(c: Any, where: str, role: str) -> str | None:
    if isinstance(c, str):
        return None
    if not isinstance(c, list):
        return f"{where} must be a string or an array of text parts, got {type(c).__name__} ({c!r:.40})"
    for j, part in enumerate(c):
        kinds = ("text", "refusal") if role == "assistant" else ("text",)
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in kinds or not isinstance(part.get(key), str):
            # Images and audio would reach the chat template as nothing: the model would be trained without them.
            return (f"{where}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}} (this endpoint serves text "
                    f"only), got {part!r:.80}")
    return None


def _tool_calls_problem(calls: Any, where: str) -> str | None:
    if not isinstance(calls, list):
        return f"{where} must be an array of tool calls, got {type(calls).__name__}"
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or c.get("type", "function") != "function" \
                or not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(f.get("arguments"), str):
            return (f'{where}[{j}] must be {{"id": "...", "type": "function", "function": {{"name": "...", '
                    f'"arguments": "<JSON string>"}}}}, got {c!r:.100}')
    return None


def check_messages(messages: Any) -> str | None:
    """Why `messages` is not an OpenAI chat conversation, or None when it is (the field path first,
    as OpenAI's own 400s give it): a non-empty array; each message an object with a known `role`;
    `content` a string or text parts, required except on an assistant message with `tool_calls`;
    tool calls with an id, a function name and string arguments; `tool` messages with a
    `tool_call_id`. Keys it does not know are ignored, as OpenAI ignores null ones."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty array of messages"
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            return f"{where} must be an object with a role and content, got {type(m).__name__}"
        role = m.get("role")
        if role not in ROLES:
            return f"{where}.role must be one of {', '.join(ROLES)}, got {role!r:.40}"
        if m.get("name") is not None and not isinstance(m["name"], str):
            return f"{where}.name must be a string, got {type(m['name']).__name__}"
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                return f"{where}.tool_calls is only allowed on an assistant message (role is {role!r})"
            if (why := _tool_calls_problem(calls, f"{where}.tool_calls")) is not None:
                return why
        if "content" not in m or m["content"] is None:
            if role != "assistant" or not calls:
                return f"{where}.content is missing: a {role} message needs content (a string or text parts)"
        elif (why := _content_problem(m["content"], f"{where}.content", role)) is not None:
            return why
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            return f"{where}.tool_call_id is missing: a tool message answers a tool call and names its id"
    return None


@dataclass
class ParsedReply:
    """A model turn read as OpenAI sees it: `content` (None when the turn is only tool calls),
    `calls` as [{"name", "arguments": dict}], or `error` when the tool-call text is malformed (then
    `content` is the whole text and `calls` is empty)."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def parse_tool_calls(text: str, names: Sequence[str] | None = None) -> ParsedReply:
    """Split `text` into content and Hermes tool calls. Content is the text before the first
    `<tool_call>` (text after the last call is dropped, as vLLM and SGLang do). Malformed calls
    (unclosed, not JSON, no name, arguments not an object, a function not in `names`) never raise:
    the reply is the whole text as content, with the reason in `error`."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        if TOOL_CALL_CLOSE in text:
            return ParsedReply(text, error=f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}")
        return ParsedReply(text)
    rest, calls, pos = text[start:], [], 0
    for m in _CALL.finditer(rest):
        between = rest[pos:m.start()]
        if between.strip():
            return ParsedReply(text, error=f"text between tool calls: {between.strip()[:40]!r}")
        call, why = _read_call(m.group(1), names)
        if why:
            return ParsedReply(text, error=f"tool call {len(calls)}: {why}")
        calls.append(call)
        pos = m.end()
    if TOOL_CALL_OPEN in rest[pos:]:
        return ParsedReply(text, error=f"tool call {len(calls)} has no {TOOL_CALL_CLOSE}")
    return ParsedReply(text[:start].rstrip() or None, calls)


def _read_call(body: str, names: Sequence[str] | None) -> tuple[dict[str, Any], str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return {}, f"not JSON ({e.msg} at character {e.pos}): {body.strip()[:60]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return {}, f'expected {{"name": ..., "arguments": {{...}}}}, got {body.strip()[:60]!r}'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return {}, f"arguments of {obj['name']!r} are not a JSON object: {args!r:.60}"
    if names is not None and obj["name"] not in names:
        return {}, f"unknown function {obj['name']!r} (the request's tools: {', '.join(names) or 'none'})"
    return {"name": obj["name"], "arguments": args}, None


def canonical_arguments(arguments: Any) -> Any:
    """An OpenAI tool call's `arguments` (a JSON string) as an object when it parses, so that two
    serialisations of the same call compare equal and the chat template renders it canonically."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


# ---------------------------------------------------------------- tokens and text


def text_pieces(decode: Callable[[list[int]], str], ids: Sequence[int]) -> list[str]:
    """The text each token adds (`"".join(pieces) == decode(ids)`), decoded incrementally: a token
    that ends in the middle of a UTF-8 character adds "" and the character comes with the next."""
    pieces, prefix, read = [], 0, 0
    ids = list(ids)
    for i in range(len(ids)):
        before = decode(ids[prefix:read])
        now = decode(ids[prefix:i + 1])
        if now.endswith("\ufffd") and i + 1 < len(ids):
            pieces.append("")
            continue
        pieces.append(now[len(before):] if now.startswith(before) else now)
        prefix, read = read, i + 1
    if "".join(pieces) != decode(ids):  # a tokenizer whose decode is not a concatenation: exact, slower
        texts = [decode(ids[:i]) for i in range(len(ids) + 1)]
        pieces = [texts[i + 1][len(texts[i]):] for i in range(len(ids))]
    return pieces


def stop_cut(pieces: Sequence[str], stops: Sequence[str]) -> tuple[int, int] | None:
    """Where the first stop string ends a turn: (tokens kept, characters of content), or None.
    The token that completes the stop string is kept (the model generated it; SGLang keeps it in
    output_ids too) and the content ends before the stop string (OpenAI's text)."""
    text = "".join(pieces)
    found = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not found:
        return None
    at, s = min(found, key=lambda f: (f[0], -len(f[1])))
    end, n = at + len(s), 0
    for n, p in enumerate(pieces, 1):
        end -= len(p)
        if end <= 0:
            break
    return n, at


# ---------------------------------------------------------------- streaming


ARGUMENT_PIECE = 16  # characters of a tool call's arguments per streamed delta


def completion_chunks(completion: dict[str, Any], pieces: Sequence[Sequence[str]],
                      include_usage: bool = False) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects OpenAI streams for `completion` (a non-streamed
    chat.completion dict): per choice a role delta, one content delta per token (`pieces[i]`: the
    text each token of choice i adds; its content is a prefix of their concatenation), the tool
    calls (id, type and name first, then the arguments in pieces), a last delta with the finish
    reason; then the usage chunk when asked. Keys a choice has beyond OpenAI's (StreamRL's
    `streamrl`) ride on its first chunk, which the SDK keeps. Accumulated (as the openai SDK does), they give back
    `completion`'s choices. Log-prob entries ride on the chunk of their token; those of tokens past
    the content (a tool call, the end-of-turn token) on the last chunk of the choice."""
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    usage = {"usage": None} if include_usage else {}
    out: list[dict[str, Any]] = []

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              **extra: Any) -> None:
        out.append({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish, **extra}], **usage})

    for choice, toks in zip(completion["choices"], pieces):
        i, msg = choice["index"], choice["message"]
        entries = list((choice.get("logprobs") or {}).get("content") or [])
        wrap = (lambda es: {"content": es}) if choice.get("logprobs") is not None else (lambda es: None)
        content = msg.get("content")
        extra = {k: v for k, v in choice.items() if k not in ("index", "message", "logprobs", "finish_reason")}
        chunk(i, {"role": "assistant", "content": "" if content is not None else None}, **extra)
        left, used = content or "", 0
        for piece in toks:
            if not left:
                break
            part, left = piece[:len(left)], left[len(piece):]
            chunk(i, {"content": part}, wrap(entries[used:used + 1]) if entries else wrap([]))
            used += 1
        for k, call in enumerate(msg.get("tool_calls") or []):
            fn = call["function"]
            chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": call["type"],
                                      "function": {"name": fn["name"], "arguments": ""}}]})
            args = fn["arguments"]
            for a in range(0, len(args), ARGUMENT_PIECE):
                chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": args[a:a + ARGUMENT_PIECE]}}]})
        chunk(i, {}, wrap(entries[used:]), choice["finish_reason"])
    if include_usage:
        out.append({**head, "choices": [], "usage": completion.get("usage")})
    return out
