"""`learner_step.py --vocab V`: the peak memory of one RL step of the megatron learner per 1k tokens at a
real vocabulary: the output layer and the log-probs computed in chunks (connectors/megatron/vocab_parallel.py)
against the learner as it was, the model's logits and the full-vocabulary computation on them
(batch.logprobs_and_entropy, `--reference`). Each side runs in a process of its own (freed memory stays in
a process's RSS): model build, one untimed step, VmHWM reset, one measured step.

figures (vocab_memory):
  vocab, hidden_size, dtype, tokens   the model (the tiny preset's layers at this vocabulary) and the batch
  chunked / reference                 one side each:
      peak_rss_mb_per_1k_tokens       (VmHWM over the measured step - RSS before it) / tokens * 1000
      step_peak_extra_mb              the same, not divided
      loss, grad_norm                 the measured step's (the two sides train the same batch from the same weights)
  chunked_over_reference              the ratio of peak_rss_mb_per_1k_tokens (the issue's target: <= 0.25)
  loss_abs_diff, grad_norm_rel_diff   between the sides
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._learner import make_batch
from benchmarks._common import reset_peak_rss, rss_bytes
from streamrl.connectors.megatron import learner as learner_module
from streamrl.connectors.megatron.batch import logprobs_and_entropy
from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_single_process
from streamrl.connectors.megatron.model_kit import build_model, build_tokenizer

REPO = Path(__file__).resolve().parent.parent


def build_model_dir(out: Path, vocab: int) -> Path:
    """The tiny preset's layers with a `vocab`-token embedding (tied), random weights; the tokenizer is the
    kit's small one (the batch is random ids below `vocab`: the learner never tokenizes)."""
    tok = build_tokenizer(seed=0)
    build_model(tok, "tiny", vocab_size=vocab).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def use_reference() -> None:
    """In this process, the learner as it was: the model's logits, then the full-vocabulary computation (tp = 1)."""
    learner_module.defer_output_layer = lambda model: None
    MegatronLearner._logp = lambda self, logits, b, t, e=False, model=None: logprobs_and_entropy(logits, b.ids, t, e)


def measured_step(learner: MegatronLearner, samples: list[Any], cfg: RLConfig) -> tuple[float, dict[str, Any]]:
    """One warm-up step (the optimizer's state exists after it), then the measured one: (MB it held at its peak
    over what was held before it — CUDA: torch.cuda.max_memory_allocated, else the process's VmHWM — , its stats)."""
    learner.rl_step(samples, cfg)
    cuda = learner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes("VmRSS")
        if not reset_peak_rss():
            raise SystemExit("vocab_memory: /proc/self/clear_refs cannot reset the peak RSS here (Linux >= 4.0 needed)")
    r = learner.rl_step(samples, cfg)
    if cuda:
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20, r
    return (rss_bytes("VmHWM") - before) / 2**20, r


def one_side(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: one warm-up step, then the measured one."""
    if args.reference:
        use_reference()
    torch.set_num_threads(args.threads)
    init_single_process()
    with tempfile.TemporaryDirectory(dir=REPO / "runs") as d:
        learner = MegatronLearner(build_model_dir(Path(d), args.vocab), lr=1e-6, micro_batch_size=args.micro_batch_size,
                                  dtype=args.dtype)
    samples = make_batch(args, args.vocab)
    tokens = sum(len(s.prompt) + len(s.response) for s in samples)
    extra, r = measured_step(learner, samples, RLConfig())
    return {"peak_rss_mb_per_1k_tokens": round(extra / tokens * 1000, 1), "step_peak_extra_mb": round(extra, 1),
            "tokens": tokens, "loss": float(r["loss"]), "grad_norm": float(r["grad_norm"])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides (or the reference alone), each in a fresh process running this module's `one_side`."""
    sides = ["reference"] if args.reference else ["chunked", "reference"]
    out: dict[str, Any] = {"vocab": args.vocab, "dtype": args.dtype, "hidden_size": 64, "samples": args.samples,
                           "micro_batch_size": args.micro_batch_size}
    for side in sides:
        cmd = [sys.executable, str(REPO / "benchmarks" / "learner_step.py"), "--vocab", str(args.vocab), "--one-side",
               "--dtype", args.dtype, "--samples", str(args.samples), "--group-size", str(args.group_size),
               "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
               "--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads)]
        print(f"vocab_memory: {side} side, vocab {args.vocab}, {args.dtype}", file=sys.stderr, flush=True)
        res = subprocess.run(cmd + (["--reference"] if side == "reference" else []), capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        if res.returncode:
            raise SystemExit(f"vocab_memory: the {side} side failed:\n{res.stderr[-3000:]}")
        out[side] = json.loads(res.stdout.strip().splitlines()[-1])
    out["tokens"] = out[sides[0]]["tokens"]
    if len(sides) == 2:
        c, r = out["chunked"], out["reference"]
        out["chunked_over_reference"] = round(c["peak_rss_mb_per_1k_tokens"] / r["peak_rss_mb_per_1k_tokens"], 3)
        out["loss_abs_diff"] = float(f"{abs(c['loss'] - r['loss']):.2e}")
        out["grad_norm_rel_diff"] = float(f"{abs(c['grad_norm'] - r['grad_norm']) / max(r['grad_norm'], 1e-12):.2e}")
    return out
