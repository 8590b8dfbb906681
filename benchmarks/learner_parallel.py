"""`learner_step.py --parallel LAYOUT ...`: the megatron learner's RL step in parallel layouts.

Each layout (`1` = one process, `tp=2`, `pp=2`, `dp=2`, or combined `tp=2,pp=2`; `distopt=0`
turns megatron's distributed optimizer off, which is on by default and acts when dp > 1) runs as
tp*pp*dp processes of this module (gloo on CPU, NCCL on GPU; rank 0 serves the store on a
socket the kernel bound, connectors/ports.py), each building MegatronLearner (in --dtype) on the
same model and training on the same batch (benchmarks/_learner.make_batch). Rank 0 times the steps (every rank
takes part in each: the step is collective); every rank reports the bytes of its parameters and
optimizer state (MegatronLearner.state_bytes, after the first step created Adam's moments).

Host memory: after each step the weights are published as a run publishes them: gathered one
tensor at a time and cut into the broadcast's buckets (streamrl/runtime/learner.py push_weights, no
network here), or, with --snapshot, as the learner did before: a packed host copy of the whole
model on rank 0, kept until the next publish (so it lives through the next step). Each rank reads
its resident-set high-water mark (VmHWM in /proc/self/status) over the timed steps, after
resetting it (/proc/self/clear_refs 5) once warm-up is done, and its RSS before the model was built
(imports and process group only): what a larger model scales is the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script (one per rank) from a checkout, installed or not
# megatron / mbridge warn at import that there is no TransformerEngine / Apex (expected on CPU)
warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)(\.|$)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_distributed  # noqa: E402
from streamrl.connectors.megatron.model_kit import init_model_dir  # noqa: E402
from streamrl.connectors.ports import listen_socket, port_of  # noqa: E402
from streamrl.connectors.sglang import weight_sync  # noqa: E402

from benchmarks._common import reset_peak_rss, rss_bytes, wait_all  # noqa: E402
from benchmarks._learner import layout_name, make_batch  # noqa: E402

RANK_TIMEOUT_S = 3600  # a whole layout run at most; a rank that fails ends the others at once (wait_all)
PARAMS_7B = 7.6e9  # Qwen2.5-7B's parameters: the memory figures are extrapolated to it


def publish(learner: MegatronLearner, rank: int, snapshot: bool) -> dict[str, torch.Tensor] | None:
    """What a run does with the weights after a step (see the module docstring); returns the
    snapshot the old learner kept (rank 0, --snapshot) or None."""
    if snapshot:
        state = dict(learner.hf_weights())  # the gather; on CPU with tp = 1 these are the parameters themselves
        return weight_sync.pack(state) if rank == 0 else None
    for part in weight_sync.buckets(t for _, t in learner.hf_weights()):
        weight_sync.flatten(part)  # the bucket push_weights would send
    return None


def run_layout(layout: dict[str, int], preset: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Start the layout's ranks, wait for them, and summarise what they reported."""
    world = layout["tp"] * layout["pp"] * layout["dp"]
    if not (work / preset / "config.json").exists():
        init_model_dir(work / preset, preset=preset)
    argv = [json.dumps({**vars(args), "out": None, "parallel": None, "preset": preset, "work": str(work), **layout})]
    # Each rank's stdout to a file: a pipe nobody reads while waiting on all ranks could fill and block one.
    outs = [(work / f"rank-{r}.out").open("w+") for r in range(world)]
    with listen_socket() as sock:
        fd = sock.fileno()
        procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port_of(sock)), str(fd), *argv],
                                  pass_fds=(fd,) if r == 0 else (), cwd=REPO, stdout=outs[r], text=True)
                 for r in range(world)]
    try:
        wait_all(procs, RANK_TIMEOUT_S, f"layout {layout_name(layout)}: ranks")
    finally:
        for f in outs:
            f.close()
    ranks = [json.loads((work / f"rank-{r}.out").read_text().strip().splitlines()[-1]) for r in range(world)]
    times, tokens = ranks[0]["step_s"], ranks[0]["tokens"]
    med = statistics.median(times)
    params = ranks[0]["parameters"]
    learner_rss = [r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks]
    per_param = max(learner_rss) / params
    # What grows with the model on the fullest rank: parameters, fp32 main copies, Adam, the fp32
    # gradient buffer, and (--snapshot, rank 0) the kept copy. Measured RSS per parameter does not
    # extrapolate from a few million parameters: the runtime's own memory dominates it there.
    accounted = max(r["state_bytes"] + r["grad_bytes"] + r["snapshot_bytes"] for r in ranks)
    return {"world_size": world, **layout, "step_s_median": round(med, 4), "step_s_by_round": [round(t, 4) for t in times],
            "tokens_per_s": round(tokens / med, 1),
            "publish_s_median": round(statistics.median(ranks[0]["publish_s"]), 4),
            "state_bytes_per_rank_max": max(r["state_bytes"] for r in ranks),
            "state_bytes_by_rank": [r["state_bytes"] for r in ranks],
            "first_step": ranks[0]["first"],
            "dtype": args.dtype, "snapshot": bool(args.snapshot), "parameters": params,
            "peak_rss_bytes_by_rank": [r["peak_rss_bytes"] for r in ranks],
            "baseline_rss_bytes_by_rank": [r["baseline_rss_bytes"] for r in ranks],
            "peak_reset": all(r["peak_reset"] for r in ranks),
            "learner_rss_bytes_per_rank_max": max(learner_rss),
            "learner_rss_bytes_per_param": round(per_param, 2),
            "state_bytes_per_param": round(max(r["state_bytes"] for r in ranks) / params, 2),
            "grad_bytes_per_param": round(max(r["grad_bytes"] for r in ranks) / params, 2),
            "snapshot_bytes": ranks[0]["snapshot_bytes"],
            "snapshot_bytes_per_param": round(ranks[0]["snapshot_bytes"] / params, 2),
            "accounted_bytes_per_param": round(accounted / params, 2),
            "extrapolated_7b": {"parameters": PARAMS_7B, "accounted_gb_per_rank": round(accounted / params * PARAMS_7B / 1e9, 1),
                                "snapshot_gb": round(ranks[0]["snapshot_bytes"] / params * PARAMS_7B / 1e9, 1)}}


