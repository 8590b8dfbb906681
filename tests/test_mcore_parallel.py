"""Pipeline parallel 2 (Megatron's 1F1B schedule), data parallel 2 without megatron's distributed
optimizer, and tensor parallel 2 x data parallel 2 with it (gloo) give the same losses, gradient
norms and published weights as one process over 3 RL steps; and the token-balanced data-parallel
split."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streamrl.connectors.megatron.batch import balanced_split

REPO = Path(__file__).resolve().parents[1]

# Each rank trains 3 RL steps per loss aggregation (a fresh learner for each) and every rank
# reports its metrics; rank 0 also writes the published weights (hf_state_dict, collective).
SCRIPT = textwrap.dedent("""
    import sys, json, random
    rank, world, tp, pp, port, fd = map(int, sys.argv[1:7])
    model_dir, out, distopt, dtype = sys.argv[7], sys.argv[8], sys.argv[9] == "1", sys.argv[10]
    from safetensors.torch import save_file
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_distributed
    init_distributed(rank, world, tp=tp, pp=pp, seed=0, port=port, listen_fd=fd if rank == 0 else None)
    rng = random.Random(0)
    samples = [Sample(prompt=[rng.randrange(500) for _ in range(5 + g)],
                      response=[rng.randrange(500) for _ in range(6 + i + 3 * g)], advantage=rng.uniform(-1, 1),
                      group=g)
               for g in range(4) for i in range(4)]
    result = {}
    for agg in ("token", "group"):
        # Adam turns a gradient element near 0 into a step of about +-lr, so float rounding that
        # differs with the layout (a TP all-reduce sums in another order) would move such weights
        # by up to ~1% of lr; a larger eps damps steps of tiny gradients and keeps the comparison
        # of published weights about the layout, not about rounding.
        learner = MegatronLearner(model_dir, lr=1e-2, micro_batch_size=4, with_reference=True, adam_eps=1e-4,
                                  distributed_optimizer=distopt, dtype=dtype)
        assert (learner.tp, learner.pp, learner.dp) == (tp, pp, world // (tp * pp))
        steps = [learner.rl_step(samples, RLConfig(kl_coef=0.1, entropy_coef=0.01, loss_agg=agg))
                 for _ in range(3)]
        weights = learner.hf_state_dict()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, f"{out}/{agg}.safetensors")
        result[agg] = [{k: s[k] for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "ratio_max")}
                       for s in steps]
        result["bytes"] = learner.state_bytes()  # this rank's parameters + optimizer state
        result["main_dtypes"] = sorted({str(p.dtype) for p in learner.opt.main_params()})
    print("RESULT " + json.dumps(result))
    import torch.distributed as dist
    dist.barrier()  # leave together: rank 0 serves the store, and exiting with gloo's threads alive can abort
    dist.destroy_process_group()
