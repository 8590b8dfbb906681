"""The held-out accuracy's 95% interval (streamrl/core/evalstats.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from streamrl.core.evalstats import accuracy_report, mean_ci95, with_ci
from streamrl.plugins.rewards import Scored
from streamrl.runtime.evaluate import metric_value


def test_interval_is_z_times_the_standard_error_over_prompts() -> None:
    # 4 prompts scoring 1, 0, 0.5, 0.5: mean 0.5, sample variance (0.25+0.25+0+0)/3 = 1/6
    mean, half = mean_ci95([1.0, 0.0, 0.5, 0.5])
    assert mean == 0.5
    assert math.isclose(half, 1.959963984540054 * math.sqrt((1 / 6) / 4))  # 0.4001
    # 100 greedy 0/1 scores, 30 right: 1.96 * sqrt(0.3 * 0.7 * 100/99 / 100) = 0.09027
    mean, half = mean_ci95([1.0] * 30 + [0.0] * 70)
    assert mean == 0.3 and math.isclose(half, 0.09027, abs_tol=1e-5)


def test_no_spread_no_interval_and_too_few_prompts_say_so() -> None:
    assert mean_ci95([0.25] * 8) == (0.25, 0.0)
    assert mean_ci95([0.7]) == (0.7, None)
    assert mean_ci95([]) == (0.0, None)


def test_report_and_its_printed_form() -> None:
    r = accuracy_report([1.0, 0.0], [1.0, 1.0])
    assert r["accuracy"] == 0.5 and math.isclose(r["accuracy_ci95"], 1.959963984540054 * math.sqrt(0.5 / 2))
    assert r["greedy_accuracy"] == 1.0 and r["greedy_ci95"] == 0.0
    assert with_ci(r, "accuracy") == "0.500±0.980" and with_ci(r, "greedy_accuracy") == "1.000±0.000"
    assert with_ci({"accuracy": 0.25}, "accuracy") == "0.250"  # an evaluation from before the interval existed


def test_eval_metric_picks_the_reward_or_a_component_and_names_what_is_missing() -> None:
    shaped = Scored(0.6, {"exact": 0.0, "prefix": 0.75}, None)  # countdown_reward, partial_credit 0.8
    assert metric_value(shaped, "reward") == 0.6 and metric_value(shaped, "exact") == 0.0
    assert metric_value(Scored(None, {}, "boom"), "exact") == 0.0  # a failed score counts 0
    with pytest.raises(ValueError, match=r"data.eval_metric.*'final'.*\['exact', 'prefix'\]"):
        metric_value(shaped, "final")
