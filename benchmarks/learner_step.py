#!/usr/bin/env python
"""Learner step throughput: one RL training step of the megatron-core learner
(streamrl.connectors.megatron.learner.MegatronLearner.rl_step) against a plain transformers model of the
same weights doing the same step, on the same batch, per model_kit preset.

The transformers side is written out by hand to do what rl_step does: the proximal
log-probs (a no-grad forward per micro-batch), then per micro-batch a forward,
`logprobs_and_entropy`, `streamrl.core.algorithms.policy_loss`, backward of the share-weighted
loss; then global-norm grad clip and a torch AdamW step. Both sides use the same
micro-batches (whole groups), the same TokenBatch padding and the same loss code, so the
difference is the model: megatron's GPTModel (local layer spec on CPU) vs transformers'
Qwen2ForCausalLM. Both run in this one process (megatron's parallel state set up once; the
transformers model does not use it), and their timed steps alternate, so load from other
jobs on the machine hits both alike. Prints one JSON object on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

# megatron / mbridge warn at import that there is no TransformerEngine / Apex (expected on CPU)
warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)(\.|$)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from streamrl.connectors.megatron.batch import TokenBatch, logprobs_and_entropy  # noqa: E402
from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_single_process  # noqa: E402
from streamrl.connectors.megatron.model_kit import PRESETS, init_model_dir  # noqa: E402
from streamrl.core import algorithms as alg  # noqa: E402

from benchmarks import _vocab_memory  # noqa: E402
from benchmarks._common import emit, git_rev, log, machine  # noqa: E402
from benchmarks._learner import layout_name, make_batch, parse_layout  # noqa: E402
from benchmarks.learner_parallel import run_layout  # noqa: E402

FIGURES = """
method: a fixed batch of --samples rows in groups of --group-size (GRPO: random 0/1 rewards
per row, advantages by streamrl.core.algorithms.group_advantages(..., "grpo")), random token ids,
prompt lengths uniform in [--prompt-len * 3/4, --prompt-len * 5/4] and response lengths
likewise around --response-len (--longtail: the long-tail recipe's shape instead, 8 tokens per
step, steps n = 2..28 drawn with P(n) ~ 1/n); micro-batches of at most --micro-batch-size rows
and --max-tokens padded tokens, rows of similar length together (plan_micro_batches).
Objective: RLConfig defaults (token aggregation, clip 0.2 / 0.28, no KL, no entropy bonus, on
policy), AdamW at --lr, grad clip 1.0. Every step of both sides trains on that same batch.
Per preset, each side first takes --warmup untimed steps (the first one's stats are the
agreement check below); then --steps rounds, each timing one megatron step and one
transformers step (the order swaps every round).

figures:
  presets.<preset>       one entry per model_kit preset
    megatron             MegatronLearner.rl_step (megatron-core GPTModel)
    transformers         the hand-written equivalent on AutoModelForCausalLM
      step_s_median / step_s_p90  wall time of one whole step (prox log-probs, forward and
                         backward of every micro-batch, clip, optimizer step), over --steps
      step_s_by_round    each timed step, in order: the spread is the machine's noise
      samples_per_s      --samples / step_s_median
      tokens_per_s       prompt + response tokens of the batch (unpadded) / step_s_median
      response_tokens_per_s  response (trained) tokens / step_s_median
    megatron_over_transformers  megatron samples_per_s / transformers samples_per_s
                         (= transformers median step time / megatron median step time):
                         above 1 the megatron learner is faster
    megatron_over_transformers_by_round  the same ratio from each round's pair of steps
    agreement            the first (warm-up) step of each side, fresh weights, same batch:
                         loss, grad_norm, entropy per side, and grad_norm_rel_diff; both
                         compute the same function, so they agree to float32 rounding
    model                parameters (the tied lm_head counted once), layers, hidden size,
                         transformers' attention implementation
  batch                  samples, groups, micro-batches, prompt / response / total tokens,
                         padded tokens per step (the padded [B, T] positions both sides compute)
  config                 torch_threads / torch_interop_threads (set explicitly: more threads
                         than free cores makes CPU training collapse on a busy box), warmup,
                         steps, micro_batch_size, lr
  machine                cpus, 1-minute loadavg at start and end (anything above ~0 on this box is
                         other jobs competing for the cores: every figure gets noisier), versions
  wall_s                 the whole run, model building and warm-up included

