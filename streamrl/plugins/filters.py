"""Group filters (recipe `filters: [{fn: "streamrl.plugins.filters:nonzero_std"}, ...]`) and the
over-sampling selection.

A filter is a plain function `fn(group: SampleGroup, **args) -> bool`; True keeps the group.
A `style: slime` filter is slime's dynamic-sampling filter `fn(args, samples, **kwargs)`
(streamrl/plugins/slime.py). A dropped group is still written to the pool (status `dropped`,
`drop_reason` = the filter's name, or a slime filter's reason), so what a filter threw away can
be queried later.
"""

from __future__ import annotations

import inspect
import logging
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from streamrl.core.types import Sample, SampleGroup
from streamrl.plugins.slime import Dropped, SlimeFilter
from streamrl.recipe import FnRef, resolve_fn

log = logging.getLogger("streamrl.plugins.filters")


def _scored(s: Sample) -> bool:
    return not s.failed and s.error is None and s.reward is not None


def reward_std(group: SampleGroup) -> float:
    """Population std of the rewards of the scored samples (0.0 for fewer than two)."""
    rewards = [s.reward for s in group.samples if _scored(s)]
    # statistics works in exact fractions, so equal rewards give exactly 0.0 (numpy's
    # float mean of [0.1, 0.1, 0.1] leaves a ~1e-17 std that would pass a `> 0` test).
    return float(statistics.pstdev(rewards)) if len(rewards) >= 2 else 0.0


def nonzero_std(group: SampleGroup, **_: object) -> bool:
    """DAPO / slime dynamic sampling: keep groups whose scored rewards are not all equal, since
    a group with one reward value has zero advantage everywhere and teaches nothing."""
    return reward_std(group) > 0.0


def min_scored(group: SampleGroup, fraction: float = 1.0, **_: object) -> bool:
    """Keep groups where at least `fraction` of the samples were scored without error."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"min_scored: fraction={fraction!r}; use a number in [0, 1] (filters[].args.fraction)")
    if not group.samples:
        return False
    return sum(_scored(s) for s in group.samples) >= fraction * len(group.samples)


class FilterHub:
    """The recipe's filters in order; `check` returns the first one's drop reason."""

    def __init__(self, refs: list[FnRef], slime_args: Any = None, decode: Callable[[list[int]], str] | None = None,
                 tokenizer: Any = None) -> None:
        """`slime_args`: the namespace `style: slime` filters get (streamrl.plugins.slime.slime_args);
        `decode`: token ids -> text, for their samples' `response`; `tokenizer` renders a message-list
        prompt as slime does."""
        self.filters: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []
        for i, ref in enumerate(refs):
            try:
                fn = resolve_fn(ref.fn)
            except ValueError as e:
                raise ValueError(f"filters[{i}].fn {ref.fn!r}: {e}") from None
            if inspect.iscoroutinefunction(fn):
                raise ValueError(f"filters[{i}].fn {ref.fn!r} is async; filters are plain functions "
                                 "fn(group, **args) -> bool")
            name = getattr(fn, "__name__", ref.fn.rpartition(":")[2])
            if ref.style == "slime":
                self.filters.append((name, SlimeFilter(fn, slime_args, ref.args, decode, tokenizer), {}))
                continue
            _check_args(fn, ref, i)
            self.filters.append((name, fn, dict(ref.args)))
        self._warned: set[int] = set()

    def check(self, group: SampleGroup) -> str | None:
        """None to keep the group, else the drop reason: the name of the first filter that
        said False, or `NAME_error` when that filter raised or returned a non-bool (`error` below
        then says what happened; the rollout worker stops the run when every group keeps failing)."""
        return self.check_error(group)[0]

    def check_error(self, group: SampleGroup) -> tuple[str | None, str | None]:
        """(drop reason or None, the filter's error or None)."""
        for i, (name, fn, args) in enumerate(self.filters):
            try:
                keep = fn(group, **args)
                if isinstance(keep, Dropped):  # a slime-style filter's keep=False with its reason
                    return keep.reason, None
                if not isinstance(keep, (bool, np.bool_)):
                    raise TypeError(f"returned {type(keep).__name__} {keep!r:.80}; a filter returns True to "
                                    "keep the group, False to drop it")
            except Exception as e:  # noqa: BLE001 - a filter bug drops the group; failing groups stop the run
                if i not in self._warned:  # once per filter: it will likely fail for every group
                    self._warned.add(i)
                    log.warning("filter %s failed on group %s (%s: %s); dropping the groups it fails on with "
                                "reason %s_error", name, group.group_id, type(e).__name__, e, name)
                return f"{name}_error", f"filter {name}: {type(e).__name__}: {e}"
            if not keep:
                return name, None
        return None, None


def _check_args(fn: Callable[..., Any], ref: FnRef, i: int) -> None:
    """Recipe args that the filter cannot take are typos: say so at start-up, not per group."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = [k for k, p in list(params.items())[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(ref.args) - set(named))
    if unknown:
        raise ValueError(f"filters[{i}].args {unknown} are not parameters of {ref.fn} (it takes {named}); fix the "
                         "spelling or remove them")


def top_by_reward_std(groups: list[SampleGroup], k: int) -> tuple[list[SampleGroup], list[SampleGroup]]:
    """slime's over-sampling selection: keep the k groups with the largest reward std, ties
    going to the earlier (older) group. Returns (kept, rest), each in input order."""
    if k < 0:
        raise ValueError(f"top_by_reward_std: k={k}; it must be >= 0")
    stds = [reward_std(g) for g in groups]
    best = set(sorted(range(len(groups)), key=lambda j: (-stds[j], j))[:k])
    return [g for j, g in enumerate(groups) if j in best], [g for j, g in enumerate(groups) if j not in best]
