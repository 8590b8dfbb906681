"""The rollout workers as a crew (streamrl/runtime/workers.py), on a real local Ray instance with
small actors that speak the worker's protocol: a worker whose actor dies is started again with
its newest dataset position and the run's version, its running totals carry on, `generate` asks
the new one for its share, nothing waits on a worker Ray cannot place yet, and one not placed for
long is handed over to the others. Also when the driver lets streaming workers admit beyond the
run's budget."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest


class _Toy:
    """A rollout worker's protocol, counting groups instead of making them."""

    def __init__(self, index: int, version: int, state: dict[str, Any] | None, die_in_generate: bool = False,
                 die_at_start: bool = False) -> None:
        if die_at_start:
            os._exit(1)
        self.i, self.v, self.state, self.eta = index, version, state or {}, None
        self.made, self.stopping, self.die_in_generate, self.split = 0, False, die_in_generate, None
        self.engines: list[str] | None = None

    async def ready(self) -> dict[str, Any]:
        return await self.report()

    async def report(self) -> dict[str, Any]:
        return {"producer": f"toy-{self.i}", "version": self.v, "eta": [self.eta], "started": self.made,
                "inflight": 0, "accepted": self.made, "gen_tokens": 10 * self.made, "drops": {"short": self.made},
                "exhausted": False, "data_state": {"pos": self.state.get("pos", 0) + self.made},
                "born_with": dict(self.state), "split": self.split, "engines": self.engines}

    async def set_engines(self, urls: list[str]) -> None:
        self.engines = urls

    async def set_split(self, live_index: int, live: int, reserved: int) -> None:
        self.split = [live_index, live, reserved]

    async def set_version(self, version: int, eta: int | None = None) -> None:
        self.v, self.eta = max(self.v, version), eta

    async def generate(self, k: int) -> dict[str, Any]:
        if self.die_in_generate:
            os._exit(1)
        self.made += k
        return await self.report()

    async def stream(self) -> dict[str, Any]:
        while not self.stopping:
            self.made += 1
            await asyncio.sleep(0.01)
        return await self.report()

    async def stop(self) -> dict[str, Any]:
        self.stopping = True
        return await self.report()


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from streamrl.connectors.sglang.launcher import ensure_ray

    here = str(Path(__file__).parent)  # the actors' class lives in this module
    ensure_ray(num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    try:
        yield
    finally:
        ray.shutdown()


def _crew(tmp_path: Path, n: int, spawned: list[tuple[int, int, Any]], placeable: Any = lambda k: True,
          dies: Any = lambda k: False, dies_at_start: Any = lambda k: False, handover_s: float = 60.0) -> Any:
    import ray

    from streamrl.runtime.runlog import RunLog
    from streamrl.runtime.workers import Crew

    toy = ray.remote(num_cpus=0, max_concurrency=100)(_Toy)

    def spawn(i: int, version: int, state: dict[str, Any] | None) -> Any:
        k = len(spawned)  # the k-th actor made
        spawned.append((i, version, state))
        opts = {} if placeable(k) else {"resources": {"no_such_node": 1}}
        return toy.options(**opts).remote(i, version, state, dies(k), dies_at_start(k))

    return Crew(spawn, [None] * n, version=3, max_staleness=2, log=RunLog(tmp_path, echo=False), handover_s=handover_s)


async def _until(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


def test_a_dead_streaming_worker_starts_again_where_it_stood_and_its_totals_carry_on(tmp_path: Path,
                                                                                      ray_local: None) -> None:
    import ray

    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 2, spawned)
        await crew.start()
        await crew.set_engines(["http://e0", "http://e1"])  # known once the engines are up, after the workers
        crew.start_streaming()
        await asyncio.sleep(0.3)
        before = await crew.reports()
        assert [r["engines"] for r in before] == [["http://e0", "http://e1"]] * 2
        assert [r["eta"] for r in before] == [[2], [2]] and all(r["accepted"] > 0 for r in before)
        await crew.set_version(7)
        ray.kill(crew.actors[0], no_restart=True)
        await _until(lambda: _restarted(crew))
        assert spawned[2][:2] == (0, 7)  # worker 0 again, at the run's version
        assert spawned[2][2] == before[0]["data_state"]  # from its newest reported dataset position
        await _until(lambda: _up(crew, 0))
        await asyncio.sleep(0.2)
        after = await crew.reports()
        new = after[0]["born_with"]
        assert new == before[0]["data_state"] and after[0]["eta"] == [2]
        assert after[0]["engines"] == ["http://e0", "http://e1"]  # a restarted worker learns them too
        assert after[0]["accepted"] > before[0]["accepted"]  # the dead worker's totals plus the new one's
        assert after[0]["drops"]["short"] == after[0]["accepted"]
        assert not await crew.check_streams()  # both stream again
        await crew.stop()
        await _until(crew.check_streams)  # stopped: every stream returns
        assert crew.restarts == 1
        assert "rollout worker 0 died" in (tmp_path / "run.log").read_text()

    asyncio.run(main())


async def _restarted(crew: Any, n: int = 1) -> bool:
    await crew.check_streams()
    return crew.restarts == n


async def _up(crew: Any, i: int) -> bool:
    return crew.up(i)


def test_generate_asks_a_restarted_worker_for_its_whole_share(tmp_path: Path, ray_local: None) -> None:
    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 2, spawned, dies=lambda k: k == 1)  # worker 1's first actor dies in generate
        await crew.start()
        reports = await asyncio.wait_for(crew.generate([3, 2]), 60)
        assert [r["accepted"] for r in reports] == [3, 2]
        assert [i for i, _, _ in spawned] == [0, 1, 1] and crew.restarts == 1

    asyncio.run(main())


