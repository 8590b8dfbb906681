"""The run's Ray placement groups (recipe `placement`): the learner's ranks, the engines, the
rollout workers; checked against the cluster's nodes before anything starts (streamrl/core/
placement.py), so a request Ray could never satisfy is exit 2 naming the short resource."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.core.capacity import GroupRequest, bundles, loopback_problem, shortfall
from streamrl.recipe import Recipe, learner_layout
from streamrl.runtime import RunFailed

ENGINE_CPUS = 1.0  # an engine actor's CPU slot (embedded engines pin their threads with engines.cpus)
WORKER_CPUS = 0.5  # a rollout worker mostly waits on HTTP
READY_TIMEOUT_S = 180.0


def learner_request(r: Recipe) -> GroupRequest:
    """One bundle per learner rank: a CPU slot, plus a GPU on GPU."""
    return GroupRequest("the learner", "placement.learner",
                        bundles(math.prod(learner_layout(r)), {"CPU": 1, "GPU": 1 if r.learner.num_gpus else 0},
                                r.placement.learner.resources), r.placement.learner.strategy)


def plan(r: Recipe, engine_gpus: float, engine_cpus: float) -> dict[str, GroupRequest]:
    """The run's placement groups: "learner", "engines", "workers" (the workers go where the
    engines' resources are)."""
    pl = r.placement
    return {"learner": learner_request(r),
            "engines": GroupRequest("the engines", "placement.engines",
                                    bundles(r.engines.num, {"CPU": engine_cpus, "GPU": engine_gpus},
                                            pl.engines.resources), pl.engines.strategy),
            "workers": GroupRequest("the rollout workers", "placement.engines",
                                    bundles(r.rollout.workers, {"CPU": WORKER_CPUS}, pl.engines.resources), "PACK")}


def check(groups: dict[str, GroupRequest]) -> None:
    """RunFailed (exit 2) when the cluster's nodes cannot hold the run's placement groups."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    problem = shortfall(list(groups.values()), nodes)
    if problem:
        raise RunFailed(f"placement: {problem}")


def check_hosts(bind: str, groups: dict[str, Any]) -> dict[str, set[str]]:
    """Where the placed groups (what -> placement group) and this driver (the router's process) are: what ->
    the addresses of its nodes. RunFailed (exit 2) when `network.bind` is loopback but that is more than one
    host: checked once Ray placed them, before an engine starts or a step trains (the learner's ranks are up by then)."""
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    driver = ray.get_runtime_context().get_node_id()
    hosts = {"the driver and the router": {ip.get(driver, driver)}}
    for what, pg in groups.items():
        if pg is not None:
            hosts[what] = {ip.get(node, node) for node in placement_group_table(pg)["bundles_to_node_id"].values()}
    problem = loopback_problem(bind, hosts)
    if problem:
        raise RunFailed(f"placement: {problem}")
    return hosts


def group(req: GroupRequest) -> Any:
    """`req`'s placement group (None for no bundles)."""
    return placement_group(req.bundles, strategy=req.strategy) if req.bundles else None


async def ready(pg: Any, what: str) -> None:
    """Wait until Ray placed `pg`; RunFailed if it cannot within READY_TIMEOUT_S (the nodes are busy)."""
    if pg is None:
        return
    try:
        await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), READY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RunFailed(f"placement: Ray could not place {what} within {READY_TIMEOUT_S:g} s (bundles "
                        f"{pg.bundle_specs}); the cluster's free resources are {_free()}") from None


def _free() -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(ray.available_resources().items()) if not k.startswith("node:"))


def on(pg: Any, index: int) -> dict[str, Any]:
    """Actor options that put an actor in bundle `index` of `pg` ({} without a group)."""
    if pg is None:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=index)}
