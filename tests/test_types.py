"""Typed payloads: msgpack / JSON round trips, dtype coercion, validation, events, Ledger.

Long file: every wire type's round trips and validation errors.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from streamrl.core.types import (
    GROUP_STATES,
    Admission,
    Batch,
    BatchClaimed,
    EnginePaused,
    EngineResumed,
    Event,
    GroupAppended,
    Ledger,
    RunCheckpointed,
    Sample,
    SampleGroup,
    VersionPublished,
    VersionSpan,
    from_json,
    from_msgpack,
    make_group_id,
    to_json,
    to_msgpack,
)

V = VersionSpan
CODECS = {
    "msgpack": (to_msgpack, from_msgpack),
    "json": (to_json, from_json),
}


def _sample(index: int = 0, n: int = 5, versions: tuple[int, ...] = (0,), seed: int = 0, **kw) -> Sample:
    rng = np.random.default_rng(seed)
    cuts = np.linspace(0, n, len(versions) + 1).astype(int)
    spans = [V(v, int(a), int(b)) for v, a, b in zip(versions, cuts[:-1], cuts[1:])]
    return Sample(
        index=index,
        response_tokens=rng.integers(0, 50_000, n),
        rollout_logprobs=-rng.random(n).astype(np.float32) * 5,
        loss_mask=(rng.random(n) > 0.3).astype(np.uint8),
        spans=spans,
        **kw,
    )


def _group(gid: str = "prod:e0:p3", n_samples: int = 3) -> SampleGroup:
    return SampleGroup(
        group_id=gid,
        prompt_id="p3",
        prompt_tokens=[11, 12, 13, 14],
        samples=[
            _sample(0, 6, (0,), seed=1, reward=1.0, rewards={"acc": 1.0, "len": -0.5}, finish_reason="stop"),
            _sample(1, 7, (0, 1), seed=2, reward=0.0, finish_reason="length", metadata={"tries": 2}),
            _sample(2, 4, (1, 2, 3, 4), seed=3, failed=True, error="engine died", finish_reason="abort"),
        ][:n_samples],
        status="partial",
        producer_id="prod",
        created_at=123_456_789,
        drop_reason=None,
        consumed_step=7,
        consumed_version=6,
        metadata={"source": "test", "nested": {"a": [1, 2]}},
    )


def assert_sample_equal(a: Sample, b: Sample) -> None:
    for name in ("response_tokens", "rollout_logprobs", "loss_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in a.__struct_fields__:
        if name not in ("response_tokens", "rollout_logprobs", "loss_mask"):
            assert getattr(a, name) == getattr(b, name), name


def assert_group_equal(a: SampleGroup, b: SampleGroup) -> None:
    assert a.prompt_tokens.dtype == b.prompt_tokens.dtype == np.int32
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        assert_sample_equal(x, y)
    for name in a.__struct_fields__:
        if name not in ("prompt_tokens", "samples"):
            assert getattr(a, name) == getattr(b, name), name


# ---------------------------------------------------------------- construction


def test_sample_coerces_arrays_and_defaults_mask():
    s = Sample(index=2, response_tokens=[1, 2, 3], rollout_logprobs=[-1, -2, -3], spans=[V(0, 0, 3)])
    assert s.response_tokens.dtype == np.int32
    assert s.rollout_logprobs.dtype == np.float32
    assert s.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(s.loss_mask, [1, 1, 1])
    assert s.num_tokens == 3


def test_empty_sample_is_valid():
    s = Sample(index=0, response_tokens=[], rollout_logprobs=[])
    assert s.num_tokens == 0 and s.loss_mask.dtype == np.uint8 and len(s.loss_mask) == 0


def test_group_min_max_version_and_batch_num_samples():
    g = _group()
    assert g.min_version == 0 and g.max_version == 4
    assert SampleGroup(group_id="g", prompt_id="p", prompt_tokens=[1], samples=[]).min_version is None
    b = Batch(step=1, learner_version=1, groups=[g, _group("other", n_samples=2)])
    assert b.num_samples == 5


def test_make_group_id_is_deterministic():
    assert make_group_id("prod-1", 2, 17) == "prod-1:e2:p17"
    assert make_group_id("a", 0, 1) != make_group_id("a", 1, 0)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", CODECS)
def test_sample_round_trip(codec):
    enc, dec = CODECS[codec]
    s = _sample(3, 9, (2, 5), seed=4, reward=0.5, rewards={"a": 0.25}, finish_reason="stop", metadata={"k": "v"})
    out = dec(enc(s), Sample)
    assert isinstance(out, Sample)
    assert_sample_equal(s, out)
    assert out.spans == [V(2, 0, 4), V(5, 4, 9)]


@pytest.mark.parametrize("codec", CODECS)
def test_group_round_trip(codec):
    enc, dec = CODECS[codec]
    g = _group()
    out = dec(enc(g), SampleGroup)
    assert_group_equal(g, out)
    assert out.status == "partial" and out.consumed_step == 7 and out.metadata["nested"] == {"a": [1, 2]}
    assert out.samples[2].failed and out.samples[2].error == "engine died"


@pytest.mark.parametrize("codec", CODECS)
def test_extreme_values_survive(codec):
    enc, dec = CODECS[codec]
    lp = np.array([0.0, -1e-8, -123.456, np.float32(-0.1), -3.4e38], np.float32)
    s = Sample(
        index=0,
        response_tokens=np.array([0, 1, 2**31 - 1, 151_643, 7], np.int32),
        rollout_logprobs=lp,
        loss_mask=np.array([0, 1, 0, 1, 1], np.uint8),
        spans=[V(0, 0, 5)],
    )
    out = dec(enc(s), Sample)
    # float32 values are kept bit for bit, not rounded through float64 text
    assert out.rollout_logprobs.tobytes() == lp.tobytes()
    assert out.response_tokens.tolist() == [0, 1, 2**31 - 1, 151_643, 7]
    assert out.loss_mask.tolist() == [0, 1, 0, 1, 1]


@pytest.mark.parametrize("codec", CODECS)
def test_admission_round_trip(codec):
    enc, dec = CODECS[codec]
    a = Admission(group_id="prod:e1:p9", prompt_id="p9", n=8, producer_id="prod", version=4, admitted_at=99)
    out = dec(enc(a), Admission)
    assert out == a
    assert out != Admission(group_id="prod:e1:p9", prompt_id="p9", n=8, producer_id="prod", version=5, admitted_at=99)


@pytest.mark.parametrize("codec", CODECS)
def test_batch_round_trip(codec):
    enc, dec = CODECS[codec]
    b = Batch(step=12, learner_version=11, groups=[_group("g1"), _group("g2", 1)], dropped=["g0"], masked_tokens=5)
    out = dec(enc(b), Batch)
    assert (out.step, out.learner_version, out.dropped, out.masked_tokens) == (12, 11, ["g0"], 5)
    assert [g.group_id for g in out.groups] == ["g1", "g2"]
    for x, y in zip(b.groups, out.groups):
        assert_group_equal(x, y)
    assert out.num_samples == 4


def test_msgpack_carries_arrays_as_raw_bytes():
    s = _sample(0, 1000, (0,))
    raw = msgspec.msgpack.decode(to_msgpack(s))  # no ext_hook: exts stay exts
    assert isinstance(raw["response_tokens"], msgspec.msgpack.Ext)
    assert raw["response_tokens"].code == 1 and len(raw["response_tokens"].data) == 4000
    assert raw["rollout_logprobs"].code == 2 and len(raw["rollout_logprobs"].data) == 4000
    assert raw["loss_mask"].code == 3 and len(raw["loss_mask"].data) == 1000
    assert len(to_msgpack(s)) < 9200  # ~9 KB of arrays plus a small envelope
    assert len(to_msgpack(s)) < len(to_json(s))


def test_msgpack_refuses_arrays_of_other_dtypes():
    s = _sample(0, 3)
    s.response_tokens = np.arange(3, dtype=np.int64)  # bypasses __post_init__
    with pytest.raises(TypeError, match="int64"):
        to_msgpack(s)


def test_msgpack_accepts_plain_lists_from_other_languages():
    doc = {"index": 0, "response_tokens": [5, 6], "rollout_logprobs": [-0.5, -1.5], "spans": [[1, 0, 2]]}
    s = from_msgpack(msgspec.msgpack.encode(doc), Sample)
    assert s.response_tokens.dtype == np.int32 and s.response_tokens.tolist() == [5, 6]
    assert s.rollout_logprobs.dtype == np.float32 and s.loss_mask.tolist() == [1, 1]


# ---------------------------------------------------------------- JSON as another producer writes it


def test_json_lists_decode_to_the_right_dtypes():
    doc = {
        "group_id": "ext:e0:p1",
        "prompt_id": "p1",
        "prompt_tokens": [101, 102],
        "samples": [
            {"index": 0, "response_tokens": [1, 2, 3], "rollout_logprobs": [0, -1, -2], "spans": [[0, 0, 3]]},
            {
                "index": 1,
                "response_tokens": [4],
                "rollout_logprobs": [-0.25],
                "loss_mask": [0],
                "spans": [[2, 0, 1]],
            },
        ],
    }
    g = from_json(json.dumps(doc), SampleGroup)
    assert g.prompt_tokens.dtype == np.int32
    s0, s1 = g.samples
    assert s0.response_tokens.dtype == np.int32 and s0.response_tokens.tolist() == [1, 2, 3]
    # ints in a log-prob list still become float32
    assert s0.rollout_logprobs.dtype == np.float32 and s0.rollout_logprobs.tolist() == [0.0, -1.0, -2.0]
    assert s0.loss_mask.dtype == np.uint8 and s0.loss_mask.tolist() == [1, 1, 1]
    assert s1.loss_mask.tolist() == [0]
    assert s1.spans == [V(2, 0, 1)]
    assert g.status == "complete" and g.producer_id == "local"  # defaults
    assert g.min_version == 0 and g.max_version == 2


def test_json_empty_lists_decode_to_typed_empty_arrays():
    g = from_json(
        '{"group_id":"g","prompt_id":"p","prompt_tokens":[],'
        '"samples":[{"index":0,"response_tokens":[],"rollout_logprobs":[]}]}',
        SampleGroup,
    )
    assert g.prompt_tokens.dtype == np.int32 and g.prompt_tokens.size == 0
    s = g.samples[0]
    assert (s.response_tokens.dtype, s.rollout_logprobs.dtype, s.loss_mask.dtype) == (np.int32, np.float32, np.uint8)


def test_json_spans_are_arrays_of_three():
    s = _sample(0, 4, (1, 2))
    doc = json.loads(to_json(s))
    assert doc["spans"] == [[1, 0, 2], [2, 2, 4]]


# ---------------------------------------------------------------- invalid data

GOOD_SAMPLE = {"index": 0, "response_tokens": [1, 2, 3], "rollout_logprobs": [-0.1, -0.2, -0.3], "spans": [[0, 0, 3]]}


def _with(**changes) -> dict:
    doc = dict(GOOD_SAMPLE)
    for k, v in changes.items():
        if v is KeyError:
            doc.pop(k)
        else:
            doc[k] = v
    return doc


INVALID = {
    "logprobs_short": (_with(rollout_logprobs=[-0.1]), r"3 response tokens but 1 log-probs and 3 mask entries"),
    "mask_long": (_with(loss_mask=[1, 1, 1, 0]), r"3 response tokens but 3 log-probs and 4 mask entries"),
    "tokens_long": (_with(response_tokens=[1, 2, 3, 4]), r"4 response tokens but 3 log-probs"),
    "spans_short": (_with(spans=[[0, 0, 2]]), r"version spans cover 2 tokens, the response has 3"),
    "spans_long": (_with(spans=[[0, 0, 4]]), r"version spans cover 4 tokens, the response has 3"),
    "spans_missing": (_with(spans=KeyError), r"version spans cover 0 tokens, the response has 3"),
    "spans_gap": (_with(spans=[[0, 0, 1], [1, 2, 3]]), r"must tile \[0, 3\)"),
    "spans_overlap": (_with(spans=[[0, 0, 2], [1, 1, 3]]), r"must tile \[0, 3\)"),
    "spans_not_from_zero": (_with(spans=[[0, 1, 3]]), r"must tile \[0, 3\)"),
    "spans_empty_span": (_with(spans=[[0, 0, 0], [0, 0, 3]]), r"non-empty spans"),
    "spans_version_backwards": (_with(spans=[[2, 0, 1], [1, 1, 3]]), r"non-decreasing versions"),
    "span_arity": (_with(spans=[[0, 3]]), r"Expected `array` of at least length 3.*spans\[0\]"),
    "index_str": (_with(index="0"), r"Expected `int`, got `str`.*\$\.index"),
    "reward_str": (_with(reward="high"), r"Expected `float \| null`, got `str`.*\$\.reward"),
    "failed_int": (_with(failed="yes"), r"Expected `bool`, got `str`.*\$\.failed"),
    "tokens_missing": (_with(response_tokens=KeyError), r"missing required field `response_tokens`"),
    "tokens_str": (_with(response_tokens="1 2 3"), r"expected an array \(list of numbers\), got str"),
    "tokens_null": (_with(response_tokens=None), r"expected an array \(list of numbers\), got NoneType"),
    "token_not_number": (_with(response_tokens=[1, "a", 3]), r"response_tokens must hold int32 token ids"),
    "logprob_not_number": (_with(rollout_logprobs=["x", 0, 0]), r"rollout_logprobs must hold finite numbers"),
    # Numbers that would poison the weights: finite in float64 but not in float32, or out of range.
    "logprob_overflows_float32": (_with(rollout_logprobs=[-1e39, 0, 0]), r"rollout_logprobs must hold finite"),
    "logprob_positive": (_with(rollout_logprobs=[0.5, -0.1, -0.1]), r"rollout_logprobs holds 0.5; log-probs are <= 0"),
    "reward_huge": (_with(reward=1e39), r"reward 1e\+39 is not a finite number within \+-1e\+06"),
    "reward_component_huge": (_with(reward=1.0, rewards={"fmt": -2e6}), r"rewards\['fmt'\] -2000000.0 is not a finite"),
    "mask_255": (_with(loss_mask=[1, 255, 0]), r"loss_mask must hold 0/1 values"),
}


@pytest.mark.parametrize("codec", ["json", "msgpack"])
@pytest.mark.parametrize("case", INVALID)
def test_invalid_sample_raises_validation_error(case, codec):
    doc, pattern = INVALID[case]
    data = json.dumps(doc).encode() if codec == "json" else msgspec.msgpack.encode(doc)
    dec = from_json if codec == "json" else from_msgpack
    with pytest.raises(msgspec.ValidationError, match=pattern):
        dec(data, Sample)


@pytest.mark.parametrize("field, value, pattern", [
    ("rollout_logprobs", np.array([np.nan, -0.1, -0.2], np.float32), "must hold finite numbers"),
    ("rollout_logprobs", np.array([-np.inf, -0.1, -0.2], np.float32), "must hold finite numbers"),
    ("loss_mask", np.array([1, 255, 0], np.uint8), "must hold 0/1 values"),
    ("reward", float("nan"), "is not a finite number"),
])
def test_msgpack_arrays_with_poison_values_are_refused(field, value, pattern):
    """Over msgpack, token arrays travel as raw bytes of the right dtype: their values are checked
    too (a NaN log-prob or a mask of 255 used to pass)."""
    s = from_json(json.dumps(GOOD_SAMPLE), Sample)
    setattr(s, field, value)  # past the constructor, as a producer in another language could send it
    with pytest.raises(msgspec.ValidationError, match=pattern):
        from_msgpack(to_msgpack(s), Sample)


def test_invalid_sample_inside_group_says_which_sample():
    doc = {"group_id": "g", "prompt_id": "p", "prompt_tokens": [1], "samples": [GOOD_SAMPLE, _with(index=1, loss_mask=[1])]}
    with pytest.raises(msgspec.ValidationError, match=r"sample 1: .*\$\.samples\[1\]"):
        from_json(json.dumps(doc), SampleGroup)


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"status": "finished"}, r"Invalid enum value 'finished'.*\$\.status"),
        ({"status": "in_flight"}, r"Invalid enum value 'in_flight'"),  # ledger-only state
        ({"prompt_tokens": "hello"}, r"expected an array"),
        ({"samples": {"0": GOOD_SAMPLE}}, r"Expected `array`, got `object`.*\$\.samples"),
        ({"created_at": 1.5}, r"Expected `int`, got `float`.*\$\.created_at"),
    ],
)
def test_invalid_group_fields(change, pattern):
    doc = {"group_id": "g", "prompt_id": "p", "prompt_tokens": [1], "samples": [GOOD_SAMPLE], **change}
    with pytest.raises(msgspec.ValidationError, match=pattern):
        from_json(json.dumps(doc), SampleGroup)


def test_constructor_rejects_mismatched_lengths_with_value_error():
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probs"):
        Sample(index=0, response_tokens=[1, 2], rollout_logprobs=[0.0], spans=[V(0, 0, 2)])
    with pytest.raises(ValueError, match="non-decreasing versions"):
        Sample(index=0, response_tokens=[1, 2], rollout_logprobs=[0.0, 0.0], spans=[V(1, 0, 1), V(0, 1, 2)])


def test_bad_array_field_message_names_the_field():
    with pytest.raises(msgspec.ValidationError, match="response_tokens"):
        from_json(json.dumps(_with(response_tokens="1 2 3")), Sample)


def test_unknown_msgpack_ext_code_is_a_validation_error():
    doc = _with(response_tokens=msgspec.msgpack.Ext(9, b"\x00" * 12))
    with pytest.raises(msgspec.ValidationError):
        from_msgpack(msgspec.msgpack.encode(doc), Sample)


@pytest.mark.parametrize(
    "field, values",
    [
        pytest.param("response_tokens", [1, 2, 2**40], id="token_overflows_int32"),
        pytest.param("response_tokens", [1.5, 2.7, 3], id="fractional_token_ids"),
        pytest.param("loss_mask", [1, 0, 300], id="mask_overflows_uint8"),
        pytest.param("loss_mask", [1, 0, -1], id="negative_mask"),
        pytest.param("rollout_logprobs", [None, -0.1, -0.2], id="null_logprob"),
    ],
)
def test_json_values_that_do_not_fit_the_dtype_are_rejected(field, values):
    with pytest.raises(msgspec.ValidationError):
        from_json(json.dumps(_with(**{field: values})), Sample)


# ---------------------------------------------------------------- events

EVENTS = [
    GroupAppended(group_ids=["a", "b"], status="partial", producer_id="prod", at=1),
    BatchClaimed(step=3, learner_version=2, group_ids=["a"], dropped=["b"], at=2),
    VersionPublished(version=3, step=3, at=3),
    EnginePaused(engine="e0", mode="abort", at=4),
    EngineResumed(engine="e0", version=3, at=5),
    RunCheckpointed(step=3, version=3, path="runs/x/ckpt/3", at=6),
]
TAGS = ["group_appended", "batch_claimed", "version_published", "engine_paused", "engine_resumed", "run_checkpointed"]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("event", EVENTS, ids=TAGS)
def test_event_union_decodes_by_tag(event, codec):
    enc, dec = CODECS[codec]
    out = dec(enc(event), Event)
    assert type(out) is type(event)
    assert out == event


def test_event_tags_on_the_wire():
    for ev, tag in zip(EVENTS, TAGS):
        assert json.loads(to_json(ev))["type"] == tag
    assert msgspec.msgpack.decode(to_msgpack(EVENTS[2])) == {"type": "version_published", "version": 3, "step": 3, "at": 3}


def test_event_log_as_list_decodes_mixed_types():
    out = from_json(to_json(EVENTS), list[Event])
    assert [type(e) for e in out] == [type(e) for e in EVENTS]
    assert out == EVENTS


@pytest.mark.parametrize(
    "doc, pattern",
    [
        ({"type": "group_dropped", "at": 1}, r"Invalid value 'group_dropped'"),
        ({"version": 1, "step": 1, "at": 1}, r"missing required field `type`"),
        ({"type": "version_published", "version": 1, "at": 1}, r"missing required field `step`"),
        ({"type": "group_appended", "group_ids": ["a"], "status": "lost", "producer_id": "p", "at": 1}, r"Invalid enum value 'lost'"),
    ],
)
def test_bad_events_raise(doc, pattern):
    with pytest.raises(msgspec.ValidationError, match=pattern):
        from_json(json.dumps(doc), Event)


def test_event_tag_is_checked_against_requested_type():
    with pytest.raises(msgspec.ValidationError):
        from_json(to_json(EVENTS[3]), VersionPublished)


# ---------------------------------------------------------------- Ledger.balanced


def test_empty_ledger_is_balanced():
    assert Ledger().balanced


def test_ledger_balanced_when_states_account_for_every_admission():
    led = Ledger(admitted=6, in_flight=1, partial=1, complete=1, consumed=1, dropped=1, failed=1)
    assert led.balanced


@pytest.mark.parametrize("state", GROUP_STATES)
def test_ledger_each_state_counts(state):
    assert Ledger(admitted=2, **{state: 2}).balanced
    assert not Ledger(admitted=2, **{state: 1}).balanced
    assert not Ledger(admitted=2, **{state: 3}).balanced


@pytest.mark.parametrize("bad", ["lost", "duplicated", "unadmitted"])
def test_ledger_anomalies_unbalance(bad):
    assert not Ledger(admitted=3, consumed=3, **{bad: 1}).balanced


def test_lost_groups_are_not_accounted_as_a_state():
    # a lost group is outside every state, so both conditions fail together
    led = Ledger(admitted=3, consumed=2, lost=1)
    assert not led.balanced
    assert not Ledger(admitted=3, consumed=2).balanced


def test_msgpack_array_of_the_wrong_byte_length_is_a_validation_error():
    """A producer's int32 array of 6 bytes: a 422 from the producer API (ValidationError), not a 500."""
    doc = {**GOOD_SAMPLE, "response_tokens": msgspec.msgpack.Ext(1, b"\x01\x00\x00\x00\x02\x00")}
    with pytest.raises(msgspec.ValidationError, match="has 6 bytes, not a multiple of 4"):
        from_msgpack(msgspec.msgpack.encode(doc), Sample)
