"""The dtype an engine holds its weights in, which the learner casts its pushes to (a bf16 engine
then receives half of an fp32 learner's bytes, and loads what it would have rounded to anyway).

The embedded engine loads float32. SGLang takes `--dtype` (its launch arguments: the recipe's
`engines.extra_args`, and on CPU connectors/sglang/cpu_sglang.py's float32 unless the recipe gives
one), default "auto", which sglang 0.5.23 resolves from the model's config.json
(srt/configs/model_config.py, `_get_and_verify_dtype`): the config's `dtype` (or `torch_dtype`),
float32 when it has none; "auto" on a float32 config gives float16 (bfloat16 for Gemma models).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# SGLang's names for --dtype (its _STR_DTYPE_TO_TORCH_DTYPE), as torch dtype names
NAMES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def flag(args: Sequence[str], name: str) -> str | None:
    """The value given to `name` in launch arguments (`--x v` or `--x=v`; the last one wins), else None."""
    out = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            out = args[i + 1]
        elif a.startswith(name + "="):
            out = a.split("=", 1)[1]
    return out


def sglang_dtype(dtype: str, config: Mapping[str, Any]) -> str:
    """SGLang's `--dtype` resolved against the model's config.json, as a torch dtype name."""
    cfg = config.get("dtype") or config.get("torch_dtype") or "float32"
    cfg = NAMES.get(str(cfg).removeprefix("torch."), str(cfg).removeprefix("torch."))
    d = dtype.lower()
    if d == "auto":
        if cfg != "float32":
            return cfg
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    if d not in NAMES:
        raise ValueError(f"engines.extra_args: --dtype {dtype!r} is not one SGLang knows "
                         f"(auto, {', '.join(NAMES)})")
    return NAMES[d]


def engine_dtype(sglang: bool, args: Sequence[str], config: Mapping[str, Any]) -> str:
    """The weights' dtype in an engine: SGLang (`sglang`) started with `args`, else the embedded engine."""
    if not sglang:
        return "float32"
    return sglang_dtype(flag(args, "--dtype") or "auto", config)