def rank_main() -> None:
    rank, port, fd = map(int, sys.argv[1:4])
    a = argparse.Namespace(**json.loads(sys.argv[4]))
    torch.set_num_threads(max(1, a.threads // (a.tp * a.pp * a.dp)))  # the layout shares the cores
    world = a.tp * a.pp * a.dp
    init_distributed(rank, world, tp=a.tp, pp=a.pp, seed=0, port=port, listen_fd=fd if rank == 0 else None)
    model_dir = Path(a.work) / a.preset
    config = AutoConfig.from_pretrained(str(model_dir))
    baseline = rss_bytes("VmRSS")  # imports and process group, no model yet
    learner = MegatronLearner(model_dir, lr=a.lr, grad_clip=1.0, micro_batch_size=a.micro_batch_size,
                              distributed_optimizer=bool(a.distopt), max_tokens_per_micro_batch=a.max_tokens,
                              dtype=a.dtype)
    samples = make_batch(a, config.vocab_size)
    cfg = RLConfig()
    first: dict[str, float] = {}
    snap = None
    for w in range(a.warmup):
        r = learner.rl_step(samples, cfg)
        snap = publish(learner, rank, a.snapshot)
        if w == 0:
            first = {k: float(r[k]) for k in ("loss", "grad_norm", "entropy")}
    reset = reset_peak_rss()
    times, publish_s = [], []
    for _ in range(a.steps):
        dist.barrier()  # time the step, not the wait for the slowest rank's previous one
        t = time.perf_counter()
        learner.rl_step(samples, cfg)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        snap = publish(learner, rank, a.snapshot)  # the old copy goes once the new one is made, as it did
        publish_s.append(time.perf_counter() - t)
    params = sum({name: t.numel() for name, t in learner.hf_weights()}.values())  # the whole model (collective)
    print(json.dumps({"step_s": times, "publish_s": publish_s, "state_bytes": learner.state_bytes(), "first": first,
                      "tokens": sum(len(s.prompt) + len(s.response) for s in samples),
                      "baseline_rss_bytes": baseline, "peak_rss_bytes": rss_bytes("VmHWM"), "peak_reset": reset,
                      "parameters": params,
                      "grad_bytes": sum(p.main_grad.numel() * p.main_grad.element_size() for p in learner.params
                                        if getattr(p, "main_grad", None) is not None),
                      "snapshot_bytes": sum(t.numel() * t.element_size() for t in (snap or {}).values())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
