"""Response-length prediction and length-aware ordering (recipe `rollout.schedule`).

In lockstep every step waits for its longest response; streaming hides that wait but the long
responses still hold engine slots and arrive last. The pool remembers every response length of
every prompt, so the next epoch (or a resumed run) can tell which prompts run long. Three
predictors, best information first:

- history: the same prompt's earlier responses, an exponentially weighted mean of each finished
  group's mean length (the newest group, from the newest policy, weighs most);
- siblings (Seer, arXiv 2511.14617): the group's samples that finished first predict the ones
  still running: at least as long as the longest finished and as what they have written so far;
- fallback: a prompt never seen gets the mean of every response seen (it ties with the other
  unseen prompts: no ranking information, so their drawn order stands).

Ordering works on chunks of `window` prompts drawn from the data source (not a sliding window:
a short prompt waits at most one chunk, never starves behind newer long ones):
- fifo: the drawn order;
- longest_first: longest predicted first. In stream mode the long groups start first and run
  while the short ones train; in lockstep consecutive steps get prompts of similar length, so a
  step waits for a tail of its own size rather than every step waiting for one long prompt;
- tail_batching (RollPacker, arXiv 2509.21009): the chunk's predicted-long prompts (the longest
  `tail_fraction`) go to the end of the chunk, together; the rest keep their drawn order (the data
  mix of most steps stays fifo's; only the long ones are consolidated into a few long rounds).

Pure: no pool, no clock. The rollout worker feeds it, the cluster simulator reuses it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal, TypeVar

import numpy as np

Schedule = Literal["fifo", "longest_first", "tail_batching"]
SCHEDULES: tuple[str, ...] = ("fifo", "longest_first", "tail_batching")
T = TypeVar("T")


class LengthHistory:
    """Per prompt: an exponentially weighted mean of its groups' mean response lengths (tokens).
    `decay` is the old estimate's weight when a new group arrives (0: only the newest group)."""

    def __init__(self, decay: float = 0.5) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be within [0, 1), got {decay!r}")
        self.decay = decay
        self.means: dict[str, float] = {}
        self.groups: dict[str, int] = {}
        self._sum, self._n = 0.0, 0

    def observe(self, prompt_id: str, lengths: Sequence[int]) -> None:
        """A finished group's response lengths (its samples; empty is ignored)."""
        if not len(lengths):
            return
        mean = float(np.mean(lengths))
        old = self.means.get(prompt_id)
        self.means[prompt_id] = mean if old is None else self.decay * old + (1 - self.decay) * mean
        self.groups[prompt_id] = self.groups.get(prompt_id, 0) + 1
        self._sum += float(np.sum(lengths))
        self._n += len(lengths)

    def known(self, prompt_id: str) -> bool:
        return prompt_id in self.means

    def fallback(self) -> float:
        """The mean of every response observed (0 before the first)."""
        return self._sum / self._n if self._n else 0.0

    def predict(self, prompt_id: str) -> float:
        return self.means.get(prompt_id, self.fallback())