with --parallel LAYOUT ... (e.g. `--parallel 1 tp=2 pp=2 dp=2 dp=2,distopt=0`): the megatron learner alone, one
run of tp*pp*dp processes per layout and preset (benchmarks/learner_parallel.py), same batch and
--warmup / --steps; torch threads are --threads split over the layout's ranks.
  parallel.<preset>.<layout>
      step_s_median, step_s_by_round, tokens_per_s   rank 0's wall time of a whole step
      state_bytes_per_rank_max   bytes of parameters + Adam state on the fullest rank (what
                         must fit one GPU): falls with tp and pp; with dp through the
                         distributed optimizer (Adam's moments split over DP ranks; distopt=0:
                         replicated, so it does not fall with dp)
      state_bytes_by_rank, first_step (loss, grad_norm, entropy of the first warm-up step:
                         the same in every layout)
      publish_s_median   rank 0's time to gather the weights after a step (--snapshot: and pack them)
      dtype, snapshot    --dtype, --snapshot
      parameters         the whole model's
      peak_rss_bytes_by_rank  each rank's resident-set high-water mark over the timed steps and their
                         publishes (VmHWM, reset after warm-up: peak_reset says it was)
      baseline_rss_bytes_by_rank  each rank's RSS before its model was built (imports, process group)
      learner_rss_bytes_per_rank_max  max over ranks of peak - baseline: what scales with the model
      learner_rss_bytes_per_param  that / parameters (at a few million parameters the runtime's own
                         memory and this batch's activations dominate it: it does not extrapolate)
      state_bytes_per_param  parameters + fp32 main copies + Adam state per parameter on the fullest
                         rank (fp32 12, bf16 14 in one process)
      grad_bytes_per_param   the fp32 gradient buffer (4 in one process, either dtype)
      snapshot_bytes(_per_param)  the copy --snapshot keeps on rank 0 (0 without it; 4 fp32, 2 bf16)
      accounted_bytes_per_param  state + gradients + snapshot on the fullest rank
      extrapolated_7b    accounted_gb_per_rank and snapshot_gb at 7.6e9 parameters, same layout
                         (activations, the runtime and the transient gather buffers come on top)
  parallel.<preset>.bytes_vs_one_process  state_bytes_per_rank_max / that of layout "1"
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


# ---------------------------------------------------------------- the transformers side


class TransformersLearner:
    """What MegatronLearner.rl_step does, on a transformers causal LM (no LR warm-up)."""

    def __init__(self, model_dir: Path, lr: float, grad_clip: float, micro_batch_size: int,
                 attention: str = "sdpa", max_tokens: int | None = None) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation=attention)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens

    def _micro_batches(self, samples: Sequence[Any]) -> list[list[Any]]:
        return MegatronLearner._micro_batches(self, samples)  # type: ignore[arg-type]  # same split

    def _forward(self, b: Any, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Right padding: the causal mask alone keeps pads away from real tokens, as in TokenBatch.
        logits = self.model(input_ids=b.ids, position_ids=b.positions).logits
        return logprobs_and_entropy(logits, b.ids, temperature, with_entropy)

    def rl_step(self, samples: Sequence[Any], cfg: Any) -> dict[str, float]:
        self.model.train()
        mbs = self._micro_batches(samples)
        prox: list[torch.Tensor] = []
        with torch.no_grad():
            for mb in mbs:
                b = TokenBatch([(s.prompt, s.response) for s in mb])
                logp, _ = self._forward(b, cfg.temperature, False)
                prox.extend(b.response_values(logp))
        unit = sum(len(s.response) for s in samples)  # token aggregation, no loss masks
        stats = {"loss": 0.0, "entropy": 0.0}
        k = 0
        for mb in mbs:
            b = TokenBatch([(s.prompt, s.response) for s in mb])
            n = len(mb)
            mask = b.resp_mask
            old = b.scatter(prox[k: k + n])
            adv = alg.tokens_from_samples(torch.tensor([s.advantage for s in mb]), b.resp_mask)
            groups = torch.tensor([s.group for s in mb])
            logp, ent = self._forward(b, cfg.temperature, True)
            pg, _ = alg.policy_loss(logp, old, adv, mask, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip,
                                    None, cfg.loss_agg, groups)
            entropy = alg.aggregate(ent.detach(), mask, cfg.loss_agg, groups)  # type: ignore[union-attr]
            share = float(mask.sum()) / unit
            (pg * share).backward()
            stats["loss"] += float(pg.detach()) * share
            stats["entropy"] += float(entropy) * share
            k += n
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": float(grad_norm)}


# ---------------------------------------------------------------- batch and measurement


def side_summary(times: list[float], batch: dict[str, int]) -> dict[str, Any]:
    med = statistics.median(times)
    return {"step_s_median": round(med, 4), "step_s_p90": round(pct(times, 0.9), 4),
            "step_s_by_round": [round(t, 4) for t in times],
            "samples_per_s": round(batch["samples"] / med, 2),
            "tokens_per_s": round(batch["tokens"] / med, 1),
            "response_tokens_per_s": round(batch["response_tokens"] / med, 1)}


def first_stats(r: dict[str, float], digits: int | None = 6) -> dict[str, float]:
    return {k: round(float(r[k]), digits) if digits else float(r[k]) for k in ("loss", "grad_norm", "entropy")}


def bench_preset(preset: str, args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], dict[str, int]]:
    log(f"{preset}: building the model in {work / preset}")
    model_dir = init_model_dir(work / preset, preset=preset)
    mg = MegatronLearner(model_dir, lr=args.lr, grad_clip=1.0, micro_batch_size=args.micro_batch_size,
                         max_tokens_per_micro_batch=args.max_tokens, dtype=args.dtype)
    hf = TransformersLearner(model_dir, lr=args.lr, grad_clip=1.0, micro_batch_size=args.micro_batch_size,
                             max_tokens=args.max_tokens,
                             attention=args.hf_attention)
    vocab = hf.model.config.vocab_size
    samples = make_batch(args, vocab)
    mbs = mg._micro_batches(samples)
    batch = {"samples": len(samples), "groups": len({s.group for s in samples}), "micro_batches": len(mbs),
             "prompt_tokens": sum(len(s.prompt) for s in samples),
             "response_tokens": sum(len(s.response) for s in samples),
             "padded_tokens": sum(len(mb) * max(len(s.prompt) + len(s.response) for s in mb) for mb in mbs)}
    batch["tokens"] = batch["prompt_tokens"] + batch["response_tokens"]
    cfg = RLConfig()
    sides = {"megatron": lambda: mg.rl_step(samples, cfg), "transformers": lambda: hf.rl_step(samples, cfg)}

    first: dict[str, dict[str, float]] = {}
    for name, step in sides.items():
        for w in range(args.warmup):
            t = time.perf_counter()
            r = step()
            if w == 0:
                first[name] = first_stats(r, None)
            log(f"{preset}: warm-up {name:12} {time.perf_counter() - t:6.3f} s  {first_stats(r)}")
    times: dict[str, list[float]] = {name: [] for name in sides}
    for k in range(args.steps):
        order = list(sides) if k % 2 == 0 else list(reversed(sides))
        for name in order:
            t = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t)
        log(f"{preset}: round {k + 1}/{args.steps}  megatron {times['megatron'][-1]:6.3f} s  "
            f"transformers {times['transformers'][-1]:6.3f} s")

    out: dict[str, Any] = {name: side_summary(times[name], batch) for name in sides}
    out["megatron_over_transformers"] = round(out["megatron"]["samples_per_s"] / out["transformers"]["samples_per_s"], 3)
    out["megatron_over_transformers_by_round"] = [round(h / m, 3) for m, h in zip(times["megatron"],
                                                                                   times["transformers"])]
    gm, gh = first["megatron"]["grad_norm"], first["transformers"]["grad_norm"]
    out["agreement"] = {**{name: first_stats(r) for name, r in first.items()},
                        "grad_norm_rel_diff": float(f"{abs(gm - gh) / max(abs(gh), 1e-12):.2e}"),
                        "loss_abs_diff": float(f"{abs(first['megatron']['loss'] - first['transformers']['loss']):.2e}")}
    cfg_p = PRESETS[preset]
    out["model"] = {"parameters": sum(p.numel() for p in hf.model.parameters()),  # tied weight counted once
                    "layers": cfg_p["num_hidden_layers"], "hidden_size": cfg_p["hidden_size"],
                    "transformers_attention": hf.model.config._attn_implementation}
    del mg, hf, sides
    gc.collect()
    return out, batch


