"""Per-expert HF weight names onto transformers' fused expert tensors.

HF MoE checkpoints (and a learner that exports HF names) name each expert's weights
`...mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`; transformers 5 keeps them fused
in memory: `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows, as its checkpoint
conversion concatenates them) and `...mlp.experts.down_proj` [E, H, I]. An update by either form
writes the same memory.
"""

from __future__ import annotations

import re

import torch

_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fused_name(name: str) -> str | None:
    """The fused tensor a per-expert weight name fills (None for any other name)."""
    m = _PER_EXPERT.match(name)
    return None if m is None else f"{m['experts']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"


def expert_views(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> tuple[
        dict[str, torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor]], list[str]]:
    """Split `state` into (names the model has as they are, [(per-expert name, the view of the
    fused tensor it fills, its tensor)], names neither form knows)."""
    plain: dict[str, torch.Tensor] = {}
    views: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    unknown: list[str] = []
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if name in own or m is None:
            (plain.__setitem__(name, t) if name in own else unknown.append(name))
            continue
        e, proj = int(m["e"]), m["proj"]
        fused = own.get(fused_name(name))  # type: ignore[arg-type]
        if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
            unknown.append(name)
            continue
        half = fused.shape[1] // 2
        view = fused[e] if proj == "down_proj" else fused[e, :half] if proj == "gate_proj" else fused[e, half:]
        views.append((name, view, t))
    return plain, views, unknown
