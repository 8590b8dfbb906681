"""`streamrl pool export`: selected samples as files for what comes after RL, streamed.

Kinds of rows (`kind`):
- `samples`: one row per sample: `prompt`, `completion` (text, when a tokenizer is known),
  `reward`, versions, status, and the exact tokens (`prompt_tokens`, `completion_tokens`,
  `loss_mask`, `rollout_logprobs`, `version_spans`): SFT or rejection sampling with a filter
  such as `reward >= 1` (TRL's prompt-completion columns);
- `best`: the highest-reward sample of each group (best-of-n), with the group's size and mean reward;
- `dpo`: per group, the best (`chosen`) and worst (`rejected`) scored samples, for groups whose
  rewards differ (TRL's preference columns: prompt, chosen, rejected);
- `raw`: every pool column, as `pool query` sees it (to share or archive the pool itself).

Formats: `parquet` (one file), `jsonl` (one object per line) or `hf` (a directory in the
Hugging Face Hub layout: data/train-*.parquet shards and a README.md dataset card, loadable with
`datasets.load_dataset(DIR)` and uploadable as is). Rows stream from the pool in batches, so
memory stays bounded whatever the pool's size. `best` and `dpo` read in two passes over one
snapshot: the small columns pick each group's samples (a few numbers per group kept), then only
the picked rows are read, by row id; a group's rows need not be next to each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from tqdm import tqdm

from streamrl.pools.queries import load_decoder
from streamrl.pools.reads import ROW_ID, Snapshot
from streamrl.pools.schema import POOL_SCHEMA, SPAN_TYPE
from streamrl.pools.sql import check_where

if TYPE_CHECKING:
    from streamrl.pools.lance_pool import LancePool  # the pool is passed in: opening one is pools.open_pool's

KINDS = ("samples", "best", "dpo", "raw")
FORMATS = ("parquet", "jsonl", "hf")
SHARD_ROWS = 100_000  # rows per parquet file of an `hf` export
_TOKENS = pa.list_(pa.int32())
_GROUP = ["group_id", "prompt_id", "producer_id", "status", "min_version", "max_version", "consumed_step",
          "consumed_version"]
_SAMPLE = ["sample_index", "reward", "rewards_json", "finish_reason", "failed", "response_tokens", "loss_mask",
           "rollout_logprobs", "version_spans", "num_tokens"]
_NEEDS = {"samples": _GROUP + ["prompt_tokens", *_SAMPLE], "best": _GROUP + ["prompt_tokens", *_SAMPLE],
          "dpo": _GROUP + ["prompt_tokens", "sample_index", "reward", "response_tokens"],
          "raw": POOL_SCHEMA.names}


class ExportError(ValueError):
    """The export cannot be written as asked; the message says why."""


def guess_format(out: str) -> str:
    """parquet for *.parquet, jsonl for *.jsonl / *.json, else hf (a directory)."""
    suffix = Path(out.rstrip("/")).suffix.lower()
    return {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}.get(suffix, "hf")


def output_schema(kind: str, text: bool) -> pa.Schema:
    g = POOL_SCHEMA
    group = [g.field(c) for c in _GROUP]
    texts = [pa.field("prompt", pa.string()), pa.field("completion", pa.string())] if text else []
    sample = [g.field("sample_index"), g.field("reward"), pa.field("rewards", pa.string()), g.field("finish_reason"),
              g.field("num_tokens"), pa.field("prompt_tokens", _TOKENS), pa.field("completion_tokens", _TOKENS),
              g.field("loss_mask"), g.field("rollout_logprobs"), pa.field("version_spans", pa.list_(SPAN_TYPE))]
    if kind == "raw":
        return POOL_SCHEMA
    if kind == "samples":
        return pa.schema([*group, *texts, *sample])
    if kind == "best":
        return pa.schema([*group, *texts, *sample, pa.field("group_size", pa.int32()),
                          pa.field("group_reward_mean", pa.float32())])
    pair = ([pa.field("prompt", pa.string()), pa.field("chosen", pa.string()), pa.field("rejected", pa.string())]
            if text else [])
    return pa.schema([*group, *pair, pa.field("chosen_reward", pa.float32()), pa.field("rejected_reward", pa.float32()),
                      pa.field("chosen_index", pa.int32()), pa.field("rejected_index", pa.int32()),
                      pa.field("group_size", pa.int32()), pa.field("prompt_tokens", _TOKENS),
                      pa.field("chosen_tokens", _TOKENS), pa.field("rejected_tokens", _TOKENS)])


# ---------------------------------------------------------------- shaping rows


def _texts(tok: Any, col: pa.ChunkedArray | pa.Array) -> pa.Array:
    lists = col.to_pylist()
    return pa.array(tok.decode_batch(lists, skip_special_tokens=False) if lists else [], pa.string())


def _samples(t: pa.Table, tok: Any) -> pa.Table:
    cols: dict[str, Any] = {c: t[c] for c in _GROUP}
    if tok is not None:
        cols["prompt"], cols["completion"] = _texts(tok, t["prompt_tokens"]), _texts(tok, t["response_tokens"])
    cols.update({"sample_index": t["sample_index"], "reward": t["reward"], "rewards": t["rewards_json"],
                 "finish_reason": t["finish_reason"], "num_tokens": t["num_tokens"], "prompt_tokens": t["prompt_tokens"],
                 "completion_tokens": t["response_tokens"], "loss_mask": t["loss_mask"],
                 "rollout_logprobs": t["rollout_logprobs"], "version_spans": t["version_spans"]})
    return pa.table(cols)


@dataclass
class _Group:
    """What pass 1 keeps per group: its scored samples' count and sum, best and worst (reward,
    sample index, row id); equal rewards go to the lower sample index."""

    n: int = 0
    total: float = 0.0
    best: tuple[float, int, int] | None = None
    worst: tuple[float, int, int] | None = None


def _pick(batches: pa.RecordBatchReader, bar: Any) -> dict[str, _Group]:
    """Pass 1 over the narrow columns: per group, its best and worst scored (not failed) sample."""
    groups: dict[str, _Group] = {}
    for b in batches:
        cols = [b.column(c).to_pylist() for c in ("group_id", "sample_index", "reward", "failed", ROW_ID)]
        for gid, idx, reward, failed, rid in zip(*cols):
            g = groups.setdefault(gid, _Group())
            if reward is None or failed:
                continue
            g.n, g.total = g.n + 1, g.total + reward
            if g.best is None or (-reward, idx) < (-g.best[0], g.best[1]):
                g.best = (reward, idx, rid)
            if g.worst is None or (reward, idx) < (g.worst[0], g.worst[1]):
                g.worst = (reward, idx, rid)
        bar.update(b.num_rows)
    return groups


def _best(rows: pa.Table, picked: list[_Group], tok: Any) -> pa.Table:
    return _samples(rows, tok).append_column("group_size", pa.array([g.n for g in picked], pa.int32())).append_column(
        "group_reward_mean", pa.array([g.total / g.n for g in picked], pa.float32()))


def _dpo(c: pa.Table, r: pa.Table, picked: list[_Group], tok: Any) -> pa.Table:
    cols: dict[str, Any] = {k: c[k] for k in _GROUP}
    if tok is not None:
        cols.update(prompt=_texts(tok, c["prompt_tokens"]), chosen=_texts(tok, c["response_tokens"]),
                    rejected=_texts(tok, r["response_tokens"]))
    cols.update(chosen_reward=c["reward"], rejected_reward=r["reward"], chosen_index=c["sample_index"],
                rejected_index=r["sample_index"], group_size=pa.array([g.n for g in picked], pa.int32()),
                prompt_tokens=c["prompt_tokens"], chosen_tokens=c["response_tokens"],
                rejected_tokens=r["response_tokens"])
    return pa.table(cols)


def _pairs(snap: Snapshot, groups: dict[str, _Group], kind: str, tok: Any,
           chunk: int = 1024) -> Iterator[pa.Table]:
    """Pass 2: the picked rows, read by row id a chunk of groups at a time, shaped."""
    if kind == "best":
        picked = [g for g in groups.values() if g.best is not None]
    else:
        picked = [g for g in groups.values() if g.n >= 2 and g.best[0] > g.worst[0]]  # type: ignore[index]
    for i in range(0, len(picked), chunk):
        part = picked[i:i + chunk]
        ids = [g.best[2] for g in part] + ([g.worst[2] for g in part] if kind == "dpo" else [])  # type: ignore[index]
        rows = snap.rows(ids, [*_NEEDS[kind], ROW_ID])
        at = {rid: k for k, rid in enumerate(rows[ROW_ID].to_pylist())}
        take = [at[g.best[2]] for g in part]  # type: ignore[index]
        if kind == "best":
            yield _best(rows.take(pa.array(take, pa.int64())), part, tok)
        else:
            worst = [at[g.worst[2]] for g in part]  # type: ignore[index]
            yield _dpo(rows.take(pa.array(take, pa.int64())), rows.take(pa.array(worst, pa.int64())), part, tok)


# ---------------------------------------------------------------- writers


def _target(out: str) -> tuple[pafs.FileSystem, str]:
    if "://" in out:
        return pafs.FileSystem.from_uri(out)
    return pafs.LocalFileSystem(), str(Path(out).resolve())


class _Writer:
    """Parquet file, JSONL file, or an `hf` directory of parquet shards."""

    def __init__(self, out: str, fmt: str, schema: pa.Schema) -> None:
        self.fs, self.path = _target(out)
        self.fmt, self.schema = fmt, schema
        self.files: list[str] = []
        self._rows_in_shard = 0
        self._pq: pq.ParquetWriter | None = None
        self._stream: Any = None
        if fmt == "hf":
            self.fs.create_dir(f"{self.path}/data", recursive=True)
        elif fmt == "jsonl":
            self.fs.create_dir(str(Path(self.path).parent), recursive=True)
            self._stream = self.fs.open_output_stream(self.path)
            self.files.append(self.path)
        else:
            self.fs.create_dir(str(Path(self.path).parent), recursive=True)

    def _parquet(self) -> pq.ParquetWriter:
        if self._pq is None:
            path = self.path if self.fmt == "parquet" else f"{self.path}/data/part-{len(self.files):05d}.parquet"
            self._pq = pq.ParquetWriter(path, self.schema, filesystem=self.fs)
            self.files.append(path)
        return self._pq

    def write(self, t: pa.Table) -> None:
        if t.num_rows == 0:
            return
        t = t.cast(self.schema)
        if self.fmt == "jsonl":
            enc = msgspec.json.Encoder()
            self._stream.write(b"".join(enc.encode(row) + b"\n" for row in t.to_pylist()))
            return
        self._parquet().write_table(t)
        self._rows_in_shard += t.num_rows
        if self.fmt == "hf" and self._rows_in_shard >= SHARD_ROWS:
            self._pq.close()  # type: ignore[union-attr]
            self._pq, self._rows_in_shard = None, 0

    def close(self) -> list[str]:
        if self._stream is not None:
            self._stream.close()
        if self._pq is not None or (self.fmt != "jsonl" and not self.files):
            self._parquet().close()  # an empty export is still a readable file with the schema
        if self.fmt == "hf":  # the Hub's shard names, now that the count is known
            n = len(self.files)
            final = [f"{self.path}/data/train-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
            for src, dst in zip(self.files, final):
                self.fs.move(src, dst)
            self.files = final
        return self.files


def _card(kind: str, schema: pa.Schema, info: dict[str, Any]) -> str:
    cols = "\n".join(f"| `{f.name}` | {f.type} |" for f in schema)
    text = (f"Text columns are decoded with `{info['tokenizer']}`, special tokens kept." if info["tokenizer"]
            else "No tokenizer was known, so there are no text columns.")
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
# StreamRL experience export ({kind})

Exported from the StreamRL experience pool `{info['pool']}` with
`streamrl pool export --kind {kind}{' --where ' + json.dumps(info['where']) if info['where'] else ''}`:
{info['rows']} rows. {text} The token columns hold the exact ids the policy sampled.

```python
import datasets
ds = datasets.load_dataset("path/to/this/directory", split="train")
```

| column | type |
|---|---|
{cols}
"""


