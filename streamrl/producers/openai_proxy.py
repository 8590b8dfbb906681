"""An OpenAI-compatible `/v1/chat/completions` endpoint in front of the run's engines, so an
agent that only knows a base URL and an API key is trained without changing its code.

Each episode (one sample of an agent environment, streamrl/producers/episode.py) gets its own API key;
requests with that key are turns of that episode: the proxy adds only what is new in the
message list (the chat template's rendering of it), generates through the router with SGLang's
native `/generate` (exact token ids, log-probs and weight versions) and answers in OpenAI's
format. So the pool stores exactly the tokens the model produced, never a re-tokenization of
the text the agent sends back.

Sampling follows the recipe's rollout settings (temperature, top_p, top_k), whatever the agent
asks: the learner's importance ratios assume the rollout's sampling distribution. `max_tokens`
is honoured up to rollout.max_new_tokens. Not supported: streaming, n > 1, stop strings,
function-call parsing (tool definitions reach the chat template; the reply comes back as text).
Binds 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.producers.episode import Episode, EpisodeError

log = logging.getLogger("streamrl.producers.openai_proxy")


class ChatRequest(msgspec.Struct, kw_only=True):
    """The part of OpenAI's chat-completions request the proxy reads (other keys are ignored, as
    OpenAI-compatible servers do)."""

    messages: list[dict[str, Any]]
    model: str = "streamrl"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


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

    async def chat(self, request: web.Request) -> web.Response:
        ep = self._episode(request)
        if ep is None:
            return _error(401, "unknown API key: use the key the environment was given (llm.api_key); the key "
                               "stops working when its episode ends", "authentication_error")
        try:
            req = msgspec.json.decode(await request.read(), type=ChatRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return _error(400, f"bad chat-completions request: {e}")
        unsupported = [name for name, bad in (("stream", req.stream), ("n > 1", (req.n or 1) != 1),
                                              ("stop", req.stop)) if bad]
        if unsupported:
            return _error(400, f"not supported by the StreamRL proxy: {', '.join(unsupported)}")
        before = len(ep.tokens)
        try:
            text = await ep.chat(req.messages, req.max_completion_tokens or req.max_tokens, req.tools)
        except EpisodeError as e:
            return _error(400, str(e))
        n_reply = len(ep.reply_ids)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "length" if ep.finish == "length" else "stop"}
        if req.logprobs:
            ids, lps = ep.tokens[-n_reply:], ep.logprobs[-n_reply:]
            choice["logprobs"] = {"content": [{"token": ep.tokenizer.decode([t]), "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(ids, lps)]}
        return web.json_response({
            "id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": [choice],
            "usage": {"prompt_tokens": len(ep.tokens) - n_reply, "completion_tokens": n_reply,
                      "total_tokens": len(ep.tokens)},
            "streamrl": {"context_tokens_added": len(ep.tokens) - before - n_reply},
        })
