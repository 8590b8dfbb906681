"""An OpenAI-compatible `/v1/chat/completions` endpoint in front of the run's engines, so an
agent that only knows a base URL and an API key is trained without changing its code.

Each episode (one sample of an agent environment, streamrl/producers/episode.py) gets its own API key;
requests with that key are turns of that episode: the proxy adds only what is new in the
message list (the chat template's rendering of it), generates through the router with SGLang's
native `/generate` (exact token ids, log-probs and weight versions) and answers in OpenAI's
format. So the pool stores exactly the tokens the model produced, never a re-tokenization of
the text the agent sends back.

What agent frameworks use, as OpenAI does it:
- `tools`: the definitions reach the chat template; tool calls in the model's text (Qwen/Hermes
  `<tool_call>{json}</tool_call>`) come back as `message.tool_calls` with `finish_reason:
  "tool_calls"`, and the assistant message and `tool` results the agent sends next go back
  through the template. Malformed tool-call text comes back as plain content, never an error,
  with the reason in the choice's `streamrl.tool_call_error`. `tool_choice: "none"` turns parsing
  off; other choices cannot force a call (the model is not constrained).
- `stream: true`: server-sent `chat.completion.chunk`s (content, tool-call deltas, finish reason,
  `stream_options.include_usage`), sent once the turn is generated: a turn may be interrupted by a
  weight update and generated again (partial_rollout: restart), so nothing is sent that could be
  taken back.
- `stop`: the turn ends after the token that completes a stop string (kept: the model generated
  it); the content ends before it.
- `n`: n replies to the same context; the conversation continues from whichever the agent sends
  back (the first when the episode ends there).
- `logprobs: true`: the exact log-prob of every generated token.

Sampling follows the recipe's rollout settings (temperature, top_p, top_k), whatever the agent
asks (`temperature`, `seed`, ...): the learner's importance ratios assume the rollout's sampling
distribution, and a fixed seed would make a group's samples identical. `max_tokens` is honoured
up to rollout.max_new_tokens. Messages are checked as OpenAI checks them (chat.check_messages):
a malformed one is a 400 naming its field, before anything is added to the episode. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.core import chat
from streamrl.producers.episode import Episode, EpisodeError, Turn

log = logging.getLogger("streamrl.producers.openai_proxy")

MAX_N = 128  # OpenAI's limit on `n`
# URLs and host:port pairs (aiohttp's connection errors name the host without a scheme)
INTERNAL_URL = re.compile(r"\bhttps?://[^\s'\"]+|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\blocalhost:\d+")


class ChatRequest(msgspec.Struct, kw_only=True):
    """The part of OpenAI's chat-completions request the proxy reads (other keys are ignored, as
    OpenAI-compatible servers do)."""

    messages: list[Any]  # checked by chat.check_messages, which names the offending field
    model: str = "streamrl"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _n(req: ChatRequest) -> int:
    return 1 if req.n is None else req.n


def _max_tokens(req: ChatRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _check(req: ChatRequest) -> str | None:
    """Why the request cannot be served, or None."""
    if (why := chat.check_messages(req.messages)) is not None:
        return why
    if (limit := _max_tokens(req)) is not None and limit < 1:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return f"{name} is {limit}; it must be at least 1 (leave it out for the run's rollout.max_new_tokens)"
    if not 1 <= _n(req) <= MAX_N:
        return f"n is {req.n}; it must be between 1 and {MAX_N}"
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if not all(stops):
        return f"stop is {req.stop!r}; stop strings must not be empty"
    return chat.check_tools(req.tools) if req.tools is not None else None


def completion(ep: Episode, req: ChatRequest, turns: list[Turn], context_added: int) -> dict[str, Any]:
    """The chat.completion object OpenAI would return for `turns` (the episode's n replies)."""
    prompt_tokens = len(ep.tokens) - len(ep.replies[-1].tokens)
    choices = []
    for i, t in enumerate(turns):
        lps = None
        if req.logprobs:
            lps = {"content": [{"token": ep.tokenizer.decode([tok]), "logprob": lp, "bytes": None, "top_logprobs": []}
                               for tok, lp in zip(t.tokens, t.logprobs)], "refusal": None}
        choices.append({"index": i, "message": t.message, "logprobs": lps, "finish_reason": t.finish_reason,
                        "streamrl": {"tool_call_error": t.tool_call_error}})
    completion_tokens = sum(len(t.tokens) for t in turns)
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "streamrl": {"context_tokens_added": context_added}}


class OpenAIProxy:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.sessions: dict[str, Episode] = {}
        self.app = web.Application(client_max_size=16 * 2**20)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_get("/v1/models", self.models)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        # Every sample of every group in flight may connect at once (hundreds): listen_socket's backlog is 4096.
        sock = listen_socket(self.host)
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self.host}:{port_of(sock)}/v1"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, episode: Episode) -> str:
        """Serve `episode` under a new API key; sets episode.base_url/api_key."""
        key = "srl-" + secrets.token_urlsafe(24)
        self.sessions[key] = episode
        episode.base_url, episode.api_key = self.url, key
        return key

    def close_session(self, key: str | None) -> None:
        self.sessions.pop(key or "", None)

    def _episode(self, request: web.Request) -> Episode | None:
        auth = request.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else ""
        return self.sessions.get(key)

    async def models(self, request: web.Request) -> web.Response:
        if self._episode(request) is None:
            return _error(401, "unknown API key: use the key the environment was given (llm.api_key)",
                          "authentication_error")
        return web.json_response({"object": "list", "data": [{"id": "streamrl", "object": "model",
                                                               "owned_by": "streamrl"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        ep = self._episode(request)
        if ep is None:
            return _error(401, "unknown API key: use the key the environment was given (llm.api_key); the key "
                               "stops working when its episode ends", "authentication_error")
        try:
            req = msgspec.json.decode(await request.read(), type=ChatRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return _error(400, f"bad chat-completions request: {e}")
        if (why := _check(req)) is not None:
            return _error(400, why)
        before = len(ep.tokens)
        try:
            turns = await ep.complete(req.messages, _max_tokens(req), req.tools,
                                      n=_n(req), stop=[req.stop] if isinstance(req.stop, str) else req.stop,
                                      parse_tools=req.tool_choice != "none")
        except EpisodeError as e:
            # An engine error names the router's or an engine's address: the agent has no business with it.
            return _error(400, INTERNAL_URL.sub("<engine>", str(e)))
        body = completion(ep, req, turns, len(ep.tokens) - before - len(ep.replies[-1].tokens))
        if not req.stream:
            return web.json_response(body)
        decode = lambda ids: ep.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        chunks = chat.completion_chunks(body, [chat.text_pieces(decode, t.tokens) for t in turns],
                                        include_usage=bool((req.stream_options or {}).get("include_usage")))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(b"data: " + msgspec.json.encode(c) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
