"""Tiny Qwen3-MoE models for routing tests, and what transformers routes on given tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrl.connectors.megatron.model_kit import init_model_dir


def moe_model_dirs(root: Path, seeds: Sequence[int]) -> list[Path]:
    """One tiny-moe model directory per seed (2 layers, top 2 of 4 experts), as root/v<seed>."""
    return [init_model_dir(root / f"v{s}", "tiny-moe", seed=s) for s in seeds]


def hf_routes(model: Any, tokens: Sequence[int]) -> np.ndarray:
    """int32 numpy [len(tokens), layers, top_k]: each MoE layer router's top-k ids for `tokens` in
    one plain transformers forward (Qwen3-MoE: the router returns logits, weights, ids)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, li=li: got.__setitem__(li, out[2]))
             for li, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[li] for li in range(len(got))], 1).to(torch.int32).numpy()
