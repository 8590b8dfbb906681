"""The experience pool's Arrow schema, in one place, and conversion to and from SampleGroups.

One row per sample; group columns are repeated on each row of the group.

| column            | type                                   | meaning |
|-------------------|----------------------------------------|---------|
| uid               | string                                 | `<group_id>/<sample_index>`, unique per row |
| run_id            | string                                 | run that owns the pool |
| group_id          | string                                 | admitted prompt instance (GRPO group) |
| prompt_id         | string                                 | dataset prompt id |
| sample_index      | int32                                  | 0..n_samples-1 within the group |
| n_samples         | int32                                  | group size n |
| status            | string                                 | partial, complete, consumed, dropped, failed (whole group) |
| producer_id       | string                                 | rollout worker or external producer that wrote it |
| prompt_tokens     | list<int32>                            | prompt token ids |
| response_tokens   | list<int32>                            | response token ids |
| loss_mask         | list<uint8>                            | 1 = trained on (model tokens), 0 = not (tool output, padding) |
| rollout_logprobs  | list<float32>                          | log-prob of each response token under the version that sampled it |
| version_spans     | list<struct<version, start, end>>      | run-length policy versions of response tokens, [start, end) |
| min_version       | int32 (null: no tokens yet)            | oldest version of any token in the group (group staleness) |
| max_version       | int32 (null: no tokens yet)            | newest version of any token in the group |
| num_tokens        | int32                                  | response length |
| reward            | float32 (null: not scored)             | scalar reward used for advantages |
| rewards_json      | string                                 | raw reward components, JSON object |
| finish_reason     | string                                 | stop, length, abort, or empty while in flight |
| failed            | bool                                   | this sample failed (reward error, engine error); see `error` |
| error             | string (null)                          | why the sample failed |
| drop_reason       | string (null)                          | why the group was dropped (filter name, `stale`) |
| created_ns        | int64                                  | when the group was written, ns since the Unix epoch |
| claimed_ns        | int64 (null)                           | when a learner step claimed the group |
| consumed_step     | int32 (null)                           | learner step that trained on the group |
| consumed_version  | int32 (null)                           | learner version at that step (staleness = consumed_version - min_version) |
| metadata_json     | string                                 | sample metadata, JSON object |
| group_metadata_json | string                               | group metadata, JSON object |
| routed_experts    | large_binary (null: no routing data)   | MoE routed expert ids, [P + n - 1 positions, layers, top_k] row-major, uint8 (or uint16 little-endian when an id is > 255) |
| routed_layers     | int16 (null: no routing data)          | layers of `routed_experts` |
| routed_top_k      | int16 (null: no routing data)          | experts per token of `routed_experts` |
| routed_id_bytes   | int8 (null: no routing data)           | bytes per id in `routed_experts`: 1 or 2 |

The routing columns came after the first pools: a pool without them gets them, all null, when
opened (ROUTING_COLUMNS; a metadata-only Lance change).

The `admissions` table (one row per admitted prompt instance) feeds the ledger:
group_id, prompt_id, n (int32), producer_id, version (int32), admitted_ns (int64).

The `claims` table holds what the learner decided about stored groups, one row per group and
decision; sample rows are never rewritten for it (streamrl.core.claims). A group's `status`,
`drop_reason`, `claimed_ns`, `consumed_step` and `consumed_version` are its claim's when it has
one (every read through LancePool applies this), else the stored ones:

| column              | type   | meaning |
|---------------------|--------|---------|
| group_id            | string | the group decided about |
| status              | string | consumed (trained on by `consumed_step`) or dropped (`drop_reason`: stale, over_sampling, ...) |
| drop_reason         | string (null) | why a dropped group was not trained on |
| consumed_step       | int32 (null)  | learner step that trained on the group |
| consumed_version    | int32  | learner version at the claim |
| claimed_ns          | int64  | when the claim was committed |
| ready_after_version | int64  | every group still claimable after this claim was stored after this `pool` table version (where a restarted learner starts reading) |
| step                | int32 (null: a pool from before time travel) | the learner step whose claim made this decision (dropped groups too) |
| pool_version        | int64 (null: idem) | the `pool` table version that claim read: the pool as of that step (pools/asof.py) |
| admissions_version  | int64 (null: idem) | the `admissions` table version when that claim was made |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core.types import Admission, Sample, SampleGroup, VersionSpan

SPAN_TYPE = pa.struct([("version", pa.int32()), ("start", pa.int32()), ("end", pa.int32())])

POOL_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("run_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_index", pa.int32()),
        ("n_samples", pa.int32()),
        ("status", pa.string()),
        ("producer_id", pa.string()),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("response_tokens", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("version_spans", pa.list_(SPAN_TYPE)),
        ("min_version", pa.int32()),
        ("max_version", pa.int32()),
        ("num_tokens", pa.int32()),
        ("reward", pa.float32()),
        ("rewards_json", pa.string()),
        ("finish_reason", pa.string()),
        ("failed", pa.bool_()),
        ("error", pa.string()),
        ("drop_reason", pa.string()),
        ("created_ns", pa.int64()),
        ("claimed_ns", pa.int64()),
        ("consumed_step", pa.int32()),
        ("consumed_version", pa.int32()),
        ("metadata_json", pa.string()),
        ("group_metadata_json", pa.string()),
        ("routed_experts", pa.large_binary()),
        ("routed_layers", pa.int16()),
        ("routed_top_k", pa.int16()),
        ("routed_id_bytes", pa.int8()),
    ]
)
ROUTING_COLUMNS = ("routed_experts", "routed_layers", "routed_top_k", "routed_id_bytes")


def added_columns(names: set[str]) -> list[pa.Field]:
    """The columns a pool table with `names` lacks that came after the first pools (all nullable)."""
    return [f for f in POOL_SCHEMA if f.name in ROUTING_COLUMNS and f.name not in names]


def add_new_columns(open_table: Callable[[], Any], tries: int = 5) -> set[str]:
    """Add the columns a pool table (`open_table()`: its pylance dataset, fresh) lacks, all null (a
    metadata-only change), and return its column names. Processes opening one old pool at once
    race: the losers' adds fail (a conflict, or the columns exist) and they look again."""
    for attempt in range(tries):
        ds = open_table()
        if not (missing := added_columns(set(ds.schema.names))):
            return set(ds.schema.names)
        try:
            ds.add_columns(missing)
        except Exception:  # noqa: BLE001 - Lance raises plain errors; the next look tells
            if attempt == tries - 1:
                raise
    return set(open_table().schema.names)

