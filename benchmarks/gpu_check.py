#!/usr/bin/env python
"""StreamRL's checks for one lent GPU (run through benchmarks/gpu_check.sh; docs/gpu.md), each in its own
process under its own time limit, all within --budget-s, so one hang cannot eat the machine's budget.
Prints ONE JSON object: {"benchmark": "gpu_check", "mode": "cuda"|"cpu", "ok", "env", "checks": {NAME:
{"status": "ok"|"failed"|"skipped", "s", "reason"|"error", ...figures}}}. The tiny model_kit model, seed 0:

  learner_fp32_cpu   MegatronLearner.rl_step on the CPU (CUDA hidden from the process): the reference
  learner_fp32       the same on CUDA: first step's loss / grad_norm / entropy, step s, tokens/s, memory
  learner_agreement  the two first steps (same weights and batch): grad_norm, entropy rel. diff < 1e-3
  learner_bf16       rl_step with dtype="bf16" (recipe key learner.dtype; skipped where this tree lacks it)
  weight_group       connectors/sglang/weight_sync open_store + create_group (rank 0) and, in a second
                     process, join_group (rank 1), gloo; a packed bucket (fp32, bf16, int64) broadcast from
                     the GPU and received on the GPU; sha256 of the bytes on both sides
  engine             the embedded engine (engine_core.EngineCore) on CUDA, greedy and sampled: each token's
                     log-prob vs a teacher-forced transformers forward on the same device (< 1e-3); tokens/s
  engine_cpu_parity  (CUDA only) the greedy requests on the CPU engine: same tokens, largest log-prob diff
  engine_moe         the embedded engine on a tiny Qwen3-MoE (model_kit tiny-moe) capturing routed experts
                     (return_routed_experts): every position's experts vs transformers' router top-k on the
                     same device, as sets; SGLang's row count (prompt + output - 1)
  learner_real_vocab MegatronLearner.rl_step at Qwen's vocabulary (--real-vocab, 151936; the tiny preset's
                     layers, bf16 on CUDA, fp32 on the CPU): the step's peak extra memory per 1k tokens
                     (CUDA: torch.cuda.max_memory_allocated; CPU: VmHWM), log-probs in chunks, vocab-parallel
  learner_real_vocab_reference  the same step computed as the learner used to (the whole [tokens, vocab]
                     logits, then log_softmax on them: benchmarks/_vocab_memory.use_reference); the first
                     check then carries over_reference (the issue's target: <= 0.25) and the loss difference
  learner_moe        MegatronLearner.rl_step on tiny-moe with routing replay, the engine's routing (from
                     engine_moe's way: transformers' top-k) on every sample: routing_mismatch must be 0;
                     step s, memory

--cpu (or no GPU): every check on the CPU; the CUDA-only ones are skipped with the reason. Exit 0 when
no check failed. In a bare checkout (the device machine) `streamrl.connectors` is found below.

Long file: the device machine runs this one script, each check a child process of itself, so the
checks and the parent that times them out live together.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

import torch  # noqa: E402

import streamrl  # noqa: E402

try:  # an installed StreamRL maps connectors/ (pools/, recipes/) to streamrl.connectors; a bare checkout does not
    import streamrl.connectors  # noqa: F401
except ModuleNotFoundError:
    streamrl.__path__.append(str(REPO))  # type: ignore[attr-defined]  # streamrl.connectors -> REPO/connectors

RESULT = "GPU_CHECK_RESULT "  # the line a child prints its result on
PACKAGES = ("torch", "transformers", "tokenizers", "megatron-core", "mbridge", "msgspec", "numpy", "sglang")
DEFAULT_LIMITS = {"learner_fp32_cpu": 120, "learner_fp32": 120, "learner_bf16": 120, "weight_group": 60,
                  "engine": 90, "engine_cpu_parity": 60, "engine_moe": 90, "learner_moe": 120,
                  "learner_real_vocab": 150, "learner_real_vocab_reference": 150}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- what runs in the children


def _need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("asked for cuda but torch sees no GPU")


def _model_dir(work: Path) -> Path:
    from streamrl.connectors.megatron.model_kit import init_model_dir

    return init_model_dir(work / "tiny", "tiny", seed=0)


def learner_dtype_support() -> str | None:
    """None when this tree's learner takes dtype="bf16" (recipe key learner.dtype); else why not."""
    import msgspec

    from streamrl.connectors.megatron.learner import MegatronLearner
    from streamrl.recipe.schema import LearnerCfg

    if "dtype" not in {f.name for f in msgspec.structs.fields(LearnerCfg)}:
        return "the recipe has no learner.dtype key in this tree (fp32 only)"
    if "dtype" not in inspect.signature(MegatronLearner.__init__).parameters:
        return "MegatronLearner takes no dtype argument in this tree"
    return None


