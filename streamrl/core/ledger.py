"""The ledger: every admitted prompt instance is in exactly one state.

Rules (pure; inputs are Arrow tables read from the pool, so this runs anywhere):
- a group with no stored rows is `in_flight`;
- a stored group holds exactly its `n` samples (indices 0..n-1), all with the same status,
  and that status is its state, unless a claim decided it (consumed, or dropped by the
  learner): then the claim's status is its state;
- `lost`: a stored group with missing samples or with rows in mixed states; a claim on a group
  that was not stored complete, or whose rows are gone;
- `duplicated`: a group admitted twice, holding a sample row twice, or claimed twice;
- `unadmitted`: stored rows whose group was never admitted.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from streamrl.core.claims import apply_claims
from streamrl.core.types import GROUP_STATES, Ledger


def compute_ledger(admissions: pa.Table, rows: pa.Table, claims: pa.Table | None = None) -> Ledger:
    """`admissions`: columns group_id, n. `rows`: columns group_id, sample_index, status, as
    stored. `claims`: the claims table (group_id, status, ...), if the pool has one."""
    adm = admissions.group_by("group_id").aggregate([("n", "max"), ("n", "count")])
    n_of = dict(zip(adm["group_id"].to_pylist(), adm["n_max"].to_pylist()))
    twice_admitted = set(pc.filter(adm["group_id"], pc.greater(adm["n_count"], 1)).to_pylist())

    per_sample = rows.group_by(["group_id", "sample_index"]).aggregate([("status", "count")])
    dup_rows = set(pc.filter(per_sample["group_id"], pc.greater(per_sample["status_count"], 1)).to_pylist())

    bad_claims: set[str] = set()
    twice_claimed: set[str] = set()
    if claims is not None and claims.num_rows:
        per_claim = claims.group_by("group_id").aggregate([("status", "count")])
        twice_claimed = set(pc.filter(per_claim["group_id"], pc.greater(per_claim["status_count"], 1)).to_pylist())
        claimed = per_claim["group_id"]
        on_claimed = pc.is_in(rows["group_id"], value_set=claimed)
        bad_claims = set(pc.filter(rows["group_id"], pc.and_(on_claimed, pc.not_equal(rows["status"], "complete")))
                         .to_pylist())
        bad_claims |= set(claimed.to_pylist()) - set(pc.filter(rows["group_id"], on_claimed).to_pylist())
        rows = apply_claims(rows, claims)

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
        elif nstat != 1 or ndist != n or smin != 0 or smax != n - 1 or gid in bad_claims:
            lost += 1
        else:
            counts[status] += 1
    gone = bad_claims - stored  # claimed, but their rows are not in the pool any more
    lost += len(gone)
    counts["in_flight"] = sum(1 for g in n_of if g not in stored and g not in gone)
    return Ledger(
        admitted=len(n_of),
        lost=lost,
        duplicated=len(twice_admitted | ((dup_rows | twice_claimed) & n_of.keys())),
        unadmitted=unadmitted,
        **counts,
    )
