"""DuckDB for the SQL a user types (`streamrl pool query`, `--where` of export and replay): one
SELECT, on a connection that cannot touch anything but the tables registered on it.

A pool directory may come from anyone, and a query may be pasted from anywhere, so the
connection has DuckDB's external access off (no COPY, ATTACH, INSTALL, LOAD, read_csv or any
other file or network function) and its configuration locked (a query cannot turn it back on),
and a query is parsed first: anything but exactly one SELECT is refused before it runs.

DuckDB loads on first use, not on import: the pool's write path imports this module's users.
"""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

from streamrl.pools.errors import PoolError

SANDBOX = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,  # last: SET cannot undo the rest
}


class QueryError(PoolError, ValueError):
    """DuckDB rejected or failed a query; the message is its first line."""


class SQLRefused(QueryError):
    """A query that is not one read-only SELECT (the message says what it is instead)."""


def connect(**limits: Any) -> Any:
    """An in-memory DuckDB connection that reads only what is registered on it; `limits` are more
    DuckDB settings (memory_limit, threads), fixed before the configuration is locked."""
    import duckdb

    return duckdb.connect(config={**limits, **SANDBOX})


def run(con: Any, sql: str) -> Any:
    """`sql` on `con` as an Arrow table; QueryError with DuckDB's first line when it fails."""
    import duckdb

    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as e:
        raise QueryError((str(e).splitlines() or [type(e).__name__])[0]) from None


def check_select(sql: str, what: str = "the query") -> None:
    """Raise SQLRefused unless `sql` is exactly one SELECT (a DuckDB parse error propagates)."""
    import duckdb

    if not sql.strip():
        raise SQLRefused(f"{what} is empty: give one SELECT, e.g. \"SELECT status, count(*) FROM pool GROUP BY 1\"")
    statements = duckdb.extract_statements(sql)
    if len(statements) != 1:
        raise SQLRefused(f"{what} holds {len(statements)} SQL statements; give exactly one SELECT (no ';')")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise SQLRefused(f"{what} is a {kind.name} statement; only a SELECT runs here (the pool is read-only: "
                         "no COPY, ATTACH, INSTALL, LOAD, SET or file functions)")


def check_where(where: str, what: str = "--where") -> None:
    """Raise SQLRefused unless `where` is one filter expression (not a second statement)."""
    if not where.strip():
        raise SQLRefused(f"{what} is empty: give a filter such as \"status = 'consumed'\", or leave it out")
    import duckdb

    try:
        check_select(f"SELECT 1 FROM pool WHERE {where}", f"{what} {where!r}")
    except duckdb.Error as e:
        raise SQLRefused(f"bad filter {where!r}: {str(e).splitlines()[0]}") from None


FILTER_MAX_CHARS = 4000


def check_filter(con: Any, where: str, tables: frozenset[str] = frozenset({"pool"})) -> None:
    """`check_where`, for a filter from an untrusted caller (the viewer's HTTP API): also refuse
    one that reads a table other than `tables`. `con` is a sandboxed connection (`connect()`):
    finding the tables binds the query, and a file function fails there rather than reading."""
    import duckdb

    if len(where) > FILTER_MAX_CHARS:
        raise SQLRefused(f"the filter is {len(where)} characters long; at most {FILTER_MAX_CHARS}")
    check_where(where, "the filter")
    try:
        named = con.get_table_names(f"SELECT 1 FROM pool WHERE {where}")
    except duckdb.Error as e:
        raise SQLRefused(f"bad filter {where!r}: {str(e).splitlines()[0]}") from None
    other = sorted(set(named) - tables)
    if other:
        raise SQLRefused(f"the filter reads {', '.join(other)}; it may read only the table(s) {', '.join(sorted(tables))}")


def run_limited(con: Any, sql: str, *params: Any, timeout_s: float, max_rows: int) -> Any:
    """`sql` (with `?` parameters) on `con` as an Arrow table of at most `max_rows` rows, interrupted
    after `timeout_s` seconds (a QueryError says so): what an untrusted filter may cost."""
    import duckdb

    timer = threading.Timer(timeout_s, con.interrupt)
    timer.start()
    try:
        reader = con.sql(sql, params=list(params) or None).to_arrow_reader(min(max_rows, 65536))
        batches, rows = [], 0
        for batch in reader:
            batches.append(batch.slice(0, max_rows - rows))
            rows += batches[-1].num_rows
            if rows >= max_rows:
                break
        return pa.Table.from_batches(batches, reader.schema)
    except duckdb.InterruptException:
        raise QueryError(f"the query ran longer than {timeout_s:g} s and was stopped") from None
    except duckdb.Error as e:
        if not timer.is_alive():
            raise QueryError(f"the query ran longer than {timeout_s:g} s and was stopped") from None
        raise QueryError((str(e).splitlines() or [type(e).__name__])[0]) from None
    finally:
        timer.cancel()