def child_learner(device: str, dtype: str, work: Path, steps: int) -> dict[str, Any]:
    from argparse import Namespace

    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_single_process

    from benchmarks._learner import make_batch

    _need(device)
    model_dir = _model_dir(work)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    init_single_process()
    kw = {"dtype": dtype} if dtype != "fp32" else {}
    mg = MegatronLearner(model_dir, lr=1e-6, grad_clip=1.0, micro_batch_size=8, **kw)
    batch = make_batch(Namespace(samples=16, group_size=4, prompt_len=16, response_len=64, longtail=False), vocab)
    tokens = sum(len(s.prompt) + len(s.response) for s in batch)
    cfg = RLConfig()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, stats = [], []
    for _ in range(steps + 1):  # the first: warm-up (and the agreement figures)
        sync()
        t = time.perf_counter()
        stats.append(mg.rl_step(batch, cfg))
        sync()
        times.append(time.perf_counter() - t)
    (first, first_s), last, times = (stats[0], times[0]), stats[-1], times[1:]
    head = {k: float(first[k]) for k in ("loss", "grad_norm", "entropy")}
    if not all(math.isfinite(v) for v in [*head.values(), float(last["loss"])]):
        raise RuntimeError(f"non-finite step statistics: first {head}, last loss {last['loss']}")
    med = sorted(times)[len(times) // 2] if times else first_s
    return {"device": str(mg.device), "param_dtype": str(next(mg.model.parameters()).dtype).removeprefix("torch."),
            "first": head, "last_loss": float(last["loss"]), "first_step_s": round(first_s, 3),
            "step_s_median": round(med, 4), "tokens_per_step": tokens, "tokens_per_s": round(tokens / med, 1),
            "steps": steps, "max_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)
            if device == "cuda" else None}


def _bucket(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(512, 256, generator=g), "b.weight": torch.randn(1000, generator=g).bfloat16(),
             "c.count": torch.randint(0, 2**40, (33,), generator=g), "d.bias": torch.randn(7, generator=g)}
    return {k: v.to(device) for k, v in state.items()}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _engine_side(port: int, device: str, meta: dict[str, Any], answer: Any) -> None:
    from streamrl.connectors.sglang.weight_sync import BUCKET_FORMAT, join_group, receive

    try:
        g = join_group("127.0.0.1", port, 1, 2, "gpu-check", backend="gloo", timeout_s=30)
        buf = torch.empty(0, dtype=torch.uint8, device=device)
        got = receive(g, meta["names"], meta["dtypes"], meta["shapes"], load_format=BUCKET_FORMAT, buf=buf)
        answer.put({"ok": True, "device": str(next(iter(got.values())).device), "sha256": _digest(got)})
    except Exception as e:  # noqa: BLE001 - reported, not raised
        answer.put({"ok": False, "error": repr(e)[-1500:]})


def child_weight_group(device: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from streamrl.connectors.sglang.weight_sync import broadcast, create_group, dtype_name, open_store, pack

    state = pack(_bucket(device))
    meta = {"names": list(state), "dtypes": [dtype_name(t.dtype) for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}
    ctx = mp.get_context("spawn")  # CUDA in a child needs spawn
    answer = ctx.Queue()
    store = open_store(2)
    p = ctx.Process(target=_engine_side, args=(store.port, device, meta, answer), daemon=True)
    p.start()
    try:
        t = time.perf_counter()
        g = create_group(store, 2, "gpu-check", backend="gloo", timeout_s=30)
        joined = time.perf_counter() - t
        t = time.perf_counter()
        broadcast(g, list(state.values()), bucketed=True)
        sent = time.perf_counter() - t
        eng = answer.get(timeout=40)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    if not eng["ok"]:
        raise RuntimeError(f"engine side: {eng['error']}")
    want = _digest(state)
    if eng["sha256"] != want or not eng["device"].startswith(device):
        raise RuntimeError(f"bytes or device differ: sent {want} on {device}, got {eng['sha256']} on {eng['device']}")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"backend": "gloo", "device": device, "tensors": len(state), "bytes": nbytes, "sha256_equal": True,
            "join_s": round(joined, 3), "broadcast_s": round(sent, 4), "received_on": eng["device"]}


def _generate(core: Any, loop: threading.Thread, prompts: list[list[int]], n: int, **sampling: Any) -> tuple[list, float]:
    from streamrl.connectors.sglang.engine_core import GenRequest

    done = threading.Semaphore(0)
    reqs = [GenRequest(rid=f"r{i}", input_ids=p, max_new_tokens=n, ignore_eos=True,
                       on_done=lambda _: done.release(), **sampling) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    core.submit_many(reqs)
    for _ in reqs:
        while not done.acquire(timeout=0.5):
            if not loop.is_alive():
                raise RuntimeError("the engine loop thread died (its traceback is on stderr)")
    wall = time.perf_counter() - t
    if bad := [r.finish for r in reqs if (r.finish or {}).get("type") != "length"]:
        raise RuntimeError(f"requests ended early: {bad[:3]}")
    return reqs, wall


def child_engine(device: str, work: Path, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from streamrl.connectors.sglang.engine_core import EngineCore

    _need(device)
    model_dir = _model_dir(work)
    core = EngineCore(model_dir, max_running=16, device=device, seed=0)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    prompts = [[5 + i, 17, 42 + i, 99, 7] for i in range(8)]
    try:
        greedy, _ = _generate(core, loop, prompts, new_tokens, temperature=0.0)
        sampled, wall = _generate(core, loop, prompts, new_tokens, temperature=1.0, sampling_seed=0)
    finally:
        core.stop()
        loop.join(timeout=30)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    diff, argmax_same = 0.0, 0
    with torch.no_grad():
        for r in [*greedy, *sampled]:
            ids = torch.tensor([r.input_ids + r.output_ids], device=device)
            logp = torch.log_softmax(ref(input_ids=ids).logits[0, len(r.input_ids) - 1: -1].float(), -1)
            want = logp.gather(-1, ids[0, len(r.input_ids):, None])[:, 0]
            diff = max(diff, float((want - torch.tensor(r.logprobs, device=device)).abs().max()))
            argmax_same += r.temperature == 0 and logp.argmax(-1).tolist() == r.output_ids
    out = {"device": str(core.device), "requests": len(greedy) + len(sampled), "new_tokens": new_tokens,
           "max_logprob_diff_vs_reference": float(f"{diff:.3g}"),
           "greedy_equals_reference_argmax": round(argmax_same / len(greedy), 3),
           "sampled_tokens_per_s": round(len(sampled) * new_tokens / wall, 1),
           "greedy": [[r.output_ids, [round(x, 6) for x in r.logprobs]] for r in greedy]}
    if diff > 1e-3:
        raise RuntimeError(f"engine log-probs differ from the reference forward by {diff:.3g} (> 1e-3): {out}")
    return out


def _router_topk(model: Any, tokens: list[int], device: str) -> torch.Tensor:
    """[len(tokens), layers, top_k] each transformers MoE router's choice in one plain forward."""
    got: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, li=li: got.__setitem__(li, out[2]))
             for li, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens], device=device))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[li].cpu() for li in range(len(got))], 1)


