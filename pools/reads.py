"""Reading sample rows as they are now: stored rows with the learner's claims applied.

A filter that names only stored columns is pushed down into the Lance scan. One that names a
column a claim decides (`status = 'consumed'`) is evaluated in two passes: a narrow scan of the
columns it names (claims applied, filtered with DuckDB) finds the matching row positions, then
only those rows are read, in order, in chunks when streaming. Claims are read before rows: a
group claimed in between shows as complete (true a moment ago), never a claim without rows.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.core.claims import CLAIM_COLUMNS, apply_claims
from streamrl.pools.schema import CLAIMS_SCHEMA, POOL_SCHEMA

_CLAIMED = set(CLAIM_COLUMNS)
_POS = "__streamrl_pos"
_WIDE = {f.name for f in POOL_SCHEMA if pa.types.is_list(f.type)}
TAKE_MAX_ROWS = 65536  # a filter selecting more reads in one filtered scan
TAKE_CHUNK = 8192


def columns_in(sql: str | None, names: list[str]) -> set[str]:
    """The columns of `names` that `sql` mentions (over-approximated: words in strings count)."""
    words = set(re.findall(r"[A-Za-z_]\w*", sql or ""))
    return {c for c in names if c in words}


class ClaimsCache:
    """The claims table in memory; a later read fetches only the claims committed since."""

    def __init__(self, open_claims: Callable[[], Any | None]) -> None:
        self._open = open_claims
        self._lock = threading.Lock()
        self._table: pa.Table = CLAIMS_SCHEMA.empty_table()
        self._version: int | None = None

    def get(self) -> pa.Table:
        ds = self._open()
        if ds is None:  # a pool from before claims, opened read-only
            return CLAIMS_SCHEMA.empty_table()
        with self._lock:
            if ds.version == self._version:
                return self._table
            if self._version is not None and ds.has_stable_row_ids:
                new = ds.scanner(columns=CLAIMS_SCHEMA.names,
                                 filter=f"_row_last_updated_at_version > {self._version}").to_table()
                table = pa.concat_tables([self._table, new])
                if table.num_rows != ds.count_rows():  # rows removed behind our back: read it all
                    table = ds.to_table(columns=CLAIMS_SCHEMA.names)
            else:
                table = ds.to_table(columns=CLAIMS_SCHEMA.names)
            self._table, self._version = table, ds.version
            return table


def _stored(columns: list[str], claims_needed: bool) -> list[str]:
    return columns if not claims_needed or "group_id" in columns else [*columns, "group_id"]


def _effective(rows: pa.Table, claims: pa.Table, columns: list[str]) -> pa.Table:
    return apply_claims(rows, claims).select(columns)


def matching_positions(ds: Any, claims: pa.Table, where: str) -> np.ndarray:
    """Row positions (in `ds`'s scan order) of the rows `where` selects once claims apply."""
    import duckdb

    named = sorted(columns_in(where, POOL_SCHEMA.names) | {"group_id"})
    narrow = apply_claims(ds.to_table(columns=named), claims)
    narrow = narrow.append_column(_POS, pa.array(np.arange(narrow.num_rows, dtype=np.int64)))
    con = duckdb.connect()
    con.register("pool", narrow)
    try:
        hit = con.sql(f"SELECT {_POS} FROM pool WHERE {where}").to_arrow_table()[_POS]
    except duckdb.Error as e:
        raise ValueError(f"bad filter {where!r}: {str(e).splitlines()[0]}") from None
    finally:
        con.close()
    return np.sort(hit.to_numpy())


def filtered(ds: Any, columns: list[str], where: str | None) -> pa.Table:
    """A filtered read. With token columns it finds the rows on the narrow columns first and
    reads them by row id: Lance's scalar-index path reads whole rows ~5x slower here."""
    if not where or not _WIDE.intersection(columns):
        return ds.to_table(columns=columns, filter=where)
    ids = ds.to_table(columns=["group_id"], filter=where, with_row_id=True)["_rowid"].to_pylist()
    if len(ids) > TAKE_MAX_ROWS:
        return ds.to_table(columns=columns, filter=where)
    parts = [ds.to_table(columns=columns, filter=f"_rowid IN ({', '.join(map(str, ids[i:i + TAKE_CHUNK]))})")
             for i in range(0, len(ids), TAKE_CHUNK)]
    return pa.concat_tables(parts) if parts else POOL_SCHEMA.empty_table().select(columns)


def scan(ds: Any, claims: Callable[[], pa.Table], columns: list[str] | None, where: str | None) -> pa.Table:
    cols = list(columns or POOL_SCHEMA.names)
    if not (set(cols) | columns_in(where, POOL_SCHEMA.names)) & _CLAIMED:
        return filtered(ds, cols, where)
    c = claims()
    stored = _stored(cols, True)
    if columns_in(where, POOL_SCHEMA.names) & _CLAIMED:
        rows = ds.take(matching_positions(ds, c, where), columns=stored)
    else:
        rows = filtered(ds, stored, where)
    return _effective(rows, c, cols)


def batches(ds: Any, claims: Callable[[], pa.Table], columns: list[str] | None, where: str | None,
            batch_rows: int = 1024) -> pa.RecordBatchReader:
    """Stream the selected rows, `batch_rows` at a time: memory stays bounded whatever the pool's size."""
    cols = list(columns or POOL_SCHEMA.names)
    named = columns_in(where, POOL_SCHEMA.names)
    if not (set(cols) | named) & _CLAIMED:
        return ds.scanner(columns=cols, filter=where, batch_size=batch_rows,
                          strict_batch_size=True).to_reader()
    c = claims()
    stored = _stored(cols, True)
    schema = POOL_SCHEMA.empty_table().select(cols).schema

    def gen() -> Iterator[pa.RecordBatch]:
        if named & _CLAIMED:
            pos = matching_positions(ds, c, where)  # type: ignore[arg-type]
            parts: Iterator[pa.Table] = (ds.take(pos[i:i + batch_rows], columns=stored)
                                         for i in range(0, len(pos), batch_rows))
        else:
            scanner = ds.scanner(columns=stored, filter=where, batch_size=batch_rows, strict_batch_size=True)
            parts = (pa.Table.from_batches([b]) for b in scanner.to_batches())
        for part in parts:
            yield from _effective(part, c, cols).to_batches()

    return pa.RecordBatchReader.from_batches(schema, gen())


def count(ds: Any, claims: Callable[[], pa.Table], where: str | None) -> int:
    if not where:
        return ds.count_rows()
    if columns_in(where, POOL_SCHEMA.names) & _CLAIMED:
        return len(matching_positions(ds, claims(), where))
    return ds.count_rows(filter=where)
