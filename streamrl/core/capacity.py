"""Where a run's actors go on a Ray cluster: the placement groups it asks for (one bundle of
resources per learner rank, per engine, per rollout worker) and whether a cluster can hold them,
checked before anything starts so that a request Ray would leave pending forever is an error
naming the short resource instead.

The check is necessary, not sufficient: it compares every resource's total with the cluster's,
each group's strategy with the nodes one by one (STRICT_PACK: one node holds the whole group;
STRICT_SPREAD: as many nodes as bundles each hold one; PACK / SPREAD: every bundle fits some
node), but not how groups compete for the same node. What Ray still cannot place stays pending.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
Resources = Mapping[str, float]


@dataclass(frozen=True)
class GroupRequest:
    """One placement group: `what` it holds ("the learner"), the recipe `key` that places it."""

    what: str
    key: str
    bundles: list[dict[str, float]]
    strategy: str = "PACK"


def bundles(count: int, each: Resources, extra: Resources) -> list[dict[str, float]]:
    """`count` bundles of `each` plus the recipe's `extra` (custom resources that pin a group to
    the nodes started with them); resources of 0 are left out (Ray refuses empty bundles)."""
    one = {k: float(v) for k, v in {**each, **extra}.items() if v}
    return [dict(one) for _ in range(count)]


def _fmt(res: Resources) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())) or "nothing"


def _fits(need: Resources, have: Resources) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _sum(items: Sequence[Resources]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in items:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + v
    return out


def shortfall(requests: Sequence[GroupRequest], nodes: Sequence[Resources]) -> str | None:
    """Why `requests` cannot be placed on `nodes` (each node's total resources), or None."""
    need = _sum([b for r in requests for b in r.bundles])
    have = _sum(nodes)
    for res in sorted(need):
        if need[res] > have.get(res, 0.0) + 1e-9:
            parts = [f"{r.what} {_sum(r.bundles).get(res, 0.0):g}" for r in requests if _sum(r.bundles).get(res)]
            hint = " (a custom resource: start the nodes that should take it with `ray start --resources`)" \
                if res not in ("CPU", "GPU", "memory", "object_store_memory") else ""
            return f"the run needs {res} {need[res]:g} in all ({', '.join(parts)}) but the cluster has " \
                   f"{have.get(res, 0.0):g}{hint}"
    for r in requests:
        if not r.bundles:
            continue
        if r.strategy == "STRICT_PACK":
            total = _sum(r.bundles)
            if not any(_fits(total, n) for n in nodes):
                return (f"{r.key}.strategy STRICT_PACK puts {r.what} ({len(r.bundles)} bundles: {_fmt(total)}) on one "
                        f"node, but no node has that; the nodes have: {'; '.join(_fmt(n) for n in nodes)}")
        elif r.strategy == "STRICT_SPREAD":
            largest = max(r.bundles, key=lambda b: sorted(b.items()))
            able = sum(_fits(largest, n) for n in nodes)
            if able < len(r.bundles):
                return (f"{r.key}.strategy STRICT_SPREAD puts each of {r.what}'s {len(r.bundles)} bundles "
                        f"({_fmt(largest)}) on a node of its own, but only {able} node(s) can hold one")
        else:
            for b in r.bundles:
                if not any(_fits(b, n) for n in nodes):
                    return (f"{r.what} needs {_fmt(b)} on one node ({r.key}), but no node has that; the nodes "
                            f"have: {'; '.join(_fmt(n) for n in nodes)}")
    return None


def loopback_problem(bind: str, hosts: Mapping[str, set[str]]) -> str | None:
    """With `network.bind: loopback` every server (router, engines, the weight group's store) listens on
    127.0.0.1 of its own machine, which no other machine reaches: a run whose parts landed on more than
    one host (`hosts`: what -> the addresses of the nodes it runs on) could not connect them. None if it can."""
    if bind != "loopback" or len(set().union(*hosts.values())) <= 1:
        return None
    where = "; ".join(f"{what} on {', '.join(sorted(ips))}" for what, ips in hosts.items() if ips)
    return (f"network.bind is loopback (every server on 127.0.0.1), but the run's parts are on more than one host "
            f"({where}): the router could not reach the engines nor the engines the weight group; set network.bind: "
            "node (each server binds its node's cluster address, still behind the run's keys)")
