"""MoE routing replay (R3) data: which experts the engine routed each position to.

SGLang (and the embedded engine) answer `return_routed_experts` with base64 of an int32 array
[tokens, layers, top_k] covering positions [routed_experts_start_len, prompt + output - 1) of the
request: position p's row is what each layer routed token p to when p was fed through the model
(the last output token never is). A sample's routing covers [0, P + n - 1) for P prompt and n
response tokens, so each row is the routing of the policy that generated the NEXT token.

Across partial-rollout segments (streamrl/core/partial.py): segment 1 asks from 0 and gets
[0, P + m - 1); a resumed segment's input is prompt + the m kept tokens, whose last one segment 1
never processed, so it asks from P + m - 1 and its rows are appended. `in_place` is one request.
A segment that starts over (restart, or nothing kept) asks from 0 and replaces everything.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np


def is_moe(config: dict[str, Any]) -> bool:
    """Whether an HF config.json describes a mixture-of-experts model (one that routes tokens)."""
    return bool(config.get("num_experts_per_tok")) and any(
        config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def experts_of(config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, experts per token, experts) of an HF config.json; (layers, 0, 0) for a dense model."""
    if not is_moe(config):
        return int(config.get("num_hidden_layers") or 0), 0, 0
    experts = next(int(config[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k))
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"]), experts


def shape_problem(routed: np.ndarray, experts: tuple[int, int, int]) -> str | None:
    """Why `routed` ([positions, layers, top_k]) cannot be this model's routing, or None."""
    layers, top_k, num = experts
    if not top_k:
        return "is given but this run's model is not a mixture of experts"
    if len(routed) and routed.shape[1:] != (layers, top_k):
        return f"has {routed.shape[1]} layers x top {routed.shape[2]}; this run's model routes {layers} x top {top_k}"
    if len(routed) and int(routed.max()) >= num:
        return f"holds expert id {int(routed.max())}; this run's model has {num} experts (ids 0..{num - 1})"
    return None


def mode(setting: str | bool) -> str:
    """The recipe's `rollout.routing` as auto, on or off (YAML reads unquoted on/off as booleans)."""
    return "on" if setting is True else "off" if setting is False else setting


def wanted(setting: str | bool, config: dict[str, Any]) -> bool:
    """Whether rollouts ask for routed experts under the recipe's `rollout.routing`."""
    return mode(setting) == "on" or (mode(setting) == "auto" and is_moe(config))


def start_len(prompt_len: int, kept: int) -> int:
    """routed_experts_start_len of a request whose input is the prompt + `kept` output tokens."""
    return prompt_len + kept - 1 if kept else 0


def decode(b64: str, layers: int, top_k: int) -> np.ndarray:
    """SGLang's meta_info["routed_experts"] as int32 [tokens, layers, top_k]."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"routed_experts is not base64: {e}") from None
    if len(raw) % (4 * layers * top_k):
        raise ValueError(f"routed_experts has {len(raw)} bytes, not a whole number of int32 "
                         f"[{layers} layers, top {top_k}] rows")
    return np.frombuffer(raw, np.int32).reshape(-1, layers, top_k)


def stitch(have: np.ndarray | None, segment: np.ndarray | None, start: int, rows: int) -> np.ndarray | None:
    """A response's routing after a segment that asked from position `start` and returned
    `segment` (None: the engine sent none), when prompt + tokens so far - 1 = `rows`. The rows
    before `start` are kept from `have`. None when a gap makes the routing incomplete (the
    engine sent none, or the earlier rows are missing): a sample without routing, never a wrong one."""
    if segment is None:
        return have if have is not None and len(have) == rows else None
    if start and (have is None or len(have) < start):
        return None
    out = segment if not start else np.concatenate([have[:start], segment]) if len(segment) else have[:start]  # type: ignore[index]
    if len(out) != rows:
        raise ValueError(f"the engine returned routed experts for {len(segment)} positions from {start}; "
                         f"positions [{start}, {rows}) were processed")
    return out
