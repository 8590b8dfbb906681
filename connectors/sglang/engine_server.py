"""The embedded engine's HTTP server: SGLang's native API (and OpenAI chat) over EngineCore.

    streamrl engine serve --model runs/models/tiny --port 30001

Binds 127.0.0.1 unless told otherwise. With keys (connectors/auth.py: STREAMRL_API_KEY and
STREAMRL_ADMIN_KEY in its environment, as SGLang's --api-key/--admin-api-key) every endpoint but
the health probes needs `Authorization: Bearer <key>` (401 otherwise); a POST body must be
`application/json` (415 otherwise: a web page cannot send that cross-site without the browser
asking first); `weights_root` confines /update_weights_from_disk to model paths under it. Bad
requests get 4xx with `{"error": {"message", "type", "code"}}` and the engine keeps serving.

Long file: one handler per SGLang endpoint the embedded engine speaks, each checked against SGLang's contract.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import msgspec
import safetensors.torch
import torch
from aiohttp import web
from transformers import AutoTokenizer

from streamrl.connectors.auth import Keys
from streamrl.connectors.ports import listen_socket, port_of
from streamrl.connectors.sglang import api
from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest, routed_rows
from streamrl.connectors.sglang.engine_lora import LoraEndpoints
from streamrl.connectors.sglang.weight_sync import join_group, receive

_UNSUPPORTED = {  # SGLang options the embedded engine does not implement: refused, not ignored
    "stream": False, "custom_logit_processor": None, "return_hidden_states": False,
    "top_logprobs_num": 0, "token_ids_logprob": None, "return_entropy": False, "session_params": None,
    "background": False, "return_bytes": False,
}
SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")  # SGLang 0.5.23's words
TENSOR_FORMAT = "safetensors"  # the one load_format /update_weights_from_tensor takes (no pickle)
_SP_UNSUPPORTED = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
MAX_STOP_COUNT = 32  # SGLang's limit on stop strings per request (sampling_params.py)


def _check_sampling(sp: api.SamplingParams) -> None:
    """The ranges SGLang enforces (a bad value must be a 400, never a crash in the scheduler)."""
    problems = []
    if not sp.temperature >= 0 or sp.temperature == float("inf"):  # NaN fails every comparison
        problems.append(f"temperature must be a finite number >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k < 1 and sp.top_k != -1:
        problems.append(f"top_k must be -1 (disabled) or >= 1, got {sp.top_k}")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        problems.append(f"max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if sp.min_new_tokens < 0 or (sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens):
        problems.append(f"min_new_tokens must be in [0, max_new_tokens], got {sp.min_new_tokens}")
    if sp.n < 1:
        problems.append(f"n must be >= 1, got {sp.n}")
    stops = _stop_strs(sp)
    if len(stops) > MAX_STOP_COUNT:
        problems.append(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    if "" in stops:  # SGLang would stop after the first token ("" is in every text)
        problems.append("stop strings must not be empty")
    if problems:
        raise HTTPError(400, "sampling_params: " + "; ".join(problems))


def _stop_strs(sp: api.SamplingParams) -> list[str]:
    return [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())


def _trim_stop(text: str, finish: dict[str, Any] | None, no_stop_trim: bool) -> str:
    """SGLang's trim of a matched stop string (DetokenizerManager.trim_matched_stop): the text
    up to its first occurrence, or through it with no_stop_trim."""
    matched = (finish or {}).get("matched")
    if not isinstance(matched, str) or (pos := text.find(matched)) == -1:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
            415: "UnsupportedMediaTypeError"}.get(status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def _decode(request: web.Request, typ: type) -> Any:
    body = await request.read()
    try:
        return msgspec.json.decode(body or b"{}", type=typ)
    except msgspec.ValidationError as e:
        raise HTTPError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"body is not valid JSON: {e}") from None


class EngineServer:
    def __init__(self, model_dir: str, max_running: int = 64, weight_version: str = "0", seed: int = 0,
                 keys: Keys | None = None, weights_root: str | None = None, tp: int = 1,
                 enable_return_routed_experts: bool = True) -> None:
        """`enable_return_routed_experts`: SGLang's server flag; on by default here (capturing costs
        nothing until a request asks). Off, a request that asks gets no routed experts, as in SGLang."""
        if type(tp) is not int or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        self.tp = tp  # the TP ranks this one process stands for in the weight group (it does not shard)

        self.keys = keys or Keys()
        self.weights_root = os.path.realpath(weights_root) if weights_root else None
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.core = EngineCore(model_dir, max_running=max_running, weight_version=weight_version, seed=seed,
                               decode=self.tokenizer.decode, enable_return_routed_experts=enable_return_routed_experts)
        self.model_path = model_dir
        self._thread = threading.Thread(target=self.core.run, name="engine-core", daemon=True)
        self._groups: dict[str, list[Any]] = {}  # weight-update groups by name: one per TP rank (rank_offset + tp_rank)
        self._session = False  # SGLang's weight-update session (/begin_weight_update .. /end_weight_update)
        self._recv_bufs = [torch.empty(0, dtype=torch.uint8, device=self.core.device) for _ in range(tp)]
        self.app = web.Application(client_max_size=64 * 1024**2, middlewares=[self._guard, self._errors])
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/v1/models", self.models)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_load", self.get_load)
        LoraEndpoints(self, _decode)  # /load_lora_adapter, /load_lora_adapter_from_tensors, /unload_lora_adapter
        self.app.on_startup.append(self._start)
        # on_shutdown runs before aiohttp waits for open requests: stopping the core first
        # finishes them (as aborts), so a paused engine still exits on SIGTERM.
        self.app.on_shutdown.append(self._stop)

    async def _start(self, _: web.Application) -> None:
        self._thread.start()

    async def _stop(self, _: web.Application) -> None:
        self.core.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's key rules (connectors/auth.py), then JSON-only bodies."""
        if not self.keys.allows(request.path, request.headers.get("Authorization")):
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (this run's engine key)")
        if request.method == "POST" and request.content_type != "application/json":
            return _error(415, f"Content-Type must be application/json, got {request.content_type!r}")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as e:
            return _error(e.status, str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the client, the server lives on
            return _error(500, f"{type(e).__name__}: {e}")

    async def _control(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self.core.call, fn)

    # ------------------------------------------------------------ generation

    def _make(self, ids: list[int], rid: str, sp: api.SamplingParams, logprob_start: int | None = None,
              routed_start: int | None = None, lora: str | None = None) -> GenRequest:
        """`logprob_start`: SGLang's logprob_start_len when return_logprob (-1: no prompt log-probs);
        `routed_start`: routed_experts_start_len when return_routed_experts."""
        if not ids:
            raise HTTPError(400, "input_ids is empty: send at least one token")
        if not all(type(t) is int and 0 <= t < self.core.vocab_size for t in ids):
            raise HTTPError(400, f"input_ids must be ints in [0, {self.core.vocab_size}) for this model")
        max_new = sp.max_new_tokens if sp.max_new_tokens is not None else self.core.max_context - len(ids)
        if max_new < 0 or len(ids) + max_new > self.core.max_context:
            raise HTTPError(400, f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the "
                                 f"model's context length {self.core.max_context}")
        if logprob_start is not None and not -1 <= logprob_start <= len(ids):
            raise HTTPError(400, f"logprob_start_len={logprob_start} is outside [-1, {len(ids)}] (the number of "
                                 "input tokens): use a smaller logprob_start_len")
        if routed_start is not None and routed_start < 0:  # SGLang 0.5.23's words (Scheduler.handle_generate_request)
            raise HTTPError(400, f"routed_experts_start_len={routed_start} is lower than 0. "
                                 "Please use a non-negative routed_experts_start_len.")
        if routed_start is not None and routed_start > len(ids):
            raise HTTPError(400, f"routed_experts_start_len={routed_start} is higher than the number of input "
                                 f"tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller "
                                 "routed_experts_start_len.")
        stops = _stop_strs(sp)
        window = max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0) + 1
        return GenRequest(  # below SGLang's sampling epsilon a temperature means greedy, as in SGLang
            rid=rid, input_ids=list(ids), max_new_tokens=max_new,
            temperature=0.0 if sp.temperature < SAMPLING_EPS else sp.temperature,
            top_p=sp.top_p, top_k=sp.top_k, min_new_tokens=sp.min_new_tokens,
            stop_token_ids=frozenset(sp.stop_token_ids or ()), ignore_eos=sp.ignore_eos,
            sampling_seed=sp.sampling_seed, stop_strs=tuple(stops), stop_window=window,
            # SGLang's -1 with return_logprob: from len(ids) on, i.e. none
            input_logprob_start=None if logprob_start is None else len(ids) if logprob_start == -1 else logprob_start,
            routed_experts=routed_start is not None and self.core.captures_routing, lora=lora)

    async def _run(self, req: GenRequest) -> GenRequest:
        return (await self._run_all([req]))[0]

    async def _run_all(self, reqs: list[GenRequest]) -> list[GenRequest]:
        """Submit `reqs` together (a group's samples are prefilled together) and wait for all."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[GenRequest]] = []
        for req in reqs:
            fut: asyncio.Future[GenRequest] = loop.create_future()
            req.on_done = lambda r, f=fut: loop.call_soon_threadsafe(lambda: f.done() or f.set_result(r))
            futs.append(fut)
        self.core.submit_many(reqs)
        try:
            return list(await asyncio.gather(*futs))
        except asyncio.CancelledError:  # client went away: free the slots (without blocking the loop)
            rids = [r.rid for r in reqs]
            loop.run_in_executor(None, self.core.call, lambda: [self.core.abort(rid) for rid in rids])
            raise

    def _response(self, r: GenRequest, t0: float, req: api.GenerateReqInput, sp: api.SamplingParams) -> dict[str, Any]:
        with_text = req.return_text_in_logprobs
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "weight_version": r.spans[-1][0] if r.spans else self.core.weight_version,
            "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in r.spans],
            "num_retractions": r.retractions,
            "e2e_latency": time.perf_counter() - t0,
        }
        if req.return_logprob:
            def entries(lps: list[Any], toks: list[int]) -> list[list[Any]]:
                return [[lp, t, self.tokenizer.decode([t]) if with_text else None] for lp, t in zip(lps, toks)]

            meta["output_token_logprobs"] = entries(r.logprobs, r.output_ids)
            start = r.input_logprob_start if r.input_logprob_start is not None else len(r.input_ids)
            meta["input_token_logprobs"] = entries(r.input_logprobs or [], r.input_ids[start:])
        if req.return_routed_experts and (rows := routed_rows(r, req.routed_experts_start_len)) is not None:
            meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()  # SGLang's wire form
        out_ids = r.output_ids
        matched = (r.finish or {}).get("matched")
        if r.finish and r.finish.get("type") == "stop" and isinstance(matched, int) and not sp.no_stop_trim:
            text_ids = out_ids[:-1]  # SGLang trims the matched stop token from the text
        else:
            text_ids = out_ids
        text = _trim_stop(self.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens), r.finish,
                          sp.no_stop_trim)
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        req: api.GenerateReqInput = await _decode(request, api.GenerateReqInput)
        for name, default in _UNSUPPORTED.items():
            if getattr(req, name) != default:
                raise HTTPError(400, f"{name} is not supported by the embedded engine")
        sp = req.sampling_params or api.SamplingParams()
        _check_sampling(sp)
        for name, default in _SP_UNSUPPORTED.items():
            if getattr(sp, name) != default:
                raise HTTPError(400, f"sampling_params.{name} is not supported by the embedded engine")
        if req.input_ids is None and req.text is None:
            raise HTTPError(400, "send input_ids or text")
        if req.input_ids is not None:
            batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
            if batch and not all(isinstance(x, list) for x in req.input_ids) or not batch and any(
                    isinstance(x, list) for x in req.input_ids):
                raise HTTPError(400, "input_ids must be a list of token ids or a list of such lists, not a mix")
            prompts = req.input_ids if batch else [req.input_ids]
        else:
            batch = isinstance(req.text, list)
            texts = req.text if batch else [req.text]
            prompts = [self.tokenizer.encode(t) for t in texts]  # type: ignore[union-attr]
        rids = req.rid if isinstance(req.rid, list) else [req.rid] if req.rid else []
        if len(rids) not in (0, len(prompts)):
            raise HTTPError(400, f"{len(rids)} rids for {len(prompts)} prompts")
        rids = rids or [uuid.uuid4().hex for _ in prompts]
        start = req.logprob_start_len if req.return_logprob else None
        # n > 1 as SGLang (TokenizerManager._handle_batch_request): n samples per prompt, each
        # with a fresh rid, answered as a list (prompt-major) even for one prompt
        n = sp.n
        routed = req.routed_experts_start_len if req.return_routed_experts else None
        loras = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * len(prompts)
        if len(loras) != len(prompts):
            raise HTTPError(400, f"{len(loras)} lora_path entries for {len(prompts)} prompts")
        for name in set(loras):
            try:
                self.core.adapters.check(name)
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
        gens = [self._make(ids, rid if n == 1 else uuid.uuid4().hex, sp, start, routed, lora)
                for ids, rid, lora in zip(prompts, rids, loras) for _ in range(n)]
        done = await self._run_all(gens)
        failed = [r.error for r in done if r.error]
        if failed:
            raise HTTPError(400, f"{failed[0]} (this request only; the engine goes on)")
        outs = [self._response(r, t0, req, sp) for r in done]
        return web.json_response(outs if batch or n > 1 else outs[0])

    async def chat(self, request: web.Request) -> web.Response:
        req: api.ChatCompletionReq = await _decode(request, api.ChatCompletionReq)
        if req.stream or req.n != 1:
            raise HTTPError(400, "stream and n > 1 are not supported by the embedded engine")
        msgs = [msgspec.structs.asdict(m) for m in req.messages]
        ids = self.tokenizer.apply_chat_template([{k: v for k, v in m.items() if v is not None} for m in msgs],
                                                 add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        sp = api.SamplingParams(max_new_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
                                top_p=req.top_p, top_k=req.top_k, stop_token_ids=req.stop_token_ids,
                                sampling_seed=req.seed)
        _check_sampling(sp)
        r = await self._run(self._make(ids, req.rid or uuid.uuid4().hex, sp))
        if r.error:
            raise HTTPError(400, f"{r.error} (this request only; the engine goes on)")
        stopped = r.finish is not None and r.finish["type"] == "stop"
        content_ids = r.output_ids[:-1] if stopped else r.output_ids
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": self.tokenizer.decode(content_ids, skip_special_tokens=True)},
            "finish_reason": {"stop": "stop", "length": "length"}.get((r.finish or {}).get("type", ""), "abort"),
        }
        if req.logprobs:
            choice["logprobs"] = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp}
                                              for t, lp in zip(r.output_ids, r.logprobs)]}
        return web.json_response({
            "id": f"chatcmpl-{r.rid}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(r.output_ids),
                      "total_tokens": len(ids) + len(r.output_ids)},
            # Token-in/token-out for agent environments: exact ids, log-probs and versions.
            "prompt_token_ids": ids, "output_token_ids": r.output_ids, "output_token_logprobs": r.logprobs,
            "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in r.spans],
        })

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_path, "object": "model",
                                                               "owned_by": "streamrl"}]})

    # ------------------------------------------------------------ control

    async def abort_request(self, request: web.Request) -> web.Response:
        req: api.AbortReq = await _decode(request, api.AbortReq)
        if not req.abort_all and not req.rid:
            raise HTTPError(400, "send rid or abort_all: true")
        n = await self._control(lambda: self.core.abort(None if req.abort_all else req.rid))
        if n == 0 and not req.abort_all:
            raise HTTPError(404, f"no running or waiting request with rid {req.rid!r}")
        return web.json_response({"success": True, "num_aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        req: api.PauseReq = await _decode(request, api.PauseReq)
        await self._control(lambda: self.core.pause(req.mode))
        return web.json_response({"success": True, "message": f"paused ({req.mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._control(self.core.resume)
        return web.json_response({"success": True, "message": "continued"})

    async def flush_cache(self, _: web.Request) -> web.Response:
        if not await self._control(self.core.can_flush):
            raise HTTPError(400, f"cannot flush the cache while {self.core.num_requests} requests are running or queued")
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def _update(self, load: Any, abort_all: bool, version: str | None, flush: bool,
                      ok: dict[str, Any]) -> web.Response:
        """SGLang's order: abort (if asked), load, record the version, then flush the cache the old
        weights made. A flush refused because requests are running fails the call (400, success
        false) although the weights did change, as in SGLang 0.5.23 (scheduler_components/
        weight_updater.py, flush_cache_after_weight_update); `flush_cache: false` skips it."""
        def do() -> bool:
            if abort_all:
                self.core.abort()
            load()
            if version is not None:
                self.core.weight_version = version
            return not flush or self.core.can_flush()

        try:
            flushed = await self._control(do)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}", **ok}, status=400)
        if not flushed:
            return web.json_response({"success": False, "message": FLUSH_REFUSED, **ok}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.", **ok})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req: api.UpdateFromDiskReq = await _decode(request, api.UpdateFromDiskReq)
        real = os.path.realpath(req.model_path)
        if self.weights_root is not None and os.path.commonpath([real, self.weights_root]) != self.weights_root:
            return web.json_response({"success": False, "message": f"model_path {req.model_path!r} is outside this "
                                      f"engine's weights directory {self.weights_root}: refused"}, status=400)
        resp = await self._update(lambda: self.core.load_from_disk(req.model_path, None),
                                  req.abort_all_requests, req.weight_version, req.flush_cache, {"num_paused_requests": 0})
        if resp.status == 200:
            self.model_path = req.model_path
        return resp

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req: api.InitGroupReq = await _decode(request, api.InitGroupReq)
        loop = asyncio.get_running_loop()
        # SGLang joins each TP rank as rank_offset + tp_rank (streamrl/core/weight_group.py); this
        # process joins every rank it stands for, each of which receives the full tensors as there.
        try:
            self._groups[req.group_name] = list(await asyncio.gather(*(loop.run_in_executor(
                None, join_group, req.master_address, req.master_port, req.rank_offset + r, req.world_size,
                req.group_name, req.backend) for r in range(self.tp))))
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req: api.DestroyGroupReq = await _decode(request, api.DestroyGroupReq)
        if self._groups.pop(req.group_name, None) is None:  # SGLang 0.5.23's words (weight_updater.py)
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _decode(request, api.BeginWeightUpdateReq)
        if self._session:
            return web.json_response({"success": False, "message": "a weight-update session is already open; "
                                      "call end_weight_update() first"}, status=400)
        self._session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _decode(request, api.EndWeightUpdateReq)
        if not self._session:
            return web.json_response({"success": False, "message": "no weight-update session is open; "
                                      "call begin_weight_update() first"}, status=400)
        self._session = False
        return web.json_response({"success": True, "message": "Success"})

    def _no_session(self, what: str) -> web.Response | None:
        """SGLang 0.5.23 takes tensor and distributed updates only inside a session (scheduler_components/weight_updater.py)."""
        if self._session:
            return None
        return web.json_response({"success": False, "message": f"{what} must run between begin_weight_update() "
                                  "and end_weight_update()"}, status=400)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req: api.UpdateFromDistributedReq = await _decode(request, api.UpdateFromDistributedReq)
        if refused := self._no_session("update_weights_from_distributed"):
            return refused
        groups = self._groups.get(req.group_name)
        if groups is None:  # SGLang asserts the same
            raise HTTPError(400, f"Group {req.group_name} not in {list(self._groups)}. "
                            "Please call `init_weights_update_group` first.")
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise HTTPError(400, "names, dtypes and shapes must have the same length")
        # Receive outside the engine thread (generation goes on), then swap between steps.
        loop = asyncio.get_running_loop()
        try:  # every TP rank takes part in each broadcast; rank_offset + 0's copy is loaded
            state, *_ = await asyncio.gather(*(loop.run_in_executor(
                None, receive, g, req.names, req.dtypes, req.shapes, req.load_format, buf)
                for g, buf in zip(groups, self._recv_bufs)))
        except ValueError as e:  # refused before anything was received
            raise HTTPError(400, str(e)) from None
        except RuntimeError as e:  # the sender dropped the group or timed out; this engine goes on serving, as SGLang's
            return web.json_response({"success": False, "message": f"Failed to receive weights: {e}"}, status=400)
        return await self._update(lambda: self.core.load_state_dict(state, None), req.abort_all_requests,
                                  req.weight_version, req.flush_cache, {})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req: api.UpdateFromTensorReq = await _decode(request, api.UpdateFromTensorReq)
        if refused := self._no_session("update_weights_from_tensor"):
            return refused
        if req.load_format != TENSOR_FORMAT:
            raise HTTPError(400, f"load_format {req.load_format!r} is refused: SGLang's entries are pickled "
                                 "tensors and this engine never unpickles what comes over the network; send "
                                 f"load_format {TENSOR_FORMAT!r} with each entry a base64 safetensors blob")

        def parse() -> dict[str, torch.Tensor]:
            state: dict[str, torch.Tensor] = {}
            for blob in req.serialized_named_tensors:
                state.update(safetensors.torch.load(blob))
            return state

        try:
            state = await asyncio.get_running_loop().run_in_executor(None, parse)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on a bad blob
            raise HTTPError(400, f"serialized_named_tensors: not a safetensors blob ({type(e).__name__}: {e})") from None
        return await self._update(lambda: self.core.load_state_dict(state, None), req.abort_all_requests,
                                  req.weight_version, req.flush_cache, {})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        req: api.UpdateWeightVersionReq = await _decode(request, api.UpdateWeightVersionReq)
        return await self._update(lambda: None, req.abort_all_requests, req.new_version, False, {})

    # ------------------------------------------------------------ info

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.core.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": self.core.model.config.model_type, "architectures": self.core.model.config.architectures,
        })

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "served_model_name": self.model_path,
            "context_length": self.core.max_context, "max_running_requests": self.core.max_running,
            "max_total_num_tokens": self.core.max_running * self.core.max_context,
            "weight_version": self.core.weight_version, "version": "streamrl-embedded", "tp_size": self.tp,
            "device": self.core.device.type,
            "internal_states": [{"paused": self.core.paused, "num_requests": self.core.num_requests}],
        })

    async def get_load(self, _: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": 0, "num_reqs": self.core.num_requests, "num_waiting_reqs": 0}])


class _DropRouterProbes(logging.Filter):
    """sglang-router probes each worker with an HTTP/2 (gRPC) preface; aiohttp logs it as an
    error. It is expected noise, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "PRI/Upgrade" in str(record.exc_info[1]))


