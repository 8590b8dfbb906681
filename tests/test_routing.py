"""MoE routing replay data off the engine: stitching across partial-rollout segments
(streamrl/core/routing.py via streamrl/core/partial.py), its checks in Sample/SampleGroup, its
wire forms, and the pool's compact columns (exact round trip; pools from before them still open)."""

from __future__ import annotations

import base64
import json

import lancedb
import msgspec
import numpy as np
import pyarrow as pa
import pytest

from streamrl.core import partial, routing
from streamrl.core.types import Sample, SampleGroup, VersionSpan, from_json, from_msgpack, to_json, to_msgpack
from streamrl.pools import LancePool
from streamrl.pools.experts import expert_stats
from streamrl.pools.schema import POOL_SCHEMA, ROUTING_COLUMNS, groups_to_table
from streamrl.tools import cli

from poolkit import assert_group_equal, make_group, popen_python

L, K = 6, 4  # layers, experts per token


def _engine_rows(truth: np.ndarray, start: int, end: int) -> str:
    """What an engine returns for positions [start, end): SGLang's base64 of int32 rows."""
    return base64.b64encode(truth[start:end].astype(np.int32).tobytes()).decode()


def _with_routing(group: SampleGroup, num_experts: int = 8) -> SampleGroup:
    rng = np.random.default_rng(7)
    for s in group.samples:
        s.routed_experts = rng.integers(0, num_experts, (len(group.prompt_tokens) + s.num_tokens - 1, L, K),
                                        dtype=np.int32)
    return SampleGroup(**{f: getattr(group, f) for f in group.__struct_fields__})


def test_start_len_is_the_last_kept_token_or_zero():
    assert routing.start_len(5, 0) == 0
    assert routing.start_len(5, 3) == 7  # prompt 0..4, kept 5..7: position 7 was never fed


def test_two_version_changes_stitch_each_row_from_the_segment_that_processed_it():
    """A sample interrupted twice (abort_resume): 3 segments under versions 0, 1, 2. Each engine
    call returns the rows it processed; the sample's routing is P + n - 1 rows, each from the
    segment (version) that generated the next token."""
    P = 4
    truth = {v: np.full((40, L, K), v, np.int32) + np.arange(40, dtype=np.int32)[:, None, None] * 10 for v in range(3)}
    t = partial.Trajectory(prompt=list(range(P)), max_new_tokens=9)
    plan = [(0, 3, "abort"), (1, 2, "abort"), (2, 4, "stop")]  # (version, tokens generated, finish)
    owner = []  # which version processed each position
    for v, m, finish in plan:
        start, kept = partial.routed_start(t), len(t.tokens)
        end = P + kept + m - 1  # the engine's seqlen - 1
        seg = routing.decode(_engine_rows(truth[v], start, end), L, K)
        assert len(seg) == end - start
        owner += [v] * (end - start)
        partial.absorb(t, list(range(100, 100 + m)), [-0.5] * m, [VersionSpan(v, 0, m)], finish, routed_experts=seg)
    n = len(t.tokens)
    assert n == 9 and t.routed is not None and t.routed.shape == (P + n - 1, L, K)
    assert [s.version for s in t.spans] == [0, 1, 2]
    want = np.stack([truth[v][p] for p, v in enumerate(owner)])
    np.testing.assert_array_equal(t.routed, want)
    # segment 1 covers prompt and its first 2 tokens' inputs, segment 2 resumes at P + 3 - 1
    assert owner == [0] * (P + 3 - 1) + [1] * 2 + [2] * 4
    s = partial.to_sample(t, 0)
    g = SampleGroup(group_id="g", prompt_id="p", prompt_tokens=t.prompt, samples=[s])
    np.testing.assert_array_equal(g.samples[0].routed_experts, want)
    back = partial.from_sample(s, t.prompt, 9)  # a resumed partial keeps its rows
    np.testing.assert_array_equal(back.routed, want)


