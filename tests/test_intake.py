"""The external producers' intake rules (streamrl/producers/intake.py): which groups are refused and why,
staleness leases, and the external share of the admission capacity. Pure: no HTTP, no pool."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from streamrl.core import staleness
from streamrl.core.types import Sample, from_json, from_msgpack, to_json, to_msgpack
from streamrl.producers import intake
from streamrl.producers.intake import LeaseBook, LeaseError, check_group, content_sha256, room

from poolkit import make_group

LIMITS = dict(producer_id="env", n_samples=4, vocab_size=50_000, max_tokens=64, published_version=3)


def group(gid: str = "env:e0:p0", **kw):
    return make_group(gid, producer_id="env", **kw)


def reason(g, **over) -> str | None:
    return check_group(g, **{**LIMITS, **over})


def test_a_valid_group_passes():
    assert reason(group(versions=(2, 3))) is None
    assert reason(group(), n_samples=None, vocab_size=None, max_tokens=None, published_version=None) is None


@pytest.mark.parametrize("mutate, expected", [
    (lambda g: setattr(g, "group_id", "other:e0:p0"), "must start with 'env:'"),
    (lambda g: setattr(g, "status", "partial"), "status is 'partial'"),
    (lambda g: setattr(g, "consumed_step", 3), "consumed_step is 3"),
    (lambda g: setattr(g, "consumed_version", 1), "consumed_version is 1"),
    (lambda g: g.samples.pop(), "has 3 samples; this run's groups have rollout.n_samples=4"),
    (lambda g: setattr(g.samples[3], "index", 1), "sample indices are [0, 1, 1, 2]"),
    (lambda g: setattr(g, "prompt_tokens", np.empty(0, np.int32)), "prompt_tokens is empty"),
    (lambda g: g.prompt_tokens.__setitem__(1, 50_000), "prompt_tokens has token id 50000 at position 1"),
    (lambda g: g.samples[1].response_tokens.__setitem__(0, -1), "samples[1].response_tokens has token id -1"),
    (lambda g: setattr(g.samples[2], "reward", None),
     "samples[2].reward is None; every sample that is not failed needs a reward"),
    (lambda g: setattr(g.samples[0], "reward", float("nan")), "samples[0].reward nan is not a finite number"),
    (lambda g: setattr(g.samples[0], "reward", float("inf")), "samples[0].reward inf is not a finite number"),
    (lambda g: setattr(g.samples[0], "reward", 1e39), "samples[0].reward 1e+39 is not a finite number within +-1e+06"),
])
def test_refusals_name_the_field_and_value(mutate, expected):
    g = group()
    mutate(g)
    got = reason(g)
    assert got is not None and expected in got, got


def test_lengths_versions_and_failed_samples():
    long = group(num_tokens=60, prompt_len=5, vary_lengths=False)
    assert "samples[0]: 5 prompt + 60 response tokens = 65 exceed" in reason(long)
    assert reason(long, max_tokens=65) is None

    future = group(versions=(3, 4))
    assert reason(future) == ("version 4 is from the future: the run has published version 3 (generate with a "
                              "published policy; GET /v1/status says which)")
    assert reason(future, published_version=None) is None

    neg = group(spans=[(-1, 0, 6)])
    assert "negative version -1" in reason(neg)

    g = group()
    g.samples[1] = Sample(index=1, response_tokens=[], rollout_logprobs=[], failed=True, error="env crashed")
    assert reason(g) is None  # a failed sample needs no tokens, reward or spans
    g.samples[2] = Sample(index=2, response_tokens=[], rollout_logprobs=[], reward=1.0)
    assert "samples[2] has no response tokens" in reason(g)

    every = group()
    for s in every.samples:
        s.failed = True
    assert "every sample is failed" in reason(every)


def test_content_hash_is_the_same_over_json_and_msgpack():
    g = group()
    h = content_sha256(g)
    assert content_sha256(from_json(to_json(g), type(g))) == h
    assert content_sha256(from_msgpack(to_msgpack(g), type(g))) == h
    # Fields the service sets do not change it; content does.
    g2 = from_msgpack(to_msgpack(g), type(g))
    g2.producer_id, g2.created_at, g2.metadata = "x", 123, {**g.metadata, "submission_sha256": "abc"}
    assert content_sha256(g2) == h
    g2.samples[0].reward = 0.123
    assert content_sha256(g2) != h


def test_producer_id_rules():
    assert intake.producer_id_problem("agent-7.b_c") is None
    for bad in ("", "a b", "x" * 65, "a/b", "ünï"):
        assert "must match" in intake.producer_id_problem(bad)
    assert "must not start with 'rollout-'" in intake.producer_id_problem("rollout-0")


def test_room_is_the_last_share_of_the_admission_capacity():
    # 2 workers + external producers: capacity (0+1+1)*4 = 8 split 3 ways -> 3, 3, 2.
    assert [staleness.capacity_share(8, i, 3) for i in range(3)] == [3, 3, 2]
    assert room(0, 1, 4, shares=3, share_index=2, started=0, outstanding=0) == 2
    assert room(0, 1, 4, shares=3, share_index=2, started=1, outstanding=1) == 0
    assert room(0, 1, 4, shares=3, share_index=2, started=5, outstanding=0) == 0  # never negative
    assert room(1, 1, 4, shares=3, share_index=2, started=1, outstanding=1) == 2  # 12 -> 4, 4, 4
    assert room(5, 0, 2, shares=1, share_index=0, started=10, outstanding=0) == 2  # only external producers


def test_lease_book_grants_uses_and_expires():
    book = LeaseBook(lease_s=10)
    assert book.grant("env", 5, room=0, version=0, now=0) is None
    a = book.grant("env", 5, room=3, version=2, now=0)
    assert (a.slots, a.used, a.version, a.producer_id, a.expires_at) == (3, 0, 2, "env", 10)
    assert book.outstanding(now=1) == 3
    book.use(a.lease_id, now=1)
    b = book.use(a.lease_id, now=2)
    assert b.used == 2 and book.outstanding(now=2) == 1
    book.check(a.lease_id, now=3)  # check does not use a slot
    assert book.outstanding(now=3) == 1
    book.use(a.lease_id, now=3)
    with pytest.raises(LeaseError, match="used all of its 3 slots"):
        book.use(a.lease_id, now=4)
    book.refund(a.lease_id)
    assert book.outstanding(now=4) == 1

    c = book.grant("env", 1, room=1, version=2, now=5)
    assert book.outstanding(now=5) == 2
    assert book.outstanding(now=15) == 0  # unused slots of expired leases go back
    with pytest.raises(LeaseError, match=r"expired 1.0s ago"):
        book.use(c.lease_id, now=16)
    with pytest.raises(LeaseError, match="unknown lease 'nope'"):
        book.use("nope", now=16)
    book.grant("env", 1, room=1, version=2, now=40)  # prunes leases expired more than lease_s ago
    with pytest.raises(LeaseError, match="unknown lease"):
        book.use(c.lease_id, now=40)


def test_wire_bodies_validate():
    g = group()
    sub = from_msgpack(to_msgpack(intake.Submission(lease_id="L", group=g)), intake.Submission)
    assert sub.group.group_id == g.group_id and np.array_equal(sub.group.samples[3].response_tokens,
                                                               g.samples[3].response_tokens)
    body = to_json(intake.Submission(lease_id="L", group=g)).replace(b'"rollout_logprobs":[', b'"rollout_logprobs":[0.5,', 1)
    with pytest.raises(msgspec.ValidationError, match="sample 0: 6 response tokens but 7 log-probs"):
        from_json(body, intake.Submission)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"producer_id": "a", "groups": 0}', type=intake.LeaseRequest)
