"""Reading a pool as it was (streamrl/core/asof.py decides which versions), keeping the versions
that matter (checkpoint tags), and dropping the rest by the recipe's policy (`pool.keep_versions`).

Lance keeps every version of a table until a cleanup removes it, and never removes a tagged one:
a checkpoint tags the versions its last step read, so the pool as of any checkpoint stays
readable, and the compaction cleans up all but the last `keep_versions` versions of each table.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core.asof import AsOf, AsOfError, claims_as_of, resolve_step, resolve_version
from streamrl.core.ledger import compute_ledger
from streamrl.core.types import Ledger, SampleGroup
from streamrl.pools import reads
from streamrl.pools.committer import retry_conflicts
from streamrl.pools.errors import PoolError
from streamrl.pools.reads import quote
from streamrl.pools.schema import ADMISSIONS_TABLE, CLAIMS_TABLE, POOL_SCHEMA, POOL_TABLE, table_to_groups

log = logging.getLogger(__name__)
CHECKPOINT_TAG = "checkpoint-v{version:06d}"  # names the versions a checkpoint of policy `version` read
MIN_AGE = timedelta(minutes=10)  # younger versions are kept too: a reader may still be scanning one


def tag(ds: Any, name: str, version: int) -> None:
    """Tag `version` of dataset `ds` as `name` (moved there when it already names another)."""
    if name in ds.tags.list():
        retry_conflicts(lambda: ds.tags.update(name, version))
    else:
        retry_conflicts(lambda: ds.tags.create(name, version))


def untag_missing(ds: Any, keep: Callable[[str], bool]) -> list[str]:
    """Delete the checkpoint tags of `ds` that `keep(name)` rejects (their checkpoint was pruned)."""
    gone = [t for t in ds.tags.list() if t.startswith("checkpoint-") and not keep(t)]
    for t in gone:
        retry_conflicts(lambda: ds.tags.delete(t))  # noqa: B023 - called at once
    return gone


def tag_checkpoint(open_table: Callable[[str], Any], tables: list[str], claims: pa.Table, step: int,
                   policy_version: int) -> dict[str, int]:
    """Tag checkpoint-v<policy_version> in every table: the pool and admissions versions learner
    `step` (the checkpoint's last) read, as its claims recorded them (the latest where they did not:
    no step yet, or a pool from before), and the claims table's latest, so cleanups keep them.
    Returns {table: tagged version}: the checkpoint records it. (Not the last claim's: in stream
    mode the next step may have claimed by the time the checkpoint is taken.)"""
    try:
        at = resolve_step(claims, step)
        read = (at.pool_version, at.admissions_version if at.admissions_version is not None
                else open_table(ADMISSIONS_TABLE).version)
    except AsOfError:
        read = (open_table(POOL_TABLE).version, open_table(ADMISSIONS_TABLE).version)
    versions = dict(zip((POOL_TABLE, ADMISSIONS_TABLE), read))
    if CLAIMS_TABLE in tables:
        versions[CLAIMS_TABLE] = open_table(CLAIMS_TABLE).version
    for table, v in versions.items():
        tag(open_table(table), CHECKPOINT_TAG.format(version=policy_version), v)
    return versions


def untag_checkpoints(open_table: Callable[[str], Any], tables: list[str], kept: set[int]) -> list[str]:
    """Delete, in every table, the checkpoint tags of policy versions not in `kept`."""
    names = {CHECKPOINT_TAG.format(version=v) for v in kept}
    return [t for table in tables for t in untag_missing(open_table(table), names.__contains__)]


def cleanup(ds: Any, keep_versions: int, min_age: timedelta = MIN_AGE) -> None:
    """Remove versions of `ds` but tagged ones, the newest `keep_versions` and those younger than
    `min_age`. `keep_versions` 0 keeps every version."""
    if keep_versions:
        stats = ds.cleanup_old_versions(older_than=min_age, retain_versions=keep_versions,
                                        error_if_tagged_old_versions=False)
        if stats.old_versions:
            log.info("experience pool %s: removed %d old versions (%.1f MB) by pool.keep_versions = %d "
                     "(tagged versions are kept)", ds.uri, stats.old_versions, stats.bytes_removed / 1e6, keep_versions)


def checkout(open_table: Callable[[str], Any], name: str, version: int | str, keep_versions: int | None) -> Any:
    """Table `name` at `version` (a number or a tag); PoolError saying why when it is gone."""
    ds = open_table(name)
    try:
        return ds.checkout_version(version)
    except (OSError, ValueError, KeyError) as e:
        kept = sorted(v["version"] for v in ds.versions())
        held = ", ".join(map(str, kept)) if len(kept) <= 6 else f"{kept[0]}..{kept[-1]}"
        tags = ", ".join(f"{t} (version {info['version']})" for t, info in sorted(ds.tags.list().items())) or "none"
        policy = f"pool.keep_versions = {keep_versions}" if keep_versions is not None else "pool.keep_versions"
        raise PoolError(f"the {name} table has no version {version!r} ({str(e).splitlines()[0][:120]}): it keeps "
                        f"versions {held} ({len(kept)} of them; {policy} keeps the newest and every "
                        f"tagged one); tags: {tags}") from None


class PoolView:
    """A pool (a LancePool; not imported: it imports this module) read as it was at `at`: the part of LancePool's read API that inspection uses (scan,
    reader, count, claims, groups, ledger), so `pool stats/query/show`, replay and the viewer read a
    past pool as they read the present one. Read-only."""

    def __init__(self, pool: Any, at: AsOf, claims: pa.Table, keep_versions: int | None = None) -> None:
        self._pool, self.at = pool, at
        self.uri = pool.uri
        self._ds = checkout(pool._open, POOL_TABLE, at.pool_version, keep_versions)
        self._claims = claims_as_of(claims, at)
        self._adm_version = at.admissions_version
        self._keep = keep_versions

    @property
    def tokenizer(self) -> str | None:
        return self._pool.tokenizer

    def snapshot(self) -> reads.Snapshot:
        return reads.Snapshot(self._ds, self._claims)

    def claims(self) -> pa.Table:
        return self._claims

    def _admissions(self, columns: list[str] | None, where: str | None) -> pa.Table:
        if self._adm_version is not None:
            with contextlib.suppress(PoolError):  # cleaned up: by the time, below
                return checkout(self._pool._open, ADMISSIONS_TABLE, self._adm_version, self._keep).to_table(
                    columns=columns, filter=where)
        # Not recorded (a bare version before any claim) or not kept: admissions made by the pool version's time.
        when = next(v["timestamp"] for v in self._ds.versions() if v["version"] == self._ds.version)
        t = self._pool.scan(None, where, table=ADMISSIONS_TABLE)
        t = t.filter(pc.less_equal(t["admitted_ns"], int(when.timestamp() * 1e9)))
        return t.select(columns) if columns else t

    def scan(self, columns: list[str] | None = None, where: str | None = None, table: str = POOL_TABLE,
             *, effective: bool = True) -> pa.Table:
        with self._pool.reading(where):
            if table == ADMISSIONS_TABLE:
                return self._admissions(columns, where)
            if table == CLAIMS_TABLE:
                if where:
                    raise ValueError("bad filter: the claims of a past pool are read whole")
                return self._claims.select(columns) if columns else self._claims
            if not effective:
                return reads.filtered(self._ds, list(columns or POOL_SCHEMA.names), where)
            return self.snapshot().scan(columns, where)

    def reader(self, columns: list[str] | None = None, where: str | None = None,
               batch_rows: int = 1024) -> pa.RecordBatchReader:
        with self._pool.reading(where):
            return self.snapshot().batches(columns, where, batch_rows)

    def count(self, where: str | None = None) -> int:
        with self._pool.reading(where):
            return self.snapshot().count(where)

    def groups(self, group_ids: Sequence[str]) -> list[SampleGroup]:
        if not group_ids:
            return []
        return table_to_groups(self.scan(where=f"group_id IN ({quote(group_ids)})"))

    def ledger(self) -> Ledger:
        rows = self.scan(["group_id", "sample_index", "status"], effective=False)
        return compute_ledger(self.scan(["group_id", "n"], table=ADMISSIONS_TABLE), rows, self._claims)

    def close(self) -> None:
        self._pool.close()


def view(pool: Any, step: int | None = None, version: int | str | None = None,
         keep_versions: int | None = None) -> PoolView:
    """`pool` as of learner `step` or pool-table `version` (a number or a tag such as checkpoint-v000010).
    PoolError (a bad-input error) when the pool cannot be read so."""
    claims = pool.claims()
    try:
        if step is not None:
            at = resolve_step(claims, step)
        else:
            assert version is not None
            number = checkout(pool._open, POOL_TABLE, version, keep_versions).version
            at = resolve_version(claims, number)
    except AsOfError as e:
        raise PoolError(str(e)) from None
    return PoolView(pool, at, claims, keep_versions)