ADMISSIONS_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("n", pa.int32()),
        ("producer_id", pa.string()),
        ("version", pa.int32()),
        ("admitted_ns", pa.int64()),
    ]
)

CLAIMS_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("status", pa.string()),
        ("drop_reason", pa.string()),
        ("consumed_step", pa.int32()),
        ("consumed_version", pa.int32()),
        ("claimed_ns", pa.int64()),
        ("ready_after_version", pa.int64()),
        ("step", pa.int32()),
        ("pool_version", pa.int64()),
        ("admissions_version", pa.int64()),
    ]
)

POOL_TABLE, ADMISSIONS_TABLE, CLAIMS_TABLE = "pool", "admissions", "claims"  # a pool's Lance tables

# Columns whose values grow with the response, and the rest: small enough to scan for bookkeeping
# (claims, ledger, stats).
WIDE_COLUMNS = frozenset(f.name for f in POOL_SCHEMA if pa.types.is_list(f.type) or pa.types.is_large_binary(f.type))
META_COLUMNS = [f.name for f in POOL_SCHEMA if f.name not in WIDE_COLUMNS]

_json = msgspec.json.Encoder()


def _flat(arrays: Sequence[np.ndarray], value_type: pa.DataType, np_dtype: type, total: int) -> pa.Array:
    """The arrays end to end, copied once into a buffer from Arrow's allocator: it reuses freed
    memory, where numpy's fresh allocations page-fault on every large append."""
    buf = pa.allocate_buffer(total * np.dtype(np_dtype).itemsize)
    if arrays:
        np.concatenate(arrays, out=np.frombuffer(buf, np_dtype), casting="same_kind")
    return pa.Array.from_buffers(value_type, total, [None, buf])


def _lists(arrays: Sequence[np.ndarray], value_type: pa.DataType, np_dtype: type,
           lens: np.ndarray | None = None) -> pa.ListArray:
    if lens is None:
        lens = np.fromiter(map(len, arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), _flat(arrays, value_type, np_dtype, int(offsets[-1])))


def _json_col(values: Sequence[Any]) -> pa.Array:
    return pa.array([b"{}" if not v else _json.encode(v) for v in values], pa.string())


