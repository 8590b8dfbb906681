"""Async client for SGLang's native HTTP API: real SGLang on GPU, the embedded engine on CPU,
or the sglang-router in front of either (for /generate and chat).

One aiohttp connection pool per client, a timeout per call, retries on connection errors
only; a request that reached the server is sent again only when its answer reused a prefix
that older weights cached (streamrl/core/prefix_cache.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np

from streamrl.connectors.sglang import api
from streamrl.connectors.auth import Keys, bearer
from streamrl.core import lora as lora_names
from streamrl.core import prefix_cache, routing
from streamrl.core.types import VersionSpan

STALE_PREFIX_RETRIES = 3


class EngineError(Exception):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} -> {status}: {message}")
        self.url, self.status, self.message = url, status, message


# A call that failed this way produced nothing usable (the engine died, restarted or refused):
# callers resubmit from what they have.
ENGINE_FAILURES: tuple[type[BaseException], ...] = (EngineError, aiohttp.ClientError, asyncio.TimeoutError)


def retryable(e: BaseException) -> bool:
    """Whether sending the same request again can succeed: not after a 4xx, which says the request
    itself is wrong (a bad sampling parameter, a missing key), except 408/429 (try later)."""
    return not (isinstance(e, EngineError) and 400 <= e.status < 500 and e.status not in (408, 429))


class FinishReason(msgspec.Struct, kw_only=True):
    type: str
    length: int | None = None
    matched: Any = None
    message: str | None = None


class WeightSpan(msgspec.Struct, kw_only=True):
    version: str
    start: int
    end: int


class MetaInfo(msgspec.Struct, kw_only=True):
    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    weight_versions: list[WeightSpan] | None = None
    num_retractions: int = 0
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    routed_experts: str | None = None  # base64 int32 [tokens, layers, top_k] (streamrl/core/routing.py)


class GenerateResult(msgspec.Struct, kw_only=True):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo

    @property
    def logprobs(self) -> list[float]:
        return [lp for lp, _, _ in self.meta_info.output_token_logprobs or []]

    @property
    def finish_type(self) -> str:
        return self.meta_info.finish_reason.type if self.meta_info.finish_reason else ""

    def version_spans(self) -> list[VersionSpan]:
        """Per-token policy versions of the output (the whole output from `weight_version`
        when the server reports no spans)."""
        n = len(self.output_ids)
        spans = self.meta_info.weight_versions
        if not spans:
            return [VersionSpan(int(self.meta_info.weight_version or 0), 0, n)] if n else []
        return [VersionSpan(int(s.version), s.start, s.end) for s in spans]

    def routed_experts(self, layers: int, top_k: int) -> np.ndarray | None:
        """The routed experts the engine sent (None: none), as int32 [tokens, layers, top_k]."""
        b64 = self.meta_info.routed_experts
        return None if b64 is None else routing.decode(b64, layers, top_k)


_result = msgspec.json.Decoder(GenerateResult)
_results = msgspec.json.Decoder(list[GenerateResult])


class SGLangClient:
    """`keys`: the run's engine/router keys; each request carries the one its path needs
    (connectors/auth.py)."""

    def __init__(self, base_url: str, timeout_s: float = 600, connect_retries: int = 5, limit: int = 1024,
                 keys: Keys | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.keys = keys or Keys()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.connect_retries = connect_retries
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None
        self.seen_version = 0  # the newest weight version a response showed (core/prefix_cache.py)
        self.lora_path: str | None = None  # the LoRA adapter generation runs with when a call names none
        self.stale_prefix_retries = 0

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._limit),
                                                  timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, body: Any = None, retries: int | None = None) -> bytes:
        url = self.base_url + path
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json", **bearer(self.keys.for_path(path))}
        retries = self.connect_retries if retries is None else retries
        for attempt in range(retries + 1):
            sess = await self._sess()
            try:
                async with sess.request(method, url, data=data, headers=headers) as resp:
                    raw = await resp.read()
                    if resp.status >= 400:
                        raise EngineError(url, resp.status, _message(raw))
                    return raw
            except aiohttp.ClientConnectorError:
                # Nothing reached the server: safe to retry.
                if attempt == retries:
                    raise
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        raise AssertionError("unreachable")

    async def json(self, method: str, path: str, body: Any = None) -> Any:
        raw = await self.request(method, path, body)
        return msgspec.json.decode(raw) if raw else None

    # ------------------------------------------------------------ generation

    async def generate(self, input_ids: Sequence[int], sampling_params: api.SamplingParams | dict[str, Any] | None = None,
                       *, rid: str | None = None, return_logprob: bool = True, lora_path: str | None = None) -> GenerateResult:
        sp = sampling_params if isinstance(sampling_params, api.SamplingParams) else \
            msgspec.convert(sampling_params or {}, api.SamplingParams)
        return (await self._generate([list(map(int, input_ids))], sp, None if rid is None else [rid],
                                     return_logprob, batched=False, lora_path=lora_path))[0]

    async def generate_batch(self, batch: Sequence[Sequence[int]], sampling_params: api.SamplingParams,
                             *, rids: list[str] | None = None, return_logprob: bool = True,
                             routed_experts_start_len: int | None = None, lora_path: str | None = None
                             ) -> list[GenerateResult]:
        """`routed_experts_start_len`: ask for routed experts from this position (None: do not ask).
        `lora_path`: the LoRA adapter to run with (`lora_versions`)."""
        return await self._generate([list(map(int, ids)) for ids in batch], sampling_params, rids, return_logprob,
                                    batched=True, routed_start=routed_experts_start_len, lora_path=lora_path)

    async def _generate(self, batch: list[list[int]], sp: api.SamplingParams, rids: list[str] | None,
                        return_logprob: bool, batched: bool, routed_start: int | None = None,
                        lora_path: str | None = None) -> list[GenerateResult]:
        """/generate under the cache key of the newest version seen (streamrl/core/prefix_cache.py);
        the requests that reused a prefix older weights made go again, under a key nobody used.
        With `lora_path` a StreamRL version name (`v12`), every output token is of that version
        (`lora_versions`)."""
        key, todo = self.seen_version, list(range(len(batch)))
        lora_path = lora_path if lora_path is not None else self.lora_path
        out: list[GenerateResult | None] = [None] * len(batch)
        for attempt in range(STALE_PREFIX_RETRIES + 1):
            extra_key = prefix_cache.cache_key(key) if attempt == 0 else f"{prefix_cache.cache_key(key)}-{uuid.uuid4().hex}"
            ids = [batch[i] for i in todo]
            req = api.GenerateReqInput(input_ids=ids if batched else ids[0], sampling_params=sp,
                                       rid=None if rids is None else [rids[i] for i in todo] if batched else rids[0],
                                       return_logprob=return_logprob, extra_key=extra_key,
                                       return_routed_experts=routed_start is not None,
                                       routed_experts_start_len=routed_start or 0, lora_path=lora_path)
            raw = await self.request("POST", "/generate", req)
            results = lora_versions(_results.decode(raw) if batched else [_result.decode(raw)], lora_path)
            again = []
            for i, r in zip(todo, results):
                spans = r.version_spans()
                self.seen_version = prefix_cache.newest(spans, self.seen_version)
                if prefix_cache.reused_older_prefix(key, spans, r.meta_info.cached_tokens):
                    again.append(i)
                else:
                    out[i] = r
            if not again:
                return [r for r in out if r is not None]
            self.stale_prefix_retries += len(again)
            key, todo = self.seen_version, again
        raise EngineError(self.base_url + "/generate", 503, f"{len(todo)} request(s) kept reusing a prefix cached "
                          f"under older weights after {STALE_PREFIX_RETRIES} fresh cache keys")

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> Any:
        return await self.json("POST", "/v1/chat/completions", {"messages": messages, **params})

    # ------------------------------------------------------------ control (send to each worker, not the router)

    async def abort(self, rid: str | None = None) -> Any:
        return await self.json("POST", "/abort_request", api.AbortReq(rid=rid or "", abort_all=rid is None))

    async def pause(self, mode: str = "abort") -> Any:
        return await self.json("POST", "/pause_generation", api.PauseReq(mode=mode))  # type: ignore[arg-type]

    async def resume(self) -> Any:
        return await self.json("POST", "/continue_generation", {})

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True) -> Any:
        """`flush_cache`: see update_weights_from_distributed."""
        return await self.json("POST", "/update_weights_from_disk", api.UpdateFromDiskReq(
            model_path=model_path, weight_version=None if weight_version is None else str(weight_version),
            abort_all_requests=abort_all_requests, flush_cache=flush_cache))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> Any:
        return await self.json("POST", "/init_weights_update_group", api.InitGroupReq(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend))

    async def destroy_weights_update_group(self, group_name: str) -> Any:
        return await self.json("POST", "/destroy_weights_update_group", api.DestroyGroupReq(group_name=group_name))

    async def begin_weight_update(self) -> Any:
        """Open SGLang's weight-update session: /update_weights_from_distributed and
        /update_weights_from_tensor are refused (400) outside one (sglang 0.5.23)."""
        return await self.json("POST", "/begin_weight_update", api.BeginWeightUpdateReq())

    async def end_weight_update(self) -> Any:
        return await self.json("POST", "/end_weight_update", api.EndWeightUpdateReq())

    @contextlib.asynccontextmanager
    async def weight_update(self) -> AsyncIterator[None]:
        """begin_weight_update ... end_weight_update, closed also when the updates inside fail
        (an open session makes the next begin fail)."""
        await self.begin_weight_update()
        try:
            yield
        finally:
            await self.end_weight_update()

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              weight_version: str | int | None = None,
                                              group_name: str = "weight_update_group",
                                              load_format: str | None = None, flush_cache: bool = True) -> Any:
        """`load_format`: None (one broadcast per tensor) or "flattened_bucket" (one for them all).
        `flush_cache` (SGLang's default true): flush the cache the old weights made, which SGLang
        refuses (400, success false, the weights loaded all the same) while requests are running,
        as they are under an `in_place` pause: send False then."""
        return await self.json("POST", "/update_weights_from_distributed", api.UpdateFromDistributedReq(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, load_format=load_format,
            weight_version=None if weight_version is None else str(weight_version), flush_cache=flush_cache))

    async def update_weights_from_tensor(self, named_tensors_or_blobs: Mapping[str, Any] | Sequence[bytes],
                                         weight_version: str | int | None = None,
                                         abort_all_requests: bool = False, flush_cache: bool = True) -> Any:
        """Embedded engine only: the tensors (a name -> tensor mapping, or safetensors blobs) as
        load_format "safetensors". Real SGLang expects pickled tensors there; StreamRL sends none."""
        if isinstance(named_tensors_or_blobs, Mapping):
            from safetensors.torch import save

            blobs = [save({k: v.contiguous() for k, v in named_tensors_or_blobs.items()})]
        else:
            blobs = list(named_tensors_or_blobs)
        return await self.json("POST", "/update_weights_from_tensor", api.UpdateFromTensorReq(
            serialized_named_tensors=blobs, load_format="safetensors", abort_all_requests=abort_all_requests,
            weight_version=None if weight_version is None else str(weight_version), flush_cache=flush_cache))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> Any:
        """SGLang's /load_lora_adapter: a PEFT directory the engine reads (4xx when it cannot)."""
        return await self.json("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path,
                                                              "pinned": pinned})

    async def unload_lora_adapter(self, lora_name: str) -> Any:
        """SGLang's /unload_lora_adapter: returns once no request uses the adapter."""
        return await self.json("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, new_version: str | int, abort_all_requests: bool = False) -> Any:
        return await self.json("POST", "/update_weight_version", api.UpdateWeightVersionReq(
            new_version=str(new_version), abort_all_requests=abort_all_requests))

    # ------------------------------------------------------------ info

    async def health(self) -> bool:
        try:
            await self.request("GET", "/health", retries=0)
            return True
        except ENGINE_FAILURES:
            return False

    async def model_info(self) -> Any:
        return await self.json("GET", "/model_info")

    async def server_info(self) -> Any:
        return await self.json("GET", "/server_info")

    async def weight_version(self) -> str:
        return (await self.model_info())["weight_version"]

    async def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.health():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.base_url} not healthy after {timeout_s}s")
            await asyncio.sleep(0.2)


def lora_versions(results: list[GenerateResult], lora_path: str | None) -> list[GenerateResult]:
    """A request runs on its adapter from start to finish (SGLang binds lora_path per request),
    so with a version-named adapter every output token is of that version, whatever the engine
    reports as its base weights' `weight_version` (SGLang reports the base's)."""
    version = lora_names.version_of(lora_path) if lora_path else None
    if version is None:
        return results
    for r in results:
        r.meta_info.weight_version, r.meta_info.weight_versions = str(version), None
    return results


def _message(raw: bytes) -> str:
    try:
        err = msgspec.json.decode(raw)
        if isinstance(err, dict):
            e = err.get("error", err.get("message", err))
            return e.get("message", str(e)) if isinstance(e, dict) else str(e)
    except msgspec.DecodeError:
        pass
    return raw.decode(errors="replace")[:500]