def test_in_place_restart_and_gaps():
    P, truth = 3, np.arange(60, dtype=np.int32).reshape(10, 3, 2) % 5
    t = partial.Trajectory(prompt=[1, 2, 3], max_new_tokens=5)  # in_place: one request, several spans
    partial.absorb(t, [7] * 5, [-1.0] * 5, [VersionSpan(0, 0, 2), VersionSpan(1, 2, 5)], "stop", "in_place",
                   routed_experts=truth[:P + 4])
    np.testing.assert_array_equal(t.routed, truth[:P + 4])
    r = partial.Trajectory(prompt=[1, 2, 3], max_new_tokens=5)  # restart drops rows with the tokens
    partial.absorb(r, [7, 7], [-1.0] * 2, [VersionSpan(0, 0, 2)], "abort", "restart", routed_experts=truth[:P + 1])
    assert r.routed is None and partial.routed_start(r) == 0
    partial.absorb(r, [8], [-1.0], [VersionSpan(1, 0, 1)], "stop", "restart", routed_experts=truth[:P])
    np.testing.assert_array_equal(r.routed, truth[:P])
    gap = partial.Trajectory(prompt=[1, 2, 3], max_new_tokens=5)  # an engine that sent none: no routing, never a wrong one
    partial.absorb(gap, [7, 7], [-1.0] * 2, [VersionSpan(0, 0, 2)], "abort", routed_experts=None)
    partial.absorb(gap, [7], [-1.0], [VersionSpan(1, 0, 1)], "stop", routed_experts=truth[4:5])
    assert gap.routed is None and partial.to_sample(gap, 0).routed_experts is None
    bad = partial.Trajectory(prompt=[1, 2, 3], max_new_tokens=5)
    with pytest.raises(ValueError, match="routed experts for 2 positions from 0"):
        partial.absorb(bad, [7], [-1.0], [VersionSpan(0, 0, 1)], "stop", routed_experts=truth[:2])
    assert bad.tokens == [] and bad.logprobs == [] and bad.routed is None  # refused whole: nothing half-absorbed


def test_group_checks_rows_and_ids_and_names_the_sample():
    s = Sample(index=3, response_tokens=[1, 2], rollout_logprobs=[-1, -1], spans=[VersionSpan(0, 0, 2)],
               routed_experts=np.zeros((4, L, K), np.int32))
    with pytest.raises(ValueError, match=r"group g sample 3: routed_experts has 4 rows.*= 2 \+ 2 - 1 = 3"):
        SampleGroup(group_id="g", prompt_id="p", prompt_tokens=[5, 6], samples=[s])
    with pytest.raises(ValueError, match="sample 1: routed_experts holds expert id -1"):
        Sample(index=1, response_tokens=[1], rollout_logprobs=[-1], spans=[VersionSpan(0, 0, 1)],
               routed_experts=[[[0, -1]]])
    with pytest.raises(ValueError, match=r"shape \[positions, layers, top_k\]"):
        Sample(index=1, response_tokens=[1], rollout_logprobs=[-1], spans=[VersionSpan(0, 0, 1)],
               routed_experts=[0, 1])
    with pytest.raises(ValueError, match="routed_experts has 12 bytes"):
        routing.decode(base64.b64encode(b"\0" * 12).decode(), L, K)


def test_wire_forms_carry_routing_exactly():
    g = _with_routing(make_group("w", n=2), num_experts=300)
    for back in (from_msgpack(to_msgpack(g), SampleGroup), from_json(to_json(g), SampleGroup)):
        assert_group_equal(back, g)
    raw = msgspec.json.decode(to_json(g))
    raw["samples"][0]["routed_experts"] = raw["samples"][0]["routed_experts"][1:]
    with pytest.raises(ValueError, match="sample 0: routed_experts has"):
        from_json(msgspec.json.encode(raw), SampleGroup)


@pytest.mark.parametrize("num_experts", [8, 300])  # uint8 and uint16 ids
def test_pool_round_trip_is_exact(pool, num_experts):
    groups = [_with_routing(make_group("a", n=3), num_experts), make_group("b", n=2)]
    pool.append(groups, admit=True)
    got = {g.group_id: g for g in pool.groups(["a", "b"])}
    assert_group_equal(got["a"], groups[0])
    assert all(s.routed_experts is None for s in got["b"].samples)
    width = pool.scan(["routed_id_bytes"], where="group_id = 'a'")["routed_id_bytes"].to_pylist()
    assert width == [1 if num_experts <= 256 else 2] * 3


