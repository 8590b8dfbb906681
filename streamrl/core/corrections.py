"""Which off-policy correction a run uses and the settings each one reads: names, defaults and the
`auto` rule. No torch, so the recipe (and every process that only reads recipes: the CLI, rollout
workers) does not pay for importing it; the formulas are streamrl/core/algorithms/offpolicy.py."""

from __future__ import annotations

from typing import Any, Literal

OffPolicy = Literal["none", "tis", "tis_seq", "mis", "decoupled", "icepop"]
SeqRatio = Literal["geometric", "product"]

# The parameters each correction reads, with their defaults (recipe keys `learner.<name>`).
DEFAULTS: dict[str, Any] = {"tis_cap": 2.0, "seq_ratio": "geometric", "mis_level": "token", "mis_low": 0.5,
                            "mis_high": 2.0, "decoupled_cap": None, "icepop_low": 0.5, "icepop_high": 5.0}
USES: dict[str, tuple[str, ...]] = {
    "none": (), "tis": ("tis_cap",), "tis_seq": ("tis_cap", "seq_ratio"),
    "mis": ("mis_level", "mis_low", "mis_high", "seq_ratio"), "decoupled": ("decoupled_cap",),
    "icepop": ("icepop_low", "icepop_high")}
# What `off_policy: auto` becomes when the run mode trains on stale data (stream with
# max_staleness > 0, one_step_off); on-policy modes get `none`. README "Which off-policy correction?".
STALE_DEFAULT: OffPolicy = "tis"


def resolve(off_policy: str, staleness_bound: int) -> str:
    """`auto` -> STALE_DEFAULT when the mode's staleness bound is above 0, else `none`."""
    if off_policy != "auto":
        return off_policy
    return STALE_DEFAULT if staleness_bound > 0 else "none"


def params(off_policy: str, settings: Any) -> dict[str, Any]:
    """The keyword arguments `off_policy` takes, read from `settings` (attributes named as in
    DEFAULTS; None or absent = the default)."""
    if off_policy not in USES:
        raise ValueError(f"unknown off-policy correction {off_policy!r} (one of {', '.join(USES)})")
    out = {}
    for name in USES[off_policy]:
        v = getattr(settings, name, None)
        out[name] = DEFAULTS[name] if v is None else v
    return out