""")


def _launch(world: int, tp: int, pp: int, model: Path, out: Path, distopt: bool = True,
            dtype: str = "fp32") -> list[subprocess.Popen[str]]:
    from streamrl.connectors.ports import listen_socket, port_of

    out.mkdir(parents=True)
    with listen_socket() as sock:  # rank 0 serves the store on it (no port to race for)
        fd = sock.fileno()
        return [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(world), str(tp), str(pp),
                                  str(port_of(sock)), str(fd), str(model), str(out), str(int(distopt)), dtype],
                                 pass_fds=(fd,) if r == 0 else (),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(world)]


def _results(procs: list[subprocess.Popen[str]]) -> list[dict]:
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out, _ in outs]


def _weights(out: Path, agg: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / f"{agg}.safetensors"))


@pytest.mark.slow
def test_parallel_layouts_match_one_process(tmp_path: Path) -> None:
    """One reference process, then pipeline parallel 2, data parallel 2 without the distributed
    optimizer (replicated Adam) and tensor parallel 2 x data parallel 2 with it (four ranks): every
    rank must report the same metrics as rank 0, and they and the published weights (gathered from
    the ranks' shards) must equal one process's over 3 RL steps; model parallelism and the
    distributed optimizer must divide what a rank holds. Then in bf16 the mixed-precision
    distributed optimizer keeps fp32 main shards and stays within bf16 rounding of one bf16 process.
    One test, and TP and DP each only inside tp2 x dp2: each launch costs 15-25 s of CI."""
    from streamrl.connectors.megatron.model_kit import init_model_dir

    model = init_model_dir(tmp_path / "tiny", "tiny")
    single = _launch(1, 1, 1, model, tmp_path / "single")
    runs = {"pp2": _launch(2, 1, 2, model, tmp_path / "pp2")}  # beside the reference: 3 processes at once
    (ref,) = _results(single)
    got = {"pp2": _results(runs["pp2"])}
    got["dp2-replicated"] = _results(_launch(2, 1, 1, model, tmp_path / "dp2-replicated", distopt=False))
    got["tp2dp2"] = _results(_launch(4, 2, 1, model, tmp_path / "tp2dp2"))
    initial = _initial(model)
    for layout, ranks in got.items():
        for agg in ("token", "group"):
            assert all(r[agg] == ranks[0][agg] for r in ranks), f"{layout}: ranks report different metrics"
            for a, b in zip(ref[agg], ranks[0][agg]):
                for k in a:
                    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (layout, agg, k, ref[agg], ranks[0][agg])
            assert ref[agg][0]["kl"] == 0.0 and ref[agg][2]["kl"] > 0  # the steps really moved the policy
            w_ref, w_got = _weights(tmp_path / "single", agg), _weights(tmp_path / layout, agg)
            assert sorted(w_ref) == sorted(w_got)
            diff = max(float((w_ref[k] - w_got[k]).abs().max()) for k in w_ref)
            moved = max(float((w_ref[k] - initial[k]).abs().max()) for k in w_ref)
            print(f"{layout} {agg}: published weights max |diff| {diff:.2e} (moved {moved:.2e} from the start)")
            assert diff <= 1e-5 and moved > 1e-3
        most = max(r["bytes"] for r in ranks)
        print(f"{layout}: parameters + optimizer state per rank {most} B (one process {ref['bytes']} B)")
        # model parallelism divides what a rank holds; DP divides Adam's moments only through the
        # distributed optimizer (without it every DP rank holds all of them); TP halves it all
        if layout == "dp2-replicated":
            assert most == ref["bytes"]
        else:
            assert most < (0.5 if layout == "tp2dp2" else 0.75) * ref["bytes"]

    (ref16,) = _results(_launch(1, 1, 1, model, tmp_path / "single16", dtype="bf16"))
    ranks16 = _results(_launch(4, 2, 1, model, tmp_path / "tp2dp2-16", dtype="bf16"))
    assert all(r["main_dtypes"] == ["torch.float32"] for r in [ref16, *ranks16])
    for agg in ("token", "group"):
        w = _weights(tmp_path / "tp2dp2-16", agg)
        assert {str(t.dtype) for t in w.values()} == {"torch.bfloat16"}
        for a, b in zip(ref16[agg], ranks16[0][agg]):
            assert b["loss"] == pytest.approx(a["loss"], rel=0.02, abs=2e-3), (agg, ref16[agg], ranks16[0][agg])


def _initial(model: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def test_balanced_split_balances_tokens_deterministically() -> None:
    sizes = [50, 10, 40, 30, 30, 20, 5]
    parts = balanced_split(sizes, 2)
    loads = [sum(s for s, p in zip(sizes, parts) if p == k) for k in range(2)]
    assert sorted(loads) == [90, 95]  # largest first onto the lighter: 50 | 40 30 | 30 20 | 10 5
    assert parts == balanced_split(sizes, 2)  # the same on every rank
    assert balanced_split(sizes, 1) == [0] * len(sizes)
    assert sorted(balanced_split([7, 7, 7], 3)) == [0, 1, 2]  # equal sizes: one each
    assert balanced_split([], 4) == []
    assert balanced_split([3, 1], 4).count(0) == 1  # more parts than items: some stay empty
    with pytest.raises(ValueError, match="parts"):
        balanced_split([1], 0)


def test_dp_share_keeps_groups_whole_and_balances_tokens() -> None:
    """The learner's split of a claimed batch: whole groups, every row once over the ranks,
    token counts balanced (a round robin by group id would put 16 groups of tokens on one)."""
    from streamrl.connectors.megatron.learner import MegatronLearner, Sample

    samples = [Sample(prompt=[1] * 4, response=[2] * (40 if g < 2 else 4), group=g) for g in range(6) for _ in range(2)]
    shares = []
    for rank in range(2):
        fake = type("L", (), {"dp": 2, "par": type("P", (), {"dp_rank": rank})()})()
        shares.append(MegatronLearner._dp_share(fake, samples, key=lambda s: s.group,  # type: ignore[arg-type]
                                                tokens=lambda s: len(s.prompt) + len(s.response)))
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
    for share in shares:
        groups = {s.group for s in share}
        assert all(sum(s.group == g for s in share) == 2 for g in groups)  # whole groups
        assert [s.group for s in share] == sorted(s.group for s in share)  # batch order
    tokens = [sum(len(s.prompt) + len(s.response) for s in share) for share in shares]
    assert {s.group for s in shares[0]} & {0, 1} and {s.group for s in shares[1]} & {0, 1}  # the long ones apart
    assert abs(tokens[0] - tokens[1]) <= 8, tokens
