"""Time travel: which table versions "the pool as of step N" means, from the claims table alone.

Every claim row records the learner `step` whose claim made it and the `pool` / `admissions`
table versions that claim read (pools/claimer.py). The pool as of step N is:

- the `pool` table at the version step N's claim read (its last claim, when a step waited and
  dropped stale groups in earlier ones: the one that formed the batch read the newest version);
- the claims of steps 0..N applied (so `consumed_step = N` selects exactly what step N trained on,
  and groups later steps took still read `complete`);
- the `admissions` table at the version recorded beside it.

A pool-table version V (`--version V`) reads the table at V with the claims whose claim read a
version <= V. Pure: Arrow tables in, versions out; pools/asof.py does the reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


class AsOfError(ValueError):
    """A step or version the pool cannot be read as of (the message says what it can)."""


@dataclass(frozen=True)
class AsOf:
    """Where to read: `pool_version` of the pool table, `admissions_version` (None: not recorded),
    and the claims that apply (`through_step`, or `through_version` for a bare table version)."""

    pool_version: int
    admissions_version: int | None = None
    through_step: int | None = None
    through_version: int | None = None

    def label(self) -> str:
        at = f"step {self.through_step}" if self.through_step is not None else f"version {self.pool_version}"
        return f"as of {at} (pool table version {self.pool_version})"


def recorded_steps(claims: pa.Table) -> tuple[int, int] | None:
    """(first, last) learner step whose claim recorded the table versions it read; None if none did."""
    if "pool_version" not in claims.column_names or claims.num_rows == 0:
        return None
    steps = pc.filter(claims["step"], pc.is_valid(claims["pool_version"]))
    if len(steps) == 0:
        return None
    lo, hi = pc.min_max(steps).values()
    return int(lo.as_py()), int(hi.as_py())


def resolve_step(claims: pa.Table, step: int) -> AsOf:
    """The versions step `step`'s claim read. AsOfError names the run's step range otherwise."""
    span = recorded_steps(claims)
    if span is None:
        raise AsOfError("this pool's claims record no table versions (no step has claimed yet, or the pool was "
                        "written before StreamRL recorded them), so it cannot be read as of a step")
    if not span[0] <= step <= span[1]:
        raise AsOfError(f"step {step} is outside this run: its steps with recorded pool versions are "
                        f"{span[0]}..{span[1]}")
    mine = claims.filter(pc.and_(pc.equal(claims["step"], step), pc.is_valid(claims["pool_version"])))
    if mine.num_rows == 0:
        raise AsOfError(f"step {step} made no claim in this pool (steps {span[0]}..{span[1]} did, "
                        "but not this one: a resumed run retrains steps it claimed before)")
    adm = pc.max(mine["admissions_version"]).as_py()
    return AsOf(int(pc.max(mine["pool_version"]).as_py()), None if adm is None else int(adm), through_step=step)


def resolve_version(claims: pa.Table, pool_version: int) -> AsOf:
    """A bare pool-table version: the admissions version the newest claim at or before it recorded."""
    adm = None
    if "pool_version" in claims.column_names and claims.num_rows:
        before = claims.filter(pc.less_equal(claims["pool_version"], pool_version))
        adm = pc.max(before["admissions_version"]).as_py() if before.num_rows else None
    return AsOf(pool_version, None if adm is None else int(adm), through_version=pool_version)


def claims_as_of(claims: pa.Table, at: AsOf) -> pa.Table:
    """The claims that had been made at `at`. Claims stored before steps were recorded (null `step`)
    predate every recorded one, so they always apply."""
    if at.through_step is not None:
        keep = pc.less_equal(claims["step"], at.through_step)
    elif at.through_version is not None:
        keep = pc.less_equal(claims["pool_version"], at.through_version)
    else:
        return claims
    return claims.filter(pc.fill_null(keep, True))
