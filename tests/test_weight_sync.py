"""connectors/sglang/weight_sync.py's buckets (SGLang's "flattened_bucket" layout) and the embedded
engine's checked weight load: byte-exact round trips, the bucket plan, clear refusals."""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import time

import pytest
import torch

from streamrl.connectors.sglang.weight_sync import (
    BUCKET_FORMAT,
    PushFailed,
    broadcast,
    buckets,
    create_group,
    dtype_name,
    flatten,
    join_group,
    open_store,
    pack,
    plan_buckets,
    receive,
    unflatten,
)
from streamrl.runtime.learner import WeightSource


def _state() -> dict[str, torch.Tensor]:
    """Mixed dtypes in an order where every tensor's byte offset is aligned to its element size."""
    g = torch.Generator().manual_seed(0)
    return {"i": torch.arange(6, dtype=torch.int64).reshape(2, 3), "w": torch.randn(3, 5, generator=g),
            "b": torch.randn(2, 2, generator=g), "h": torch.randn(4, generator=g).to(torch.bfloat16)}


def _meta(state):
    return list(state), [dtype_name(t.dtype) for t in state.values()], [list(t.shape) for t in state.values()]


def test_flatten_unflatten_round_trip_is_exact():
    state = _state()
    names, dtypes, shapes = _meta(state)
    buf = flatten(list(state.values()))
    assert buf.dtype == torch.uint8 and buf.numel() == sum(t.numel() * t.element_size() for t in state.values())
    back = unflatten(buf.clone(), names, dtypes, shapes)
    assert list(back) == names
    for k, t in state.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k], t)


def test_flatten_matches_sglang_layout():
    """SGLang's FlattenedTensorBucket: each tensor's bytes (tensor.flatten().view(uint8)) concatenated."""
    state = _state()
    want = torch.cat([t.flatten().view(torch.uint8) for t in state.values()])
    assert torch.equal(flatten(list(state.values())), want)


def test_packed_state_flattens_without_a_copy():
    state = _state()
    packed = pack(state)
    assert all(torch.equal(packed[k], state[k]) for k in state)
    assert all(packed[k].data_ptr() != state[k].data_ptr() for k in state)  # a copy of the caller's tensors
    buf = flatten(list(packed.values()))
    assert buf.data_ptr() == packed["i"].data_ptr()
    assert torch.equal(buf, flatten(list(state.values())))
    # out of order, the same tensors are not end to end: flattened by copying, still correct
    rev = list(packed.values())[::-1]
    assert torch.equal(flatten(rev), torch.cat([t.reshape(-1).view(torch.uint8) for t in rev]))


def test_plan_buckets_caps_size_and_keeps_alignment():
    f32 = [[4]] * 5  # 16 bytes each
    assert plan_buckets(["float32"] * 5, f32, max_bytes=32) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan_buckets(["float32"] * 5, f32, max_bytes=10) == [range(i, i + 1) for i in range(5)]  # each alone
    assert plan_buckets(["float32"] * 5, f32) == [range(0, 5)]
    # 3 bf16 = 6 bytes: a float32 after them would sit at offset 6, so it starts a new bucket
    assert plan_buckets(["bfloat16", "float32", "float32"], [[3], [1], [1]]) == [range(0, 1), range(1, 3)]
    assert plan_buckets([], []) == []


def test_streamed_buckets_are_the_planned_ones():
    """The learner cuts buckets as its gathered tensors come (`buckets`); the engines were told
    `plan_buckets`' cut: they must agree, for any sizes and dtype mix."""
    g = torch.Generator().manual_seed(0)
    dts = [torch.float32, torch.bfloat16, torch.int64]
    tensors = [torch.zeros(int(torch.randint(1, 9, (1,), generator=g)), dtype=dts[int(torch.randint(0, 3, (1,),
                                                                                                     generator=g))])
               for _ in range(40)]
    meta = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
    for cap in (1, 12, 40, 10**9):
        streamed = [len(b) for b in buckets(iter(tensors), cap)]
        assert streamed == [len(r) for r in plan_buckets(*meta, max_bytes=cap)], cap
    assert list(buckets(iter([]))) == []


