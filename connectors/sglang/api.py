"""SGLang's native HTTP request shapes (sglang 0.5.23 `GenerateReqInput` and the control
endpoints), as msgspec Structs shared by the embedded engine (validation) and the client
(construction). Field names and types follow SGLang; see DESIGN.md "Engines".

SGLang ignores unknown keys; the embedded engine rejects them (400) so typos surface in
tests. The router drops unknown keys before they reach a worker anyway.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Req(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class SamplingParams(_Req):
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0


class GenerateReqInput(_Req):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # 1-D (one request) or 2-D (a batch)
    rid: str | list[str] | None = None
    sampling_params: SamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the adapter(s) to run with (SGLang: one per prompt or one for all)
    custom_logit_processor: str | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    extra_key: str | None = None
    routing_key: str | None = None
    return_hidden_states: bool = False
    return_prompt_token_ids: bool = False
    return_entropy: bool = False
    # MoE routing replay: meta_info["routed_experts"] = base64 of int32 [tokens, layers, top_k] for
    # positions [routed_experts_start_len, prompt + output - 1); the start must be in [0, prompt]
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    session_params: dict[str, Any] | None = None
    no_logs: bool = False
    # sglang-router 0.3.2 adds these when it re-serialises a request
    model: str | None = None
    log_metrics: bool = True
    background: bool = False
    return_bytes: bool = False


class AbortReq(_Req):
    rid: str = ""
    abort_all: bool = False


class PauseReq(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateFromDiskReq(_Req):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class InitGroupReq(_Req):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupReq(_Req):
    group_name: str = "weight_update_group"


class UpdateFromDistributedReq(_Req):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateFromTensorReq(_Req):
    """SGLang's fields; SGLang's entries are pickled tensors (base64 in JSON), which the embedded
    engine refuses: it takes load_format "safetensors", each entry a safetensors blob (msgspec
    reads and writes `bytes` as base64 in JSON)."""

    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class BeginWeightUpdateReq(_Req):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReq(_Req):
    pass


class UpdateWeightVersionReq(_Req):
    new_version: str
    abort_all_requests: bool = True


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionReq(msgspec.Struct, kw_only=True):
    """OpenAI `/v1/chat/completions` (unknown OpenAI options are ignored, as servers do)."""

    messages: list[ChatMessage]
    model: str = "default"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: list[int] | None = None
    logprobs: bool = False
    seed: int | None = None
    stream: bool = False
    rid: str | None = None
