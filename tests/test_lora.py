"""LoRA (learner.lora; connectors/megatron/lora.py): target names, the recipe's checks, the
adapted megatron model against a hand-written reference (transformers + W x + s B A x hooks:
log-probs and gradients), tp=2 against one process, the merged export against base + adapter,
and that only the adapters train."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from learnerkit import model_dir  # noqa: F401 - fixture
from streamrl.core import lora as names

REPO = Path(__file__).resolve().parents[1]


def test_targets_map_hf_names_to_fused_megatron_layers() -> None:
    assert names.targets(["q_proj", "k_proj", "v_proj", "o_proj"]) == (["linear_qkv", "linear_proj"], None)
    assert names.targets(["gate_up_proj", "down_proj"]) == (["linear_fc1", "linear_fc2"], None)
    assert names.targets(["all-linear"])[0] == list(names.FUSED)
    layers, problem = names.targets(["q_proj", "v_proj"])
    assert layers == [] and "without k_proj" in problem and "linear_qkv" in problem
    assert "not a linear layer" in names.targets(["lm_head"])[1]
    assert names.peft_name(3, "k_proj", "B") == "base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"
    assert names.version_of(names.adapter_name(12)) == 12 and names.version_of("other") is None


@pytest.mark.parametrize("override, key, words", [
    ("learner.lora.target_modules=[q_proj]", "learner.lora.target_modules", "without k_proj, v_proj"),
    ("learner.lora.rank=0", "learner.lora.rank", ">= 1"),
    ("learner.lora.dropout=1.5", "learner.lora.dropout", "< 1"),
])
def test_bad_lora_settings_exit_2_naming_the_key(override: str, key: str, words: str) -> None:
    r = subprocess.run([sys.executable, "-m", "streamrl", "check", "recipes/quickstart.yaml",
                        "learner.lora.rank=4", override], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert key in r.stderr and words in r.stderr, r.stderr


# One learner rank: LoRA on every linear layer with random nonzero B (drawn whole, then sliced as
# each TP rank holds it), one forward and backward of a fixed batch. Rank 0 writes the loss, the
# log-probs and the gradients in PEFT form (lora_state of the gradients); a single process also
# checks the reference, the merged export and an SFT step (frozen base, only adapters in Adam).
SCRIPT = textwrap.dedent("""
    import sys, json, torch
    rank, world, tp, port, fd = map(int, sys.argv[1:6])
    model_dir, out = sys.argv[6], sys.argv[7]
    from safetensors.torch import save_file
    from streamrl.connectors.megatron.learner import MegatronLearner, init_distributed
    from streamrl.connectors.megatron.batch import TokenBatch
    from streamrl.core import lora as names
    init_distributed(rank, world, tp=tp, pp=1, seed=0, port=port, listen_fd=fd if rank == 0 else None)
    learner = MegatronLearner(model_dir, lr=1e-2, micro_batch_size=4)
    R, ALPHA = 4, 8.0
    learner.enable_lora(R, ALPHA, 0.0, list(names.FUSED), seed=0)
    gen = torch.Generator().manual_seed(1)
    for a in learner.adapters:  # nonzero B, the same whole matrix in every layout
        rows = a.B.shape[0] * (tp if a.kind == "column" else 1)
        full = torch.randn(rows, R, generator=gen) * 0.5
        if a.kind == "column":
            parts = [full] if not a.gated else list(full.chunk(2))
            full = torch.cat([p.chunk(tp)[rank % tp] for p in parts])
        a.B.data.copy_(full)
    g = torch.Generator().manual_seed(2)
    rows = [([int(x) for x in torch.randint(3, 200, (6,), generator=g)],
             [int(x) for x in torch.randint(3, 200, (9,), generator=g)]) for _ in range(3)]
    batch = TokenBatch(rows)
    logp = learner._forward(learner.model, batch, 1.0)[0]
    loss = -(logp * batch.resp_mask).sum()
    loss.backward()
    peft = learner.lora_state()
    for a in learner.adapters:  # the gradients in PEFT form: lora_state of them
        a._keep = (a.A.data, a.B.data)
        a.A.data, a.B.data = a.A.main_grad.clone(), a.B.main_grad.clone()
    grads = learner.lora_state()
    for a in learner.adapters:
        a.A.data, a.B.data = a._keep
    res = {"loss": float(loss), "trainable": sum(p.numel() for p in learner.opt.params),
           "adapter_params": sum(p.numel() for a in learner.adapters for p in a.parameters())}
    merged = learner.hf_state_dict()
    if rank == 0:
        save_file({**{"grad." + k: v for k, v in grads.items()}, **{"peft." + k: v for k, v in peft.items()},
                   "logp": logp.detach().contiguous()}, f"{out}/lora.safetensors")
    if world == 1:
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base = {k: v.clone() for k, v in ref.state_dict().items()}
        # the reference: W x + s B A x on each HF module, A shared by the modules of a fused layer
        leaves = {k: v.clone().requires_grad_(True) for k, v in peft.items()}
        s = ALPHA / R
        def hook(name):
            a, b = leaves[name + ".lora_A.weight"], leaves[name + ".lora_B.weight"]
            return lambda m, args, y: y + s * torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)
        for n, m in ref.named_modules():
            if n.split(".")[-1] in names.HF_PARENT:
                m.register_forward_hook(hook("base_model.model." + n))
        logits = ref(input_ids=batch.ids).logits
        ref_logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)
        ref_loss = -(ref_logp * batch.resp_mask).sum()
        ref_loss.backward()
        # a fused layer's A: megatron's one gradient = the sum over the HF modules sharing it
        shared = {}
        for k, v in leaves.items():
            if "lora_A" in k:
                fused = k.replace(".q_proj.", ".QKV.").replace(".k_proj.", ".QKV.").replace(".v_proj.", ".QKV.")
                fused = fused.replace(".gate_proj.", ".FC1.").replace(".up_proj.", ".FC1.")
                shared[fused] = shared.get(fused, 0) + v.grad
        grad_err = 0.0
        for k, v in leaves.items():
            want = v.grad if "lora_B" in k else shared[k.replace(".q_proj.", ".QKV.").replace(".k_proj.", ".QKV.")
                .replace(".v_proj.", ".QKV.").replace(".gate_proj.", ".FC1.").replace(".up_proj.", ".FC1.")]
            grad_err = max(grad_err, float((grads[k] - want).abs().max() / want.abs().max()))
        res["ref"] = {"logp": float((logp - ref_logp).abs().max()), "loss": float(ref_loss), "grad_rel": grad_err,
                      "grad_max": max(float(v.grad.abs().max()) for v in leaves.values())}
        # merged export = base + s B A, module by module
        worst = 0.0
        for k, w in merged.items():
            mod = k[: -len(".weight")]
            key = "base_model.model." + mod
            want = base[k] + (s * peft[key + ".lora_B.weight"] @ peft[key + ".lora_A.weight"]
                              if key + ".lora_A.weight" in peft else 0)
            worst = max(worst, float((w - want).abs().max()))
        res["merged_err"] = worst
        res["merged_moved"] = max(float((merged[k] - base[k]).abs().max()) for k in merged)
        # the frozen base stays exactly as it was after a step; the adapters move
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        learner.sft_step(rows)
        after = dict(learner.model.named_parameters())
        res["base_moved"] = max(float((after[n] - v).abs().max()) for n, v in before.items() if "_lora." not in n)
        res["lora_moved"] = max(float((after[n] - v).abs().max()) for n, v in before.items() if "_lora." in n)
        res["adam_tensors"] = sum(len(st) for part in learner.opt.parts for st in part.optimizer.state.values())
    print("RESULT " + json.dumps(res))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
