"""megatron-core GPTModel from HF directories via mbridge, on CPU: logits equal the
transformers model's (Qwen2, Qwen3, Qwen3-MoE, Llama), and the weights export back under HF names
exactly; MoE routing replay makes megatron route as a transformers model forced to the same experts."""

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
    from safetensors.torch import load_file
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
        # the files, not hf.state_dict(): transformers 5 fuses MoE experts in memory, not on disk
        exported, hf_sd = hf_state_dict(model, bridge), load_file(f"{d}/model.safetensors")
        tied = hf.config.tie_word_embeddings
        out[d] = {"logit_diff": (logits - ref).abs().max().item(),
                  "missing": sorted(set(hf_sd) - set(exported) - ({"lm_head.weight"} if tied else set())),
                  "weight_diff": max((exported[k].cpu() - hf_sd[k]).abs().max().item() for k in exported)}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mbridge_qwen2_qwen3_moe_and_llama_match_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.connectors.megatron.model_kit import init_model_dir
    qwen = init_model_dir(tmp_path / "qwen2", "tiny")
    qwen3 = init_model_dir(tmp_path / "qwen3", "tiny-qwen3")
    moe = init_model_dir(tmp_path / "qwen3_moe", "tiny-moe")
    torch.manual_seed(0)  # Llama: GQA, untied output layer, no qkv bias
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False))
    llama.save_pretrained(tmp_path / "llama")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(qwen), str(qwen3), str(moe), str(tmp_path / "llama")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == 4
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


REPLAY_SCRIPT = textwrap.dedent("""
    import sys, json, torch, torch.nn.functional as F
    from streamrl.connectors.megatron.learner import init_single_process
    init_single_process()
    from transformers import AutoModelForCausalLM
    from streamrl.connectors.megatron import routing
    from streamrl.connectors.megatron.batch import TokenBatch, logprobs_and_entropy
    from streamrl.connectors.megatron.model import load_model
    d = sys.argv[1]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    c = hf.config
    g = torch.Generator().manual_seed(0)
    rows = [([5, 9, 13, 21], [40, 41, 42, 43, 44, 45]), ([7, 8], [50, 51, 52])]
    # the engine's routing of row 0: random distinct experts per position and layer (not what the model would pick)
    forced = torch.stack([torch.stack([torch.randperm(c.num_experts, generator=g)[:c.num_experts_per_tok]
                                       for _ in range(c.num_hidden_layers)]) for _ in range(9)])
    b = TokenBatch(rows, routing=[forced.numpy(), None])  # row 1 came without routing: the model's own

    def hf_logprobs(row, force):
        def gate(layer):
            def forward(h):
                logits = F.linear(h.reshape(-1, layer.hidden_dim), layer.weight)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                idx = torch.topk(probs, layer.top_k, dim=-1).indices
                if force is not None:  # positions 0..8 forced, the last one (never run by an engine) its own
                    idx[: len(force)] = force[:, layer.layer_index]
                top = probs.gather(1, idx)
                return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx
            return forward
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.gate.layer_index = i
            layer.mlp.gate.forward = gate(layer.mlp.gate)
        ids = torch.tensor([row[0] + row[1]])
        with torch.no_grad():
            return logprobs_and_entropy(hf(ids).logits, ids, 1.0, False)[0][0]

    model, _ = load_model(d)
    replays = routing.install(model)
    out = {}
    for replay in (True, False):
        for r in replays:
            r.enabled = replay
        routing.set_batch(replays, b.routing, b.routing_known)
        with torch.no_grad():
            logp = logprobs_and_entropy(model(b.ids, b.positions, b.attn_mask), b.ids, 1.0, False)[0]
        mismatched, used, known = routing.take_counts(replays)
        got = b.response_values(logp)
        out[replay] = {"row0_forced": (got[0] - hf_logprobs(rows[0], forced)[3:]).abs().max().item(),
                       "row0_own": (got[0] - hf_logprobs(rows[0], None)[3:]).abs().max().item(),
                       "row1_own": (got[1] - hf_logprobs(rows[1], None)[1:]).abs().max().item(),
                       "mismatched": mismatched, "used": used, "known": known}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_routing_replay_routes_as_the_engine_did(tmp_path: Path) -> None:
    """With replay, megatron's log-probs of a sample equal those of the transformers model forced to
    the sample's routing (every position but the last); a sample without routing, and every sample
    with replay off, route as the model itself would. The counts say how often the model's own
    choice differed from the given routing, replay or not."""
    import json

    from streamrl.connectors.megatron.model_kit import init_model_dir

    d = init_model_dir(tmp_path / "moe", "tiny-moe")
    r = subprocess.run([sys.executable, "-c", REPLAY_SCRIPT, str(d)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    on, off = res["true"], res["false"]
    assert on["row0_forced"] < 1e-5 and on["row1_own"] < 1e-5, on
    assert on["row0_own"] > 1e-3, on  # the forced experts changed the log-probs: the comparison can fail
    assert off["row0_own"] < 1e-5 and off["row1_own"] < 1e-5 and off["row0_forced"] > 1e-3, off
    assert on["known"] == off["known"] == 9 * 2  # row 0's 9 positions x 2 layers
    assert on["mismatched"] == off["mismatched"] == off["used"] > 0 and on["used"] == 0