def test_nothing_waits_on_a_worker_ray_cannot_place_yet(tmp_path: Path, ray_local: None) -> None:
    import ray

    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 2, spawned, placeable=lambda k: k < 2)  # the restarted worker finds no node
        await crew.start()
        crew.start_streaming()
        await asyncio.sleep(0.2)
        ray.kill(crew.actors[1], no_restart=True)
        await _until(lambda: _restarted(crew))
        t0 = time.monotonic()
        await crew.set_version(9)
        reports = await crew.reports()
        assert time.monotonic() - t0 < 10  # not blocked on the actor no node can take
        assert not crew.up(1) and crew.up(0)
        assert reports[0]["version"] == 9 and reports[1]["producer"] == "toy-1"  # worker 1: its last report
        await asyncio.wait_for(crew.stop(), 10)
        assert "rollout worker 1 was not placed again" in (tmp_path / "run.log").read_text()

    asyncio.run(main())


def test_a_worker_not_placed_again_is_handed_over_to_the_live_ones(tmp_path: Path, ray_local: None) -> None:
    """Worker 2 of 3 dies and no node takes it: after handover_s the live workers 0 and 1 split
    the capacity less what worker 2 had started, and a worker 0 restarted later gets its part again."""
    import ray

    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 3, spawned, placeable=lambda k: k < 3 or k == 4, handover_s=1.0)  # k=3: worker 2 again
        await crew.start()
        crew.start_streaming()
        await asyncio.sleep(0.2)
        before = await crew.reports()
        ray.kill(crew.actors[2], no_restart=True)
        await _until(lambda: _restarted(crew))
        await crew.hand_over_lost()
        assert not crew.handed_over  # not lost for long enough yet
        await asyncio.sleep(1.1)
        await crew.hand_over_lost()
        assert crew.handed_over == {2}
        started = before[2]["started"]
        assert started > 0
        reports = await crew.reports()
        assert [r["split"] for r in reports[:2]] == [[0, 2, started], [1, 2, started]]
        assert "rollout worker(s) 2 not placed again for 1 s: workers 0, 1 take over" in (tmp_path / "run.log").read_text()
        await crew.hand_over_lost()  # nothing more to hand over
        ray.kill(crew.actors[0], no_restart=True)  # worker 0 dies too: its new actor (k=4) gets its part
        await _until(lambda: _restarted(crew, 2))
        await _until(lambda: _up(crew, 0))
        assert (await crew.reports())[0]["split"] == [0, 2, started]
        await asyncio.wait_for(crew.stop(), 10)

    asyncio.run(main())


