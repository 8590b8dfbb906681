"""Compaction of a pool's tables. Only the learner compacts, in a background thread: Lance appends
never conflict with a compaction, and claims do not touch the tables it rewrites."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrl.pools.asof import cleanup
from streamrl.pools.committer import retry_conflicts

COMPACT_TARGET_ROWS = 16384
# The scalar indices that make lookups by group fast, per table.
INDEXED = {"pool": {"group_id": "BTREE", "status": "BITMAP", "uid": "BTREE"}, "admissions": {"group_id": "BTREE"}}


def compact_table(open_table: Callable[[str], Any], name: str, keep_versions: int = 1000) -> None:
    """Merge small fragments of table `name` into ~16k-row ones (bounded, so a big fragment is not
    rewritten every time), bring its scalar indices up to date, and remove versions but the newest
    `keep_versions`, tagged ones (checkpoints) and those under 10 minutes old (pools/asof.py).
    Indices are made with pylance, like every read: LanceDB 0.40's own Lance ignores the index
    version pylance 14 writes. `open_table(name)` gives a fresh pylance dataset."""
    if open_table(name).count_rows() == 0:
        return
    # Binary copy moves the encoded pages as they are (3-4x less CPU than decoding and encoding
    # them again here), so a compaction takes less from the claims beside it.
    retry_conflicts(lambda: open_table(name).optimize.compact_files(
        target_rows_per_fragment=COMPACT_TARGET_ROWS, materialize_deletions_threshold=0.1,
        compaction_mode="try_binary_copy"))
    have = {f for idx in open_table(name).describe_indices() for f in idx.field_names}
    for col, kind in INDEXED.get(name, {}).items():
        if col not in have:
            retry_conflicts(lambda: open_table(name).create_scalar_index(col, kind))  # noqa: B023 - called at once
    if INDEXED.get(name):
        retry_conflicts(lambda: open_table(name).optimize.optimize_indices())
    cleanup(open_table(name), keep_versions)


def small_fragments(ds: Any) -> int:
    """Fragments of dataset `ds` under COMPACT_TARGET_ROWS rows: those a compaction would merge."""
    return sum(f.physical_rows < COMPACT_TARGET_ROWS for f in ds.get_fragments())
