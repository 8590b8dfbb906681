"""LoRA names and numbers, without torch: which megatron layers a recipe's `target_modules` mean,
the PEFT names an adapter is published under, and its `adapter_config.json`.

Megatron fuses what HF (and peft, and SGLang's adapter loader) keep apart: `linear_qkv` holds
q_proj, k_proj and v_proj, `linear_fc1` holds gate_proj and up_proj. One adapter sits on each
fused layer (A: [r, in], B: [out, r]); it is published as one PEFT adapter per HF module that
shares the fused layer's A and takes that module's rows of B, which is exact: (B A x) restricted
to q's rows is B_q A x. So a recipe names whole fused layers: q_proj without k_proj and v_proj
has no exact megatron form and is refused (`targets` says which names are missing).
`target_modules` takes HF names, SGLang's fused names (qkv_proj, gate_up_proj), megatron's
(linear_qkv, linear_proj, linear_fc1, linear_fc2) or `all-linear`.
"""

from __future__ import annotations

from typing import Any

# megatron layer -> the HF modules it fuses, in the order megatron stacks their rows
FUSED: dict[str, tuple[str, ...]] = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ATTENTION = ("linear_qkv", "linear_proj")  # the others are the MLP's (experts' in a MoE layer)
_ALIASES = {"qkv_proj": "linear_qkv", "gate_up_proj": "linear_fc1"}  # SGLang's fused names
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def targets(names: list[str]) -> tuple[list[str], str | None]:
    """(the megatron layers `names` cover, in FUSED order; None or the problem with `names`)."""
    if "all-linear" in names:
        return list(FUSED), None
    layers: set[str] = set()
    hf: set[str] = set()
    for n in names:
        if n in FUSED:
            layers.add(n)
        elif n in _ALIASES:
            layers.add(_ALIASES[n])
        elif n in HF_PARENT:
            hf.add(n)
        else:
            known = sorted([*FUSED, *_ALIASES, *HF_PARENT, "all-linear"])
            return [], f"{n!r} is not a linear layer StreamRL can adapt; choose from {', '.join(known)}"
    for layer, parts in FUSED.items():
        got = hf & set(parts)
        if got and got != set(parts):
            missing = [p for p in parts if p not in got]
            return [], (f"{', '.join(sorted(got))} without {', '.join(missing)}: megatron fuses "
                        f"{', '.join(parts)} into {layer}, which takes one adapter; name all of them "
                        f"(or {layer})")
        if got:
            layers.add(layer)
    if not layers:
        return [], "is empty; name at least one linear layer"
    return [k for k in FUSED if k in layers], None


def scaling(rank: int, alpha: float) -> float:
    """The factor on B A x (peft's lora_alpha / r)."""
    return alpha / rank


def peft_name(layer: int, module: str, which: str) -> str:
    """The PEFT tensor name of HF module `module` of decoder layer `layer` (0-based); which = A | B."""
    return f"base_model.model.model.layers.{layer}.{HF_PARENT[module]}.{module}.lora_{which}.weight"


def hf_modules(layers: list[str]) -> list[str]:
    """The HF module names a set of megatron layers is published as."""
    return [m for k in layers for m in FUSED[k]]


def adapter_config(rank: int, alpha: float, dropout: float, layers: list[str], base_model: str) -> dict[str, Any]:
    """peft's adapter_config.json for the adapter (what SGLang's /load_lora_adapter reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": hf_modules(layers), "bias": "none",
            "base_model_name_or_path": base_model, "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True}


def modules_of(tensors: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(HF module name, its lora_A key, lora_A, lora_B or None) of each adapted module of PEFT
    tensors (`peft_name`'s form; the `base_model.model.` prefix optional)."""
    a_end, b_end, prefix = ".lora_A.weight", ".lora_B.weight", "base_model.model."
    out = []
    for key, a in tensors.items():
        if key.endswith(a_end):
            stem = key[:-len(a_end)]
            out.append((stem[len(prefix):] if stem.startswith(prefix) else stem, key, a, tensors.get(stem + b_end)))
    return out


def adapter_name(version: int) -> str:
    """The engines' name for the adapter of policy version `version` (lora_path on /generate)."""
    return f"v{version}"


def version_of(name: str) -> int | None:
    """`adapter_name`'s inverse; None for another name."""
    return int(name[1:]) if name[:1] == "v" and name[1:].isdigit() else None
