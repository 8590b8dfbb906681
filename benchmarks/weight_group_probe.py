#!/usr/bin/env python
"""Can a learner and an engine that share one GPU form a weight group? For each backend named,
two processes join one group through the product's `connectors/sglang/weight_sync` (the learner as
rank 0 broadcasts a tensor from the GPU, the engine as rank 1 receives it into the GPU, as an
engine's /update_weights_from_distributed does) and each says what happened.

    python benchmarks/weight_group_probe.py gloo nccl

Prints one JSON object: per backend, each side's outcome (ok, or the error) and the seconds
taken. Without a GPU both sides use the CPU and `nccl` falls back to gloo (as weight_sync does).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script from a checkout

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from streamrl.connectors.sglang.weight_sync import broadcast, create_group, join_group, open_store, receive  # noqa: E402

TIMEOUT_S = 30


def engine(port: int, backend: str, answer: Any) -> None:
    try:
        g = join_group("127.0.0.1", port, 1, 2, "probe-" + backend, backend=backend, timeout_s=TIMEOUT_S)
        w = receive(g, ["w"], ["float32"], [[4]])["w"]
        answer.put({"ok": w.tolist() == [0.0, 1.0, 2.0, 3.0], "device": str(w.device), "values": w.tolist()})
    except Exception as e:  # noqa: BLE001 - reported, not raised
        answer.put({"ok": False, "error": repr(e)[-1500:]})


def probe(backend: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA in a child needs spawn
    answer = ctx.Queue()
    store = open_store(2)
    p = ctx.Process(target=engine, args=(store.port, backend, answer), daemon=True)  # dies with this one
    p.start()
    t = time.perf_counter()
    try:
        g = create_group(store, 2, "probe-" + backend, backend=backend, timeout_s=TIMEOUT_S)
        broadcast(g, [torch.arange(4.0, device="cuda" if torch.cuda.is_available() else "cpu")])
        learner: dict[str, Any] = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        learner = {"ok": False, "error": repr(e)[-1500:]}
    try:
        eng = answer.get(timeout=TIMEOUT_S + 10)
    except Exception as e:  # noqa: BLE001
        eng = {"ok": False, "error": f"no answer from the engine process: {e!r}"}
    p.join(10)
    p.kill()
    return {"learner": learner, "engine": eng, "s": round(time.perf_counter() - t, 2)}


def main() -> None:
    backends = sys.argv[1:] or ["gloo", "nccl"]
    if bad := [b for b in backends if b not in ("gloo", "nccl")]:
        sys.exit(f"unknown backends {bad}: name gloo and/or nccl")
    out = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           **{b: probe(b) for b in backends}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
