"""slime's custom generate (`env: {fn: "mod:generate", style: slime}`): the user's
`async def generate(args, sample, sampling_params)` runs unchanged and POSTs SGLang's `/generate`
to `http://{args.sglang_router_ip}:{args.sglang_router_port}` itself.

That address is not the router: it is a `GenerateProxy` port given to this one sample while its
function runs. Each call is served through the sample's `Episode` (streamrl/producers/episode.py):
the request's `input_ids` must extend what the sample has so far (the new part — the prompt, a
tool's output — is context, loss mask 0), and the reply is generated through the router with
the exact token ids, log-probs and policy version of every token. A version update during a call
follows `staleness.partial_rollout` inside the proxy (abort_resume continues on the new weights),
so the function sees one answer and the stored sample carries both versions. The answer has
SGLang's shape (`text`, `output_ids`, `meta_info` with `finish_reason`, `output_token_logprobs`,
`weight_version`).

What is stored is the episode, not the Sample the function returns: the tokens, log-probs and
versions are the ones the proxy recorded. From the returned Sample the run takes its `reward`
(when set; otherwise reward.fn scores `response`, or the last turn's text), a `loss_mask` that
masks more (when its length is the response's), `remove_sample` (mask everything) and a FAILED
or ABORTED `status` (the sample fails). Sampling follows the recipe (temperature, top_p, top_k;
`max_new_tokens` up to rollout.max_new_tokens; `stop` strings are honoured). Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import secrets
from typing import Any

import numpy as np
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.producers.episode import Episode, EpisodeError
from streamrl.plugins.slime import Sample, Status, prompt_text
from streamrl.recipe import FnRef, resolve_fn


class GenerateProxy:
    """SGLang's `/generate`, one listening port per sample in flight (ports are reused)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.app = web.Application(client_max_size=64 * 2**20)
        self.app.router.add_post("/generate", self.generate)
        self._runner: web.AppRunner | None = None
        self.sessions: dict[int, Episode] = {}
        self._free: list[int] = []
        self._sites: list[web.SockSite] = []
        self._locks: dict[int, asyncio.Lock] = {}
        self._texts: dict[int, str | None] = {}  # a sample's context as text, while its calls send `text`

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def open(self, episode: Episode) -> int:
        """A port whose `/generate` serves `episode` until close_session(port)."""
        if not self._free:
            assert self._runner is not None, "start() the proxy first"
            sock = listen_socket(self.host)
            site = web.SockSite(self._runner, sock)
            await site.start()
            self._sites.append(site)
            self._free.append(port_of(sock))
        port = self._free.pop()
        self.sessions[port] = episode
        self._locks[port] = asyncio.Lock()
        self._texts[port] = ""
        return port

    def close_session(self, port: int) -> None:
        if self.sessions.pop(port, None) is not None:
            self._locks.pop(port, None)
            self._texts.pop(port, None)
            self._free.append(port)

    async def generate(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        port = int(sockname[1]) if sockname else -1
        ep = self.sessions.get(port)
        if ep is None:
            return _error(404, "no sample is generating on this port (it finished); a generate function may only "
                               "call the address it was given while it runs")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        async with self._locks[port]:
            try:
                out, self._texts[port] = await _serve(ep, body, self._texts[port])
                return web.json_response(out)
            except EpisodeError as e:
                return _error(400, str(e))
            except _BadRequest as e:
                return _error(400, str(e))


class _BadRequest(Exception):
    pass


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _new_context(ep: Episode, body: dict[str, Any], text_so_far: str | None) -> list[int]:
    """The tokens this call adds to the sample's context. `input_ids` must start with the
    context so far; `text` (the whole text again, as slime's multi-turn examples send it) must
    start with the text so far (what was sent and answered), and only the rest is tokenized: the
    model's own tokens are never re-tokenized."""
    if body.get("input_ids") is None and isinstance(body.get("text"), str):
        text = body["text"]
        if text_so_far is None:
            raise _BadRequest("`text` after calls with input_ids: keep to one of the two for a sample")
        if not text.startswith(text_so_far):
            raise _BadRequest(f"`text` does not extend this sample's text so far ({len(text_so_far)} characters: what "
                              "was sent and the answers, unchanged): a call continues the sample")
        return ep._encode(text[len(text_so_far):]) if len(text) > len(text_so_far) else []
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _BadRequest("input_ids must be a non-empty list of token ids (or give `text`); a batch of prompts "
                          "is not supported: one call generates for one sample")
    have = len(ep.tokens)
    if ids[:have] != ep.tokens:
        raise _BadRequest(f"input_ids do not extend this sample's context so far ({have} tokens): a call continues "
                          "the sample, with the tokens generated before and anything added after them")
    return ids[have:]


async def _serve(ep: Episode, body: dict[str, Any], text_so_far: str | None) -> tuple[dict[str, Any], str | None]:
    """SGLang's answer to one call, and the sample's text so far after it (None once a call gave input_ids)."""
    new = _new_context(ep, body, text_so_far)
    by_text = body.get("input_ids") is None
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    ep.observe(new)
    turn = await ep._sample(ep.tokens, ep._budget(params.get("max_new_tokens"), len(ep.tokens)), stop or None)
    context = len(ep.tokens)
    ep._commit(turn)
    meta: dict[str, Any] = {
        "id": secrets.token_hex(8), "finish_reason": {"type": turn.finish}, "prompt_tokens": context,
        "completion_tokens": len(turn.tokens), "cached_tokens": 0,
        "weight_version": str(max(turn.versions)) if turn.versions else "",
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(turn.logprobs, turn.tokens)]
    text = body["text"] + turn.text if by_text else None
    return {"text": turn.text, "output_ids": list(turn.tokens), "meta_info": meta}, text


class SlimeGenerateHub:
    """An env hub (the interface of streamrl.producers.episode.EnvHub) for a `style: slime`
    custom generate function; see the module doc."""

    def __init__(self, ref: FnRef, args: argparse.Namespace, timeout_s: float = 600, tokenizer: Any = None,
                 evaluation: bool = False) -> None:
        """`evaluation`: the hub serves held-out evaluation (passed on as slime does, to a function
        that takes an `evaluation` parameter)."""
        try:
            self.fn = resolve_fn(ref.fn)
        except ValueError as e:
            raise ValueError(f"env.fn {ref.fn!r}: {e}") from None
        if not inspect.iscoroutinefunction(self.fn):
            raise ValueError(f"env.fn {ref.fn!r} must be async (async def generate(args, sample, sampling_params))")
        self.path, self.ns, self.timeout_s, self.tokenizer = ref.fn, args, timeout_s, tokenizer
        try:
            takes = "evaluation" in inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            takes = False
        self._extra = {"evaluation": evaluation} if takes else {}
        self.proxy = GenerateProxy()
        self._returned: dict[int, Any] = {}

    async def start(self) -> None:
        await self.proxy.start()

    async def close(self) -> None:
        await self.proxy.close()

    def _sampling_params(self) -> dict[str, Any]:
        ns = self.ns
        return {"temperature": ns.rollout_temperature, "top_p": ns.rollout_top_p, "top_k": ns.rollout_top_k,
                "max_new_tokens": ns.rollout_max_response_len, "stop": ns.rollout_stop,
                "stop_token_ids": ns.rollout_stop_token_ids, "skip_special_tokens": ns.rollout_skip_special_tokens,
                "no_stop_trim": True, "spaces_between_special_tokens": False}

    async def run(self, task: dict[str, Any], episode: Episode) -> tuple[Any, str | None]:
        """(what the run scores, None) or (None, the error that failed the sample)."""
        port = await self.proxy.open(episode)
        args = argparse.Namespace(**{**vars(self.ns), "sglang_router_ip": self.proxy.host,
                                     "sglang_router_port": port})
        record = task.get("record") or {}
        sample = Sample(index=task.get("sample"), prompt=prompt_text(task.get("prompt", ""), self.tokenizer),
                        label=task.get("label"),
                        metadata=dict(record.get("metadata") or {}) if isinstance(record, dict) else {})
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self.fn(args, sample, self._sampling_params(), **self._extra)
        except TimeoutError:
            return None, f"{self.path}: no result within {self.timeout_s}s"
        except Exception as e:  # noqa: BLE001 - a broken generate fails its sample, never the run
            return None, f"{self.path}: {type(e).__name__}: {e}"
        finally:
            self.proxy.close_session(port)
        if isinstance(out, list):
            return None, (f"{self.path} returned a list of samples (slime's fan-out); StreamRL stores one sample per "
                          "generate call")
        if not hasattr(out, "status") or not hasattr(out, "reward"):
            return None, f"{self.path} returned {type(out).__name__}, not the sample"
        self._returned[id(episode)] = out
        status = getattr(out.status, "value", out.status)
        if status in (Status.FAILED.value, Status.ABORTED.value):
            return None, f"{self.path} set the sample's status to {status}"
        if out.reward is not None:
            return out.reward, None
        return (out.response or None) if isinstance(out.response, str) else None, None

    def amend(self, episodes: list[Episode], samples: list[Any]) -> None:
        """Apply what the returned Samples say about training (loss_mask, remove_sample) to the
        stored samples of `episodes`."""
        for ep, s in zip(episodes, samples):
            out = self._returned.pop(id(ep), None)
            if out is None or s.failed:
                continue
            if getattr(out, "remove_sample", False):
                s.loss_mask[:] = 0
            mask = getattr(out, "loss_mask", None)
            if isinstance(mask, list) and len(mask) == s.num_tokens:
                s.loss_mask &= (np.asarray(mask) != 0).astype(s.loss_mask.dtype)