def test_pack_splits_misaligned_tensors_into_buckets():
    state = {"odd": torch.ones(3, dtype=torch.bfloat16), "f": torch.full((2,), 2.0)}
    packed = pack(state)
    assert torch.equal(packed["odd"], state["odd"]) and torch.equal(packed["f"], state["f"])
    assert packed["f"].data_ptr() % 4 == 0


@pytest.mark.parametrize("case, args, words", [
    ("too few bytes", (8, ["a"], ["float32"], [[3]]), "describe 12"),
    ("too many bytes", (16, ["a"], ["float32"], [[3]]), "16 bytes"),
    ("unaligned", (6, ["a", "b"], ["bfloat16", "float32"], [[1], [1]]), "not aligned"),
    ("unknown dtype", (4, ["a"], ["float8"], [[4]]), "unsupported dtype 'float8'"),
    ("negative dim", (4, ["a"], ["float32"], [[-1]]), "negative dimension"),
    ("lengths differ", (4, ["a", "b"], ["float32"], [[1]]), "must match"),
])
def test_unflatten_refuses_a_layout_that_does_not_fit(case, args, words):
    n, names, dtypes, shapes = args
    with pytest.raises(ValueError, match=words):
        unflatten(torch.zeros(n, dtype=torch.uint8), names, dtypes, shapes)


def test_bucketed_broadcast_into_a_reused_buffer():
    """Two ranks in two threads: the sender's buckets land in the receiver's buffer (grown, then
    reused), byte for byte, for two pushes of different weights."""
    store = open_store(2)
    with cf.ThreadPoolExecutor(2) as ex:
        f0 = ex.submit(create_group, store, 2, "bk", "gloo", 20)
        f1 = ex.submit(join_group, "127.0.0.1", store.port, 1, 2, "bk", "gloo", 20)
        g0, g1 = f0.result(), f1.result()
        buf = torch.empty(0, dtype=torch.uint8)
        for seed in (1, 2):
            state = {k: v * seed for k, v in _state().items()}
            names, dtypes, shapes = _meta(state)
            sent = list(pack(state).values()) if seed == 1 else iter(state.values())  # a list, or one by one
            fb = ex.submit(broadcast, g0, sent, True)
            got = ex.submit(receive, g1, names, dtypes, shapes, BUCKET_FORMAT, buf).result(30)
            fb.result(30)
            assert all(torch.equal(got[k], state[k]) for k in names)
            assert got["i"].data_ptr() == buf.data_ptr()


def test_receive_refuses_an_unknown_load_format():
    with pytest.raises(ValueError, match="not supported"):
        receive(None, ["a"], ["float32"], [[1]], "direct")


def test_engine_load_checks_the_whole_update_first(tmp_path):
    from streamrl.connectors.sglang.engine_core import EngineCore
    from streamrl.connectors.megatron.model_kit import init_model_dir

    core = EngineCore(init_model_dir(tmp_path / "m", "tiny"))
    own = core.model.state_dict()
    before = {k: v.clone() for k, v in own.items()}
    good = {k: torch.full_like(v, 0.5) for k, v in own.items() if k != "lm_head.weight"}
    bad = dict(good, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"shape mismatch: model\.norm\.weight: \(3,\) for \(64,\)"):
        core.load_state_dict(bad, "9")
    with pytest.raises(ValueError, match="unknown weight names"):
        core.load_state_dict(dict(good, extra=torch.zeros(1)), "9")
    assert all(torch.equal(own[k], before[k]) for k in own) and core.weight_version == "0"
    core.load_state_dict({k: v.to(torch.bfloat16) for k, v in good.items()}, "1")  # converted to the model's dtype
    assert all(torch.equal(own[k], torch.full_like(before[k], 0.5)) for k in own) and core.weight_version == "1"