def test_generate_hands_a_lost_workers_share_to_a_live_one(tmp_path: Path, ray_local: None) -> None:
    """Lockstep: worker 1 dies in generate and no node takes it again; after handover_s worker 0
    makes worker 1's share as well, at every step, so the run does not wait for the node."""

    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 2, spawned, placeable=lambda k: k < 2, dies=lambda k: k == 1, handover_s=1.0)
        await crew.start()
        t0 = time.monotonic()
        reports = await asyncio.wait_for(crew.generate([3, 2]), 30)
        assert time.monotonic() - t0 >= 1.0  # it waited handover_s for worker 1 first
        assert [r["accepted"] for r in reports] == [5, 0]  # worker 0: its 3 and worker 1's 2
        assert not crew.up(1) and crew.restarts == 1
        reports = await asyncio.wait_for(crew.generate([2, 2]), 30)  # the next step: at once
        assert [r["accepted"] for r in reports] == [9, 0]
        assert "rollout worker 1 not placed again for 1 s: worker 0 makes its 2 groups" in (
            tmp_path / "run.log").read_text()

    asyncio.run(main())


def test_a_worker_that_dies_every_time_it_starts_ends_the_run(tmp_path: Path, ray_local: None) -> None:
    import ray

    from streamrl.runtime import RunFailed
    from streamrl.runtime.workers import RESTARTS_PER_WORKER

    async def main() -> None:
        spawned: list[tuple[int, int, Any]] = []
        crew = _crew(tmp_path, 1, spawned, dies_at_start=lambda k: k > 0)  # only the first actor starts
        await crew.start()
        crew.start_streaming()
        ray.kill(crew.actors[0], no_restart=True)
        with pytest.raises(RunFailed, match=f"rollout worker 0 died {RESTARTS_PER_WORKER + 1} times"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                await crew.check_streams()
                await asyncio.sleep(0.05)
        assert len(spawned) == RESTARTS_PER_WORKER + 1

    asyncio.run(main())


class _StarvedCrew:
    """What `Steps` sees of the crew while it waits for a batch: reports, the budget calls."""

    def __init__(self, reports: list[dict[str, Any]]) -> None:
        self.rows, self.added, self.restarts = reports, [], 0

    async def reports(self) -> list[dict[str, Any]]:
        return self.rows

    async def add_budget(self, groups: int) -> None:
        self.added.append(groups)

    async def hand_over_lost(self) -> None:
        pass

    async def check_streams(self) -> bool:
        return False


def _runtime(tmp_path: Path, crew: Any, learner: Any = None) -> Any:
    from types import SimpleNamespace

    from streamrl.recipe import load_recipe
    from streamrl.runtime.resume import Resumed
    from streamrl.runtime.runlog import RunLog
    from streamrl.runtime.steps import Steps

    r = load_recipe(Path(__file__).parents[1] / "recipes" / "quickstart.yaml")
    svc = SimpleNamespace(r=r, log=RunLog(tmp_path, echo=False), resumed=Resumed(), crew=crew, learner=learner,
                          broadcaster=None, engines=SimpleNamespace(restarts=0), dir=tmp_path)
    return Steps(svc)  # type: ignore[arg-type]


@pytest.mark.parametrize("rows, starved", [
    ([{"budget_spent": True, "inflight": 0}, {"budget_spent": True, "inflight": 0}], True),
    ([{"budget_spent": True, "inflight": 0}, {"budget_spent": True, "inflight": 2}], False),  # a group may finish
    ([{"budget_spent": True, "inflight": 0}, {"budget_spent": False, "inflight": 0}], False),  # one may admit more
], ids=["starved", "in-flight", "room-left"])
def test_streaming_admits_one_more_step_only_when_no_batch_can_form(tmp_path: Path, rows: list[dict[str, Any]],
                                                                    starved: bool) -> None:
    """Each poll that finds every worker's budget spent with nothing in flight grows the budget by
    one step's claim (the fake's reports never change, so both polls find it so)."""
    crew = _StarvedCrew(rows)
    rt = _runtime(tmp_path, crew)

    async def main() -> None:
        await rt._grow_budget_if_starved(7)
        await rt._grow_budget_if_starved(7)

    asyncio.run(main())
    assert crew.added == ([rt.per_step] * 2 if starved else [])
    assert rt.per_step == 16  # the quick-start recipe's groups_per_step, not over-sampled
    log = tmp_path / "run.log"
    assert ("admitting 16 more" in (log.read_text() if log.exists() else "")) == starved


def test_stale_drops_raise_the_budget_and_the_wait_counts_every_poll(tmp_path: Path) -> None:
    """Every group the learner drops as stale (1 while it waited for a batch, 1 more in the claim
    that formed it) adds one to what the workers may admit; the step's wait is the whole time the
    driver polled, not only the learner's last call."""
    from types import SimpleNamespace

    class Learner:
        def __init__(self) -> None:
            self.calls = 0

        async def _answer(self) -> dict[str, Any] | None:
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.3)  # no batch within the poll
                return None
            return {"policy_version": 1, "groups": ["a", "b"], "dropped_ids": ["y"], "dropped_stale": 1,
                    "stale_dropped_total": 2, "wait_s": 0.01}

        async def _dropped(self) -> int:
            return 1

    learner = Learner()
    learner.train_step = SimpleNamespace(remote=lambda *a: learner._answer())  # type: ignore[attr-defined]
    learner.stale_dropped = SimpleNamespace(remote=lambda: learner._dropped())  # type: ignore[attr-defined]
    crew = _StarvedCrew([{"budget_spent": False, "inflight": 3, "gen_tokens": 5, "drops": {}}])
    rt = _runtime(tmp_path, crew, learner)
    m = asyncio.run(rt.train_step(0, streams=["a stream"]))
    assert crew.added == [1, 1]
    assert m["wait_s"] >= 0.3, m["wait_s"]


