"""OpenAI-style conversations rendered with the tokenizer's chat template, one turn at a time, so
that an episode (streamrl/producers/episode.py) adds only the template text that is new after the
model's own tokens (token-in/token-out: what the model generated is never re-tokenized).

Messages may carry OpenAI `tool_calls` (their `arguments` a JSON string) and `tool` results; the
template renders them (the tiny model's: Qwen/Hermes `<tool_call>` blocks, connectors/megatron/model_kit.py).
"""

from __future__ import annotations

from typing import Any

from streamrl.core.chat import canonical_arguments


class ConversationError(Exception):
    """A conversation that does not extend the episode's previous turn."""


def content_text(m: dict[str, Any]) -> str:
    """A message's text; OpenAI content parts ([{"type": "text", "text": ...}]) are joined."""
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c or ""


def _calls(m: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as the template renders them (arguments as an object)."""
    out = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", c) if isinstance(c, dict) else {}
        out.append({"type": "function", "function": {"name": f.get("name"),
                                                      "arguments": canonical_arguments(f.get("arguments", {}))}})
    return out


def same_message(want: dict[str, Any], got: dict[str, Any]) -> bool:
    """Equal as the template renders them: role, text, tool calls (name and arguments; ids and
    other keys are not rendered)."""
    return (got.get("role") == want.get("role") and content_text(got) == content_text(want)
            and _calls(got) == _calls(want))


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
    msgs = []
    for m in messages:
        msg = {**m, "content": content_text(m)}
        if m.get("tool_calls"):
            msg["tool_calls"] = _calls(m)
        msgs.append(msg)
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False, **kw)


def _describe(m: dict[str, Any]) -> str:
    calls = ", ".join(f"{c['function']['name']}(...)" for c in _calls(m))
    return f"{m.get('role')!r}: {content_text(m)[:60]!r}" + (f" calling {calls}" if calls else "")


def chat_delta(tokenizer: Any, history: list[dict[str, Any]] | None,
               replies: list[tuple[list[int], dict[str, Any]]], messages: list[dict[str, Any]],
               tools: Any = None) -> tuple[str, int]:
    """(the template text to add after the tokens so far, which reply the conversation continued)
    so that the context becomes `messages` followed by the assistant prompt.

    `history` is the message list of the previous turn (None on the first), `replies` its
    candidate replies as (token ids the model generated, the assistant message the agent was
    given): one, or `n` of them. `messages` must repeat `history`, then one of the replies'
    messages, then add at least one message. The model's tokens stay as they are: the delta starts
    with the template's end of the assistant turn (less the end-of-turn token when the model
    generated it), so a reply the template would write differently (a stop string cut off, tool-call
    JSON spaced otherwise) keeps its exact tokens. Raises ConversationError otherwise."""
    if history is None:
        return render(tokenizer, messages, True, tools), 0
    n = len(history)
    for i, (want, got) in enumerate(zip(history, messages)):
        if not same_message(want, got):
            raise ConversationError(
                f"message {i} ({_describe(got)}) differs from the one this episode was sent ({_describe(want)}); a "
                "trained conversation must send earlier messages back unchanged")
    chosen = next((k for k, (_, msg) in enumerate(replies) if len(messages) > n and same_message(msg, messages[n])), None)
    if len(messages) > n and chosen is None:
        raise ConversationError(
            f"message {n} ({_describe(messages[n])}) differs from the one this episode generated "
            f"({_describe(replies[0][1]) if replies else 'none'}); a trained conversation must send earlier messages "
            "back unchanged (token-in/token-out: the model's own tokens are kept)")
    if len(messages) <= n + 1:
        raise ConversationError(f"the conversation has {len(messages)} messages; a new turn must add at least one "
                                f"message after the {n + 1} of the previous turn and its reply")
    ids = replies[chosen][0]
    before = render(tokenizer, history, True, tools)
    empty = render(tokenizer, [*history, {"role": "assistant", "content": ""}], False, tools)
    closed = render(tokenizer, messages[:n + 1], False, tools)
    full = render(tokenizer, messages, True, tools)
    tail = empty[len(before):]
    if not (empty.startswith(before) and closed.startswith(before) and closed.endswith(tail) and full.startswith(closed)):
        raise ConversationError("the chat template does not render this conversation as an extension of its "
                                "previous turn, so the new turn cannot reuse the model's tokens")
    end = tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids and ids[-1] in tokenizer.all_special_ids else ""
    skip = len(end) if end and tail.startswith(end) else 0
    return tail[skip:] + full[len(closed):], chosen
