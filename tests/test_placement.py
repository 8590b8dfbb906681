"""Whether a cluster's nodes can hold a run's placement groups (streamrl/core/capacity.py),
and the recipe keys that ask for them."""

from __future__ import annotations

import pytest

from streamrl.core.capacity import GroupRequest, bundles, loopback_problem, shortfall

TWO_NODES = [{"CPU": 8, "GPU": 4, "trainer": 1}, {"CPU": 8, "GPU": 4}]


def _learner(ranks: int, strategy: str = "STRICT_PACK", **extra: float) -> GroupRequest:
    return GroupRequest("the learner", "placement.learner", bundles(ranks, {"CPU": 1, "GPU": 1}, extra), strategy)


def _engines(n: int, strategy: str = "PACK", gpus: float = 1) -> GroupRequest:
    return GroupRequest("the engines", "placement.engines", bundles(n, {"CPU": 1, "GPU": gpus}, {}), strategy)


def test_bundles_carry_the_custom_resources_and_drop_zeros() -> None:
    assert bundles(2, {"CPU": 1, "GPU": 0}, {"trainer": 0.5}) == [{"CPU": 1.0, "trainer": 0.5}] * 2
    assert bundles(0, {"CPU": 1}, {}) == []


def test_what_fits_passes() -> None:
    assert shortfall([_learner(4), _engines(4, "SPREAD")], TWO_NODES) is None
    assert shortfall([_learner(4, trainer=0.25), _engines(2, "STRICT_SPREAD")], TWO_NODES) is None


def test_a_total_the_cluster_lacks_names_the_resource_and_who_wants_it() -> None:
    problem = shortfall([_learner(4), _engines(6)], TWO_NODES)
    assert problem == "the run needs GPU 10 in all (the learner 4, the engines 6) but the cluster has 8", problem
    problem = shortfall([_learner(1, rack=1)], TWO_NODES)
    assert problem is not None and problem.startswith("the run needs rack 1 in all (the learner 1) but the cluster has 0")
    assert "ray start --resources" in problem  # a custom resource: says how nodes get one


def test_strategies_are_checked_node_by_node() -> None:
    strict = shortfall([_learner(6)], TWO_NODES)  # 6 GPUs exist, but not on one node
    assert strict is not None and strict.startswith("placement.learner.strategy STRICT_PACK puts the learner "
                                                    "(6 bundles: CPU 6, GPU 6) on one node, but no node has that")
    assert shortfall([_learner(6, "PACK")], TWO_NODES) is None  # PACK may split it
    spread = shortfall([_engines(3, "STRICT_SPREAD")], TWO_NODES)
    assert spread is not None and "each of the engines's 3 bundles" in spread and "only 2 node(s)" in spread
    wide = shortfall([_engines(1, gpus=6)], [{"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4}])
    assert wide is not None and wide.startswith("the engines needs CPU 1, GPU 6 on one node (placement.engines)")
    pinned = shortfall([_learner(2, trainer=1)], TWO_NODES)  # 2 trainer in all, only 1 on the cluster
    assert pinned is not None and "trainer 2" in pinned


@pytest.mark.parametrize("override, needle", [
    ("placement.learner.strategy=TIGHT", "placement.learner.strategy"),
    ("placement.engines.resources={GPU: 1}", "placement.engines.resources: 'GPU' is set by the run"),
    ("placement.engines.resources={rack: 0}", "placement.engines.resources"),
])
def test_bad_placement_keys_exit_2_naming_the_key(override: str, needle: str) -> None:
    from streamrl.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_recipe("recipes/quickstart.yaml", [override])


def test_placement_defaults() -> None:
    from streamrl.recipe import load_recipe

    r = load_recipe("recipes/quickstart.yaml", ["placement.engines.strategy=SPREAD", "placement.learner.resources={trainer: 1}"])
    assert (r.placement.learner.strategy, r.placement.engines.strategy) == ("STRICT_PACK", "SPREAD")
    assert r.placement.learner.resources == {"trainer": 1.0} and r.placement.engines.resources == {}


def test_loopback_on_more_than_one_host_names_network_bind_and_where_each_part_is() -> None:
    one_host = {"the driver and the router": {"10.0.0.1"}, "the engines": {"10.0.0.1"}, "the learner's ranks": set()}
    assert loopback_problem("loopback", one_host) is None
    two = {"the driver and the router": {"10.0.0.1"}, "the engines": {"10.0.0.2", "10.0.0.1"},
           "the learner's ranks": {"10.0.0.1"}}
    problem = loopback_problem("loopback", two)
    assert problem is not None and "set network.bind: node" in problem, problem
    assert "the engines on 10.0.0.1, 10.0.0.2" in problem and "the driver and the router on 10.0.0.1" in problem
    assert loopback_problem("node", two) is None  # each server binds its node's address: reachable
