"""Group filters (nonzero_std, min_scored, user filters through FilterHub, raising or
non-bool filters) and the over-sampling selection top_by_reward_std."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable

import numpy as np
import pytest

from streamrl.core.types import Sample, SampleGroup, VersionSpan
from streamrl.plugins.filters import (
    FilterHub,
    min_scored,
    nonzero_std,
    reward_std,
    top_by_reward_std,
)
from streamrl.recipe import FnRef

FAILED = "failed"  # marks a sample whose generation failed
ERROR = "error"  # marks a sample whose reward function failed


def group(rewards: list, gid: str = "g") -> SampleGroup:
    samples = []
    for i, r in enumerate(rewards):
        s = Sample(index=i, response_tokens=[1], rollout_logprobs=[-0.5], spans=[VersionSpan(0, 0, 1)])
        if r == FAILED:
            s.failed, s.error = True, "engine died"
        elif r == ERROR:
            s.error = "score: KeyError: 'x'"
        else:
            s.reward = r
        samples.append(s)
    return SampleGroup(group_id=gid, prompt_id="p", prompt_tokens=[1, 2], samples=samples)


@pytest.mark.parametrize("rewards,keep", [
    ([1.0, 0.0, 1.0], True),
    ([1.0, 1.0, 1.0], False),
    ([0.1, 0.1, 0.1], False),  # float mean round-off must not fake a spread
    ([1.0, FAILED, 0.0], True),
    ([1.0, FAILED, ERROR, 1.0], False),  # only scored samples count
    ([1.0, None], False),  # unscored (reward None) is not a reward
    ([1.0, FAILED], False),  # fewer than two scored
    ([], False),
])
def test_nonzero_std(rewards: list, keep: bool):
    assert nonzero_std(group(rewards)) is keep


def test_reward_std_values():
    assert reward_std(group([0.0, 1.0])) == pytest.approx(0.5)
    assert reward_std(group([0.0, 1.0, ERROR, FAILED])) == pytest.approx(0.5)
    assert reward_std(group([2.0])) == 0.0
    assert reward_std(group([0.1, 0.1, 0.1])) == 0.0


@pytest.mark.parametrize("rewards,fraction,keep", [
    ([1.0, 0.0], 1.0, True),
    ([1.0, ERROR], 1.0, False),
    ([1.0, ERROR], 0.5, True),
    ([1.0, FAILED, ERROR, 0.0], 0.5, True),
    ([1.0, FAILED, ERROR, ERROR], 0.5, False),
    ([None, None], 0.0, True),
    ([], 0.0, False),
])
def test_min_scored(rewards: list, fraction: float, keep: bool):
    assert min_scored(group(rewards), fraction=fraction) is keep


def test_min_scored_rejects_bad_fraction():
    with pytest.raises(ValueError, match=r"fraction=1\.5.*\[0, 1\]"):
        min_scored(group([1.0]), fraction=1.5)


mod = types.ModuleType("filterkit")
sys.modules["filterkit"] = mod


def register(fn: Callable) -> str:
    setattr(mod, fn.__name__, fn)
    return f"filterkit:{fn.__name__}"


def test_hub_first_false_filter_names_the_reason():
    def short_enough(g, max_tokens):
        return all(s.num_tokens <= max_tokens for s in g.samples)

    hub = FilterHub([FnRef(fn="streamrl.plugins.filters:min_scored", args={"fraction": 0.5}),
                     FnRef(fn="streamrl.plugins.filters:nonzero_std"),
                     FnRef(fn=register(short_enough), args={"max_tokens": 0})])
    assert hub.check(group([1.0, ERROR, ERROR])) == "min_scored"
    assert hub.check(group([1.0, 1.0])) == "nonzero_std"
    assert hub.check(group([1.0, 0.0])) == "short_enough"
    assert FilterHub([FnRef(fn=register(short_enough), args={"max_tokens": 1})]).check(group([1.0])) is None
    assert FilterHub([]).check(group([1.0])) is None


def test_hub_raising_or_non_bool_filter_drops_and_warns_once(caplog: pytest.LogCaptureFixture):
    def explodes(g):
        raise ZeroDivisionError("oops")

    def forgot_return(g):
        pass

    def np_bool(g):
        return np.bool_(True)

    hub = FilterHub([FnRef(fn=register(np_bool)), FnRef(fn=register(explodes)), FnRef(fn=register(forgot_return))])
    with caplog.at_level(logging.WARNING, logger="streamrl.plugins.filters"):
        assert [hub.check(group([1.0, 0.0], gid=f"g{i}")) for i in range(3)] == ["explodes_error"] * 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "streamrl.plugins.filters"]
    assert len(warnings) == 1 and "explodes" in warnings[0] and "ZeroDivisionError: oops" in warnings[0]
    caplog.clear()
    hub2 = FilterHub([FnRef(fn=register(forgot_return))])
    with caplog.at_level(logging.WARNING, logger="streamrl.plugins.filters"):
        assert hub2.check(group([1.0])) == "forgot_return_error"
    assert "returned NoneType None" in caplog.text


def test_hub_construction_errors():
    def strict(g, limit=1):
        return True

    async def async_filter(g):
        return True

    with pytest.raises(ValueError, match=r"filters\[0\]\.args \['limt'\] are not parameters"):
        FilterHub([FnRef(fn=register(strict), args={"limt": 2})])
    with pytest.raises(ValueError, match=r"filters\[1\]\.fn 'filterkit:async_filter' is async"):
        FilterHub([FnRef(fn=register(strict)), FnRef(fn=register(async_filter))])
    with pytest.raises(ValueError, match=r"filters\[0\]\.fn 'filterkit:nope'.*no attribute"):
        FilterHub([FnRef(fn="filterkit:nope")])


def test_top_by_reward_std_keeps_largest_spread_in_input_order():
    gs = [group(r, gid=f"g{i}") for i, r in enumerate([
        [1.0, 1.0],  # g0 std 0
        [0.0, 1.0],  # g1 std 0.5
        [0.0, 0.5],  # g2 std 0.25
        [1.0, 0.0],  # g3 std 0.5 (ties g1, younger)
        [0.0, 2.0],  # g4 std 1.0
        [0.0, FAILED, 1.0],  # g5 std 0.5 (ties, youngest)
    ])]
    ids = lambda xs: [g.group_id for g in xs]
    kept, rest = top_by_reward_std(gs, 3)
    assert ids(kept) == ["g1", "g3", "g4"] and ids(rest) == ["g0", "g2", "g5"]
    kept, rest = top_by_reward_std(gs, 1)
    assert ids(kept) == ["g4"] and len(rest) == 5
    assert top_by_reward_std(gs, 0) == ([], gs)
    assert top_by_reward_std(gs, 10) == (gs, [])
    assert top_by_reward_std([], 2) == ([], [])
    with pytest.raises(ValueError, match="k=-1"):
        top_by_reward_std(gs, -1)
