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
    from streamrl.connectors.megatron import cpu_shim
    cpu_shim.apply()
    from megatron.core import parallel_state
    from streamrl.connectors.ports import tcp_store
    dist.init_process_group("gloo", store=tcp_store(1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu_shim.seed_cpu(0)
    from transformers import AutoModelForCausalLM
    from streamrl.connectors.megatron.model import load_model, hf_state_dict
    out = {}
    for d in sys.argv[1:]:
        model, bridge = load_model(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = torch.randint(0, hf.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(20).expand(3, 20)
        dev = next(model.parameters()).device  # cuda when there is a GPU (the learner's own placement)
        with torch.no_grad():
            logits = model(ids.to(dev), pos.to(dev), torch.ones(1, 1, 20, 20, dtype=torch.bool).triu(1).to(dev)).cpu()
            ref = hf(ids).logits
        exported, hf_sd = hf_state_dict(model, bridge), hf.state_dict()
        tied = hf.config.tie_word_embeddings
        out[d] = {"logit_diff": (logits - ref).abs().max().item(),
                  "missing": sorted(set(hf_sd) - set(exported) - ({"lm_head.weight"} if tied else set())),
                  "weight_diff": max((exported[k].cpu() - hf_sd[k]).abs().max().item() for k in exported)}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mbridge_qwen2_and_llama_match_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.connectors.megatron.model_kit import init_model_dir
    qwen = init_model_dir(tmp_path / "qwen2", "tiny")
    torch.manual_seed(0)  # Llama: GQA, untied output layer, no qkv bias
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False))
    llama.save_pretrained(tmp_path / "llama")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(qwen), str(tmp_path / "llama")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    results = json.loads(r.stdout.strip().splitlines()[-1])
    for d, res in results.items():
        assert res["logit_diff"] < 1e-5, (d, res)
        assert res["missing"] == [] and res["weight_diff"] == 0.0, (d, res)


LOGPROB_SCRIPT = textwrap.dedent("""
    import sys, json, threading, torch, torch.distributed as dist
    from streamrl.connectors.megatron import cpu_shim
    cpu_shim.apply()
    from megatron.core import parallel_state
    from streamrl.connectors.ports import tcp_store
    dist.init_process_group("gloo", store=tcp_store(1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu_shim.seed_cpu(0)
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest
    from streamrl.connectors.megatron.batch import TokenBatch, logprobs_and_entropy
    from streamrl.connectors.megatron.model import load_model
    eng = EngineCore(sys.argv[1])
    threading.Thread(target=eng.run, daemon=True).start()
    done, ev = [], threading.Event()
    def cb(r):
        done.append(r)
        if len(done) == 6:
            ev.set()
    for i in range(6):  # different prompt and response lengths: the learner batch is padded
        eng.submit(GenRequest(rid=str(i), input_ids=list(range(3, 6 + i)), max_new_tokens=12 + i,
                              temperature=float(sys.argv[2]), ignore_eos=True, sampling_seed=i, on_done=cb))
    assert ev.wait(120)
    eng.stop()
    done.sort(key=lambda r: int(r.rid))
    model, _ = load_model(sys.argv[1])
    b = TokenBatch([(r.input_ids, r.output_ids) for r in done])
    on = TokenBatch([(r.input_ids, r.output_ids) for r in done]).to(next(model.parameters()).device)
    with torch.no_grad():
        logp, ent = (t.cpu() for t in logprobs_and_entropy(model(on.ids, on.positions, on.attn_mask), on.ids,
                                                           float(sys.argv[2])))
    diff = max((got - torch.tensor(r.logprobs)).abs().max().item() for got, r in zip(b.response_values(logp), done))
    ratio = torch.exp(logp - b.scatter([r.logprobs for r in done]))[b.resp_mask.bool()]
    print(json.dumps({"diff": diff, "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
                      "tokens": int(b.resp_mask.sum()), "entropy_ok": bool((ent >= 0).all())}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_learner_logprobs_equal_engine_rollout_logprobs(tmp_path: Path, temperature: float) -> None:
    import json

    from streamrl.connectors.megatron.model_kit import init_model_dir
    d = init_model_dir(tmp_path / "m", "tiny")
    r = subprocess.run([sys.executable, "-c", LOGPROB_SCRIPT, str(d), str(temperature)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tokens"] == sum(12 + i for i in range(6)) and res["entropy_ok"]
    assert res["diff"] < 1e-4, res
    assert abs(res["ratio_min"] - 1) < 1e-4 and abs(res["ratio_max"] - 1) < 1e-4, res