def sibling_estimate(finished: Sequence[int], running_so_far: Sequence[int] = ()) -> float:
    """The predicted mean length of a group's samples still running, from the lengths of the ones
    that finished (`finished`, non-empty) and what the running ones have written so far: the
    siblings finished first are the shortest, so the rest are predicted at least as long as the
    longest of them, and each at least as long as it already is."""
    if not len(finished):
        raise ValueError("sibling_estimate needs at least one finished sample")
    floor = float(max(finished))
    if not len(running_so_far):
        return floor
    return float(np.mean([max(floor, float(x)) for x in running_so_far]))


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (as Spearman's rho wants)."""
    a = np.asarray(x, dtype=float)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    for v in np.unique(a):
        tied = a == v
        if tied.sum() > 1:
            r[tied] = r[tied].mean()
    return r


def spearman(predicted: Sequence[float], actual: Sequence[float]) -> float | None:
    """Spearman's rank correlation; None when it is undefined (fewer than 2 pairs, or either side
    constant: a predictor that ties everything ranks nothing)."""
    if len(predicted) != len(actual):
        raise ValueError(f"spearman: {len(predicted)} predictions for {len(actual)} lengths")
    if len(predicted) < 2:
        return None
    rp, ra = ranks(predicted), ranks(actual)
    if rp.std() == 0 or ra.std() == 0:
        return None
    return float(np.corrcoef(rp, ra)[0, 1])


def order(items: Sequence[T], predicted: Sequence[float], schedule: str, tail_fraction: float = 0.25) -> list[T]:
    """One chunk of prompts in the order `schedule` starts them (see the module docstring).
    Ties keep the drawn order (sorts are stable), so unseen prompts stay fifo among themselves."""
    if len(items) != len(predicted):
        raise ValueError(f"order: {len(items)} items, {len(predicted)} predictions")
    idx = list(range(len(items)))
    if schedule == "fifo":
        pass
    elif schedule == "longest_first":
        idx.sort(key=lambda i: -predicted[i])
    elif schedule == "tail_batching":
        if not 0.0 < tail_fraction < 1.0:
            raise ValueError(f"tail_fraction must be within (0, 1), got {tail_fraction!r}")
        k = int(round(tail_fraction * len(items)))
        cut = sorted(predicted, reverse=True)[k - 1] if k else float("inf")
        # prompts tied with the k-th longest join the tail; when every prompt ties there is no tail
        tail = [i for i in idx if predicted[i] >= cut] if cut > min(predicted, default=cut) else []
        tail.sort(key=lambda i: -predicted[i])
        in_tail = set(tail)
        idx = [i for i in idx if i not in in_tail] + tail
    else:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    return [items[i] for i in idx]


def tail_share(batches: Sequence[tuple[Sequence[float], Sequence[float]]], last: float = 0.1) -> float | None:
    """The fraction of rollout time during which only the last `last` of the requests are still
    running (Seer's measure of the long tail). `batches`: per rollout batch (a lockstep step, or
    the groups one streaming step trained on), its requests' (start times, end times). A batch's
    rollout time runs from its first start to its last end; its tail from the moment all but the
    last `last` of its requests had ended. None when no batch has any time."""
    tail = total = 0.0
    for starts, ends in batches:
        if not len(ends):
            continue
        e = np.sort(np.asarray(ends, dtype=float))
        keep = max(1, int(np.ceil(len(e) * (1 - last))))  # requests that end before the tail starts
        span = e[-1] - float(np.min(starts))
        total += span
        tail += e[-1] - e[keep - 1] if keep < len(e) else 0.0
    return tail / total if total > 0 else None


def rank_quality(groups: Sequence[tuple[str, Sequence[int]]], decay: float = 0.5) -> dict[str, float | int | None]:
    """How well each predictor ranks the real lengths of `groups` ((prompt id, sample lengths), in
    the order they started), replayed as a run would have seen them: Spearman's rho of
    - `history`: the prompt's history before the group vs the group's mean length, over the groups
      whose prompt was seen before;
    - `siblings`: the group's shortest sample (the first to finish at a common decode rate) vs the
      mean of the others, over groups of 2 or more;
    - `fallback`: the mean of all earlier responses vs the group's mean, over the groups whose
      prompt was new (None: it ties them all, it ranks nothing);
    with `n_history`, `n_siblings`, `n_fallback` the groups each was measured on."""
    h = LengthHistory(decay)
    cols: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("history", "siblings", "fallback")}
    for prompt_id, lens in groups:
        if not len(lens):
            continue
        mean = float(np.mean(lens))
        pred, actual = cols["history" if h.known(prompt_id) else "fallback"]
        pred.append(h.predict(prompt_id))
        actual.append(mean)
        if len(lens) > 1:
            s = sorted(lens)
            cols["siblings"][0].append(sibling_estimate(s[:1]))
            cols["siblings"][1].append(float(np.mean(s[1:])))
        h.observe(prompt_id, lens)
    out: dict[str, float | int | None] = {k: spearman(p, a) for k, (p, a) in cols.items()}
    out.update({f"n_{k}": len(p) for k, (p, _) in cols.items()})
    return out


def within_share(groups: Sequence[Sequence[int]]) -> float | None:
    """The share of the response-length spread left within one group (one prompt's samples): the
    pooled within-group variance of the lengths' normal scores over their total variance, in [0, 1].
    1: a prompt says nothing about its length; 0.3: which prompt it is explains 70% of the spread.
    Normal scores (the standard-normal quantile of each length's rank) make it the parameter of the
    cluster simulator's Gaussian copula (`Lengths.within`) whatever the lengths' distribution.
    None when undefined: no group of 2 or more, or every length the same."""
    sizes = [len(g) for g in groups if len(g)]
    n, k = sum(sizes), len(sizes)
    if n - k < 1:
        return None
    flat = np.concatenate([np.asarray(g, dtype=float) for g in groups if len(g)])
    normal = statistics.NormalDist()
    z = np.array([normal.inv_cdf((r - 0.5) / n) for r in ranks(flat)])
    total = float(((z - z.mean()) ** 2).sum()) / (n - 1)
    if total <= 0:
        return None
    within, at = 0.0, 0
    for size in sizes:
        part = z[at:at + size]
        within += float(((part - part.mean()) ** 2).sum())
        at += size
    return min(1.0, within / (n - k) / total)
