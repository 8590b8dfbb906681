"""What learner_step.py and its --parallel runs (learner_parallel.py, one process per rank) share:
the layout names and the fixed RL batch every side and every rank trains on."""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from streamrl.connectors.megatron.learner import Sample
from streamrl.core.algorithms import group_advantages


def parse_layout(text: str) -> dict[str, int]:
    """"1" | "tp=2" | "tp=2,pp=2,dp=1" | "dp=2,distopt=0" -> {"tp", "pp", "dp", "distopt"}
    (missing sizes are 1, the distributed optimizer is on unless distopt=0)."""
    out = {"tp": 1, "pp": 1, "dp": 1, "distopt": 1}
    if text.strip() in ("1", ""):
        return out
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        ok = value.strip().isdigit() and (int(value) in (0, 1) if key == "distopt" else int(value) >= 1)
        if key not in out or not ok:
            raise argparse.ArgumentTypeError(f"--parallel {text!r}: expected 1 or tp=N,pp=N,dp=N (N >= 1) "
                                             f"[,distopt=0|1], got {part!r}")
        out[key] = int(value)
    return out


def layout_name(layout: dict[str, int]) -> str:
    name = ",".join(f"{k}={v}" for k, v in layout.items() if k != "distopt" and v > 1)
    if not layout.get("distopt", 1):
        name = f"{name},distopt=0" if name else "distopt=0"
    return name or "1"


def make_batch(args: argparse.Namespace, vocab: int) -> list[Any]:
    rng = random.Random(0)
    groups = args.samples // args.group_size
    rewards = torch.tensor([[float(rng.random() < 0.5) for _ in range(args.group_size)] for _ in range(groups)])
    for row in rewards:  # GRPO needs spread inside a group for nonzero advantages
        if row.min() == row.max():
            row[0] = 1.0 - row[0]
    adv = group_advantages(rewards, "grpo").flatten().tolist()

    def length(mean: int) -> int:
        return rng.randint(max(1, mean * 3 // 4), max(1, mean * 5 // 4))

    steps = range(2, 29)

    def response_len() -> int:
        if args.longtail:
            return 8 * rng.choices(steps, weights=[1 / n for n in steps])[0]
        return length(args.response_len)

    # ids from 3 up: no special tokens (0-2), though the model would not care
    return [Sample(prompt=[rng.randrange(3, vocab) for _ in range(length(args.prompt_len))],
                   response=[rng.randrange(3, vocab) for _ in range(response_len())],
                   advantage=adv[i], group=i // args.group_size) for i in range(groups * args.group_size)]
