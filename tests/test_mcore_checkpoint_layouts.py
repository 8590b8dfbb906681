"""Sharded learner checkpoints across parallel layouts (connectors/megatron/checkpoint.py): a
checkpoint saved at tp=2, dp=2 or pp=2 loads into one process (and one saved by one process
loads at tp=2) with the saved weights and Adam moments, and training goes on with the losses
and gradient norms of a single process that never stopped. A damaged shard is named on every rank.

Three launches (megatron's parallel state is per process; a launch re-forms it per layout):
one process trains 4 RL steps and saves after 2 (the reference); two ranks save at tp=2, dp=2
and pp=2 and load the single-process checkpoint at tp=2; one process loads each of theirs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from learnerkit import REPO

SCRIPT = textwrap.dedent("""
    import contextlib, json, random, shutil, sys, warnings
    import torch, torch.distributed as dist
    from safetensors.torch import save_file
    from megatron.core import parallel_state as mpu
    from streamrl.connectors.megatron import checkpoint as mc
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_distributed
    rank, world, port, fd = map(int, sys.argv[1:5])
    model, work, phases = sys.argv[5], sys.argv[6], json.loads(sys.argv[7])
    rng = random.Random(0)
    samples = [Sample(prompt=[rng.randrange(500) for _ in range(5 + g)],
                      response=[rng.randrange(500) for _ in range(6 + i + g)], advantage=rng.uniform(-1, 1), group=g)
               for g in range(4) for i in range(4)]
    hf = json.load(open(f"{model}/config.json"))
    experts = hf.get("num_local_experts") or hf.get("num_experts")  # transformers 5 writes the former
    if experts:  # MoE: engine routing for all samples but the last (routed by the learner)
        for s in samples[:-1]:
            s.routed_experts = [[rng.sample(range(experts), hf["num_experts_per_tok"])
                                 for _ in range(hf["num_hidden_layers"])] for _ in range(len(s.prompt) + len(s.response) - 1)]
    cfg = RLConfig(entropy_coef=0.01)
    out = {}

    def steps(learner, n):
        return [{k: r[k] for k in ("loss", "grad_norm", "routing_own_mismatch", "routing_missing_rows") if k in r}
                for r in (learner.rl_step(samples, cfg) for _ in range(n))]

    def weights(learner, name):  # HF names, TP shards gathered: the same on any layout
        sd = learner.hf_state_dict()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in sd.items()}, f"{work}/{name}.safetensors")

    def derived(learner):  # pp: weights and moments set from the base weights, layout-independently
        with torch.no_grad():
            for p in learner.params:
                p.mul_(1.5).add_(0.01)
        learner.opt.load_param_states({p: {"exp_avg": p.detach() * 0.5, "exp_avg_sq": p.detach() ** 2}
                                       for p in learner.params}, step=3.0)
        learner.version = 3

    class NoCuda(torch.overrides.TorchFunctionMode):
        # pp > 1 ties the last stage's output layer to the embedding with `weight.data.cuda()`
        # at build time; helper pp's CPU patch (connectors/megatron/cpu_shim.py) covers it there
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return args[0] if func is torch.Tensor.cuda else func(*args, **(kwargs or {}))

    first = True
    for ph in phases:
        tp, pp = ph.get("tp", 1), ph.get("pp", 1)
        if not first:
            mpu.destroy_model_parallel()
        init_distributed(rank, world, tp, pp, seed=0, ep=ph.get("ep", 1), port=port,
                         listen_fd=fd if rank == 0 and first else None)
        first = False
        with NoCuda() if pp > 1 else contextlib.nullcontext():
            learner = MegatronLearner(model, lr=1e-2, micro_batch_size=4, warmup_steps=3,
                                      adam_eps=ph.get("adam_eps", 1e-8))
        name = ph["name"]
        if ph.get("train"):
            out[name] = steps(learner, ph["train"])
            weights(learner, name)
            mc.save_checkpoint(learner, f"{work}/{name}", extra={"saved_by": name})
            out[name] += steps(learner, ph.get("then", 0))
        if ph.get("derive"):
            derived(learner)
            mc.save_checkpoint(learner, f"{work}/{name}")
        for src in ph.get("load", []):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                extra = mc.load_checkpoint(learner, f"{work}/{src}")
            warned = any("was saved with layout" in str(w.message) for w in caught)
            if src.startswith("pp"):
                base = MegatronLearner(model)
                ok = {"version": learner.version}
                states, step = learner.opt.param_states(), learner.opt.step_count()
                for (n, p), b in zip(learner.model.named_parameters(), base.model.parameters()):
                    s = states[p]
                    ok[n] = [float((p - (b * 1.5 + 0.01)).abs().max()), float((s["exp_avg"] - p * 0.5).abs().max()),
                             float((s["exp_avg_sq"] - p ** 2).abs().max()), step]
                out[f"{name}<-{src}"] = ok
                continue
            weights(learner, f"{name}_loaded_{src}")
            out[f"{name}<-{src}"] = {"extra": extra, "version": learner.version, "warned": warned,
                                     "lr": learner.opt.param_groups[0]["lr"], "steps": steps(learner, 2)}
        if ph.get("damage"):
            bad = f"{work}/damaged"
            if rank == 0:
                shutil.copytree(f"{work}/{ph['damage']}", bad)
                path = f"{bad}/step_00000002/sharded/__1_0.distcp"
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0xFF
                open(path, "wb").write(bytes(data))
            dist.barrier()
            try:
                mc.load_checkpoint(learner, bad)
                msg = ""
            except mc.CheckpointError as e:
                msg = str(e)
            every = [None] * world
            dist.all_gather_object(every, msg)
            out["damage"] = every
    if rank == 0:
        print(json.dumps(out))
    dist.barrier()  # leave together: rank 0 serves the store
    dist.destroy_process_group()
