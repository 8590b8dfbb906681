"""The ledger: every admitted prompt instance is in exactly one state.

Rules (pure; inputs are Arrow tables read from the pool, so this runs anywhere):
- a group with no stored rows is `in_flight`;
- a stored group holds exactly its `n` samples (indices 0..n-1), all with the same status,
  and that status is its state;
- `lost`: a stored group with missing samples or with rows in mixed states;
- `duplicated`: a group admitted twice, or holding a sample row twice;
- `unadmitted`: stored rows whose group was never admitted.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core.types import GROUP_STATES, Ledger


def compute_ledger(admissions: pa.Table, rows: pa.Table) -> Ledger:
    """`admissions`: columns group_id, n. `rows`: columns group_id, sample_index, status."""
    adm = admissions.group_by("group_id").aggregate([("n", "max"), ("n", "count")])
    n_of = dict(zip(adm["group_id"].to_pylist(), adm["n_max"].to_pylist()))
    twice_admitted = set(pc.filter(adm["group_id"], pc.greater(adm["n_count"], 1)).to_pylist())

    per_sample = rows.group_by(["group_id", "sample_index"]).aggregate([("status", "count")])
    dup_rows = set(pc.filter(per_sample["group_id"], pc.greater(per_sample["status_count"], 1)).to_pylist())

    per_group = rows.group_by("group_id").aggregate(
        [("sample_index", "count_distinct"), ("sample_index", "min"), ("sample_index", "max"),
         ("status", "count_distinct"), ("status", "min")]
    )
    counts = dict.fromkeys(GROUP_STATES, 0)
    lost = unadmitted = 0
    stored = set()
    for gid, ndist, smin, smax, nstat, status in zip(
        *(per_group[c].to_pylist() for c in (
            "group_id", "sample_index_count_distinct", "sample_index_min", "sample_index_max",
            "status_count_distinct", "status_min"))
    ):
        stored.add(gid)
        n = n_of.get(gid)
        if n is None:
            unadmitted += 1
        elif nstat != 1 or ndist != n or smin != 0 or smax != n - 1:
            lost += 1
        else:
            counts[status] += 1
    counts["in_flight"] = sum(1 for g in n_of if g not in stored)
    return Ledger(
        admitted=len(n_of),
        lost=lost,
        duplicated=len(twice_admitted | (dup_rows & n_of.keys())),
        unadmitted=unadmitted,
        **counts,
    )
