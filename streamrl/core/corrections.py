"""The recipe's choices for the RL step, without torch: which advantage estimator, policy loss and
off-policy correction a run uses (a built-in name or a function path `pkg.mod:fn`), the settings
each built-in correction reads, and the `auto` rule. The recipe (and every process that only reads
recipes: the CLI, rollout workers) does not pay for importing torch; the formulas and the plug-in
contracts are in streamrl/core/algorithms/ (step.py)."""

from __future__ import annotations

import typing
from typing import Any, Literal

Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
Loss = Literal["ppo"]
OffPolicy = Literal["none", "tis", "tis_seq", "mis", "decoupled", "icepop"]
SeqRatio = Literal["geometric", "product"]

# Recipe key (`learner.<key>`) -> the built-in names it accepts besides a function path.
CHOICES: dict[str, tuple[str, ...]] = {"advantage": typing.get_args(Advantage), "loss": typing.get_args(Loss),
                                       "off_policy": ("auto", *typing.get_args(OffPolicy))}
# How the step calls a user function named there (positional arguments; step.py has the contracts),
# so a recipe naming a function of the wrong shape fails when it is loaded.
CALLED_WITH: dict[str, tuple[str, ...]] = {"advantage": ("rewards",), "loss": ("logp", "inputs", "cfg"),
                                           "off_policy": ("prox", "behav", "mask")}

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


def is_fn_path(choice: object) -> bool:
    """A choice naming a user function (`pkg.mod:fn`) rather than a built-in."""
    return isinstance(choice, str) and ":" in choice


def resolve(off_policy: str, max_staleness: int) -> str:
    """`auto` -> STALE_DEFAULT when the mode's staleness bound is above 0, else `none`."""
    if off_policy != "auto":
        return off_policy
    return STALE_DEFAULT if max_staleness > 0 else "none"


def params(off_policy: str, settings: Any) -> dict[str, Any]:
    """The keyword arguments `off_policy` takes, read from `settings` (attributes named as in
    DEFAULTS; None or absent = the default). A user function takes none of them."""
    if is_fn_path(off_policy):
        return {}
    if off_policy not in USES:
        raise ValueError(f"unknown off-policy correction {off_policy!r} (one of {', '.join(USES)})")
    out = {}
    for name in USES[off_policy]:
        v = getattr(settings, name, None)
        out[name] = DEFAULTS[name] if v is None else v
    return out
