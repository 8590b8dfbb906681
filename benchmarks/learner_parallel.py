"""`learner_step.py --parallel LAYOUT ...`: the megatron learner's RL step in parallel layouts.

Each layout (`1` = one process, `tp=2`, `pp=2`, `dp=2`, or combined `tp=2,pp=2`; `distopt=0`
turns megatron's distributed optimizer off, which is on by default and acts when dp > 1) runs as
tp*pp*dp processes of this module (gloo on CPU, NCCL on GPU; rank 0 serves the store on a
socket the kernel bound, connectors/ports.py), each building MegatronLearner on the same model
and training on the same batch (benchmarks/_learner.make_batch). Rank 0 times the steps (every rank
takes part in each: the step is collective); every rank reports the bytes of its parameters and
optimizer state (MegatronLearner.state_bytes, after the first step created Adam's moments).
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

from benchmarks._common import wait_all  # noqa: E402
from benchmarks._learner import layout_name, make_batch  # noqa: E402

RANK_TIMEOUT_S = 3600  # a whole layout run at most; a rank that fails ends the others at once (wait_all)


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
    return {"world_size": world, **layout, "step_s_median": round(med, 4), "step_s_by_round": [round(t, 4) for t in times],
            "tokens_per_s": round(tokens / med, 1),
            "state_bytes_per_rank_max": max(r["state_bytes"] for r in ranks),
            "state_bytes_by_rank": [r["state_bytes"] for r in ranks],
            "first_step": ranks[0]["first"]}


def rank_main() -> None:
    rank, port, fd = map(int, sys.argv[1:4])
    a = argparse.Namespace(**json.loads(sys.argv[4]))
    torch.set_num_threads(max(1, a.threads // (a.tp * a.pp * a.dp)))  # the layout shares the cores
    world = a.tp * a.pp * a.dp
    init_distributed(rank, world, tp=a.tp, pp=a.pp, seed=0, port=port, listen_fd=fd if rank == 0 else None)
    model_dir = Path(a.work) / a.preset
    learner = MegatronLearner(model_dir, lr=a.lr, grad_clip=1.0, micro_batch_size=a.micro_batch_size,
                              distributed_optimizer=bool(a.distopt), max_tokens_per_micro_batch=a.max_tokens)
    samples = make_batch(a, AutoConfig.from_pretrained(str(model_dir)).vocab_size)
    cfg = RLConfig()
    first: dict[str, float] = {}
    for w in range(a.warmup):
        r = learner.rl_step(samples, cfg)
        if w == 0:
            first = {k: float(r[k]) for k in ("loss", "grad_norm", "entropy")}
    times = []
    for _ in range(a.steps):
        dist.barrier()  # time the step, not the wait for the slowest rank's previous one
        t = time.perf_counter()
        learner.rl_step(samples, cfg)
        times.append(time.perf_counter() - t)
    print(json.dumps({"step_s": times, "state_bytes": learner.state_bytes(), "first": first,
                      "tokens": sum(len(s.prompt) + len(s.response) for s in samples)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
