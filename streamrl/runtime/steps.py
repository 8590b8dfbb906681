"""The operations `streamrl/runtime/loop.py` is made of: generate, train a step, publish a version,
evaluate, checkpoint. `Steps` runs them on the services a run started
(`streamrl/runtime/services.py`) and keeps the per-step bookkeeping (versions, metrics, rates).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streamrl.connectors.sglang.client import SGLangClient
from streamrl.core import lora as lora_names
from streamrl.core import staleness
from streamrl.core.evalstats import with_ci
from streamrl.core.types import BatchClaimed
from streamrl.runtime import RunFailed
from streamrl.runtime.evaluate import eval_due, evaluate
from streamrl.runtime.inputs import eval_records
from streamrl.runtime.runlog import now_ns
from streamrl.runtime.services import Services


POLL_S = 1.0  # the learner waits this long for a batch before the driver looks at the workers
STALL_LOG_S = 30.0  # a step still waiting for its batch says why in run.log this often


class Steps:
    def __init__(self, svc: Services) -> None:
        self.svc, self.r, self.log = svc, svc.r, svc.log
        self.crew, self.learner, self.broadcaster = svc.crew, svc.learner, svc.broadcaster  # started by svc.start()
        self.max_staleness = svc.r.max_staleness
        ro = svc.r.rollout
        self.per_step = staleness.claimed_per_step(ro.groups_per_step, ro.over_sampling)  # groups a step claims
        self._stale_seen = 0  # the learner's stale drops the budget has grown by
        self.start_step = svc.resumed.start_step  # the first step this process trains (> 0 when resuming)
        self.wall_offset = svc.resumed.wall_offset
        self.version = svc.resumed.version
        self.t0 = time.perf_counter()
        self._last = (time.perf_counter(), 0)
        self._accepted: dict[int, int] = {}  # groups each worker has produced (lockstep, one-step-off)
        self._reports: list[dict[str, Any]] = []  # the workers' reports as of the last step
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    # ------------------------------------------------------------ generation

    def _shares(self, total: int) -> list[int]:
        n = len(self.crew.actors)
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    async def generate(self, num_groups: int) -> None:
        """Each worker produces its share of `num_groups` accepted groups (lockstep, one-step-off)."""
        shares = self._shares(num_groups)
        reports = await self.crew.generate(shares)  # every worker's: a live one may make a lost one's share
        before = {i: self._accepted.get(i, 0) for i in range(len(reports))}
        for i, r in enumerate(reports):
            self._accepted[i] = r["accepted"]
        made = sum(self._accepted[i] - before[i] for i in before)
        if made < num_groups and any(r["exhausted"] for r in reports):
            raise RunFailed(f"the rollout workers ran out of prompts ({made} of {num_groups} groups for this step); "
                            "raise data.epochs or lower run.steps")

    def start_streaming(self) -> list[Any]:
        return self.crew.start_streaming()

    async def stop_workers(self) -> None:
        await self.crew.stop()

    # ------------------------------------------------------------ training

    async def train_step(self, step: int, streams: list[Any] | None = None) -> dict[str, Any]:
        """Claim a batch and train on it; the learner's version moves to step + 1."""
        learner = self.learner
        task = asyncio.ensure_future(learner.train_step.remote(step, self.max_staleness, POLL_S))
        waited = t0 = asked = time.perf_counter()
        while True:  # poll: a worker that stopped with an error ends the run, one whose actor died starts again
            m = await task
            if m is not None:
                m["wait_s"] = m.get("wait_s", 0.0) + (asked - t0)  # the learner counts only the last call's wait
                break
            stopped = await self.crew.check_streams() if streams else False
            if streams and not stopped:
                await self._count_stale_drops(await learner.stale_dropped.remote())  # a waiting claim drops too
                await self.crew.hand_over_lost()
                await self._grow_budget_if_starved(step)
            if time.perf_counter() - waited > STALL_LOG_S:
                waited = time.perf_counter()
                self.log.info(self._waiting(step, waited - t0, bool(streams)))
            if stopped:
                reports = await self.crew.reports()
                raise RunFailed(f"step {step}: no batch of {self.per_step} groups can be formed and "
                                f"the rollout workers have stopped (out of prompts: "
                                f"{all(x['exhausted'] for x in reports)}; raise data.epochs or lower run.steps)")
            asked = time.perf_counter()
            task = asyncio.ensure_future(learner.train_step.remote(step, self.max_staleness, POLL_S))
        self.version = m["policy_version"]
        if streams:
            await self._count_stale_drops(m.get("stale_dropped_total", 0))
        if m.get("nonfinite_skipped"):
            self.log.warn(f"step {step}: {m['nonfinite_skipped']} optimizer step(s) skipped, loss or gradient norm not "
                          f"finite (loss {m.get('loss')}, grad norm {m.get('grad_norm')}); the weights did not change "
                          f"({m.get('nonfinite_skipped_total')} skipped in this run)")
        self.log.event(BatchClaimed(step=step, learner_version=m["policy_version"] - 1, group_ids=m["groups"],
                                    dropped=m["dropped_ids"], at=now_ns()))
        reports = await self.crew.reports()
        now, tokens = time.perf_counter(), sum(x.get("gen_tokens", 0) for x in reports)
        m["gen_tokens_per_s"] = (tokens - self._last[1]) / max(1e-9, now - self._last[0])
        self._last = (now, tokens)
        m["wall_time_s"] = now - self.t0 + self.wall_offset
        m["drops"] = _sum_dicts(x["drops"] for x in reports)
        m["interrupted_calls"] = sum(x.get("interrupted_calls", 0) for x in reports)
        # Generated tokens thrown away by the in-flight policy (restart), over all generated so far.
        m["gen_tokens"], m["discarded_tokens"] = tokens, sum(x.get("discarded_tokens", 0) for x in reports)
        m["discarded_token_frac"] = m["discarded_tokens"] / max(1, tokens)
        m["engine_errors"] = sum(x.get("engine_errors", 0) for x in reports)
        m["engine_restarts"] = self.svc.engines.restarts
        m["worker_restarts"] = self.crew.restarts
        # Groups workers picked up from the pool after a restart (partial ones and admitted-but-unstored ones).
        m["groups_resumed"] = sum(x.get("resumed_groups", 0) + x.get("restarted_groups", 0) for x in reports)
        self._reports = reports
        return m

    def _waiting(self, step: int, seconds: float, streaming: bool) -> str:
        """What a step that has waited `seconds` for its batch is waiting for."""
        api = self.r.producer_api.enabled
        external = f"external producers (the producer API; {self.svc.dir / 'producer.json'} has its URL)"
        if not streaming:
            source = external if api else "the rollout workers"
        else:
            source = "the rollout workers" + (f" and {external}" if api else "")
        return f"step {step}: waiting {seconds:.0f}s for a batch of {self.per_step} groups from {source}"

    async def _count_stale_drops(self, total: int) -> None:
        """Streaming admits what the run's steps claim; each group the learner dropped as stale
        (it waited too long behind slower ones) must be made again, so the budget grows by it."""
        crew = self.crew
        if total > self._stale_seen:
            await crew.add_budget(total - self._stale_seen)
        self._stale_seen = max(self._stale_seen, total)

    async def _grow_budget_if_starved(self, step: int) -> None:
        """Streaming admits only the groups the run's steps consume (plus the stale drops counted
        above); when groups went missing otherwise (a group that raised stays admitted) and every
        worker has spent its budget with nothing in flight, no batch can form: the workers may
        admit one step's claim more, and again at a later poll if that is still not enough (so
        the run ends with less than a step's surplus, where lifting the budget gave max_staleness + 1)."""
        reports = await self.crew.reports()
        if reports and all(x.get("budget_spent") and not x.get("inflight") for x in reports):
            self.log.info(f"step {step}: the workers have started every group this run's budget allows but "
                          f"some were not trained on (failed or dropped); admitting {self.per_step} more")
            await self.crew.add_budget(self.per_step)

    async def publish(self, step: int, metrics: dict[str, Any], interrupt: bool) -> None:
        """Push the learner's new version to every engine, then let the workers admit under it."""
        pub = await self.broadcaster.publish(metrics["policy_version"], step, interrupt,
                                                 self.r.staleness.finish_window_s)
        metrics.update(pause_s=pub["pause_s"], push_s=pub["push_s"], finish_window_s=pub["finish_window_s"],
                       failed_engines=pub["failed_engines"])
        await self.crew.set_version(metrics["policy_version"])
        self.steps.append(metrics)
        self.log.metrics({k: v for k, v in metrics.items() if k != "groups"} | {"groups": metrics["groups"]})
        every = self.r.run.checkpoint_every
        if every and (step + 1) % every == 0:
            await self.checkpoint()
        v = metrics["policy_version"]
        if eval_due(self.r.run, v):
            bg = self.svc.bg_eval
            if bg is not None:  # exported now, before the next step changes the weights
                path = str(self.svc.dir / "weights" / f"eval-v{v:06d}")
                bg.submit(v, step + 1, self.learner.export.remote(path, v), metrics["wall_time_s"])
            else:
                await self.evaluate(step + 1)  # on the rollout engines: training waits

    async def checkpoint(self) -> None:
        """A checkpoint with the workers' dataset positions as of the last step."""
        await self.svc.checkpoint([x["data_state"] for x in self._reports])

    async def evaluate(self, step: int) -> dict[str, Any] | None:
        """Held-out accuracy at the version the engines serve now (eval.jsonl)."""
        if not self.r.data.eval_path:
            return None
        async with SGLangClient(self.svc.router.url, keys=self.svc.keys) as c:
            if self.r.learner.lora is not None:  # the policy is the base + the served version's adapter
                c.lora_path = lora_names.adapter_name(self.broadcaster.version)
            res = await evaluate(c, self.svc.tokenizer, eval_records(self.r), self.r)
        served = self.broadcaster.version  # what the engines serve (the learner may be a step ahead)
        # When the version was trained, as background rows have it: not after the waits that come
        # between (the last evaluations drained, the final checkpoint), which would count as RL time.
        wall = self.steps[-1]["wall_time_s"] if self.steps else self.wall_offset
        row = {"policy_version": served, "step": step, "wall_time_s": wall, "mode": "inline", **res}
        self.evals.append(row)
        self.log.eval(row)
        self.log.info(f"eval at version {served}: accuracy {with_ci(res, 'accuracy')} "
                      f"(greedy {with_ci(res, 'greedy_accuracy')}) over {res['prompts']} prompts")
        return row


def _sum_dicts(ds: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
