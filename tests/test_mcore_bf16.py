"""learner.dtype bf16: megatron's mixed precision on the tiny model (CPU). bf16 weights with fp32
main weights in the optimizer, losses within bf16 rounding of the fp32 learner's over 3 RL steps,
the exported weights in bf16 (with a matching HF config), and a checkpoint that keeps the fp32
main weights."""

from __future__ import annotations

from pathlib import Path

from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture

STEPS = """
    import sys, json, random, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_single_process
    from streamrl.connectors.megatron import checkpoint as mc
    from streamrl.connectors.megatron.hf_export import export_hf
    model_dir, out = sys.argv[1], sys.argv[2]
    init_single_process(0)
    rng = random.Random(0)
    samples = [Sample(prompt=[rng.randrange(500) for _ in range(5 + g)],
                      response=[rng.randrange(500) for _ in range(6 + i + 3 * g)], advantage=rng.uniform(-1, 1),
                      group=g) for g in range(4) for i in range(4)]
    cfg = RLConfig(kl_coef=0.1, entropy_coef=0.01)
    res = {}
    for dt in ("fp32", "bf16"):
        L = MegatronLearner(model_dir, lr=1e-2, micro_batch_size=4, dtype=dt, with_reference=True)
        steps = [L.rl_step(samples, cfg) for _ in range(3)]
        res[dt] = {"loss": [s["loss"] for s in steps], "kl": [s["kl"] for s in steps],
                   "model": sorted({str(p.dtype) for p in L.model.parameters()}),
                   "main": sorted({str(p.dtype) for p in L.opt.main_params()}),
                   "moments": sorted({str(t.dtype) for part in L.opt.parts for s in part.optimizer.state.values()
                                      for k, t in s.items() if k != "step"}),
                   "exported": sorted({str(t.dtype) for t in L.hf_state_dict().values()}),
                   "bytes": L.state_bytes()}
        if dt == "bf16":
            path = export_hf(L.hf_weights(), model_dir, f"{out}/hf")
            res["config"] = json.load(open(f"{path}/config.json"))
            from safetensors import safe_open
            with safe_open(f"{path}/model.safetensors", "pt") as f:
                res["file"] = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
            # a checkpoint keeps the fp32 main weights: a fresh bf16 learner loaded from it has the same
            mc.save_checkpoint(L, f"{out}/ckpt")
            main = [p.detach().clone() for p in L.opt.main_params()]
            L2 = MegatronLearner(model_dir, lr=1e-2, micro_batch_size=4, dtype="bf16", with_reference=True)
            mc.load_checkpoint(L2, f"{out}/ckpt")
            res["main_reloaded_equal"] = all(torch.equal(a, b) for a, b in zip(main, L2.opt.main_params()))
            res["main_differs_from_bf16"] = any(not torch.equal(a, a.bfloat16().float()) for a in main)
            a, b = L.rl_step(samples, cfg), L2.rl_step(samples, cfg)
            res["next_step_equal"] = a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    print(json.dumps(res))
"""


def test_bf16_learner_keeps_fp32_main_params_and_tracks_the_fp32_loss(model_dir: Path, tmp_path: Path) -> None:
    res = run_script(STEPS, str(model_dir), str(tmp_path))
    fp32, bf16 = res["fp32"], res["bf16"]
    assert fp32["model"] == ["torch.float32"] and fp32["main"] == [] and fp32["exported"] == ["torch.float32"]
    assert bf16["model"] == ["torch.bfloat16"]  # norms included: one dtype, as TE's layers have on GPU
    assert bf16["main"] == ["torch.float32"] and bf16["moments"] == ["torch.float32"]
    assert bf16["exported"] == ["torch.bfloat16"] and res["file"] == ["torch.bfloat16"]
    assert res["config"].get("dtype", res["config"].get("torch_dtype")) == "bfloat16"
    # parameters 2 B + fp32 main 4 B + Adam 8 B per parameter, against 4 + 8
    assert bf16["bytes"] / fp32["bytes"] == 14 / 12
    for a, b in zip(fp32["loss"], bf16["loss"]):
        assert abs(a - b) <= 0.02 * max(abs(a), 1e-2) + 2e-3, (fp32["loss"], bf16["loss"])
    assert fp32["loss"][0] != fp32["loss"][2] and bf16["kl"][2] > 0  # the steps moved the policy
    assert res["main_differs_from_bf16"] and res["main_reloaded_equal"] and res["next_step_equal"]