def routing_columns(samples: Sequence[Sample]) -> dict[str, pa.Array]:
    """The routing columns of `samples`: ids as uint8 when every one fits, else uint16."""
    blobs, layers, top_k, width = [], [], [], []
    for s in samples:
        r = s.routed_experts
        if r is None:
            blobs.append(None), layers.append(None), top_k.append(None), width.append(None)
            continue
        wide = r.size > 0 and int(r.max()) > 255
        blobs.append(r.astype("<u2" if wide else np.uint8).tobytes())
        layers.append(r.shape[1]), top_k.append(r.shape[2]), width.append(2 if wide else 1)
    return {"routed_experts": pa.array(blobs, pa.large_binary()), "routed_layers": pa.array(layers, pa.int16()),
            "routed_top_k": pa.array(top_k, pa.int16()), "routed_id_bytes": pa.array(width, pa.int8())}


def routing_arrays(table: pa.Table) -> list[np.ndarray | None]:
    """Each row's routed experts as int32 [positions, layers, top_k] (None: no routing data)."""
    cols = [table[c].to_pylist() for c in ROUTING_COLUMNS]
    out: list[np.ndarray | None] = []
    for blob, layers, top_k, width in zip(*cols):
        if blob is None:
            out.append(None)
            continue
        ids = np.frombuffer(blob, "<u2" if width == 2 else np.uint8)
        out.append(ids.astype(np.int32).reshape(-1, layers, top_k) if layers and top_k else np.zeros((0, 0, 0), np.int32))
    return out


def groups_to_table(groups: Sequence[SampleGroup], run_id: str = "") -> pa.Table:
    """Arrow rows of `groups` (POOL_SCHEMA). Group columns are built once per group and repeated
    with one `take`, so the Python work per sample is a handful of attribute reads."""
    samples = [s for g in groups for s in g.samples]
    sizes = np.fromiter((len(g.samples) for g in groups), np.int64, len(groups))
    row_group = pa.array(np.repeat(np.arange(len(groups), dtype=np.int64), sizes))

    def per_group(values: list[Any], type_: pa.DataType) -> pa.Array:
        return pa.array(values, type_).take(row_group)

    spans = [sp for s in samples for sp in s.spans]
    span_lens = np.fromiter((len(s.spans) for s in samples), np.int64, len(samples))
    span_offsets = np.zeros(len(samples) + 1, np.int32)
    np.cumsum(span_lens, out=span_offsets[1:])
    span_values = pa.StructArray.from_arrays(
        [pa.array([sp.version for sp in spans], pa.int32()), pa.array([sp.start for sp in spans], pa.int32()),
         pa.array([sp.end for sp in spans], pa.int32())], fields=list(SPAN_TYPE))
    versions = [(g.min_version, g.max_version) for g in groups]
    group_id = per_group([g.group_id for g in groups], pa.string())
    index = pa.array([s.index for s in samples], pa.int32())
    num_tokens = np.fromiter((len(s.response_tokens) for s in samples), np.int64, len(samples))
    cols = {
        "uid": pc.binary_join_element_wise(group_id, index.cast(pa.string()), "/"),
        "run_id": pa.repeat(pa.scalar(run_id), len(samples)) if samples else pa.array([], pa.string()),
        "group_id": group_id,
        "prompt_id": per_group([g.prompt_id for g in groups], pa.string()),
        "sample_index": index,
        "n_samples": per_group(sizes.tolist(), pa.int32()),
        "status": per_group([g.status for g in groups], pa.string()),
        "producer_id": per_group([g.producer_id for g in groups], pa.string()),
        "prompt_tokens": _lists([g.prompt_tokens for g in groups], pa.int32(), np.int32).take(row_group),
        "response_tokens": _lists([s.response_tokens for s in samples], pa.int32(), np.int32, num_tokens),
        "loss_mask": _lists([s.loss_mask for s in samples], pa.uint8(), np.uint8, num_tokens),
        "rollout_logprobs": _lists([s.rollout_logprobs for s in samples], pa.float32(), np.float32, num_tokens),
        "version_spans": pa.ListArray.from_arrays(pa.array(span_offsets), span_values),
        "min_version": per_group([v[0] for v in versions], pa.int32()),
        "max_version": per_group([v[1] for v in versions], pa.int32()),
        "num_tokens": pa.array(num_tokens, pa.int32()),
        "reward": pa.array([s.reward for s in samples], pa.float32()),
        "rewards_json": _json_col([s.rewards for s in samples]),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "failed": pa.array([s.failed for s in samples], pa.bool_()),
        "error": pa.array([s.error for s in samples], pa.string()),
        "drop_reason": per_group([g.drop_reason for g in groups], pa.string()),
        "created_ns": per_group([g.created_at for g in groups], pa.int64()),
        "claimed_ns": pa.nulls(len(samples), pa.int64()),
        "consumed_step": per_group([g.consumed_step for g in groups], pa.int32()),
        "consumed_version": per_group([g.consumed_version for g in groups], pa.int32()),
        "metadata_json": _json_col([s.metadata for s in samples]),
        "group_metadata_json": per_group([_json.encode(g.metadata) for g in groups], pa.string()),
        **routing_columns(samples),
    }
    return pa.Table.from_arrays(list(cols.values()), schema=POOL_SCHEMA)