def child_engine_moe(device: str, work: Path, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from streamrl.connectors.megatron.model_kit import init_model_dir
    from streamrl.connectors.sglang.engine_core import EngineCore, routed_rows

    _need(device)
    model_dir = init_model_dir(work / "moe", "tiny-moe", seed=0)
    core = EngineCore(model_dir, max_running=16, device=device, seed=0)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    prompts = [[5 + i, 17, 42 + i, 99, 7] for i in range(8)]
    try:
        reqs, wall = _generate(core, loop, prompts, new_tokens, temperature=1.0, sampling_seed=0, routed_experts=True)
    finally:
        core.stop()
        loop.join(timeout=30)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    differ = rows = 0
    for r in reqs:
        got = routed_rows(r, 0)
        if got is None or len(got) != len(r.input_ids) + len(r.output_ids) - 1:
            raise RuntimeError(f"request {r.rid}: {None if got is None else len(got)} routing rows, expected "
                               f"{len(r.input_ids) + len(r.output_ids) - 1}")
        want = _router_topk(ref, r.input_ids + r.output_ids, device)[: len(got)]
        differ += int((got.cpu().sort(-1).values != want.sort(-1).values).any(-1).sum())
        rows += got.shape[0] * got.shape[1]
    out = {"device": str(core.device), "requests": len(reqs), "routed_rows": rows,
           "rows_differing_from_reference": differ, "sampled_tokens_per_s": round(len(reqs) * new_tokens / wall, 1)}
    if differ > rows * 0.01:  # near-ties may flip between kernels; more is a capture bug
        raise RuntimeError(f"routing differs from transformers' router on {differ} of {rows} (position, layer): {out}")
    return out


def child_learner_moe(device: str, work: Path, steps: int) -> dict[str, Any]:
    from argparse import Namespace

    from transformers import AutoModelForCausalLM

    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_single_process
    from streamrl.connectors.megatron.model_kit import init_model_dir

    from benchmarks._learner import make_batch

    _need(device)
    model_dir = init_model_dir(work / "moe", "tiny-moe", seed=0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batch = make_batch(Namespace(samples=16, group_size=4, prompt_len=16, response_len=64, longtail=False), vocab)
    for s in batch:  # what the engine would send: the routing of every position but the last
        s.routed_experts = _router_topk(ref, [*s.prompt, *s.response], "cpu")[:-1].to(torch.int32).numpy()
    init_single_process()
    mg = MegatronLearner(model_dir, lr=1e-6, grad_clip=1.0, micro_batch_size=8, routing_replay=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    stats, times = [], []
    for _ in range(steps + 1):
        sync()
        t = time.perf_counter()
        stats.append(mg.rl_step(batch, RLConfig()))
        sync()
        times.append(time.perf_counter() - t)
    if any(s["routing_mismatch"] != 0 for s in stats):
        raise RuntimeError(f"replayed routing differs from the engine's: {[s['routing_mismatch'] for s in stats]}")
    if not all(math.isfinite(float(s["loss"])) for s in stats):
        raise RuntimeError(f"non-finite loss: {[s['loss'] for s in stats]}")
    med = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return {"device": str(mg.device), "routing_mismatch": stats[0]["routing_mismatch"],
            "routing_own_mismatch_first": stats[0]["routing_own_mismatch"], "first_loss": float(stats[0]["loss"]),
            "step_s_median": round(med, 4), "max_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)
            if device == "cuda" else None}


def child_real_vocab(device: str, work: Path, vocab: int, reference: bool) -> dict[str, Any]:
    from argparse import Namespace

    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, init_single_process

    from benchmarks import _vocab_memory
    from benchmarks._learner import make_batch

    _need(device)
    if reference:
        _vocab_memory.use_reference()
    init_single_process()
    dtype = "bf16" if device == "cuda" else "fp32"
    mg = MegatronLearner(_vocab_memory.build_model_dir(work / "vocab", vocab), lr=1e-6, micro_batch_size=8, dtype=dtype)
    batch = make_batch(Namespace(samples=16, group_size=4, prompt_len=64, response_len=192, longtail=False), vocab)
    tokens = sum(len(s.prompt) + len(s.response) for s in batch)
    t = time.perf_counter()
    extra, r = _vocab_memory.measured_step(mg, batch, RLConfig())  # a warm-up step, then the measured one
    return {"vocab": vocab, "dtype": dtype, "tokens": tokens, "two_steps_s": round(time.perf_counter() - t, 3),
            "peak_extra_mb": round(extra, 1), "peak_mb_per_1k_tokens": round(extra / tokens * 1000, 1),
            "max_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None,
            "loss": float(r["loss"]), "grad_norm": float(r["grad_norm"])}


def run_child(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        if args.child == "real_vocab":
            out = child_real_vocab(args.device, work, args.real_vocab, args.reference)
        elif args.child == "learner_moe":
            out = child_learner_moe(args.device, work, args.steps)
        elif args.child.startswith("learner"):
            out = child_learner(args.device, args.dtype, work, args.steps)
        elif args.child == "weight_group":
            out = child_weight_group(args.device)
        elif args.child == "engine":
            out = child_engine(args.device, work, args.new_tokens)
        elif args.child == "engine_moe":
            out = child_engine_moe(args.device, work, args.new_tokens)
        else:
            raise SystemExit(f"unknown child {args.child!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(RESULT + json.dumps(out), flush=True)


# ---------------------------------------------------------------- the parent


DEADLINE = [float("inf")]  # time.monotonic() by which every check must be over (--budget-s)


def run_check(name: str, argv: list[str], limit: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One child process in its own session; killed (with its children) at `limit` seconds, or sooner
    where the run's budget ends first (a check with under 10 s left is skipped)."""
    left = DEADLINE[0] - time.monotonic()
    if left < 10:
        return skipped(f"the run's --budget-s was spent before this check ({left:.0f} s left)")
    limit = min(limit, left)
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--child", *argv]
    log(f"{name}: start (limit {limit:g} s)")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        log(f"{name}: killed at its {limit:g} s limit")
        return {"status": "failed", "s": round(time.perf_counter() - t, 1), "error": f"timed out after {limit:g} s",
                "stderr_tail": err[-1500:]}
    took = round(time.perf_counter() - t, 1)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        log(f"{name}: failed (exit {proc.returncode}) in {took} s")
        return {"status": "failed", "s": took, "error": f"exit {proc.returncode}", "stderr_tail": err[-2500:]}
    log(f"{name}: ok in {took} s")
    return {"status": "ok", "s": took, **json.loads(lines[-1][len(RESULT):])}


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "s": 0.0, "reason": reason}


def environment() -> dict[str, Any]:
    have = {(d.metadata["Name"] or "").lower().replace("_", "-"): d.version
            for d in reversed(list(metadata.distributions()))}  # the first on sys.path wins, as for imports
    versions = {p: have.get(p) for p in PACKAGES}
    cuda = torch.cuda.is_available()
    return {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "versions": versions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run every check on the CPU (skip the CUDA-only ones)")
    ap.add_argument("--only", nargs="+", metavar="CHECK", help="run these checks alone (names above)")
    ap.add_argument("--steps", type=int, default=3, help="timed learner steps after the first (default 3)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens per engine request (default 16)")
    ap.add_argument("--limit-scale", type=float, default=1.0, help="multiply every check's time limit")
    ap.add_argument("--budget-s", type=float, default=420, help="all checks together end within this (default 420 "
                    "s: the device machine's 15 minutes hold a start, this run and a rerun)")
    ap.add_argument("--real-vocab", type=int, default=151936, help="learner_real_vocab's vocabulary (default "
                    "151936, Qwen2.5's; the CPU smoke test uses a smaller one)")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            run_child(args)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return

    t0 = time.perf_counter()
    DEADLINE[0] = time.monotonic() + args.budget_s
    env = environment()
    cuda = env["cuda_available"] and not args.cpu
    dev = "cuda" if cuda else "cpu"
    why_cpu = "--cpu given" if args.cpu else "torch sees no GPU"
    try:
        why_no_bf16 = learner_dtype_support()
    except Exception as e:  # noqa: BLE001 - reported as the reason
        why_no_bf16 = f"cannot import the learner: {e!r}"
    lim = {k: v * args.limit_scale for k, v in DEFAULT_LIMITS.items()}
    common = ["--steps", str(args.steps), "--new-tokens", str(args.new_tokens)]
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    plan: dict[str, Any] = {
        "learner_fp32_cpu": lambda: run_check("learner_fp32_cpu", ["learner", "--device", "cpu", *common],
                                              lim["learner_fp32_cpu"], no_gpu),
        "learner_fp32": lambda: run_check("learner_fp32", ["learner", "--device", "cuda", *common],
                                          lim["learner_fp32"]) if cuda else skipped(f"CUDA only ({why_cpu})"),
        "learner_bf16": lambda: skipped(why_no_bf16) if why_no_bf16 else run_check(
            "learner_bf16", ["learner", "--device", dev, "--dtype", "bf16", *common], lim["learner_bf16"],
            None if cuda else no_gpu),
        "weight_group": lambda: run_check("weight_group", ["weight_group", "--device", dev], lim["weight_group"],
                                          None if cuda else no_gpu),
        "engine": lambda: run_check("engine", ["engine", "--device", dev, *common], lim["engine"],
                                    None if cuda else no_gpu),
        "engine_cpu_parity": lambda: run_check("engine_cpu_parity", ["engine", "--device", "cpu", *common],
                                               lim["engine_cpu_parity"], no_gpu) if cuda
        else skipped(f"compares the CUDA engine with the CPU one ({why_cpu})"),
        "engine_moe": lambda: run_check("engine_moe", ["engine_moe", "--device", dev, *common], lim["engine_moe"],
                                        None if cuda else no_gpu),
        "learner_moe": lambda: run_check("learner_moe", ["learner_moe", "--device", dev, *common], lim["learner_moe"],
                                         None if cuda else no_gpu),
        **{name: (lambda name=name, ref=ref: run_check(
            name, ["real_vocab", "--device", dev, "--real-vocab", str(args.real_vocab), *ref], lim[name],
            None if cuda else no_gpu))
           for name, ref in (("learner_real_vocab", []), ("learner_real_vocab_reference", ["--reference"]))},
    }
    names = list(plan) + ["learner_agreement"]
    if args.only and (bad := set(args.only) - set(names)):
        ap.error(f"unknown checks {sorted(bad)}; choose from {names}")
    wanted = set(args.only or names)
    checks: dict[str, Any] = {n: plan[n]() if n in wanted else skipped("not in --only") for n in plan}

    a, b = checks["learner_fp32"], checks["learner_fp32_cpu"]
    if "learner_agreement" not in wanted:
        checks["learner_agreement"] = skipped("not in --only")
    elif a["status"] == "ok" and b["status"] == "ok":
        d = {k: float(f"{abs(a['first'][k] - b['first'][k]) / max(abs(b['first'][k]), 1e-12):.3g}")
             for k in ("grad_norm", "entropy")}
        ok = max(d.values()) < 1e-3
        checks["learner_agreement"] = {"status": "ok" if ok else "failed", "s": 0.0,
                                       **{f"{k}_rel_diff": v for k, v in d.items()},
                                       "loss_abs_diff": float(f"{abs(a['first']['loss'] - b['first']['loss']):.3g}")}
    else:
        checks["learner_agreement"] = skipped("needs learner_fp32 and learner_fp32_cpu both ok")
    v, vr = checks["learner_real_vocab"], checks["learner_real_vocab_reference"]
    if v["status"] == "ok" and vr["status"] == "ok":
        v |= {"over_reference": round(v["peak_mb_per_1k_tokens"] / max(vr["peak_mb_per_1k_tokens"], 1e-9), 3),
              "loss_abs_diff_vs_reference": float(f"{abs(v['loss'] - vr['loss']):.3g}")}
    g, c = checks["engine"], checks["engine_cpu_parity"]
    if cuda and g["status"] == "ok" and c["status"] == "ok":
        same = sum(x[0] == y[0] for x, y in zip(g["greedy"], c["greedy"])) / len(g["greedy"])
        lp = max((abs(p - q) for x, y in zip(g["greedy"], c["greedy"]) if x[0] == y[0]
                  for p, q in zip(x[1], y[1])), default=0.0)
        c |= {"same_tokens": round(same, 3), "max_logprob_diff": float(f"{lp:.3g}")}
    for r in (g, c):
        r.pop("greedy", None)
    result = {"benchmark": "gpu_check", "mode": dev, "ok": all(r["status"] != "failed" for r in checks.values()),
              "env": env, "checks": checks, "wall_s": round(time.perf_counter() - t0, 1)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
