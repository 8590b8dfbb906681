"""Partial-rollout state transitions and learner rows: pure functions, driven directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.core import algorithms as alg
from streamrl.core import partial
from streamrl.core.types import Batch, Sample, SampleGroup, VersionSpan
from streamrl.runtime.learner import batch_metrics, learner_rows


def V(v: int, s: int, e: int) -> VersionSpan:
    return VersionSpan(v, s, e)


def test_abort_resume_keeps_tokens_and_shifts_spans_of_the_next_call():
    t = partial.Trajectory(prompt=[1, 2], max_new_tokens=6)
    assert partial.next_request(t) == ([1, 2], 6)
    partial.absorb(t, [10, 11], [-0.1, -0.2], [V(0, 0, 2)], "abort")
    assert (t.tokens, t.spans, t.done, t.interruptions) == ([10, 11], [V(0, 0, 2)], False, 1)
    # The next call sends prompt + tokens so far and asks only for what is left.
    assert partial.next_request(t) == ([1, 2, 10, 11], 4)
    partial.absorb(t, [12, 13, 14], [-0.3, -0.4, -0.5], [V(1, 0, 1), V(2, 1, 3)], "stop")
    assert t.tokens == [10, 11, 12, 13, 14] and t.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert t.spans == [V(0, 0, 2), V(1, 2, 3), V(2, 3, 5)]
    assert t.done and t.finish == "stop" and t.calls == 2
    with pytest.raises(ValueError, match="finished"):
        partial.next_request(t)


def test_same_version_after_resume_merges_into_one_span():
    t = partial.Trajectory(prompt=[1], max_new_tokens=4)
    partial.absorb(t, [5], [-1.0], [V(3, 0, 1)], "abort")
    partial.absorb(t, [6, 7, 8], [-1.0, -1.0, -1.0], [V(3, 0, 3)], "length")
    assert t.spans == [V(3, 0, 4)] and t.done and t.finish == "length"


def test_restart_discards_what_was_generated():
    t = partial.Trajectory(prompt=[1], max_new_tokens=4)
    partial.absorb(t, [5, 6], [-1.0, -1.0], [V(0, 0, 2)], "abort", policy="restart")
    assert t.tokens == [] and t.spans == [] and t.interruptions == 1 and t.discarded == 2
    assert partial.next_request(t) == ([1], 4)
    partial.absorb(t, [7], [-1.0], [V(1, 0, 1)], "abort", policy="restart")
    assert t.discarded == 3


@pytest.mark.parametrize("policy", ["abort_resume", "in_place", "finish_old"])
def test_only_restart_throws_tokens_away(policy):
    t = partial.Trajectory(prompt=[1], max_new_tokens=4)
    partial.absorb(t, [5, 6], [-1.0, -1.0], [V(0, 0, 2)], "abort", policy=policy)
    partial.absorb(t, [7], [-1.0], [V(1, 0, 1)], "stop", policy=policy)
    assert t.tokens == [5, 6, 7] and t.discarded == 0 and t.spans == [V(0, 0, 2), V(1, 2, 3)]


def test_abort_with_the_budget_used_up_finishes_as_length():
    t = partial.Trajectory(prompt=[1], max_new_tokens=2)
    partial.absorb(t, [5, 6], [-1.0, -1.0], [V(0, 0, 2)], "abort")
    assert t.done and t.finish == "length"


def test_absorb_refuses_inconsistent_engine_output():
    t = partial.Trajectory(prompt=[1], max_new_tokens=2)
    with pytest.raises(ValueError, match="log-probs"):
        partial.absorb(t, [5], [], [V(0, 0, 1)], "stop")
    with pytest.raises(ValueError, match="requested"):
        partial.absorb(t, [5, 6, 7], [0.0] * 3, [V(0, 0, 3)], "stop")
    with pytest.raises(ValueError, match="cover"):
        partial.absorb(t, [5, 6], [0.0] * 2, [V(0, 0, 1)], "stop")
    partial.absorb(t, [5], [0.0], [V(2, 0, 1)], "abort")
    with pytest.raises(ValueError, match="backwards"):
        partial.absorb(t, [6], [0.0], [V(1, 0, 1)], "stop")


def test_stored_partial_round_trips_and_resumes():
    t = partial.Trajectory(prompt=[1, 2], max_new_tokens=5)
    partial.absorb(t, [7, 8], [-0.5, -0.25], [V(4, 0, 2)], "abort")
    s = partial.to_sample(t, 3)
    assert s.finish_reason == "abort" and s.index == 3 and s.metadata == {"calls": 1, "interruptions": 1}
    back = partial.from_sample(s, [1, 2], 5)
    assert (back.tokens, back.spans, back.calls, back.done) == ([7, 8], [V(4, 0, 2)], 1, False)
    assert partial.next_request(back) == ([1, 2, 7, 8], 3)
    done = partial.from_sample(Sample(index=0, response_tokens=[1], rollout_logprobs=[0.0], spans=[V(0, 0, 1)],
                                      finish_reason="stop"), [1], 5)
    assert done.done


def _group(gid: str, rewards: list[float | None], version: int = 0, failed: set[int] = frozenset()) -> SampleGroup:
    samples = [Sample(index=i, response_tokens=[10 + i, 11], rollout_logprobs=[-1.0, -2.0], spans=[V(version, 0, 2)],
                      reward=r, failed=i in failed, error="boom" if i in failed else None)
               for i, r in enumerate(rewards)]
    return SampleGroup(group_id=gid, prompt_id=gid, prompt_tokens=[1, 2, 3], samples=samples)


def test_learner_rows_use_group_advantages_and_skip_failed_samples():
    groups = [_group("a", [1.0, 0.0, 0.0, 1.0]), _group("b", [0.0, 1.0, 1.0, 1.0])]
    rows, rewards = learner_rows(groups, "grpo")
    want = alg.group_advantages(torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 1]]), "grpo").flatten().tolist()
    assert [r.advantage for r in rows] == pytest.approx(want)
    assert [r.group for r in rows] == [0] * 4 + [1] * 4 and rewards == [1, 0, 0, 1, 0, 1, 1, 1]
    assert rows[0].prompt == [1, 2, 3] and rows[1].response == [11, 11] and rows[0].rollout_logprobs == [-1.0, -2.0]

    # A failed sample is left out; its group's advantages come from the others.
    rows, rewards = learner_rows([_group("a", [1.0, None, 0.0, 1.0], failed={1}), groups[1]], "grpo")
    assert len(rows) == 7 and rewards == [1, 0, 1, 0, 1, 1, 1]
    a = alg.group_advantages(torch.tensor([[1.0, 0.0, 1.0]]), "grpo")[0].tolist()
    assert [r.advantage for r in rows[:3]] == pytest.approx(a)
    assert [r.response[0] for r in rows[:3]] == [10, 12, 13]


def test_batch_metrics_staleness_from_token_versions():
    b = Batch(step=5, learner_version=5, groups=[_group("a", [1.0, 0.0], version=3), _group("b", [0.0, 0.0], version=5)],
              dropped=["x", "y"], masked_tokens=4)
    m = batch_metrics(b, [1.0, 0.0, 0.0, 0.0])
    assert (m["staleness_mean"], m["staleness_max"], m["dropped_stale"], m["masked_tokens"]) == (1.0, 2, 2, 4)
    assert m["reward_mean"] == 0.25 and m["groups"] == ["a", "b"] and m["samples"] == 4
    assert np.isnan(batch_metrics(Batch(step=0, learner_version=0, groups=[]), [])["reward_mean"])
