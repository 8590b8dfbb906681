"""Which steps of the long-tail countdown RL fixes: from a run's pool, per bucket of policy versions,
how often the rollouts wrote a step right where it borrows (the units digit below d: "952-7=945")
and where it does not, and how often the opening step (the subtraction from the prompt) was right.

Each sample is read up to and including its first wrong step (`streamrl.plugins.tasks:countdown_steps`),
so "right" is the rate of a step right given that the chain was right until it. Samples are bucketed
by the oldest policy version that wrote them (min_version). Tokens are decoded with the model kit's
tokenizer (the long-tail recipe's model), or --tokenizer DIR.

    .venv/bin/python benchmarks/longtail_steps.py runs/longtail [--bucket 50]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout, installed or not

from transformers import AutoTokenizer  # noqa: E402

from benchmarks._common import emit, git_rev  # noqa: E402
from streamrl.connectors.megatron.model_kit import build_tokenizer  # noqa: E402
from streamrl.plugins.tasks import countdown_steps  # noqa: E402
from streamrl.pools import LancePool  # noqa: E402


def tokenizer(path: str | None) -> Any:
    return build_tokenizer() if path is None else AutoTokenizer.from_pretrained(path)


def step_rates(rows: list[dict[str, Any]], tok: Any, bucket: int) -> list[dict[str, Any]]:
    """Per bucket of `bucket` versions: counts and rates of borrow / other / opening steps right."""
    n: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        prompt = tok.decode(r["prompt_tokens"], skip_special_tokens=True)
        response = tok.decode(r["response_tokens"], skip_special_tokens=True)
        c = n[r["min_version"] // bucket]
        c["samples"] += 1
        for i, (borrows, right) in enumerate(countdown_steps(prompt, response)):
            kind = "borrow" if borrows else "other"
            c[f"{kind}_steps"] += 1
            c[f"{kind}_right"] += right
            if i == 0:
                c["opening_right"] += right
    out = []
    for b in sorted(n):
        c = n[b]
        out.append({"versions": [b * bucket, (b + 1) * bucket - 1], "samples": c["samples"],
                    "borrow_steps": c["borrow_steps"], "other_steps": c["other_steps"],
                    **{f"{k}_right": round(c[f"{k}_right"] / max(1, c[f"{k}_steps"]), 4) for k in ("borrow", "other")},
                    "opening_right": round(c["opening_right"] / max(1, c["samples"]), 4)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a long-tail run's directory (its pool/)")
    ap.add_argument("--bucket", type=int, default=50, help="policy versions per bucket (default: 50)")
    ap.add_argument("--tokenizer", help="a model directory whose tokenizer wrote the run (default: the model kit's)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    pool_dir = a.run_dir / "pool"
    if not pool_dir.is_dir():
        ap.error(f"{pool_dir} does not exist: give a run directory (streamrl run --run-dir)")
    pool = LancePool(pool_dir, create=False)
    rows = pool.scan(["prompt_tokens", "response_tokens", "min_version"], where="NOT failed").to_pylist()
    emit({"benchmark": "longtail_steps", "code": git_rev(), "run_dir": str(a.run_dir), "bucket": a.bucket,
          "buckets": step_rates(rows, tokenizer(a.tokenizer), a.bucket)}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
