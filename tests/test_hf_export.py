"""The streamed HF export (connectors/megatron/hf_export.py) against the export it replaced: transformers'
own `save_pretrained` of a model holding the same weights (the oracle here). Same tensors (names, dtypes,
values), same config and generation config; several shards with an index when the model is larger than a
shard, loadable by transformers; names that do not fit the model refused with nothing left behind; a failed
write still takes the rest of the weights (the other ranks of a learner gather each one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from learnerkit import run_script
from streamrl.connectors.megatron.hf_export import INDEX, TOKENIZER_FILES, WEIGHTS, export_hf
from streamrl.connectors.megatron.model_kit import init_model_dir


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _reference(base: Path, out: Path, dtype: torch.dtype) -> Path:
    """The export as it was: a model from the base's config holding the weights, `save_pretrained`, the base's
    tokenizer and generation config copied over (new random weights: not the base's)."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(str(out))
    for pattern in TOKENIZER_FILES:
        for f in base.glob(pattern):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("hf") / request.param, request.param, seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_files_hold_what_save_pretrained_wrote(base: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    ref = _reference(base, tmp_path / "ref", dtype)
    want = _tensors(ref)
    # the learner's names are the checkpoint's (MoE experts one by one); a tied head comes too, as mbridge
    # may send it; the embedding twice (pp > 1 with tied embeddings); fp32 in: the first tensor's dtype wins
    first, *rest = list(want.items())
    weights = [(first[0], first[1]), *((k, v.float()) for k, v in rest), (first[0], first[1]),
               ("lm_head.weight", want["model.embed_tokens.weight"])]
    out = export_hf(iter(weights), base, tmp_path / "new")
    got = _tensors(out)
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    for k in want:
        assert got[k].dtype == want[k].dtype == dtype and torch.equal(got[k], want[k]), k
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((ref / name).read_text()), name


def test_a_model_larger_than_a_shard_is_written_in_shards_with_an_index(base: Path, tmp_path: Path) -> None:
    want = _tensors(_reference(base, tmp_path / "ref", torch.float32))
    limit = 64 * 1024  # bytes: the tiny models are ~0.5 MB
    out = export_hf(want.items(), base, tmp_path / "new", shard_bytes=limit)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 4 and not (out / WEIGHTS).exists(), files
    assert all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    for f in files:  # each shard within the limit, or one tensor larger than it alone
        t = _tensors_in(f)
        size = sum(x.numel() * x.element_size() for x in t.values())
        assert size <= limit or len(t) == 1, (f.name, size, len(t))
    index = json.loads((out / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(x.numel() * x.element_size() for x in want.values())
    got = _tensors(out)
    assert all(torch.equal(got[k], want[k]) for k in want)
    model = AutoModelForCausalLM.from_pretrained(str(out))  # transformers reads the shards through the index
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def _tensors_in(f: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def test_weights_that_do_not_fit_the_model_are_refused_and_nothing_is_left(base: Path, tmp_path: Path) -> None:
    want = _tensors(base)
    short = {k: v for k, v in want.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"missing: model.layers.1"):
        export_hf(short.items(), base, tmp_path / "out")
    bad = dict(want, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"missing: none; unexpected: model.norm.weight \[3\] \(the model's: \[64\]\)"):
        export_hf(bad.items(), base, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_failed_write_still_takes_every_weight(base: Path, tmp_path: Path) -> None:
    want = list(_tensors(base).items())
    taken: list[str] = []

    def gather() -> Iterator[tuple[str, object]]:
        for i, (k, v) in enumerate(want):
            taken.append(k)
            yield k, ("not a tensor" if i == 2 else v)

    with pytest.raises(AttributeError):
        export_hf(gather(), base, tmp_path / "out")
    assert taken == [k for k, _ in want] and list(tmp_path.iterdir()) == []


ROUND_TRIP = """
    import sys, json, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    from streamrl.connectors.megatron.hf_export import export_hf
    init_single_process()
    learner = MegatronLearner(sys.argv[1], lr=1e-2)
    learner.sft_step([([5, 6, 7], [8, 9, 2])])  # away from the base's weights
    out = export_hf(learner.hf_weights(), sys.argv[1], sys.argv[2], shard_bytes=64 * 1024)
    back = MegatronLearner(str(out), lr=1e-2)  # mbridge reads the shards through the index
    mine = {k: v.clone() for k, v in learner.hf_weights()}
    print(json.dumps({"files": len(list(out.glob("*.safetensors"))), "equal": all(
        torch.equal(mine[k], v) for k, v in back.hf_weights()), "names": len(mine)}))
"""


@pytest.mark.slow
def test_a_sharded_export_of_the_learner_loads_back_into_the_learner(tmp_path: Path) -> None:
    base = init_model_dir(tmp_path / "tiny", "tiny", seed=3)
    res = run_script(ROUND_TRIP, str(base), str(tmp_path / "out"))
    assert res["files"] > 4 and res["equal"] and res["names"] == len(_tensors(base)), res
