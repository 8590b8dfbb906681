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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.core.claims import CLAIM_COLUMNS, apply_claims
from streamrl.pools.schema import CLAIMS_SCHEMA, POOL_SCHEMA, WIDE_COLUMNS, conform
from streamrl.pools.sql import check_where, connect

_CLAIMED = set(CLAIM_COLUMNS)
_POS = "__streamrl_pos"
_WIDE = WIDE_COLUMNS
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
            stored = [c for c in CLAIMS_SCHEMA.names if c in ds.schema.names]  # older pools lack some
            if self._version is not None and ds.has_stable_row_ids:
                new = ds.scanner(columns=stored, filter=f"_row_last_updated_at_version > {self._version}").to_table()
                table = pa.concat_tables([self._table, conform(new, CLAIMS_SCHEMA)])
                if table.num_rows != ds.count_rows():  # rows removed behind our back: read it all
                    table = conform(ds.to_table(columns=stored), CLAIMS_SCHEMA)
            else:
                table = conform(ds.to_table(columns=stored), CLAIMS_SCHEMA)
            self._table, self._version = table, ds.version
            return table


ROW_ID = "_rowid"  # Lance's stable row id: may be asked for as a column; stays valid across compactions


def _schema(columns: list[str]) -> pa.Schema:
    return pa.schema([pa.field(ROW_ID, pa.uint64()) if c == ROW_ID else POOL_SCHEMA.field(c) for c in columns])


def matching_positions(ds: Any, claims: pa.Table, where: str) -> np.ndarray:
    """Row positions (in `ds`'s scan order) of the rows `where` selects once claims apply."""
    import duckdb

    check_where(where)
    named = sorted(columns_in(where, POOL_SCHEMA.names) | {"group_id"})
    narrow = apply_claims(ds.to_table(columns=named), claims)
    narrow = narrow.append_column(_POS, pa.array(np.arange(narrow.num_rows, dtype=np.int64)))
    con = connect()
    con.register("pool", narrow)
    try:
        hit = con.sql(f"SELECT {_POS} FROM pool WHERE {where}").to_arrow_table()[_POS]
    except duckdb.Error as e:
        raise ValueError(f"bad filter {where!r}: {str(e).splitlines()[0]}") from None
    finally:
        con.close()
    return np.sort(hit.to_numpy())


def quote(values: Sequence[str]) -> str:
    """A SQL list of string literals for Lance filters (`col IN (...)`)."""
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)


def filtered(ds: Any, columns: list[str], where: str | None) -> pa.Table:
    """A filtered read. With token columns it finds the rows on the narrow columns first and
    reads them by row id: Lance's scalar-index path reads whole rows ~5x slower here."""
    if not where or not _WIDE.intersection(columns):
        return ds.to_table(columns=columns, filter=where)
    ids = ds.to_table(columns=["group_id"], filter=where, with_row_id=True)[ROW_ID].to_pylist()
    if len(ids) > TAKE_MAX_ROWS:
        return ds.to_table(columns=columns, filter=where)
    return by_row_id(ds, columns, ids)


def by_row_id(ds: Any, columns: list[str], row_ids: list[int]) -> pa.Table:
    """The rows with these row ids, in the dataset's order (a take, in chunks)."""
    parts = [ds.to_table(columns=columns, filter=f"{ROW_ID} IN ({', '.join(map(str, row_ids[i:i + TAKE_CHUNK]))})")
             for i in range(0, len(row_ids), TAKE_CHUNK)]
    return pa.concat_tables(parts) if parts else _schema(columns).empty_table()


class Snapshot:
    """One version of the pool table with the claims read just before it: every read through one
    snapshot sees the same rows (an export's two passes, for instance)."""

    def __init__(self, ds: Any, claims: pa.Table) -> None:
        self.ds, self.claims = ds, claims

    def _plan(self, columns: list[str] | None, where: str | None) -> tuple[list[str], list[str], bool, bool]:
        """(output columns, stored columns to read, claims needed, filter needs claims)."""
        cols = list(columns or POOL_SCHEMA.names)
        on_claims = bool(columns_in(where, POOL_SCHEMA.names) & _CLAIMED)
        needed = on_claims or bool(set(cols) & _CLAIMED)
        return cols, (cols if not needed or "group_id" in cols else [*cols, "group_id"]), needed, on_claims

    def scan(self, columns: list[str] | None = None, where: str | None = None) -> pa.Table:
        cols, stored, needed, on_claims = self._plan(columns, where)
        if on_claims:
            rows = self.ds.take(matching_positions(self.ds, self.claims, where), columns=stored)  # type: ignore[arg-type]
        else:
            rows = filtered(self.ds, stored, where)
        return apply_claims(rows, self.claims).select(cols) if needed else rows

    def batches(self, columns: list[str] | None = None, where: str | None = None,
                batch_rows: int = 1024) -> pa.RecordBatchReader:
        """Stream the selected rows, `batch_rows` at a time: memory stays bounded whatever the pool's size."""
        cols, stored, needed, on_claims = self._plan(columns, where)
        if not needed:
            return self.ds.scanner(columns=cols, filter=where, batch_size=batch_rows, strict_batch_size=True).to_reader()

        def gen() -> Iterator[pa.RecordBatch]:
            if on_claims:
                pos = matching_positions(self.ds, self.claims, where)  # type: ignore[arg-type]
                parts: Iterator[pa.Table] = (self.ds.take(pos[i:i + batch_rows], columns=stored)
                                             for i in range(0, len(pos), batch_rows))
            else:
                scanner = self.ds.scanner(columns=stored, filter=where, batch_size=batch_rows, strict_batch_size=True)
                parts = (pa.Table.from_batches([b]) for b in scanner.to_batches())
            for part in parts:
                yield from apply_claims(part, self.claims).select(cols).to_batches()

        return pa.RecordBatchReader.from_batches(_schema(cols), gen())

    def rows(self, row_ids: list[int], columns: list[str]) -> pa.Table:
        """Rows by row id (from a `_rowid` column this snapshot returned), claims applied."""
        cols, stored, needed, _ = self._plan(columns, None)
        rows = by_row_id(self.ds, stored, row_ids)
        return apply_claims(rows, self.claims).select(cols) if needed else rows

    def count(self, where: str | None = None) -> int:
        if not where:
            return self.ds.count_rows()
        if columns_in(where, POOL_SCHEMA.names) & _CLAIMED:
            return len(matching_positions(self.ds, self.claims, where))
        return self.ds.count_rows(filter=where)
