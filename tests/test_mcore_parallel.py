"""Tensor parallel 2 and data parallel 2 (two processes, gloo) give the same losses and
gradient norms as one process over 3 RL steps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys, json, random
    rank, world, tp, port, fd, d = (*map(int, sys.argv[1:6]), sys.argv[6])
    from streamrl.connectors.mcore_learner import MegatronLearner, RLConfig, Sample, init_distributed
    init_distributed(rank, world, tp, seed=0, port=port, listen_fd=fd if rank == 0 else None)
    rng = random.Random(0)
    samples = [Sample(prompt=[rng.randrange(500) for _ in range(5 + g)],
                      response=[rng.randrange(500) for _ in range(6 + i + g)], advantage=rng.uniform(-1, 1), group=g)
               for g in range(4) for i in range(4)]
    learner = MegatronLearner(d, lr=1e-2, micro_batch_size=4, with_reference=True)
    out = [learner.rl_step(samples, RLConfig(kl_coef=0.1, entropy_coef=0.01, loss_agg=sys.argv[7]))
           for _ in range(3)]
    if rank == 0:
        print(json.dumps([{k: o[k] for k in ("loss", "grad_norm", "kl", "entropy")} for o in out]))
    import torch.distributed as dist
    dist.barrier()  # leave together: rank 0 serves the store, and exiting with gloo's threads alive can abort
    dist.destroy_process_group()
""")


def _launch(world: int, tp: int, model: Path, agg: str) -> list[subprocess.Popen[str]]:
    from streamrl.connectors.ports import listen_socket, port_of

    with listen_socket() as sock:  # rank 0 serves the store on it (no port to race for)
        fd = sock.fileno()
        return [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(world), str(tp), str(port_of(sock)),
                                  str(fd), str(model), agg], pass_fds=(fd,) if r == 0 else (),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(world)]


def _result(procs: list[subprocess.Popen[str]]) -> list[dict[str, float]]:
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token", "group"])
def test_tp2_and_dp2_match_one_process(tmp_path: Path, agg: str) -> None:
    from streamrl.connectors.model_kit import init_model_dir

    model = init_model_dir(tmp_path / "tiny", "tiny")
    single = _launch(1, 1, model, agg)
    tp2 = _launch(2, 2, model, agg)
    ref, got_tp = _result(single), _result(tp2)
    got_dp = _result(_launch(2, 1, model, agg))
    for got in (got_tp, got_dp):
        for a, b in zip(ref, got):
            for k in ("loss", "grad_norm", "kl", "entropy"):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, ref, got)
    assert ref[0]["kl"] == 0.0 and ref[2]["kl"] > 0  # the steps really moved the policy
