"""The embedded engine's routed experts (SGLang's `return_routed_experts`) over real HTTP, on the
tiny Qwen3-MoE model: SGLang's wire format, equal to an independent transformers forward's router
top-k on the same tokens (prefill and decode positions, batched with left padding), the start
honoured, bad starts refused with SGLang's words; and weights updated by per-expert HF names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest, routed_rows
from streamrl.connectors.sglang.client import EngineError, SGLangClient
from streamrl.core import routing

from enginekit import EngineProc, load_model
from moekit import hf_routes, moe_model_dirs


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return moe_model_dirs(tmp_path_factory.mktemp("moe"), (0, 1))


@pytest.fixture(scope="module")
def moe_engine(moe_dirs, tmp_path_factory: pytest.TempPathFactory):
    proc = EngineProc(moe_dirs[0], tmp_path_factory.mktemp("moe-logs") / "engine.log").wait_ready()
    yield proc
    proc.stop()


def _shape(model_dir: Path) -> tuple[int, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg["num_experts_per_tok"]


def _generate(url: str, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with SGLangClient(url) as c:
            return await c.json("POST", "/generate", body)
    return asyncio.run(go())


PROMPTS = [[5, 9, 17, 33, 40, 41, 7], [3, 4, 100]]  # different lengths: the batch is left-padded


def test_routed_experts_in_sglang_format_equal_transformers(moe_engine, moe_dirs):
    layers, top_k = _shape(moe_dirs[0])
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = _generate(moe_engine.url, {"input_ids": PROMPTS, "sampling_params": sp, "return_routed_experts": True})
    plain = _generate(moe_engine.url, {"input_ids": PROMPTS[0], "sampling_params": sp})
    assert "routed_experts" not in plain["meta_info"]  # only when asked
    model = load_model(moe_dirs[0])
    for ids, out in zip(PROMPTS, outs):
        b64 = out["meta_info"]["routed_experts"]
        assert isinstance(b64, str)
        rows = routing.decode(b64, layers, top_k)
        seq = ids + out["output_ids"]
        assert rows.shape == (len(seq) - 1, layers, top_k)  # [0, seqlen - 1)
        want = hf_routes(model, seq[:-1])
        np.testing.assert_array_equal(np.sort(rows, -1), np.sort(want, -1))
        # from a start: the same rows from there; start = prompt length is allowed
        for start in (3, len(ids)):
            part = _generate(moe_engine.url, {"input_ids": ids, "sampling_params": sp, "return_routed_experts": True,
                                              "routed_experts_start_len": start})
            assert part["output_ids"] == out["output_ids"]
            np.testing.assert_array_equal(routing.decode(part["meta_info"]["routed_experts"], layers, top_k), rows[start:])


def test_bad_start_len_is_refused_with_sglangs_words(moe_engine):
    for start, words in ((-1, "is lower than 0"), (len(PROMPTS[0]) + 1, "is higher than the number of input tokens")):
        with pytest.raises(EngineError, match=words) as e:
            _generate(moe_engine.url, {"input_ids": PROMPTS[0], "return_routed_experts": True,
                                       "routed_experts_start_len": start, "sampling_params": {"max_new_tokens": 2}})
        assert e.value.status == 400
    # without return_routed_experts SGLang does not look at it
    _generate(moe_engine.url, {"input_ids": PROMPTS[0], "routed_experts_start_len": -1, "sampling_params": {"max_new_tokens": 1}})


def test_weights_by_per_expert_names_fill_the_fused_tensors(moe_engine, moe_dirs):
    """The checkpoint on disk names each expert (experts.{e}.gate_proj/up_proj/down_proj): loading
    seed 1 from disk must route as seed 1 does in transformers; an update of one expert by name
    lands in its slice of the fused tensor and nowhere else."""
    layers, top_k = _shape(moe_dirs[1])
    async def load(path: Path) -> None:
        async with SGLangClient(moe_engine.url) as c:
            await c.update_weights_from_disk(str(path), weight_version=7)
    asyncio.run(load(moe_dirs[1]))
    try:
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        out = _generate(moe_engine.url, {"input_ids": PROMPTS[0], "sampling_params": sp, "return_routed_experts": True})
        seq = PROMPTS[0] + out["output_ids"]
        want = hf_routes(load_model(moe_dirs[1]), seq[:-1])
        np.testing.assert_array_equal(np.sort(routing.decode(out["meta_info"]["routed_experts"], layers, top_k), -1),
                                      np.sort(want, -1))
    finally:
        asyncio.run(load(moe_dirs[0]))
    core = EngineCore(moe_dirs[0], device="cpu")
    disk = load_file(str(moe_dirs[0] / "model.safetensors"))
    assert any(".experts.3.up_proj.weight" in k for k in disk)
    fused = core.model.model.layers[1].mlp.experts.gate_up_proj
    before = fused.detach().clone()
    up = torch.full_like(disk["model.layers.1.mlp.experts.2.up_proj.weight"], 0.25)
    core.load_state_dict({"model.layers.1.mlp.experts.2.up_proj.weight": up}, None)
    half = fused.shape[1] // 2
    assert torch.equal(fused[2, half:], up)
    changed = (fused != before).any(-1)
    assert changed[2, half:].all() and not changed[:2].any() and not changed[3].any() and not changed[2, :half].any()
    with pytest.raises(ValueError, match="unknown weight names"):
        core.load_state_dict({"model.layers.1.mlp.experts.9.up_proj.weight": up}, None)
    with pytest.raises(ValueError, match="shape mismatch"):
        core.load_state_dict({"model.layers.1.mlp.experts.2.up_proj.weight": up[:1]}, None)


def test_in_place_update_keeps_the_rows_routed_before_it(moe_dirs):
    """A request that goes on across an in-place weight update: positions processed before it keep
    the old weights' routing (the engine never recomputes them), the later ones come from the new."""
    core = EngineCore(moe_dirs[0], device="cpu", weight_version="0")
    ids = PROMPTS[0]
    req = GenRequest(rid="r", input_ids=list(ids), max_new_tokens=6, temperature=0.0, ignore_eos=True,
                     routed_experts=True)
    core.submit(req)
    core._admit()  # prefill: token 1, rows for the prompt
    core._decode()  # token 2: row of position P
    core._decode()  # token 3: row of position P + 1
    core.load_state_dict(load_file(str(moe_dirs[1] / "model.safetensors")), "1")
    while req.finish is None:
        core._decode()
    P, n = len(ids), len(req.output_ids)
    rows = routed_rows(req, 0).numpy()
    assert n == 6 and rows.shape[0] == P + n - 1
    assert [s[0] for s in req.spans] == ["0", "1"] and req.spans[0][2] == 3
    seq = ids + req.output_ids
    np.testing.assert_array_equal(np.sort(rows[:P + 2], -1), np.sort(hf_routes(load_model(moe_dirs[0]), seq[:P + 2]), -1))
    assert not np.array_equal(np.sort(rows, -1), np.sort(hf_routes(load_model(moe_dirs[0]), seq[:-1]), -1))


def test_without_the_flag_nothing_is_captured(moe_dirs):
    """SGLang without --enable-return-routed-experts answers without routed experts; so does the
    engine built with enable_return_routed_experts=False (and it hooks nothing)."""
    core = EngineCore(moe_dirs[0], device="cpu", enable_return_routed_experts=False)
    req = GenRequest(rid="r", input_ids=list(PROMPTS[1]), max_new_tokens=2, temperature=0.0, routed_experts=True)
    core.submit(req)
    core._admit()
    while req.finish is None:
        core._decode()
    assert not core.captures_routing and routed_rows(req, 0) is None and len(req.output_ids) == 2