def _old_pool(path, first: SampleGroup) -> None:
    """A pool whose `pool` table has the columns from before routing data, holding `first`."""
    old = pa.schema([f for f in POOL_SCHEMA if f.name not in ROUTING_COLUMNS])
    LancePool(path).close()  # the other tables, as a pool creates them
    db = lancedb.connect(str(path))
    db.drop_table("pool")
    db.create_table("pool", groups_to_table([first]).select(old.names).cast(old))


def test_a_pool_from_before_routing_opens_and_takes_routed_groups(run_dir):
    first = make_group("old", n=2)
    _old_pool(run_dir / "pool", first)
    p = LancePool(run_dir / "pool")
    try:
        new = _with_routing(make_group("new", n=2))
        p.append([new])
        got = {g.group_id: g for g in p.groups(["old", "new"])}
        assert_group_equal(got["old"], first)
        assert_group_equal(got["new"], new)
    finally:
        p.close()


def test_expert_stats_count_each_position_under_the_version_after_it(pool, capsys):
    """Prompt of 2, 3 response tokens under versions 0, 0, 1: rows 0..3 (positions 0..3) count
    under 0, 0, 0, 1 (row p: the version of response token p - 1). Every row picks experts
    (row, row + 1) in layer 0 and (5, 6) in layer 1, so the counts are known exactly."""
    rows = np.array([[[p, p + 1], [5, 6]] for p in range(4)], np.int32)
    s = Sample(index=0, response_tokens=[1, 2, 3], rollout_logprobs=[-1] * 3,
               spans=[VersionSpan(0, 0, 2), VersionSpan(1, 2, 3)], reward=1.0, routed_experts=rows)
    plain = Sample(index=1, response_tokens=[4], rollout_logprobs=[-1], spans=[VersionSpan(0, 0, 1)], reward=0.0)
    pool.append([SampleGroup(group_id="g", prompt_id="p", prompt_tokens=[7, 8], samples=[s, plain])], admit=True)
    got = {(r["version"], r["layer"], r["expert"]): (r["chosen"], r["share"]) for r in expert_stats(pool).to_pylist()}
    want = {(0, 0, 0): 1, (0, 0, 1): 2, (0, 0, 2): 2, (0, 0, 3): 1, (0, 1, 5): 3, (0, 1, 6): 3,
            (1, 0, 3): 1, (1, 0, 4): 1, (1, 1, 5): 1, (1, 1, 6): 1}
    assert {k: c for k, (c, _) in got.items()} == want
    assert got[(0, 0, 1)][1] == pytest.approx(2 / 6) and got[(1, 1, 5)][1] == 0.5
    assert expert_stats(pool, "status = 'dropped'").num_rows == 0
    assert cli.main(["pool", "experts", str(pool.uri), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {(r["version"], r["layer"], r["expert"]): r["chosen"] for r in printed} == want
    assert cli.main(["pool", "show", str(pool.uri), "g"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "routed_experts=4x2x2" in shown[3] and "routed_experts" not in shown[5], shown


def test_routing_costs_top_k_bytes_per_token_per_layer_on_disk(tmp_path):
    """The same 16 samples with and without routed experts (600 positions, 6 layers, top 4 of 64):
    the pool grows by about top_k bytes per position and layer (uint8 ids), not SGLang's 4 x top_k."""
    def size(d) -> int:
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    grown = []
    for routed in (False, True):
        groups = [make_group(f"s{i}", n=8, num_tokens=500, prompt_len=101, vary_lengths=False) for i in range(2)]
        if routed:
            groups = [_with_routing(g, num_experts=64) for g in groups]
        with LancePool(tmp_path / str(routed)) as p:
            p.append(groups)
        grown.append(size(tmp_path / str(routed)))
    per = (grown[1] - grown[0]) / (16 * 600 * L)
    assert K <= per < K * 1.1, per


def test_processes_opening_one_old_pool_at_once_all_open_it(run_dir):
    first = make_group("old", n=2)
    _old_pool(run_dir / "pool", first)
    procs = [popen_python("from streamrl.pools import LancePool; LancePool(%r).close(); print('ok')"
                          % str(run_dir / "pool")) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    with LancePool(run_dir / "pool") as p:
        assert_group_equal(p.groups(["old"])[0], first)