@pytest.mark.parametrize("workers, external, lost", [(2, False, [1]), (3, True, [0]), (4, False, [1, 3]), (3, True, [2])])
def test_handing_over_lost_workers_keeps_the_total_and_grows_with_every_version(workers, external, lost):
    """Lost workers keep what they started; the live ones split the rest of the capacity: the
    parts still sum to the capacity (the staleness bound holds), no live part shrinks, and the
    live parts together grow by a whole step's groups per version (so a batch can always form)."""
    from streamrl.core import staleness

    gps, eta, lost_at = 8, 2, 5
    shares = staleness.capacity_shares(workers, external)
    reserved = sum(staleness.capacity_share(staleness.admission_capacity(lost_at, eta, gps), i, shares) for i in lost)
    live = [i for i in range(workers) if i not in lost]
    ext = lambda total: staleness.capacity_share(total, workers, shares) if external else 0  # noqa: E731
    previous = None
    for v in range(lost_at, lost_at + 30):
        total = staleness.admission_capacity(v, eta, gps)
        parts = [staleness.handed_over_share(total, workers, external, reserved, k, len(live)) for k in range(len(live))]
        assert sum(parts) + reserved + ext(total) == total
        for k, i in enumerate(live):
            assert parts[k] >= staleness.capacity_share(total, i, shares)
        if previous is not None:
            assert sum(parts) - previous == gps - (ext(total) - ext(staleness.admission_capacity(v - 1, eta, gps)))
        previous = sum(parts)


def test_a_rollout_worker_takes_its_handed_over_share(tmp_path: Path) -> None:
    """RolloutWorker's capacity follows set_split: its static share before, its part of what the
    lost workers did not start after, nothing new when it is itself handed over."""
    from streamrl.core import staleness
    from streamrl.recipe import load_recipe
    from streamrl.runtime.rollout import RolloutWorker

    r = load_recipe(Path(__file__).parents[1] / "recipes" / "quickstart.yaml", ["rollout.workers=3"])
    w = RolloutWorker.__new__(RolloutWorker)  # the capacity rule only: no pool, router or engine
    w.r, w.index, w.split, w.version, w.max_staleness, w.per_step = r, 1, None, 4, 2, 16
    w.budget, w._wake = 10**6, asyncio.Event()
    total = staleness.admission_capacity(4, 2, 16)  # 112
    assert w.capacity() == staleness.capacity_share(total, 1, 3) == 37
    w.set_split(0, 2, 30)  # worker 2 lost after starting 30 groups; this one is live worker 0 of 2
    assert w.capacity() == (total - 30 + 1) // 2 == 41 and w._wake.is_set()
    w.set_split(-1, 0, 0)
    assert w.capacity() == 0