# ---------------------------------------------------------------- the export


def export(pool: LancePool, out: str, *, where: str | None = None, kind: str = "samples", fmt: str | None = None,
           tokenizer: str | None = None, progress: bool = True, batch_rows: int = 1024) -> dict[str, Any]:
    """Write the rows `where` selects (SQL over the pool's columns, claims applied) as `kind` rows
    in `fmt` (default from `out`'s suffix) and return a summary."""
    if where is not None:  # before Lance or DuckDB sees it: one filter expression, never a second statement
        check_where(where)
    if kind not in KINDS:
        raise ExportError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    fmt = fmt or guess_format(out)
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    tok_path = tokenizer or pool.tokenizer
    tok = load_decoder(tok_path) if kind != "raw" else None
    if tokenizer and tok is None:
        raise ExportError(f"--tokenizer {tokenizer}: no tokenizer.json there")
    schema = output_schema(kind, tok is not None)
    t0 = time.perf_counter()
    snap = pool.snapshot()  # both passes of `best`/`dpo` read the same rows
    writer, rows = _Writer(out, fmt, schema), 0
    with pool.reading(where):
        total = snap.count(where)
        with tqdm(total=total, unit="rows", desc=f"export {kind}", disable=not progress) as bar:
            if kind in ("samples", "raw"):
                parts: Iterator[pa.Table] = (pa.Table.from_batches([b]) for b in
                                             snap.batches(_NEEDS[kind], where, batch_rows))
            else:
                narrow = snap.batches(["group_id", "sample_index", "reward", "failed", ROW_ID], where, batch_rows)
                parts = _pairs(snap, _pick(narrow, bar), kind, tok)
            for part in parts:
                shaped = _samples(part, tok) if kind == "samples" else part
                writer.write(shaped)
                rows += shaped.num_rows
                if kind in ("samples", "raw"):
                    bar.update(part.num_rows)
    files = writer.close()
    info = {"pool": pool.uri, "out": out, "kind": kind, "format": fmt, "where": where, "rows": rows,
            "samples_read": total, "files": files, "tokenizer": tok_path if tok is not None else None,
            "seconds": round(time.perf_counter() - t0, 2)}
    if fmt == "hf":
        with writer.fs.open_output_stream(f"{writer.path}/README.md") as f:
            f.write(_card(kind, schema, info).encode())
    return info