EXIT_GRACE_S = 3.0  # SIGTERM to exit: what open requests get before the process goes anyway


async def _exit_on_sigterm(_: web.Application) -> None:
    """SIGTERM stops the server gracefully, and the process exits EXIT_GRACE_S later whatever is
    still running: a request blocked in a worker thread (a weight-group join whose master never
    answers) would otherwise hold aiohttp's shutdown and the executor's join for minutes. Through
    the loop (not signal.signal), so that the signal wakes it wherever the kernel delivers it."""
    def on_term() -> None:
        threading.Timer(EXIT_GRACE_S, os._exit, args=(0,)).start()
        raise web.GracefulExit()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 30000, max_running: int = 64,
          weight_version: str = "0", seed: int = 0, threads: int = 1, cpus: list[int] | None = None,
          idle: bool = False, sock_fd: int | None = None, weights_root: str | None = None, tp: int = 1,
          enable_return_routed_experts: bool = True) -> None:
    """Serve until interrupted. `threads`: torch intra-op threads. One by default: engines share
    the CPU with the learner and other engines, and torch's default (one per core) collapses
    7-10x under such contention (benchmarks/engine_throughput.py --engine-threads).
    `cpus`: pin the engine to these cores (Linux; before any worker thread starts).
    `idle`: run only on CPU time nothing else wants (Linux SCHED_IDLE, else nice 19): a
    background-evaluation engine must not slow training down.
    `sock_fd`: serve on this inherited, already listening socket (connectors/ports.py: the parent
    bound it to port 0, so no other process can take the port between choosing and binding);
    `port=0` without one binds a free port here and prints it. Keys come from the environment
    (connectors/auth.py), never from the command line; `weights_root`: see the module doc."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if idle:  # before any thread starts: threads inherit the policy
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            os.nice(19)
    torch.set_num_threads(threads)
    logging.getLogger("aiohttp.server").addFilter(_DropRouterProbes())
    server = EngineServer(model_dir, max_running=max_running, weight_version=weight_version, seed=seed,
                          keys=Keys.from_env(), weights_root=weights_root, tp=tp,
                          enable_return_routed_experts=enable_return_routed_experts)
    sock = socket.socket(fileno=sock_fd) if sock_fd is not None else listen_socket(host, port)
    if not port:
        print(f"embedded engine serving on http://{host}:{port_of(sock)}", flush=True)
    server.app.on_startup.append(_exit_on_sigterm)
    web.run_app(server.app, sock=sock, print=lambda *_: None, access_log=None, handle_signals=False,
                shutdown_timeout=EXIT_GRACE_S)
