"""Peak host memory of the learner's HF export (every disk-path publish, engine restart, background
evaluation's version and the final model): streamed a shard at a time (connectors/megatron/hf_export.py)
against the export as it was (`--reference`: the whole model gathered into a host dict, a second model built
from the config, `save_pretrained`). Each side runs in a process of its own (freed memory stays in a
process's RSS): the learner built, one export untimed, VmHWM reset, the measured export. The two sides'
files are compared tensor by tensor.

    python benchmarks/export_memory.py                       # the small preset, both sides
    python benchmarks/export_memory.py --vocab 151936 --shard-mb 64 --dtype bf16

figures: params, model_mb; per side peak_extra_mb (VmHWM over the export - RSS before it), bytes_per_param
(peak_extra / params), seconds; files_equal (every tensor, name and dtype alike); at_7b_gb: the reference's
bytes per parameter times Qwen2.5-7B's 7.62e9 parameters, and the streamed export's bound there (one shard
plus its largest tensor, the 152064 x 3584 embedding).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from benchmarks._common import emit, git_rev, reset_peak_rss, rss_bytes  # noqa: E402
from streamrl.connectors.megatron.hf_export import export_hf  # noqa: E402
from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process  # noqa: E402
from streamrl.connectors.megatron.model_kit import build_model, build_tokenizer  # noqa: E402

PARAMS_7B, EMBED_7B = 7.62e9, 152064 * 3584  # Qwen2.5-7B: parameters, and its largest tensor's elements


def reference_export(weights: Any, base: Path, out: Path) -> None:
    """The export as it was: every tensor into a host dict, a model from the base's config holding them,
    save_pretrained (a dense model: the MoE expert mapping is not needed for the memory figure)."""
    state = {name: t.to("cpu") for name, t in weights}
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base)), dtype=dtype)
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    with torch.no_grad():
        model.save_pretrained(str(out))


def one_side(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    init_single_process()
    work = Path(args.work)
    base = work / "base"
    if not (base / "config.json").exists():
        tok = build_tokenizer(seed=0)
        build_model(tok, args.preset, vocab_size=args.vocab).save_pretrained(base)
        tok.save_pretrained(base)
    learner = MegatronLearner(str(base), lr=1e-6, dtype=args.dtype)
    params = sum(p.numel() for p in learner.model.parameters())

    def export(out: Path) -> None:
        # each tensor a new host buffer, as a TP gather or a GPU-to-host copy makes it (tp = 1 on CPU would
        # hand over the parameters themselves, and the streamed export would hold nothing of its own)
        weights = ((name, t.clone()) for name, t in learner.hf_weights())
        if args.reference:
            reference_export(weights, base, out)
        else:
            export_hf(weights, base, out, shard_bytes=args.shard_mb * 2**20)

    side = "reference" if args.reference else "streamed"
    if args.warm:
        export(work / f"{side}-warm")
    before = rss_bytes("VmRSS")
    if not reset_peak_rss():
        raise SystemExit("export_memory: /proc/self/clear_refs cannot reset the peak RSS here (Linux >= 4.0 needed)")
    t0 = time.perf_counter()
    export(work / side)
    seconds = time.perf_counter() - t0
    extra = rss_bytes("VmHWM") - before
    return {"params": params, "peak_extra_mb": round(extra / 2**20, 1), "bytes_per_param": round(extra / params, 2),
            "seconds": round(seconds, 2)}


def files_equal(a: Path, b: Path) -> bool:
    def tensors(d: Path) -> dict[str, Any]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out |= {k: h.get_tensor(k) for k in h.keys()}
        return out

    x, y = tensors(a), tensors(b)
    return sorted(x) == sorted(y) and all(x[k].dtype == y[k].dtype and bool((x[k] == y[k]).all()) for k in x)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": args.preset, "vocab": args.vocab, "dtype": args.dtype, "shard_mb": args.shard_mb}
    with tempfile.TemporaryDirectory(prefix="export-memory-") as work:
        for side in ("streamed", "reference"):
            print(f"export_memory: {side} side", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--one-side", "--work", work, "--preset", args.preset, "--dtype", args.dtype,
                   "--shard-mb", str(args.shard_mb), *(["--vocab", str(args.vocab)] if args.vocab else []),
                   *(["--reference"] if side == "reference" else [])]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if res.returncode:
                raise SystemExit(f"export_memory: the {side} side failed:\n{res.stderr[-3000:]}")
            out[side] = json.loads(res.stdout.strip().splitlines()[-1])
        out["files_equal"] = files_equal(Path(work, "streamed"), Path(work, "reference"))
    s, r = out["streamed"], out["reference"]
    out["params"] = s.pop("params")
    r.pop("params")
    width = 2 if args.dtype == "bf16" else 4
    out["model_mb"] = round(out["params"] * width / 2**20, 1)
    out["streamed_over_reference"] = round(s["peak_extra_mb"] / max(r["peak_extra_mb"], 1e-9), 3)
    out["at_7b_gb"] = {"reference": round(r["bytes_per_param"] * PARAMS_7B / 1e9, 1),
                       "streamed_bound": round((args.shard_mb * 2**20 + EMBED_7B * width) / 1e9, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="model_kit preset (default small: ~3M parameters)")
    ap.add_argument("--vocab", type=int, default=0, help="a V-token embedding instead of the kit tokenizer's")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the learner's dtype (default fp32)")
    ap.add_argument("--shard-mb", type=int, default=1024, help="the streamed export's shard size (default 1024)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--one-side", action="store_true", help=argparse.SUPPRESS)  # each side's child process
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_side:
        print(json.dumps(one_side(args)))
        return
    emit({"benchmark": "export_memory", **run(args), "git": git_rev()}, args.out)


if __name__ == "__main__":
    main()