""")


def _launch(world: int, model: Path, work: Path, phases: list[dict]) -> dict:
    from streamrl.connectors.ports import listen_socket, port_of

    with listen_socket() as sock:  # rank 0 serves the store on it
        fd = sock.fileno()
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(world), str(port_of(sock)), str(fd),
                                   str(model), str(work), json.dumps(phases)], pass_fds=(fd,) if r == 0 else (),
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _close(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in ("loss", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), (k, a, b)


def _same_weights(work: Path, a: str, b: str, tol: float = 0.0) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(str(work / f"{a}.safetensors")), load_file(str(work / f"{b}.safetensors"))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= tol


@pytest.mark.slow
def test_checkpoints_load_across_tp_dp_pp_layouts(tmp_path: Path) -> None:
    from streamrl.connectors.megatron.model_kit import init_model_dir

    model = init_model_dir(tmp_path / "tiny", "tiny")
    work = tmp_path / "work"
    work.mkdir()
    ref = _launch(1, model, work, [{"name": "one", "train": 2, "then": 2}])["one"]
    two = _launch(2, model, work, [{"name": "tp2", "tp": 2, "train": 2, "load": ["one"], "damage": "tp2"},
                                   {"name": "dp2", "train": 2, "load": ["one"]},  # into the distributed optimizer
                                   {"name": "pp2", "pp": 2, "derive": True}])
    back = _launch(1, model, work, [{"name": "tp1", "load": ["tp2", "dp2", "pp2"]}])

    assert ref[2]["grad_norm"] != pytest.approx(ref[0]["grad_norm"], rel=1e-3)  # the steps moved the policy
    _close(ref[:2], two["tp2"])  # tp=2 / dp=2 train as one process does (FACTS.md), so their
    _close(ref[:2], two["dp2"])  # checkpoints hold the reference's step-2 state
    for got, src in ((two["tp2<-one"], "one"), (two["dp2<-one"], "one"), (back["tp1<-tp2"], "tp2"),
                     (back["tp1<-dp2"], "dp2")):
        assert got["extra"] == {"saved_by": src} and got["version"] == 2, got
        assert got["lr"] == pytest.approx(1e-2), got  # warm-up scheduler state (3 steps) came along
        _close(ref[2:], got["steps"])  # steps 3 and 4: weights and Adam moments both restored
        assert got["warned"]  # RNG states do not map across layouts: said so
    _same_weights(work, "one", "tp2_loaded_one")
    _same_weights(work, "one", "dp2_loaded_one")
    _same_weights(work, "tp2", "tp1_loaded_tp2")
    _same_weights(work, "dp2", "tp1_loaded_dp2")

    pp = back["tp1<-pp2"]
    assert pp.pop("version") == 3
    assert len(pp) == 16, sorted(pp)  # every parameter of the tiny model, both stages' layers
    for name, (w, m1, m2, step) in pp.items():
        assert w < 1e-6 and m1 == 0.0 and m2 == 0.0 and step == 3.0, (name, w, m1, m2, step)

    assert all("sharded/__1_0.distcp is damaged" in m for m in two["damage"]), two["damage"]


@pytest.mark.slow
def test_moe_expert_parallel_trains_as_one_process_and_checkpoints_across_ep(tmp_path: Path) -> None:
    """Qwen3-MoE (top-2 of 4 experts) with routing replay: ep=2 (2 ranks, 2 experts each; dp=2 for
    the dense layers) gives one process's losses, gradient norms and published weights over 4 RL
    steps; a checkpoint saved at ep=2 loads in one process and one saved by one process loads at
    ep=2, and both train on as the reference did."""
    from streamrl.connectors.megatron.model_kit import init_model_dir

    model = init_model_dir(tmp_path / "moe", "tiny-moe")
    work = tmp_path / "work"
    work.mkdir()
    # Adam's eps damps the steps of near-zero gradients, whose sign the summation order decides
    # (tests/test_mcore_parallel.py): the comparison is about the layout, not about rounding
    eps = 1e-4
    ref = _launch(1, model, work, [{"name": "one", "train": 2, "then": 2, "adam_eps": eps}])["one"]
    two = _launch(2, model, work, [{"name": "ep2", "ep": 2, "train": 2, "then": 1, "load": ["one"], "adam_eps": eps}])
    back = _launch(1, model, work, [{"name": "ep1", "load": ["ep2"], "adam_eps": eps}])

    assert ref[3]["grad_norm"] != pytest.approx(ref[0]["grad_norm"], rel=1e-3)  # the steps moved the policy
    assert all(s["routing_missing_rows"] == 1 for s in ref), ref  # the one sample sent without routing
    assert 0.2 < ref[0]["routing_own_mismatch"] < 1.0  # random routing: the learner's own top-2 mostly differs
    _close(ref[:3], two["ep2"][:3])  # the 4th drifts by ~1e-5 of the norm: fp32 sums in another order
    _same_weights(work, "one", "ep2", tol=1e-5)
    for got, src in ((two["ep2<-one"], "one"), (back["ep1<-ep2"], "ep2")):
        assert got["extra"] == {"saved_by": src} and got["version"] == 2, got
        _close(ref[2:], got["steps"])
    _same_weights(work, "one", "ep2_loaded_one")
    _same_weights(work, "ep2", "ep1_loaded_ep2")
