"""DuckDB for the SQL a user types (`streamrl pool query`, `--where` of export and replay): one
SELECT, on a connection that cannot touch anything but the tables registered on it.

A pool directory may come from anyone, and a query may be pasted from anywhere, so the
connection has DuckDB's external access off (no COPY, ATTACH, INSTALL, LOAD, read_csv or any
other file or network function) and its configuration locked (a query cannot turn it back on),
and a query is parsed first: anything but exactly one SELECT is refused before it runs.

DuckDB loads on first use, not on import: the pool's write path imports this module's users.
"""

from __future__ import annotations

from typing import Any

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


def connect() -> Any:
    """An in-memory DuckDB connection that reads only what is registered on it."""
    import duckdb

    return duckdb.connect(config=dict(SANDBOX))


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