class _Fixed(WeightSource):
    """The learner's side of a push over fixed weights (six 64 KiB tensors)."""

    def __init__(self) -> None:
        super().__init__("unused")
        self.state = {f"w{i}": torch.full((16384,), float(i)) for i in range(6)}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


def test_a_hung_engine_fails_the_push_at_its_bucket_within_the_timeout_and_the_others_are_released():
    """Three buckets to two receivers; one takes the first and then hangs (never receives again).
    The sender fails at bucket 2 within its group timeout (2 s) with PushFailed, drops the group, and
    the receiver that was still waiting (its own timeout 60 s) fails at once: released."""
    src = _Fixed()
    names, dtypes, shapes = src.weights_meta()
    bucket_bytes = 2 * 16384 * 4  # two tensors a bucket: three buckets
    parts = plan_buckets(dtypes, shapes, bucket_bytes)
    assert len(parts) == 3
    host, port = src.open_weight_store("127.0.0.1", 3, 2.0)

    def engine(rank: int, takes: int) -> tuple[int, str, float]:
        g = join_group(host, port, rank, 3, "hang", "gloo", 60)
        k = 0
        try:
            for k, b in enumerate(parts[:takes]):
                receive(g, names[b.start:b.stop], dtypes[b.start:b.stop], shapes[b.start:b.stop], BUCKET_FORMAT)
        except RuntimeError as e:
            return k, str(e), time.monotonic()
        time.sleep(8)  # hung: holds its end of the group open, receives nothing
        return takes, "hung", time.monotonic()

    with cf.ThreadPoolExecutor(3) as ex:
        good, hung = ex.submit(engine, 1, 3), ex.submit(engine, 2, 1)
        src.init_weight_group(3, "hang", "gloo", 2.0)
        t0 = time.monotonic()
        with pytest.raises(PushFailed) as err:
            src.push_weights(True, None, bucket_bytes)
        failed_at = time.monotonic()
        k, msg, released_at = good.result(30)
        assert hung.result(30)[1] == "hung"
    assert err.value.bucket == 1 and str(err.value).startswith("bucket 2: ")  # the second bucket never arrived
    assert 1.5 < failed_at - t0 < 6, failed_at - t0  # the group's timeout, not the receivers' 60 s
    assert src._group is None  # dropped: the next push forms a new group
    assert k in (1, 2) and "closed" in msg.lower(), msg  # the other receiver's wait ended by the drop...
    assert released_at - failed_at < 2, released_at - failed_at  # ...at once, not at its own 60 s


def test_a_push_cast_to_the_engines_dtype_sends_that_dtype():
    """An fp32 source pushing to bf16 engines: the meta and the bytes are bf16 (half the bytes)."""
    src = _Fixed()
    names, dtypes, shapes = src.weights_meta("bfloat16")
    assert set(dtypes) == {"bfloat16"}
    host, port = src.open_weight_store("127.0.0.1", 2, 20.0)
    with cf.ThreadPoolExecutor(1) as ex:
        g = ex.submit(join_group, host, port, 1, 2, "cast", "gloo", 20)
        src.init_weight_group(2, "cast", "gloo", 20.0)
        got = ex.submit(receive, g.result(), names, dtypes, shapes, BUCKET_FORMAT)
        src.push_weights(True, "bfloat16")
        got = got.result(30)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], src.state[k].to(torch.bfloat16)) for k in names)


def test_push_failed_survives_pickling():
    """Ray sends the learner's exception to the driver pickled; a PushFailed it cannot rebuild arrives
    as UnserializableException and the bucket is lost (seen in tests/test_push_failure_e2e.py)."""
    e = pickle.loads(pickle.dumps(PushFailed(2, "RuntimeError: Connection reset by peer")))
    assert (e.bucket, e.reason, str(e)) == (2, "RuntimeError: Connection reset by peer",
                                           "bucket 3: RuntimeError: Connection reset by peer")
