"""Read-only views of a pool: stats, SQL (DuckDB), the tokenizer that decodes it (exports: pools/export.py).

The pool is read at one Lance version per table, so all of this works while producers and
the learner are still writing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pyarrow as pa
from tokenizers import Tokenizer

from streamrl.core.claims import apply_claims
from streamrl.core.ledger import compute_ledger
from streamrl.pools.schema import ADMISSIONS_SCHEMA, ADMISSIONS_TABLE, META_COLUMNS, POOL_SCHEMA
from streamrl.pools.sql import check_select, connect, run

if TYPE_CHECKING:
    from streamrl.pools.lance_pool import LancePool  # the pool is passed in: opening one is pools.open_pool's

STATS_VERSION = 1


def pool_stats(pool: LancePool) -> dict[str, Any]:
    """Everything `streamrl pool stats --json` prints. Keys are stable; see README
    ("Inspecting a pool") for their meaning. New keys may be added, none renamed."""
    claims = pool.claims()  # claims, rows, admissions: the order LancePool.ledger reads them in
    stored = pool.scan(META_COLUMNS, effective=False)
    adm = pool.scan(["group_id", "n"], table=ADMISSIONS_TABLE)
    ledger = compute_ledger(adm, stored.select(["group_id", "sample_index", "status"]), claims)
    meta = apply_claims(stored, claims)
    con = connect()
    con.register("pool", meta)

    def rows(sql: str) -> list[tuple[Any, ...]]:
        return con.execute(sql).fetchall()

    (n_rows, n_groups, vmin, vmax, n_tokens) = rows(
        "SELECT count(*), count(DISTINCT group_id), min(min_version), max(max_version), "
        "coalesce(sum(num_tokens), 0) FROM pool")[0]
    by_status = rows("SELECT status, count(*), count(DISTINCT group_id) FROM pool GROUP BY 1 ORDER BY 1")
    stale = rows("SELECT consumed_version - min_version AS s, count(DISTINCT group_id) FROM pool "
                 "WHERE status = 'consumed' AND min_version IS NOT NULL GROUP BY 1 ORDER BY 1")
    reward = rows("SELECT max_version, count(DISTINCT group_id), count(reward), avg(reward) FROM pool "
                  "WHERE max_version IS NOT NULL AND status <> 'partial' GROUP BY 1 ORDER BY 1")
    drops = rows("SELECT drop_reason, count(DISTINCT group_id) FROM pool WHERE status = 'dropped' "
                 "GROUP BY 1 ORDER BY 1")
    failed_samples = rows("SELECT count(*) FROM pool WHERE failed")[0][0]
    return {
        "stats_version": STATS_VERSION,
        "uri": pool.uri,
        "rows": n_rows,
        "groups": n_groups,
        "response_tokens": int(n_tokens),
        "failed_samples": failed_samples,
        "rows_by_status": {s: r for s, r, _ in by_status},
        "groups_by_status": {s: g for s, _, g in by_status},
        "versions": {"min": vmin, "max": vmax},
        "staleness_histogram": {str(s): c for s, c in stale},
        "reward_by_version": [
            {"version": v, "groups": g, "scored_samples": n, "mean_reward": None if m is None else round(m, 6)}
            for v, g, n, m in reward
        ],
        "drops_by_reason": {str(r): c for r, c in drops},
        "ledger": {**msgspec.to_builtins(ledger), "balanced": ledger.balanced},
    }


def _mentioned(sql: str, schema: pa.Schema) -> list[str]:
    """Columns a query names; all of them for `*`. Token lists are big, so read only what is used."""
    if "*" in re.sub(r"count\s*\(\s*\*\s*\)", "", sql, flags=re.I):
        return schema.names
    words = set(re.findall(r"[A-Za-z_]\w*", sql))
    return [c for c in schema.names if c in words] or schema.names[:1]


def pool_query(pool: LancePool, sql: str) -> pa.Table:
    """Run one DuckDB SELECT over the pool (table `pool`, claims applied), the ledger's `admissions`
    table and the learner's `claims`, read-only (pools/sql.py); QueryError when refused or failed."""
    check_select(sql)
    con = connect()
    con.register("pool", pool.scan(_mentioned(sql, POOL_SCHEMA)))
    if re.search(r"\badmissions\b", sql):
        con.register("admissions", pool.scan(_mentioned(sql, ADMISSIONS_SCHEMA), table=ADMISSIONS_TABLE))
    if re.search(r"\bclaims\b", sql):
        con.register("claims", pool.claims())
    return run(con, sql)


def load_decoder(path: str | None) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json or a model directory holding one."""
    if not path:
        return None
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        return None
    return Tokenizer.from_file(str(p))



def group_lengths(pool: LancePool) -> list[tuple[str, list[int]]]:
    """(prompt id, response lengths of its samples that did not fail) for every finished group
    (complete, consumed or dropped), in the order they were stored: what length prediction
    (streamrl/core/lengths.py) learns from."""
    t = pool.scan(["group_id", "prompt_id", "num_tokens", "failed", "created_ns"],
                  where="status IN ('complete', 'consumed', 'dropped')")
    groups: dict[str, tuple[int, str, list[int]]] = {}
    for gid, pid, n, failed, at in zip(*(t[c].to_pylist() for c in ("group_id", "prompt_id", "num_tokens",
                                                                      "failed", "created_ns"))):
        _, _, lens = groups.setdefault(gid, (at or 0, pid, []))
        if not failed:
            lens.append(int(n))
    return [(pid, lens) for _, pid, lens in sorted(groups.values(), key=lambda g: g[0])]
