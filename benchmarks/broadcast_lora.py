"""`benchmarks/broadcast.py --lora`: a version push of LoRA adapters against one of the full
weights, on the same engines. The sender holds two fixed rank-R adapter sets on every linear layer
(random A and B, as a LoRA learner publishes them: streamrl/core/lora.py names) and the runtime's
VersionBroadcaster (lora=True) publishes them in turn: the learner's PEFT directory written under
the run directory, `/load_lora_adapter` on every engine, the adapter two versions back unloaded in
the background. After every push each engine is checked: a greedy generation with lora_path =
the version's adapter has the log-probs of base + that adapter computed here.

figures, per preset (the engines the run of broadcast.py started, the first --engines count):
  push_bytes {full, lora}   bytes a push moves: the model's weights / the adapter's safetensors
  push_s {full, lora}       median publish push time with nothing in flight; full = the disk path
                            (the path that LoRA pushes also take: a directory the engines read)
  pause_s {full, lora}      median pause window with 4 long requests in flight per engine, policy
                            in_place (LoRA in_place never pauses: running requests keep their adapter)
  pause_abort_s {lora}      the same under abort_resume (pause, abort, push, continue)
"""

from __future__ import annotations

import asyncio
import statistics
import time
import types
from pathlib import Path
from typing import Any

import torch

from streamrl.connectors.megatron.lora import write_peft_dir
from streamrl.core import lora as names
from streamrl.runtime.broadcast import VersionBroadcaster
from streamrl.runtime.runlog import RunLog

RANK, ALPHA, LOAD = 8, 16.0, 4


def adapter_sets(model: Any, seeds: tuple[int, ...] = (0, 1)) -> list[dict[str, torch.Tensor]]:
    """Random PEFT tensors on every q/k/v/o/gate/up/down of an HF model, one set per seed."""
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        t = {}
        for name, m in model.named_modules():
            short = name.split(".")[-1]
            if short in names.HF_PARENT and isinstance(m, torch.nn.Linear):
                layer = int(name.split(".")[2])
                t[names.peft_name(layer, short, "A")] = torch.randn(RANK, m.in_features, generator=g) * 0.1
                t[names.peft_name(layer, short, "B")] = torch.randn(m.out_features, RANK, generator=g) * 0.1
        out.append(t)
    return out


class _Sender:
    """The learner actor's export_adapter, over the fixed sets (awaited as `.remote(...)`)."""

    def __init__(self, sets: list[dict[str, torch.Tensor]], base: str) -> None:
        self.sets, self.current = sets, 0
        self.config = names.adapter_config(RANK, ALPHA, 0.0, list(names.FUSED), base)
        self.export_adapter = types.SimpleNamespace(remote=lambda path: asyncio.to_thread(
            lambda: str(write_peft_dir(self.sets[self.current], self.config, path))))


def _merged_logprobs(model: Any, adapter: dict[str, torch.Tensor], prompt: list[int], output: list[int]) -> list[float]:
    s = names.scaling(RANK, ALPHA)
    hooks = []
    for name, m in model.named_modules():
        key = f"base_model.model.{name}"
        if f"{key}.lora_A.weight" in adapter:
            a, b = adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"]
            hooks.append(m.register_forward_hook(lambda _m, args, y, a=a, b=b: y + s * (args[0] @ a.T) @ b.T))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    rows = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)].float(), -1)
    return rows[torch.arange(len(output)), torch.tensor(output)].tolist()


async def _check(clients: list[Any], model: Any, adapter: dict[str, torch.Tensor], version: int) -> None:
    prompt = [5, 17, 42, 99, 7, 3]
    for c in clients:
        r = await c.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                             lora_path=names.adapter_name(version))
        err = max(abs(x - y) for x, y in zip(r.logprobs, _merged_logprobs(model, adapter, prompt, r.output_ids)))
        if err > 1e-3 or r.version_spans()[0].version != version:
            raise RuntimeError(f"{c.base_url}: adapter {version} not served (log-prob error {err:.2e})")


async def _paused(bc: Any, sender: _Sender, clients: list[Any], version: int) -> float:
    sp = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}
    tasks = [asyncio.create_task(c.generate([5 + i, 9, 11], sp)) for c in clients for i in range(LOAD)]
    for c in clients:
        while (await c.server_info())["internal_states"][0]["num_requests"] < LOAD and not any(t.done() for t in tasks):
            await asyncio.sleep(0.005)
    sender.current = version % 2
    r = await bc.publish(version, step=version, interrupt=True)
    await asyncio.gather(*(c.abort() for c in clients))
    await asyncio.gather(*tasks, return_exceptions=True)
    return r["pause_s"]


async def measure(work: Path, model: Any, model_dir: Path, clients: list[Any], repeats: int, full: dict[str, Any],
                  model_bytes: int, first_version: int) -> dict[str, Any]:
    """LoRA pushes to `clients` next to the full-weight figures `full` (broadcast.py's disk path)."""
    sets = adapter_sets(model)
    sender = _Sender(sets, str(model_dir))
    workers = {c.base_url: c for c in clients}
    run_dir = work / "lora-run"
    bc = VersionBroadcaster(types.SimpleNamespace(workers=workers), sender, "disk", "in_place",  # type: ignore[arg-type]
                            run_dir, RunLog(run_dir, echo=False), lora=True)
    v = first_version
    push = []
    for i in range(repeats + 1):  # the first is a warm-up
        v += 1
        sender.current = v % 2
        r = await bc.publish(v, step=v, interrupt=False)
        if r["failed_engines"]:
            raise RuntimeError(f"adapter push of version {v} failed on {r['failed_engines']} engines")
        await _check(clients, model, sets[v % 2], v)
        if i:
            push.append(r["push_s"])
    lora_bytes = (run_dir / "weights" / f"lora-v{v:06d}" / "adapter_model.safetensors").stat().st_size
    pause = []
    for _ in range(repeats):
        v += 1
        pause.append(await _paused(bc, sender, clients, v))
    bc.policy = "abort_resume"
    pause_abort = []
    for _ in range(repeats):
        v += 1
        pause_abort.append(await _paused(bc, sender, clients, v))
    await _check(clients, model, sets[v % 2], v)
    await asyncio.gather(*bc._unloads)  # background unloads of old adapters finish before the engines stop
    t = time.perf_counter()
    return {"rank": RANK, "engines": len(clients),
            "push_bytes": {"full": model_bytes, "lora": lora_bytes},
            "push_s": {"full": full["push_s_median"], "lora": round(statistics.median(push), 5)},
            "pause_s": {"full": full["pause_s_median"], "lora": round(statistics.median(pause), 5)},
            "pause_abort_s": {"lora": round(statistics.median(pause_abort), 5)},
            "bytes_ratio": round(model_bytes / lora_bytes, 1), "check_s": round(time.perf_counter() - t, 3),
            "last_version": v}
