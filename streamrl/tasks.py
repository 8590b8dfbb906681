"""The quick-start's synthetic, verifiable task: two-digit addition, "37+48=" -> "85".

Draft (being tuned).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def arithmetic_problem(rng: random.Random, digits: int = 2, ops: str = "+") -> tuple[str, str]:
    hi = 10**digits - 1
    a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", str(value)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def decode_response(tokenizer: Any, output_ids: Iterable[int]) -> str:
    ids = list(output_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_task(out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 128, n_sft: int = 2000,
               **difficulty: Any) -> dict[str, Path]:
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    order: list[str] = []
    want = n_train + n_eval + n_sft
    tries = 0
    while len(order) < want:
        tries += 1
        if tries > 50 * want:
            raise ValueError(f"the problem space is too small for {want} distinct prompts")
        p, a = arithmetic_problem(rng, **difficulty)
        if p not in seen:
            seen[p] = a
            order.append(p)
    ev, sft, tr = order[:n_eval], order[n_eval:n_eval + n_sft], order[n_eval + n_sft:]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "train": _write_jsonl(out / "train.jsonl", ({"id": f"train-{i}", "prompt": p, "label": seen[p]}
                                                    for i, p in enumerate(tr))),
        "eval": _write_jsonl(out / "eval.jsonl", ({"id": f"eval-{i}", "prompt": p, "label": seen[p]}
                                                  for i, p in enumerate(ev))),
        "sft": _write_jsonl(out / "sft.jsonl", ({"id": f"sft-{i}", "prompt": p, "response": seen[p]}
                                                for i, p in enumerate(sft))),
    }


def sft_rows(tokenizer: Any, records: Iterable[Mapping[str, Any]]) -> list[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    return [(encode_prompt(tokenizer, r["prompt"]),
             list(tokenizer(str(r["response"]), add_special_tokens=False)["input_ids"]) + [eos])
            for r in records]
