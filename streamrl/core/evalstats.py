"""Held-out accuracy with its 95% confidence interval: is a change between two evaluations signal?

Each prompt contributes one number (the mean reward of its k sampled answers, or its greedy
answer's reward), so the interval is over prompts: prompts differ far more than the samples of one
prompt do, and k samples of the same prompt are not independent draws of the accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def mean_ci95(per_prompt: Sequence[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% interval) of per-prompt scores: z * sample std / sqrt(n).
    0 prompts -> (0, None); 1 prompt -> (its score, None): nothing says how far the mean may be off."""
    n = len(per_prompt)
    if n == 0:
        return 0.0, None
    mean = math.fsum(per_prompt) / n
    if n == 1:
        return mean, None
    var = math.fsum((x - mean) ** 2 for x in per_prompt) / (n - 1)
    return mean, Z95 * math.sqrt(var / n)


def accuracy_report(sampled: Sequence[float], greedy: Sequence[float]) -> dict[str, float | None]:
    """The evaluation's accuracy fields: `accuracy`/`greedy_accuracy` and their `*_ci95` half-widths."""
    acc, acc_ci = mean_ci95(sampled)
    g, g_ci = mean_ci95(greedy)
    return {"accuracy": acc, "accuracy_ci95": acc_ci, "greedy_accuracy": g, "greedy_ci95": g_ci}


def with_ci(res: dict[str, object], key: str) -> str:
    """'0.412±0.061' for an evaluation's `accuracy` / `greedy_accuracy` (rows from before the
    interval was recorded print the bare value)."""
    ci = res.get("greedy_ci95" if key == "greedy_accuracy" else "accuracy_ci95")
    return f"{res[key]:.3f}" + (f"±{ci:.3f}" if isinstance(ci, float) else "")
