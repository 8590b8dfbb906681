"""`streamrl model merge-lora BASE ADAPTER OUT`: an HF model directory whose weights are BASE's with
a PEFT LoRA adapter merged in (W + lora_alpha / r * B A for each adapted module), written as the
run's own HF exports are (connectors/megatron/hf_export.py `export_hf`: config and tokenizer of
BASE, atomic). ADAPTER is what a LoRA run publishes: RUN_DIR/weights/lora-v<version>, or
RUN_DIR/adapter at the end of the run; BASE the model the adapters were trained on (RUN_DIR/sft_model
after an SFT warm-start, else the recipe's model.path). RUN_DIR/model of a LoRA run is this merge
already, made by the learner itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from streamrl.connectors.megatron.hf_export import export_hf
from streamrl.connectors.sglang.engine_lora import read_peft_dir
from streamrl.core import lora as names


def merged_state(base: dict[str, torch.Tensor], config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base` (HF names) with each adapted module's weight W + s B A (fp32 sum, W's dtype)."""
    s = names.scaling(int(config["r"]), float(config.get("lora_alpha", config["r"])))
    out = dict(base)
    for module, key, a, b in names.modules_of(tensors):
        w = out.get(module + ".weight")
        if w is None or b is None:
            raise ValueError(f"adapter tensor {key}: the base has no {module}.weight or the adapter no lora_B beside it")
        out[module + ".weight"] = (w.float() + s * b.float() @ a.float()).to(w.dtype)
    return out


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    base = {}
    for f in sorted(Path(base_dir).glob("*.safetensors")):
        base.update(load_file(str(f)))
    if not base:
        raise ValueError(f"{base_dir} holds no *.safetensors weights")
    config, tensors = read_peft_dir(str(adapter_dir))
    return export_hf(merged_state(base, config, tensors).items(), base_dir, out_dir)