def _np_lists(col: pa.ChunkedArray | pa.Array) -> list[np.ndarray]:
    """Zero-copy numpy views of each list in a list column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def table_to_groups(table: pa.Table) -> list[SampleGroup]:
    """Rows -> SampleGroups, in order of first appearance of each group, samples by index."""
    n = table.num_rows
    if n == 0:
        return []
    py = {c: table[c].to_pylist() for c in (
        "group_id", "prompt_id", "sample_index", "status", "producer_id", "reward", "rewards_json",
        "finish_reason", "failed", "error", "drop_reason", "created_ns", "consumed_step",
        "consumed_version", "metadata_json", "group_metadata_json")}
    prompt = _np_lists(table["prompt_tokens"])
    resp = _np_lists(table["response_tokens"])
    mask = _np_lists(table["loss_mask"])
    lps = _np_lists(table["rollout_logprobs"])
    spans = table["version_spans"].to_pylist()
    routed = routing_arrays(table) if "routed_experts" in table.column_names else [None] * n
    groups: dict[str, SampleGroup] = {}
    for i in range(n):
        gid = py["group_id"][i]
        g = groups.get(gid)
        if g is None:
            g = groups[gid] = SampleGroup(
                group_id=gid,
                prompt_id=py["prompt_id"][i],
                prompt_tokens=prompt[i],
                samples=[],
                status=py["status"][i],
                producer_id=py["producer_id"][i],
                created_at=py["created_ns"][i],
                drop_reason=py["drop_reason"][i],
                consumed_step=py["consumed_step"][i],
                consumed_version=py["consumed_version"][i],
                metadata=msgspec.json.decode(py["group_metadata_json"][i] or "{}"),
            )
        g.samples.append(
            Sample(
                index=py["sample_index"][i],
                response_tokens=resp[i],
                rollout_logprobs=lps[i],
                loss_mask=mask[i],
                spans=[VersionSpan(s["version"], s["start"], s["end"]) for s in spans[i]],
                reward=py["reward"][i],
                rewards=msgspec.json.decode(py["rewards_json"][i] or "{}"),
                finish_reason=py["finish_reason"][i],
                failed=py["failed"][i],
                error=py["error"][i],
                metadata=msgspec.json.decode(py["metadata_json"][i] or "{}"),
                routed_experts=routed[i],
            )
        )
    for g in groups.values():
        g.samples.sort(key=lambda s: s.index)
    return list(groups.values())


def admissions_to_table(admissions: Sequence[Admission]) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "group_id": [a.group_id for a in admissions],
            "prompt_id": [a.prompt_id for a in admissions],
            "n": pa.array([a.n for a in admissions], pa.int32()),
            "producer_id": [a.producer_id for a in admissions],
            "version": pa.array([a.version for a in admissions], pa.int32()),
            "admitted_ns": pa.array([a.admitted_at for a in admissions], pa.int64()),
        },
        schema=ADMISSIONS_SCHEMA,
    )


def claims_to_table(columns: dict[str, list[Any]], claimed_ns: int, ready_after_version: int | None,
                    read_versions: tuple[int | None, int | None] = (None, None)) -> pa.Table:
    """Claim rows from streamrl.core.claims.claim_columns, stamped with the commit's time and the
    (pool, admissions) table versions the claim read."""
    n = len(columns["group_id"])
    return pa.Table.from_pydict({**columns, "claimed_ns": [claimed_ns] * n,
                                 "ready_after_version": [ready_after_version] * n,
                                 "pool_version": [read_versions[0]] * n,
                                 "admissions_version": [read_versions[1]] * n}, schema=CLAIMS_SCHEMA)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns, those it lacks all null: a claims table written
    before a column was added reads with the current schema."""
    n = table.num_rows
    return pa.table([table[f.name] if f.name in table.column_names else pa.nulls(n, f.type) for f in schema],
                    schema=schema)