def bench_layouts(preset: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in args.parallel:
        name = layout_name(layout)
        log(f"{preset}: layout {name} ({layout['tp'] * layout['pp'] * layout['dp']} processes)")
        out[name] = run_layout(layout, preset, args, work)
        log(f"{preset}: {name}: {out[name]['step_s_median']:.3f} s/step, {out[name]['tokens_per_s']} tokens/s, "
            f"{out[name]['state_bytes_per_rank_max']} B per rank")
    if "1" in out:
        one = out["1"]["state_bytes_per_rank_max"]
        out["bytes_vs_one_process"] = {k: round(v["state_bytes_per_rank_max"] / one, 3) for k, v in out.items()}
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog=FIGURES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="2 warm-up steps and 8 timed rounds per side and preset (about 30 s on an idle box)")
    ap.add_argument("--presets", nargs="+", choices=("tiny", "small"), default=["tiny", "small"],
                    help="model_kit presets to measure (default: tiny small)")
    ap.add_argument("--samples", type=int, default=16, help="rows per RL batch (default 16)")
    ap.add_argument("--group-size", type=int, default=4, help="GRPO group size (default 4; --samples is rounded down "
                    "to whole groups)")
    ap.add_argument("--prompt-len", type=int, default=16, help="mean prompt length in tokens (default 16)")
    ap.add_argument("--response-len", type=int, default=128, help="mean response length in tokens (default 128)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (default 8)")
    ap.add_argument("--max-tokens", type=int, help="padded tokens per micro-batch (learner.max_tokens_per_micro_batch; "
                    "default: no cap)")
    ap.add_argument("--longtail", action="store_true", help="response lengths shaped like recipes/longtail.yaml's "
                    "(8 to 224 tokens, P(n steps) ~ 1/n) instead of uniform around --response-len")
    ap.add_argument("--warmup", type=int, help="untimed steps per side and preset (default 3, quick 2)")
    ap.add_argument("--steps", type=int, help="timed rounds, one step per side each (default 30, quick 8)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch.set_num_threads (default: one per core, %(default)s here)")
    ap.add_argument("--hf-attention", choices=("sdpa", "eager"), default="sdpa",
                    help="transformers attention implementation (default sdpa, transformers' own default; eager "
                    "materialises the [T, T] scores, as megatron's local DotProductAttention does)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    ap.add_argument("--parallel", nargs="+", type=parse_layout, metavar="LAYOUT",
                    help="measure the megatron learner in these layouts instead of the transformers comparison: "
                    "1 (one process), tp=2, pp=2, dp=2 or combined (tp=2,pp=2); see the figures below")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the megatron learner's precision (recipe learner.dtype; bf16: mixed precision with fp32 "
                    "main params); the transformers side stays fp32 (default fp32)")
    ap.add_argument("--snapshot", action="store_true",
                    help="--parallel: after each step keep a packed host copy of the whole model on rank 0, as the "
                    "learner did before it published by gathering (for the memory comparison)")
    ap.add_argument("--vocab", type=int, metavar="V",
                    help="instead: the peak memory of one RL step per 1k tokens with a V-token vocabulary (151936: "
                    "Qwen's) on the tiny preset's layers, the chunked log-probs beside the full-vocabulary ones, "
                    "each side in a process of its own (figures in benchmarks/_vocab_memory.py)")
    ap.add_argument("--reference", action="store_true",
                    help="--vocab: only the full-vocabulary computation the learner used before (the tests' oracle)")
    ap.add_argument("--one-side", action="store_true", help=argparse.SUPPRESS)  # --vocab's child process
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    args.warmup = max(1, args.warmup if args.warmup is not None else (2 if args.quick else 3))
    args.steps = max(1, args.steps if args.steps is not None else (8 if args.quick else 30))
    if args.samples < args.group_size:
        ap.error("--samples must be at least --group-size")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally block on kill, too
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)  # nothing here runs ops in parallel; must precede any parallel work
    except RuntimeError:
        pass
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()  # no weight-loading / shard-writing bars on stderr
    if args.vocab:
        (REPO / "runs").mkdir(exist_ok=True)
        if args.one_side:
            print(json.dumps(_vocab_memory.one_side(args)))
            return
        emit({"benchmark": "learner_step", "vocab_memory": _vocab_memory.run(args), "git": git_rev(),
              "machine": machine(load0, ("torch", "transformers", "megatron-core")),
              "wall_s": round(time.perf_counter() - wall0, 1)}, args.out)
        return

    (REPO / "runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="learner_step-", dir=REPO / "runs"))
    presets: dict[str, Any] = {}
    batch: dict[str, int] = {}
    try:
        for preset in args.presets:
            if args.parallel:
                presets[preset] = bench_layouts(preset, args, work)
            else:
                init_single_process()  # megatron parallel state and gloo group, once for every preset
                presets[preset], batch = bench_preset(preset, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    head: dict[str, Any] = {"parallel": presets} if args.parallel else {
        "megatron_over_transformers": {p: r["megatron_over_transformers"] for p, r in presets.items()},
        "presets": presets, "batch": batch}
    result = {
        "benchmark": "learner_step", "quick": args.quick, **head,
        "config": {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
                   "warmup": args.warmup, "steps": args.steps, "micro_batch_size": args.micro_batch_size,
                   "max_tokens": args.max_tokens, "longtail": args.longtail,
                   "group_size": args.group_size, "lr": args.lr, "loss_agg": "token", "advantages": "grpo",
                   "dtype": args.dtype, "snapshot": args.snapshot, "transformers_attention": args.hf_attention},
        "git": git_rev(),
        "machine": machine(load0, ("torch", "transformers", "megatron-core", "mbridge")),
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
