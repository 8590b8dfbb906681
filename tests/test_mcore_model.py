"""megatron-core GPTModel from HF directories via mbridge, on CPU: logits equal the
transformers model's, and the weights export back under HF names exactly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys, json, torch, torch.distributed as dist
    from connectors import megatron_cpu
    megatron_cpu.apply()
    from megatron.core import parallel_state
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    megatron_cpu.seed_cpu(0)
    from transformers import AutoModelForCausalLM
    from connectors.mcore_model import load_model, hf_state_dict
    out = {}
    for d in sys.argv[2:]:
        model, bridge = load_model(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = torch.randint(0, hf.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(20).expand(3, 20)
        with torch.no_grad():
            logits = model(ids, pos, torch.ones(1, 1, 20, 20, dtype=torch.bool).triu(1))
            ref = hf(ids).logits
        exported, hf_sd = hf_state_dict(model, bridge), hf.state_dict()
        tied = hf.config.tie_word_embeddings
        out[d] = {"logit_diff": (logits - ref).abs().max().item(),
                  "missing": sorted(set(hf_sd) - set(exported) - ({"lm_head.weight"} if tied else set())),
                  "weight_diff": max((exported[k] - hf_sd[k]).abs().max().item() for k in exported)}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mbridge_qwen2_and_llama_match_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from connectors.model_kit import init_model_dir
    from connectors.router import free_port

    qwen = init_model_dir(tmp_path / "qwen2", "tiny")
    torch.manual_seed(0)  # Llama: GQA, untied output layer, no qkv bias
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False))
    llama.save_pretrained(tmp_path / "llama")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), str(qwen), str(tmp_path / "llama")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    results = json.loads(r.stdout.strip().splitlines()[-1])
    for d, res in results.items():
        assert res["logit_diff"] < 1e-5, (d, res)
        assert res["missing"] == [] and res["weight_diff"] == 0.0, (d, res)
