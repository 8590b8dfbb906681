"""The learner's memory per rank before launching (streamrl/core/learner_memory.py, `streamrl plan RECIPE`):
parameter counts equal transformers' models and the published sizes of the GPU recipes' models; the bytes
per rank equal what megatron holds (MegatronLearner.state_bytes and its gradient buffer) in one process
(fp32, bf16, dense and MoE) and at tp 2 x dp 2 with the distributed optimizer; the command reads a recipe,
takes overrides and says what it cannot size; the activations per token equal what autograd saves in a
forward of each preset's megatron model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from learnerkit import run_script
from streamrl.connectors.megatron.model_kit import PRESETS, build_model, build_tokenizer, init_model_dir
from streamrl.core import learner_memory as lm
from streamrl.tools.plan_memory import KNOWN

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_counts_equal_transformers_models(preset: str) -> None:
    model = build_model(build_tokenizer(seed=0), preset)
    assert lm.total_parameters(lm.shape_of(model.config.to_dict())) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,published_b", [("qwen2.5-0.5b", 0.49), ("qwen2.5-7b", 7.62), ("qwen3-30b-a3b", 30.5)])
def test_the_gpu_recipes_models_have_their_published_sizes(name: str, published_b: float) -> None:
    assert abs(lm.total_parameters(lm.shape_of(KNOWN[name])) / 1e9 - published_b) < 0.05


def test_a_pipeline_stage_holds_its_layers_and_the_end_it_serves() -> None:
    s = lm.shape_of(KNOWN["qwen2.5-7b"])
    whole, _ = lm.rank_parameters(s)
    assert whole == lm.total_parameters(s)
    halves, _ = lm.rank_parameters(s, pp=2)  # the last stage: half the layers, the output layer, final norm
    dense, _ = lm.layers(s)
    assert halves == 14 * (dense.split + dense.replicated) + s.vocab * s.hidden + s.hidden
    b = lm.rank_bytes(s, "bf16", tp=2, dp=2)  # the recipe's arithmetic: 3.8B x (2 + 4 + (4 + 8) / 2) B
    assert b["total"] == pytest.approx(b["parameters"] * 12, rel=1e-12) and b["total"] / 1e9 == pytest.approx(45.7, abs=0.05)


MEASURE = """
    import sys, json, random
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_single_process
    init_single_process()
    rng = random.Random(0)
    samples = [Sample(prompt=[rng.randrange(500) for _ in range(5)], response=[rng.randrange(500) for _ in range(6)],
                      advantage=rng.uniform(-1, 1), group=g) for g in range(2) for _ in range(2)]
    out = {}
    for dtype in ("fp32", "bf16"):
        L = MegatronLearner(sys.argv[1], lr=1e-3, micro_batch_size=4, dtype=dtype)
        L.rl_step(samples, RLConfig())  # Adam's moments exist after a step
        out[dtype] = {"state": L.state_bytes(),
                      "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in L.opt.ddp.buffers)}
    print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_bytes_equal_what_megatron_holds_in_one_process(preset: str, tmp_path: Path) -> None:
    d = init_model_dir(tmp_path / preset, preset)
    got = run_script(MEASURE, str(d))
    shape = lm.shape_of(json.loads((d / "config.json").read_text()))
    for dtype in ("fp32", "bf16"):
        b = lm.rank_bytes(shape, dtype)
        assert got[dtype]["state"] == b["weights"] + b["main_fp32"] + b["adam"], (dtype, got, b)
        assert got[dtype]["grads"] == b["gradients"], (dtype, got, b)


@pytest.mark.slow
def test_bytes_per_rank_at_tp2_dp2_equal_megatrons(tmp_path: Path) -> None:
    """Four ranks over gloo (benchmarks/learner_step.py --parallel): each holds half of every split weight
    and half of Adam (the distributed optimizer); its shards are cut in buckets, so ranks differ by a few
    hundred bytes around the formula's even split."""
    r = subprocess.run([sys.executable, "benchmarks/learner_step.py", "--presets", "tiny", "--warmup", "1", "--steps", "1",
                        "--samples", "4", "--group-size", "2", "--prompt-len", "8", "--response-len", "8",
                        "--parallel", "tp=2,dp=2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run = json.loads(r.stdout)["parallel"]["tiny"]["tp=2,dp=2"]
    d = init_model_dir(tmp_path / "tiny", "tiny")
    b = lm.rank_bytes(lm.shape_of(json.loads((d / "config.json").read_text())), "fp32", tp=2, dp=2)
    by_rank = run["state_bytes_by_rank"]
    assert sum(by_rank) / len(by_rank) == b["weights"] + b["adam"], (by_rank, b)
    assert max(by_rank) - min(by_rank) < 0.002 * max(by_rank), by_rank


SAVED = """
    import sys, json, torch
    from streamrl.connectors.megatron.batch import TokenBatch
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    init_single_process()
    out = {}
    for dtype in ("fp32", "bf16"):
        L = MegatronLearner(sys.argv[1], lr=1e-3, micro_batch_size=4, dtype=dtype)
        params = {p.untyped_storage().data_ptr() for p in L.model.parameters()}
        for rows, t in ((1, 48), (4, 96)):
            g = torch.Generator().manual_seed(rows)
            b = TokenBatch([(torch.randint(5, 500, (t // 2,), generator=g).tolist(),
                             torch.randint(5, 500, (t - t // 2,), generator=g).tolist()) for _ in range(rows)])
            saved = {}  # storage -> bytes: what the backward will read, each storage once

            def pack(x):
                st = x.untyped_storage()
                if st.data_ptr() not in params:
                    saved[st.data_ptr()] = st.nbytes()
                return x

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                L._run(L.model, b)
            out[f"{dtype}/{rows}x{t}"] = sum(saved.values()) / (rows * t)
    print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-moe", "small"])
def test_activations_per_token_are_what_autograd_saves(preset: str, tmp_path: Path) -> None:
    """The count is an upper bound within 3% (rotary's cos and sin are counted per token; they are per position)."""
    d = init_model_dir(tmp_path / preset, preset)
    got = run_script(SAVED, str(d))
    shape = lm.shape_of(json.loads((d / "config.json").read_text()))
    for key, measured in got.items():
        dtype, (rows, seq) = key.split("/")[0], map(int, key.split("/")[1].split("x"))
        est = lm.activation_bytes(shape, dtype, rows * seq, seq)["per_token"]
        assert measured <= est <= 1.03 * measured, (key, measured, est)


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl", "plan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_plan_reads_a_recipe_with_overrides_and_says_what_it_cannot_size(tmp_path: Path) -> None:
    r = _plan("recipes/gpu_qwen2.5_7b_math.yaml", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["layout"] == {"tp": 2, "pp": 1, "dp": 2, "ep": 1, "distributed_optimizer": True}
    assert "published config of qwen2.5-7b" in out["config_source"] and out["parameters_b"] == pytest.approx(7.616, abs=1e-3)
    assert out["per_rank_gb"]["model"] == pytest.approx(45.7, abs=0.05)
    gb = out["per_rank_gb"]  # and the activations of a micro-batch of the recipe's learner.max_tokens_per_micro_batch
    assert out["fits"] and gb["activations"] == pytest.approx(out["micro_batch"]["tokens"] * out["micro_batch"][
        "activation_mb_per_token"] / 1e3, rel=1e-3) and gb["total"] == pytest.approx(
        gb["model"] + gb["activations"] + gb["logprob_chunks"], abs=0.02)
    longer = json.loads(_plan("recipes/gpu_qwen2.5_7b_math.yaml", "--prompt-tokens", "2048", "--json").stdout)
    assert longer["micro_batch"]["activation_mb_per_token"] > out["micro_batch"]["activation_mb_per_token"]
    wider = json.loads(_plan("recipes/gpu_qwen2.5_7b_math.yaml", "learner.parallel.tp=4", "learner.num_gpus=8",
                             "--json").stdout)
    assert wider["per_rank_gb"]["model"] < out["per_rank_gb"]["model"] / 1.9
    moe = json.loads(_plan("recipes/gpu_qwen3_30b_a3b_math.yaml", "--json", "--gpu-gb", "80").stdout)
    # 76.8 GB before activations: the recipe's own arithmetic (~76 GB) says it needs an H200, not an 80 GB H100
    assert moe["layout"]["ep"] == 8 and moe["per_rank_gb"]["model"] == pytest.approx(76.8, abs=0.05) and not moe["fits"]
    assert json.loads(_plan("recipes/gpu_qwen3_30b_a3b_math.yaml", "--json", "--gpu-gb", "141").stdout)["fits"]

    table = _plan("recipes/gpu_qwen2.5_7b_math.yaml")
    assert table.returncode == 0 and "fits a 80 GB GPU" in table.stdout and "MB a token" in table.stdout

    unknown = _plan("recipes/gpu_qwen2.5_7b_math.yaml", f"model.path={tmp_path}/my-model")
    assert unknown.returncode == 2 and "--model-config" in unknown.stderr, unknown.stderr
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(KNOWN["qwen2.5-0.5b"]))
    own = _plan("recipes/gpu_qwen2.5_7b_math.yaml", f"model.path={tmp_path}/my-model", "--model-config", str(cfg), "--json")
    assert own.returncode == 0 and json.loads(own.stdout)["parameters_b"] == pytest.approx(0.494, abs=1e-3), own.stderr
    no_gpus = _plan(str(tmp_path))
    assert no_gpus.returncode == 2 and "--gpus" in no_gpus.stderr