""")


def _run(world: int, tp: int, model: Path, out: Path) -> list[dict]:
    from streamrl.connectors.ports import listen_socket, port_of

    out.mkdir(parents=True)
    with listen_socket() as sock:  # rank 0 serves the store on it
        fd = sock.fileno()
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(world), str(tp), str(port_of(sock)),
                                   str(fd), str(model), str(out)], pass_fds=(fd,) if r == 0 else (),
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(next(ln for ln in o.splitlines() if ln.startswith("RESULT "))[7:]) for o, _ in outs]


@pytest.fixture(scope="module")
def one(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:  # noqa: F811
    out = tmp_path_factory.mktemp("lora") / "one"
    return _run(1, 1, model_dir, out)[0], out


def test_lora_equals_reference_and_merged_export(one: tuple[dict, Path]) -> None:
    res = one[0]
    ref = res["ref"]
    assert ref["logp"] < 1e-4, ref
    assert abs(res["loss"] - ref["loss"]) < 1e-3 * abs(ref["loss"])
    assert ref["grad_max"] > 1e-3 and ref["grad_rel"] < 1e-4, ref  # gradients that exist, equal to the reference
    assert res["merged_moved"] > 1e-2 and res["merged_err"] < 1e-5, res
    assert res["trainable"] == res["adapter_params"] > 0
    assert res["base_moved"] == 0.0 and res["lora_moved"] > 0, res
    # Adam's state for the adapters only: step, exp_avg, exp_avg_sq of each (2 decoder layers x 4 linears x A, B)
    assert res["adam_tensors"] == 3 * 2 * 4 * 2, res


@pytest.mark.slow
def test_lora_tp2_equals_one_process(one: tuple[dict, Path], model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Loss, log-probs, the adapters and their gradients (gathered into PEFT form) of tp=2 equal one process's."""
    from safetensors.torch import load_file

    two = _run(2, 2, model_dir, tmp_path / "two")
    assert all(abs(r["loss"] - one[0]["loss"]) < 1e-4 * abs(one[0]["loss"]) for r in two), (one[0], two)
    a, b = load_file(str(one[1] / "lora.safetensors")), load_file(str(tmp_path / "two" / "lora.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-5 * max(1.0, float(a[k].abs().max())), k


# The learner trains its adapters a few SFT steps, writes them as a PEFT directory (what a
# version push sends), the embedded engine loads it as "v3" and samples with it: the engine's
# log-probs of its own tokens equal the learner's within fp32 noise, tokens are tagged version 3,
# and the same prompts without the adapter are measurably different (the adapter is applied).
PUSH = textwrap.dedent("""
    import sys, json, threading, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    from streamrl.connectors.megatron.batch import TokenBatch
    from streamrl.connectors.megatron.lora import write_peft_dir
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest
    from streamrl.connectors.sglang.engine_lora import read_peft_dir
    from streamrl.core import lora as names
    init_single_process()
    model_dir, out = sys.argv[1], sys.argv[2]
    learner = MegatronLearner(model_dir, lr=2e-2, micro_batch_size=8)
    learner.enable_lora(4, 8.0, 0.0, list(names.FUSED), seed=0)
    rows = [([5, 6, 7 + i], [20 + i, 21, 22, 23 + i]) for i in range(4)]
    for _ in range(3):
        learner.sft_step(rows)
    path = write_peft_dir(learner.lora_state(), names.adapter_config(4, 8.0, 0.0, list(names.FUSED), model_dir),
                          f"{out}/lora-v000003")
    eng = EngineCore(model_dir)
    threading.Thread(target=eng.run, daemon=True).start()
    eng.call(lambda: eng.adapters.add(names.adapter_name(3), *read_peft_dir(str(path)), str(path)))
    done, ev = [], threading.Event()
    def cb(r):
        done.append(r)
        if len(done) == 8:
            ev.set()
    for i in range(8):
        eng.submit(GenRequest(rid=f"{i}", input_ids=[5, 6, 7 + i % 4], max_new_tokens=8, ignore_eos=True,
                              sampling_seed=i, lora="v3" if i < 4 else None, on_done=cb))
    assert ev.wait(120)
    eng.stop()
    done.sort(key=lambda r: int(r.rid))
    b = TokenBatch([(r.input_ids, r.output_ids) for r in done])
    with torch.no_grad():
        logp = learner._forward(learner.model, b, 1.0)[0]
    diffs = []
    for i, r in enumerate(done):
        p = len(r.input_ids)
        mine = logp[i, p - 1: p - 1 + len(r.output_ids)]
        diffs.append(float((mine - torch.tensor(r.logprobs)).abs().max()))
    # the merged weights (streamrl model merge-lora must write the same), and a checkpoint round trip
    from safetensors.torch import save_file
    from streamrl.connectors.megatron.checkpoint import load_checkpoint, save_checkpoint
    save_file({k: v.contiguous() for k, v in learner.hf_state_dict().items()}, f"{out}/merged.safetensors")
    save_checkpoint(learner, f"{out}/ckpt")
    other = MegatronLearner(model_dir, lr=2e-2, micro_batch_size=8)
    other.enable_lora(4, 8.0, 0.0, list(names.FUSED), seed=5)  # other A, zero B: the checkpoint must replace both
    load_checkpoint(other, f"{out}/ckpt")
    saved, loaded = learner.lora_state(), other.lora_state()
    moments = [(learner.opt.param_states()[p], other.opt.param_states()[q]) for p, q in zip(learner.params, other.params)]
    print(json.dumps({"with": max(diffs[:4]), "without": min(diffs[4:]),
                      "spans": [r.spans for r in done], "b_norm": max(float(a.B.abs().max()) for a in learner.adapters),
                      "ckpt_adapter_diff": max(float((saved[k] - loaded[k]).abs().max()) for k in saved),
                      "ckpt_moment_diff": max(float((a[k] - b[k]).abs().max()) for a, b in moments for k in a),
                      "ckpt_version": other.version}))
""")


@pytest.mark.slow
def test_engine_logprobs_after_an_adapter_push_equal_the_learners(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from learnerkit import run_script

    res = run_script(PUSH, str(model_dir), str(tmp_path))
    assert res["b_norm"] > 1e-3, res  # the adapters trained
    assert res["with"] < 1e-4, res  # fp32 noise
    assert res["without"] > 1e-3, res  # without the adapter the engine is the base model: not the learner
    assert all(s == [["3", 0, 8]] for s in res["spans"][:4]) and all(s == [["0", 0, 8]] for s in res["spans"][4:])
    # the checkpoint holds the adapters and Adam's state of them
    assert res["ckpt_adapter_diff"] == 0.0 and res["ckpt_moment_diff"] == 0.0 and res["ckpt_version"] == 3, res
    # streamrl model merge-lora (base HF directory + the pushed PEFT directory) = the learner's merged export
    from safetensors.torch import load_file

    r = subprocess.run([sys.executable, "-m", "streamrl", "model", "merge-lora", str(model_dir),
                        str(tmp_path / "lora-v000003"), str(tmp_path / "merged-model")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = load_file(str(tmp_path / "merged.safetensors"))
    got = load_file(str(tmp_path / "merged-model" / "model.safetensors"))
    assert set(want) - {"lm_head.weight"} <= set(got)
    assert max(float((got[k] - want[k]).abs().max()) for k in want if k in got) < 1e-6


def _random_adapter(model_dir: Path, out: Path, rank: int = 2) -> Path:
    """A PEFT directory for the tiny model: q/k/v/o adapters with random A and B."""
    import torch
    from transformers import AutoConfig

    from streamrl.connectors.megatron.lora import write_peft_dir

    cfg = AutoConfig.from_pretrained(str(model_dir))
    head = cfg.hidden_size // cfg.num_attention_heads
    outs = {"q_proj": cfg.hidden_size, "k_proj": cfg.num_key_value_heads * head,
            "v_proj": cfg.num_key_value_heads * head, "o_proj": cfg.hidden_size}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m, n in outs.items():
            tensors[names.peft_name(layer, m, "A")] = torch.randn(rank, cfg.hidden_size, generator=g)
            tensors[names.peft_name(layer, m, "B")] = torch.randn(n, rank, generator=g)
    return write_peft_dir(tensors, names.adapter_config(rank, 4.0, 0.0, ["linear_qkv", "linear_proj"], str(model_dir)),
                          out)


def test_embedded_engine_serves_adapters_by_sglang_endpoints(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """/load_lora_adapter (a path under the weights root only), lora_path on /generate (the
    tokens tagged with the adapter's version; an unknown name is a 400), /unload_lora_adapter."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from streamrl.connectors.sglang.engine_server import EngineServer

    root = tmp_path / "weights"
    path = _random_adapter(model_dir, root / "lora-v000007")
    outside = _random_adapter(model_dir, tmp_path / "elsewhere")

    async def main() -> None:
        server = EngineServer(str(model_dir), weights_root=str(root))
        async with TestClient(TestServer(server.app)) as c:
            r = await c.post("/load_lora_adapter", json={"lora_name": "v7", "lora_path": str(outside)})
            assert r.status == 400 and "outside" in (await r.json())["error_message"]
            r = await c.post("/load_lora_adapter", json={"lora_name": "v7", "lora_path": str(path)})
            body = await r.json()
            assert r.status == 200 and body["success"] and body["loaded_adapters"] == {"v7": str(path)}, body
            gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                   "return_logprob": True}
            base = await (await c.post("/generate", json=gen)).json()
            adapted = await (await c.post("/generate", json={**gen, "lora_path": "v7"})).json()
            assert adapted["meta_info"]["weight_version"] == "7" and base["meta_info"]["weight_version"] == "0"
            assert adapted["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]
            r = await c.post("/generate", json={**gen, "lora_path": "v8"})
            assert r.status == 400 and "not loaded" in (await r.text())
            r = await c.post("/unload_lora_adapter", json={"lora_name": "v7"})
            assert r.status == 200 and (await r.json())["loaded_adapters"] == {}
            r = await c.post("/generate", json={**gen, "lora_path": "v7"})
            assert r.status == 400

    asyncio.run(main())
