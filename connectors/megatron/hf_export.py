"""The HF export: the learner's weights (HF names, one tensor at a time, as `hf_weights` gathers them) written
as an HF model directory a shard at a time, so that neither the whole model nor a second model built from
its config is ever in host memory: the extra host memory is one shard (`shard_bytes`; a larger tensor is a
shard alone). Every disk-path publish, engine restart, background evaluation's version and the final model
goes through here, at 7B fp32 ~28 GB each time a whole host copy was made.

The files hold what transformers' `save_pretrained` writes for the same weights (tests/test_hf_export.py keeps
that path as the oracle): the checkpoint's own tensor names (MoE experts one by one), a tied `lm_head` left
out, every floating tensor in the first one's dtype, `config.json` with that dtype; the base's tokenizer and
generation config copied. Up to `shard_bytes` one `model.safetensors`, else `model-0000i-of-0000n.safetensors`
and `model.safetensors.index.json` (as transformers names shards). The directory appears whole: written
beside `out_dir` and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from streamrl.connectors.megatron.checkpoint import clean_leftovers, fsync_path, install_dir, tmp_sibling
from streamrl.connectors.sglang.expert_weights import expert_views, fused_name

SHARD_BYTES = 1 << 30  # host memory an export holds at once, at most (besides one tensor larger than this)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template.*", "*.tiktoken", "generation_config.json")


class _Shards:
    """Tensors collected into shards of at most `limit` bytes, each written when the next would overflow it."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.dir, self.limit = directory, limit
        self.dtype: torch.dtype | None = None
        self.meta: dict[str, torch.Tensor] = {}  # name -> an empty tensor of its shape and dtype (meta device)
        self.files: list[list[str]] = []
        self.total = 0
        self._open: dict[str, torch.Tensor] = {}
        self._bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.is_floating_point():
            self.dtype = self.dtype or t.dtype
            t = t.to(self.dtype)
        t = t.to("cpu").contiguous()  # (tp = 1 on CPU: the parameter itself; the caller holds the weights still)
        n = t.numel() * t.element_size()
        if self._open and self._bytes + n > self.limit:
            self._flush()
        self._open[name], self._bytes = t, self._bytes + n
        self.meta[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        self.total += n

    def _flush(self) -> None:
        save_file(self._open, str(self.dir / f".shard-{len(self.files):05d}"), metadata={"format": "pt"})
        self.files.append(list(self._open))
        self._open, self._bytes = {}, 0

    def finish(self) -> None:
        """Write the last shard and give the shards their final names (and the index, if more than one)."""
        if self._open or not self.files:
            self._flush()
        n = len(self.files)
        names = [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (self.dir / f".shard-{i:05d}").rename(self.dir / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {t: names[i] for i, ts in enumerate(self.files) for t in ts}}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _check_names(config: object, meta: dict[str, torch.Tensor], base: Path) -> None:
    """The names and shapes must fill the model transformers builds from `config` (on the meta device: no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    own = model.state_dict()
    plain, views, unexpected = expert_views(meta, own)  # MoE: per-expert names fill transformers' fused tensors
    unexpected += [f"{n} {list(t.shape)} (the model's: {list(own[n].shape)})"
                   for n, t in plain.items() if t.shape != own[n].shape]
    unexpected += [f"{n} {list(t.shape)} (the model's: {list(v.shape)})" for n, v, t in views if t.shape != v.shape]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    filled = set(plain) | {fused_name(name) for name, _, _ in views}
    missing = sorted(set(own) - filled - ({"lm_head.weight"} if tied else set()))
    if unexpected or missing:
        def some(names: list[str]) -> str:
            return (", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")) or "none"
        raise ValueError(f"learner weights do not match {type(model).__name__} from {base}: "
                         f"missing: {some(missing)}; unexpected: {some(unexpected)}")


def export_hf(weights: Iterable[tuple[str, torch.Tensor]], base_model_dir: str | Path, out_dir: str | Path,
              shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `weights` (HF names) as an HF model directory at `out_dir` (replacing one there), with
    `base_model_dir`'s config, tokenizer and generation config. `weights` is taken to its end even when
    writing fails (the other ranks of a learner take part in each tensor's gather)."""
    base, out = Path(base_model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(str(base))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out.parent, out.name)  # only this export's leftovers: the parent may be shared
    tmp = tmp_sibling(out)
    tmp.mkdir()
    try:
        shards, error = _Shards(tmp, shard_bytes), None
        for name, t in weights:
            # tied: save_pretrained leaves the head out; pp > 1 sends the tied embedding twice under one name
            if error is not None or (tied and name == "lm_head.weight") or name in shards.meta:
                continue
            try:
                shards.add(name, t)
            except Exception as e:  # noqa: BLE001 - raised once the other ranks are through the gather
                error = e
        if error is not None:
            raise error
        _check_names(config, shards.meta, base)
        shards.finish()
        config.dtype = shards.dtype or torch.float32
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))  # the base's own replaces it below
        for pattern in TOKENIZER_FILES:
            for f in base.glob(pattern):
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
