"""The run's rollout workers as one crew. A worker whose actor dies (its node lost, its process
killed) is started again in its placement bundle, where Ray places it as soon as a node has the
resources again (the node back, or another one); it then picks up its groups from the pool
(`RolloutWorker._resume`: partial groups continue from their saved tokens, groups admitted but
never stored start again, admitted prompts are not drawn again). Until then the run goes on with
the workers that are up: nothing waits on a worker that is not placed yet.

A streaming worker not placed again within `handover_s` (its node is gone for good, say) is
handed over: admission capacity is split between the other workers, less the groups the lost one
had started, as its static share would otherwise stay unused and, a few steps later, no batch could
form (each step claims more than the survivors' shares grow by). When it is placed after all it
finishes its groups from the pool and starts no new ones. In lockstep and one-step-off, the share
of a step that such a worker would make goes to a live worker instead (each step anew: once it is
placed again it makes its own shares again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from streamrl.runtime import RunFailed
from streamrl.runtime.runlog import RunLog

# A worker's report keys that are not running totals (the rest of its numbers are, and a restarted
# worker's totals continue from those of the worker it replaces).
_STATE = ("version", "started", "inflight")

RESTARTS_PER_WORKER = 10  # beyond this a worker's deaths are not a lost node: its start-up itself fails
HANDOVER_S = 60.0  # a worker not placed again this long is handed over (Ray needs ~10 s to call a node dead)

Spawn = Callable[[int, int, "dict[str, Any] | None"], Any]  # (index, version, dataset position) -> actor


class Crew:
    def __init__(self, spawn: Spawn, states: list[dict[str, Any] | None], version: int, max_staleness: int, log: RunLog,
                 handover_s: float = HANDOVER_S) -> None:
        self.spawn, self.max_staleness, self.log, self.handover_s = spawn, max_staleness, log, handover_s
        self.version = version
        self.engine_urls: list[str] | None = None  # set_engines: a restarted worker gets them too
        self.actors = [spawn(i, version, s) for i, s in enumerate(states)]
        self.last: list[dict[str, Any] | None] = [None] * len(states)  # each worker's newest report
        self._states = list(states)
        self._carried: list[dict[str, Any]] = [{} for _ in states]  # totals of the workers each one replaced
        self._placing: dict[int, Any] = {}  # restarted workers not up yet: index -> their ready() ref
        self.streams: list[Any] | None = None  # stream() refs, in stream mode
        self.restarts = 0
        self._restarts_of = [0] * len(states)
        self._lost_since: dict[int, float] = {}  # restarted workers not placed yet: index -> when they died
        self._started: dict[int, int] = {}  # groups each dead worker had started (its last report)
        self.handed_over: set[int] = set()
        self._split: dict[int, tuple[int, int, int]] = {}  # index -> its set_split arguments
        self._turn = [asyncio.Lock() for _ in states]  # lockstep: a worker makes one share at a time

    async def start(self) -> None:
        self.last = list(await asyncio.gather(*(a.ready.remote() for a in self.actors)))
        await self.set_version(self.version)

    # ------------------------------------------------------------ who is up

    def up(self, i: int) -> bool:
        ref = self._placing.get(i)
        if ref is not None and _done(ref):
            del self._placing[i]
            self._lost_since.pop(i, None)
            self.log.info(f"rollout worker {i} is up again; it continues its groups from the pool")
        return i not in self._placing

    def restart(self, i: int, why: str) -> None:
        """Start worker i again (its actor died); returns at once, Ray places it when it can."""
        self._restarts_of[i] += 1
        if self._restarts_of[i] > RESTARTS_PER_WORKER:
            raise RunFailed(f"rollout worker {i} died {self._restarts_of[i]} times; the last time: {why}")
        self.log.warn(f"rollout worker {i} died ({why}); starting it again: Ray places it when a node has its "
                      "resources, and it picks up its groups from the pool")
        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        last = self.last[i]
        self._lost_since.setdefault(i, time.monotonic())
        if last is not None:
            self._started[i] = max(self._started.get(i, 0), int(last.get("started", 0)))
            self._carried[i] = _add(self._carried[i], last)
            self._states[i] = last.get("data_state") or self._states[i]
        self.last[i] = None
        a = self.actors[i] = self.spawn(i, self.version, self._states[i])
        a.set_version.remote(self.version, self.max_staleness)  # queued: it runs once the actor is placed
        if self.engine_urls is not None:
            a.set_engines.remote(self.engine_urls)
        if i in self._split:
            a.set_split.remote(*self._split[i])
        self._placing[i] = a.ready.remote()
        if self.streams is not None:
            self.streams[i] = a.stream.remote()
        self.restarts += 1

    # ------------------------------------------------------------ calls to every worker

    async def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker that is up (None for the others, whose call is only
        queued); a worker found dead is restarted and gives None, one Ray cannot reach for now
        (not known to be dead: it may still be writing to the pool) gives None."""
        up = [i for i in range(len(self.actors)) if self.up(i)]
        for i in set(range(len(self.actors))) - set(up):
            getattr(self.actors[i], method).remote(*args)
        got = await asyncio.gather(*(_result(getattr(self.actors[i], method).remote(*args)) for i in up),
                                   return_exceptions=True)
        out: list[Any] = [None] * len(self.actors)
        for i, r in zip(up, got):
            if isinstance(r, ActorDiedError):
                self.restart(i, _why(r))
            elif isinstance(r, ActorUnavailableError):
                continue
            elif isinstance(r, BaseException):
                raise r
            else:
                out[i] = r
        return out

    async def set_engines(self, urls: list[str]) -> None:
        self.engine_urls = urls
        await self.call("set_engines", urls)

    async def set_version(self, version: int) -> None:
        self.version = version
        await self.call("set_version", version, self.max_staleness)

    async def add_budget(self, groups: int) -> None:
        await self.call("add_budget", groups)

    async def reports(self) -> list[dict[str, Any]]:
        """Every worker's report (the newest one for a worker not up), totals over its restarts."""
        for i, r in enumerate(await self.call("report")):
            if r is not None:
                self.last[i] = r
        return [self._total(i) for i in range(len(self.actors))]

    def _total(self, i: int) -> dict[str, Any]:
        r = self.last[i]
        return self._carried[i] if r is None else _add(self._carried[i], r)

    async def generate(self, shares: list[int]) -> list[dict[str, Any]]:
        """Each worker produces its share of groups (lockstep, one-step-off); returns every
        worker's totals. A worker that dies is restarted and asked for its whole share again
        (what it stored before it died is used by a later step); one Ray lost contact with is
        asked again, for what it has not made yet, once it answers (its target is absolute, so a
        call still running in it stops at the same one). A worker not placed again within
        `handover_s` of its death has its share made by a live one, after that one's own."""
        await asyncio.gather(*(self._share(i, k) for i, k in enumerate(shares) if k))
        return [self._total(i) for i in range(len(self.actors))]

    async def _share(self, i: int, k: int) -> None:
        while True:
            if not await self._placed_in_time(i):
                taker = next((j for j in range(len(self.actors)) if j != i and self.up(j)), None)
                if taker is None:  # every worker is down: wait for one to be placed
                    await asyncio.sleep(1.0)
                    continue
                self.log.warn(f"rollout worker {i} not placed again for {self.handover_s:g} s: worker {taker} "
                              f"makes its {k} groups of this step")
                return await self._share(taker, k)
            before = (self.last[i] or {}).get("accepted", 0)
            try:
                async with self._turn[i]:  # one generate at a time per worker: its target is absolute
                    self.last[i] = await _result(self.actors[i].generate.remote(k))
                return
            except ActorDiedError as e:
                self.restart(i, _why(e))
            except ActorUnavailableError:
                now = await self._probe(i)
                if now is not None:  # alive: ask for the rest
                    k -= now.get("accepted", 0) - before
                    if k <= 0:
                        return

    async def _placed_in_time(self, i: int) -> bool:
        """Wait while worker i waits to be placed again: True once it is up, False once it has
        been down `handover_s` (its node is gone for now; Ray places it when a node has room)."""
        while not self.up(i):
            if time.monotonic() - self._lost_since.get(i, time.monotonic()) >= self.handover_s:
                return False
            await asyncio.sleep(0.2)
        return True

    async def _probe(self, i: int, patience_s: float = 120.0) -> dict[str, Any] | None:
        """Worker i's report once Ray can reach it again; None (and worker i restarted) when Ray
        says it died or it stays out of reach `patience_s` (Ray declares a lost node dead sooner)."""
        deadline = asyncio.get_running_loop().time() + patience_s
        while True:
            try:
                r = await _result(self.actors[i].report.remote())
                self.last[i] = r
                return r
            except ActorDiedError as e:
                self.restart(i, _why(e))
                return None
            except ActorUnavailableError as e:
                if asyncio.get_running_loop().time() > deadline:
                    self.restart(i, f"out of reach for {patience_s:g} s: {_why(e)}")
                    return None
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------ streaming

    def start_streaming(self) -> list[Any]:
        self.streams = [a.stream.remote() for a in self.actors]
        return self.streams

    async def hand_over_lost(self) -> None:
        """Hand over the streaming workers that have not been placed again for `handover_s` (see
        the module's docstring); the last live worker is never handed over."""
        now = time.monotonic()
        lost = sorted(i for i, t in self._lost_since.items()
                      if i not in self.handed_over and i in self._placing and now - t >= self.handover_s)
        live = [i for i in range(len(self.actors)) if i not in self.handed_over and i not in lost]
        if self.streams is None or not lost or not live:
            return
        self.handed_over.update(lost)
        # A lost worker's last report may miss the groups it started in its last moments: those
        # may be trained a version later than the bound allowed at admission, and the learner's
        # claim still drops or corrects them as the recipe says.
        reserved = sum(self._started.get(i, 0) for i in self.handed_over)
        self.log.warn(f"rollout worker(s) {', '.join(map(str, lost))} not placed again for {self.handover_s:g} s: "
                      f"workers {', '.join(map(str, live))} take over their share of admission capacity "
                      f"({reserved} groups they had started stay counted); placed later, they only "
                      "finish their groups")
        for i in self.handed_over:
            self._split[i] = (-1, 0, 0)
        for k, i in enumerate(live):
            self._split[i] = (k, len(live), reserved)
        for i in self.handed_over:
            self.actors[i].set_split.remote(*self._split[i])  # queued until it is placed, if ever
        await asyncio.gather(*(_result(self.actors[i].set_split.remote(*self._split[i])) for i in live),
                             return_exceptions=True)  # a dead one is restarted with its split by check_streams

    async def check_streams(self) -> bool:
        """Raise RunFailed for a worker that stopped with an error, restart one whose actor died
        (or, when Ray lost contact with it, once Ray knows whether it did); True when every worker
        has stopped streaming (out of prompts)."""
        assert self.streams is not None
        for i, s in enumerate(self.streams):
            if _done(s):
                try:
                    await _result(s)
                except ActorDiedError as e:
                    self.restart(i, _why(e))
                except ActorUnavailableError:
                    if await self._probe(i) is not None:  # alive after all: wait on its stream again
                        self.streams[i] = self.actors[i].stream.remote()
        return all(_done(s) for s in self.streams)

    async def stop(self) -> None:
        """Stop the workers that are up; one still waiting to be placed is left (its groups wait
        in the pool for `--resume`)."""
        for i in self._placing:
            self.log.warn(f"rollout worker {i} was not placed again before the run ended; its groups in flight "
                          "stay in the pool (admitted), and `streamrl run --resume` continues them")
        await self.call("stop")


async def _result(ref: Any) -> Any:
    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RunFailed(f"a rollout worker stopped: {cause}") from None


def _done(ref: Any) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _why(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if "died because" in line), type(e).__name__)


def _add(base: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`report` with the running totals of `base` added (numbers and the drops counter)."""
    out = dict(report)
    for k, v in base.items():
        if k in _STATE or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and isinstance(out.get(k, 0), (int, float)):
            out[k] = out.get(k, 0) + v
        elif k == "drops":
            out[k] = {d: out.get(k, {}).get(d, 0) + v.get(d, 0) for d in {*v, *out.get(k, {})}}
    return out
