"""The CPU patches for megatron-core: fail loudly when an upgrade moves or changes what they
patch, and show a GPTModel trains on CPU with them (forward, backward, both mask paths)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streamrl.connectors.megatron import cpu_shim

REPO = Path(__file__).resolve().parents[1]


def test_pinned_megatron_version() -> None:
    assert cpu_shim.check_version().startswith(cpu_shim.PINNED + ".")


@pytest.mark.parametrize("module, name, needle", [
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb", "torch.cuda.current_device()"),
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()"),
    ("megatron.core.transformer.utils", "get_default_causal_mask", 'device="cuda"'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
     'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
     'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate", "torch.cuda.current_device()"),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate_shapes",
     "torch.cuda.synchronize()"),
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer", "weight.data.cuda()"),
    ("mbridge.core.util", "broadcast_from_megatron_pp", "torch.cuda.current_device()"),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__", "torch.cuda.current_device()"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "'torch.cuda.FloatTensor'"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__", "device='cuda'"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", "'torch.cuda.BFloat16Tensor'"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
     "'torch.cuda.FloatTensor'"),
    ("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"'),
])
def test_patched_spots_still_hard_code_cuda(module: str, name: str, needle: str) -> None:
    """If this fails, megatron-core changed the spot: re-check connectors/megatron/cpu_shim.py."""
    import importlib

    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    obj = inspect.unwrap(obj)  # apply() wraps setup_embeddings_and_output_layer
    assert needle in inspect.getsource(obj), f"{module}.{name} no longer contains {needle!r}"


def test_megatron_imports_without_compiling_its_fusions() -> None:
    """A fresh process that imports the learner (through streamrl.connectors.megatron) gets megatron's
    fusions as plain functions and never imports TorchDynamo; torch.compile is torch's own again after."""
    code = ("import sys, torch, streamrl.connectors.megatron.learner, megatron.core.jit as jit; "
            "print(jit.jit_fuser.__name__, 'torch._dynamo' in sys.modules, torch.compile.__module__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["_eager", "False", "torch"], p.stdout


def test_cpu_views_of_torch_redirect_only_cuda() -> None:
    """What the patched modules see: `torch.zeros(device="cuda")` and `current_device()` land on
    the CPU, `synchronize()` is a no-op, everything else is torch; `.cuda()` is the identity only
    inside the wrapped call."""
    import torch

    view = cpu_shim._torch_on_cpu()
    assert view.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert view.zeros(2, 3).shape == (2, 3) and view.zeros(2, device="cpu").device.type == "cpu"
    assert view.cuda.current_device() == "cpu" and view.cuda.synchronize() is None
    assert view.tensor([1], device="cuda").device.type == "cpu" and view.empty(2, device="cuda").device.type == "cpu"
    assert view.randn is torch.randn and view.distributed is torch.distributed

    def moves(t: torch.Tensor) -> torch.Tensor:
        return t.cuda() + 1

    wrapped = cpu_shim._cuda_is_cpu(moves)
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0)) and wrapped.__wrapped__ is moves
    assert cpu_shim._cuda_is_cpu(lambda t: t.type())(torch.ones(1)) == "torch.cuda.FloatTensor"
    assert torch.ones(1).type() == "torch.FloatTensor"  # only inside the wrapped call
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):  # outside the wrapper .cuda() still fails
            moves(torch.ones(2))


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from streamrl.connectors.megatron import cpu_shim
    assert cpu_shim.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from streamrl.connectors.ports import tcp_store
    dist.init_process_group("gloo", store=tcp_store(1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    def build():
        cpu_shim.seed_cpu(0)
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=192, use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=True,
            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
        return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=512,
                        max_sequence_length=256, position_embedding_type="rope",
                        share_embeddings_and_output_weights=True)
    m = build()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(2, 12)
    explicit = m(ids, pos, torch.ones(1, 1, 12, 12, dtype=torch.bool).triu(1))
    default = m(ids, pos, None)  # fused softmax builds the causal mask itself
    assert explicit.shape == (2, 12, 512)
    assert torch.equal(explicit, default), (explicit - default).abs().max()
    # causal: changing a later token leaves earlier logits untouched
    ids2 = ids.clone(); ids2[:, -1] = (ids2[:, -1] + 1) % 512
    assert torch.equal(m(ids2, pos, None)[:, :-1], default[:, :-1])
    loss = torch.nn.functional.cross_entropy(explicit[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert torch.equal(build().state_dict()["decoder.layers.0.mlp.linear_fc1.weight"],
                       m.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"])  # seeded init
    print("ok", float(loss))
""")


@pytest.mark.slow
def test_gptmodel_trains_on_cpu_with_the_patches() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]
