"""Rollout worker: prompts -> groups of n responses through the router -> rewards -> filters -> pool.

One asyncio loop per worker (a Ray actor in a run), many groups in flight. Two ways to drive it:
`stream()` starts groups continuously under admission control (`streamrl.core.staleness`) until
stopped; `generate(k)` produces exactly k accepted groups and returns (lockstep, one-step-off).

Every engine call's tokens, log-probs and version spans are folded into a `Trajectory`
(`streamrl.core.partial`): an aborted call (a version update with `abort_resume`, or an engine that
died) is resubmitted as prompt + tokens so far, and the group is saved to the pool as
`partial` meanwhile, so a crash loses no generated token. A reward function that raises marks
that sample failed; a filter drops the group with its reason; both release the admission slot.

With a recipe `env`, each sample is an episode of the user's environment function instead
(streamrl/producers/episode.py): multi-turn, token-in/token-out, with an OpenAI-compatible endpoint
(streamrl/producers/openai_proxy.py) for agents that only speak that API.

Long file: one worker's generation loop (admission, partial rollouts, rewards, filters, pool writes) reads best as one class.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, deque
from pathlib import Path
from typing import Any

import msgspec

from streamrl.connectors.sglang import api
from streamrl.connectors.auth import Keys
from streamrl.connectors.sglang.client import ENGINE_FAILURES, SGLangClient, retryable
from streamrl.core import lora as lora_names
from streamrl.core import credit, lengths, partial, routing, staleness
from streamrl.core.types import Admission, GroupAppended, SampleGroup, make_group_id
from streamrl.plugins.data import PromptRecord, PromptSource
from streamrl.pools import open_pool
from streamrl.pools.queries import group_lengths
from streamrl.plugins.filters import FilterHub
from streamrl.plugins.slime import reward_hub, slime_args
from streamrl.producers import episode as agent
from streamrl.producers.generate_proxy import SlimeGenerateHub
from streamrl.producers.openai_proxy import OpenAIProxy
from streamrl.recipe import Recipe
from streamrl.runtime.runlog import RunLog, now_ns

log = logging.getLogger("streamrl.runtime.rollout")


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Chat messages (and tool definitions) go through the tokenizer's chat template; text is tokenized as is."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **({"tools": tools} if tools else {})))
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def decode_response(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def blame_token(tokenizer: Any, tokens: list[int], components: dict[str, Any]) -> dict[str, Any]:
    """`components` with the token holding the reward's `first_error` character (core/credit.py),
    found from the decoded lengths of the response's token prefixes; as they were without one."""
    offset = components.get(credit.ERROR_CHAR)
    if not isinstance(offset, int | float) or offset < 0:
        return components
    k = credit.token_of_char(lambda k: len(decode_response(tokenizer, tokens[:k + 1])), len(tokens), offset)
    return components if k is None else {**components, credit.ERROR_TOKEN: float(k)}


class RolloutWorker:
    def __init__(self, recipe: Recipe, router_url: str, index: int = 0, num_workers: int = 1,
                 version: int = 0, data_state: dict | None = None, api_key: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.r, self.index, self.num_workers = recipe, index, num_workers
        self.producer_id = f"rollout-{index}"
        d = recipe.data
        self.source = PromptSource(d.path, d.prompt_key, d.label_key, d.shuffle, d.seed, d.epochs, d.on_error)
        if data_state:
            self.source.restore(data_state)
        self._admitted_state = self.source.state()  # where the source stood after the last admission
        self._known: set[str] = set()  # groups admitted before a resume: their prompts are not drawn again
        # prompts drawn but not admitted yet, in the order rollout.schedule starts them, each with the source's
        # state before it was drawn (so a resume draws again from the oldest one not admitted)
        self._chunk: deque[tuple[dict[str, int], PromptRecord]] = deque()
        self.lengths = lengths.LengthHistory()  # response lengths per prompt: what the schedule predicts from
        self._history_epoch = -1  # the data epoch the history was last read from the pool for
        self.tokenizer = AutoTokenizer.from_pretrained(recipe.model.tokenizer or recipe.model.path)
        self.pool = open_pool(recipe.pool_uri, create=True, config=recipe.pool, compact_every=0,
                              write_ahead=recipe.pool.write_ahead)
        self.client = SGLangClient(router_url, connect_retries=2, keys=Keys(api=api_key))  # generation only
        self.log = RunLog(recipe.run_dir, echo=False)
        # style: slime functions get slime's args and Samples
        self.rewards = reward_hub(recipe, router_url, self.tokenizer)
        self.env = env_hub(recipe, router_url, self.tokenizer)
        self.proxy: Any = None  # the OpenAI-compatible endpoint env episodes get (started by _resume)
        if self.env is not None:
            self.max_context = agent.context_length(recipe.model.path)
        self._slime = any(ref.style == "slime" for ref in [recipe.reward, *recipe.filters, *filter(None, [recipe.env])])
        self.filters = FilterHub(recipe.filters, slime_args(recipe, router_url=router_url),
                                 lambda ids: decode_response(self.tokenizer, ids), self.tokenizer)
        ro = recipe.rollout
        self.sampling = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}
        self.routing = model_routing(recipe)  # (layers, top_k) when responses carry routed experts
        self.api_key = api_key
        self.direct: list[SGLangClient] = []  # set_engines: the engines' own clients, for routed calls
        self._next_engine = index  # workers start on different engines
        self._direct_failed = False
        self.version = version
        self._set_adapter()
        self.max_staleness = recipe.staleness.max_staleness
        self.per_step = staleness.claimed_per_step(ro.groups_per_step, ro.over_sampling)
        self.budget = staleness.run_budget(recipe.run.steps, self.per_step)  # grown by the driver (add_budget)
        self.policy = recipe.staleness.partial_rollout
        self.started = 0  # admitted groups still counting against capacity (filtered ones release)
        self.split: tuple[int, int, int] | None = None  # (live index, live workers, reserved) after a handover
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.stats: Counter[str] = Counter()
        self.drops: Counter[str] = Counter()
        self._wake = asyncio.Event()
        self._stopping = False
        self._accepted = 0
        self._failed_in_a_row = 0
        self._last_failure: str | None = None
        self.exhausted = False
        self._streaming: asyncio.Future[dict[str, Any]] | None = None

    # ------------------------------------------------------------ control (called by the driver)

    def set_version(self, version: int, max_staleness: int | None = None) -> None:
        self.version = max(self.version, version)  # calls queued for a worker being placed may run out of order
        self._set_adapter()
        if max_staleness is not None:
            self.max_staleness = max_staleness
        self._wake.set()

    def set_engines(self, urls: list[str]) -> None:
        """The engines' own URLs, known once they are up (the worker is built while they start).
        sglang-router 0.3.2 drops return_routed_experts from what it forwards (docs/engines.md), so
        routed calls go to the engines themselves, round robin as the router would, and a call
        whose engine fails goes through the router next time (without routing: counted)."""
        if self.routing and not self.direct:
            self.direct = [SGLangClient(u, connect_retries=2, keys=Keys(api=self.api_key)) for u in urls]
            self._set_adapter()

    def _set_adapter(self) -> None:
        """learner.lora: new generations run with the adapter of the current version (engines keep
        the previous one loaded for calls already under way); the client tags their tokens with it."""
        if self.r.learner.lora is not None:
            for c in (self.client, *self.direct):
                c.lora_path = lora_names.adapter_name(self.version)

    def capacity(self) -> int:
        """This worker's share of the admission capacity, within the run's budget."""
        total = staleness.admission_capacity(self.version, self.max_staleness, self.per_step)
        return self._share(min(total, self.budget))

    def _share(self, total: int) -> int:
        workers, external = self.r.rollout.workers, self.r.producer_api.enabled
        if self.split is None:
            return staleness.capacity_share(total, self.index, staleness.capacity_shares(workers, external))
        live_index, live, reserved = self.split
        if live_index < 0:  # handed over: it finishes the groups it has and starts no more
            return 0
        return staleness.handed_over_share(total, workers, external, reserved, live_index, live)

    def set_split(self, live_index: int, live: int, reserved: int) -> None:
        """Lost workers were handed over (streamrl/runtime/workers.py): this worker's share of the
        capacity is now its part among the `live` ones of what the lost ones did not start
        (`reserved`); live_index -1: this worker is one of the handed-over ones."""
        self.split = (live_index, live, reserved)
        self._wake.set()

    def add_budget(self, groups: int) -> None:
        """The run needs `groups` more than its steps claim (the learner dropped them as stale, or
        no batch could form within the budget)."""
        self.budget += groups
        self._wake.set()

    def report(self) -> dict[str, Any]:
        spent = self.started >= self._share(self.budget)
        return {"producer": self.producer_id, "version": self.version, "started": self.started,
                "inflight": len(self.inflight), "accepted": self._accepted, "exhausted": self.exhausted,
                "budget_spent": spent, "data_state": self._admitted_state, "drops": dict(self.drops), **self.stats}

    async def stop(self) -> None:
        """Stop starting groups and wait for the ones in flight (their partials are saved)."""
        self._stopping = True
        self._wake.set()
        if self.inflight:
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)

    async def close(self) -> None:
        await self.stop()
        if self.proxy is not None:
            await self.proxy.close()
        if isinstance(self.env, SlimeGenerateHub):
            await self.env.close()
        await self.client.close()
        for c in self.direct:
            await c.close()
        self.pool.close()

    # ------------------------------------------------------------ drivers

    async def stream(self) -> dict[str, Any]:
        """Start groups while admission control allows, until stopped or out of prompts. A second
        call (the driver lost contact with the first) waits for the same loop."""
        if self._streaming is None:
            self._streaming = asyncio.ensure_future(self._stream())
        return await asyncio.shield(self._streaming)

    async def _stream(self) -> dict[str, Any]:
        await self._resume()
        while not self._stopping:
            self._check_failing()
            room = min(self.capacity() - self.started, self.r.rollout.max_concurrency - len(self.inflight))
            if room <= 0:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not await self._start(room):
                break
        return self.report()

    async def generate(self, num_groups: int) -> dict[str, Any]:
        """Produce exactly `num_groups` accepted groups (filtered or failed ones are replaced)."""
        await self._resume()
        target = self._accepted + num_groups
        while self._accepted < target and not self._stopping:
            self._check_failing()
            room = min(target - self._accepted - len(self.inflight), self.r.rollout.max_concurrency - len(self.inflight))
            if room > 0:
                if await self._start(room):
                    continue
                if not self.inflight:
                    break
            self._wake.clear()
            await self._wake.wait()
        return self.report()

    # ------------------------------------------------------------ groups

    def _next_record(self) -> PromptRecord | None:
        if not self._chunk:
            self._draw_chunk()
        if self._chunk:
            return self._chunk.popleft()[1]
        self.exhausted = True
        return None

    def _draw_chunk(self) -> None:
        """Draw the next chunk of this worker's prompts and order it by `rollout.schedule`."""
        ro, drawn = self.r.rollout, []
        window = -(-(ro.schedule_window or 4 * self.per_step) // self.num_workers)  # this worker's share
        while len(drawn) < window:
            before = self.source.state()
            if (rec := self.source.next()) is None:
                break
            if rec.index % self.num_workers == self.index and \
                    make_group_id(self.producer_id, rec.epoch, rec.index) not in self._known:
                drawn.append((before, rec))
        if ro.schedule != "fifo" and drawn and drawn[0][1].epoch > self._history_epoch:
            self._read_history(drawn[0][1].epoch)
        predicted = [self.lengths.predict(rec.prompt_id) for _, rec in drawn]
        self._chunk.extend(lengths.order(drawn, predicted, ro.schedule, ro.tail_fraction))

    def _read_history(self, epoch: int) -> None:
        """Every producer's finished groups, oldest first: a prompt goes to another worker in each epoch
        (and a resumed run has the groups of before the stop), so once per epoch the pool is read whole."""
        self.lengths = lengths.LengthHistory()
        for prompt_id, lens in group_lengths(self.pool):
            self.lengths.observe(prompt_id, lens)
        self._history_epoch = epoch

    def _resume_state(self) -> dict[str, int]:
        """Where a resumed run draws from: before the oldest prompt drawn and not admitted (prompts
        admitted out of order after it are known by then and skipped)."""
        waiting = [before for before, _ in self._chunk]
        return min(waiting, key=lambda st: (st["epoch"], st["position"])) if waiting else self.source.state()

    async def _start(self, count: int) -> int:
        """Start up to `count` groups, admitted in one commit (a commit costs 5-20 ms: admitting
        groups one by one would be most of a small step's time). Returns how many started."""
        recs = []
        while len(recs) < count and (rec := self._next_record()) is not None:
            recs.append(rec)
        if not recs:
            return 0
        n, t = self.r.rollout.n_samples, now_ns()
        gids = [make_group_id(self.producer_id, rec.epoch, rec.index) for rec in recs]
        await self.pool.admit_async([Admission(group_id=gid, prompt_id=rec.prompt_id, n=n, producer_id=self.producer_id,
                                               version=self.version, admitted_at=t + k)
                                     for k, (gid, rec) in enumerate(zip(gids, recs))])
        self._admitted_state = self._resume_state()
        for k, (gid, rec) in enumerate(zip(gids, recs)):
            self._launch_new(gid, rec, t + k)
        return len(recs)

    def _launch_new(self, gid: str, rec: PromptRecord, admitted_ns: int) -> None:
        # `admitted_ns` becomes the group's created time: claims take groups in the order they started.
        meta = {"label": rec.label, "prompt": rec.prompt, "epoch": rec.epoch, "index": rec.index, "line": rec.line,
                "admitted_ns": admitted_ns}
        if self._slime and isinstance(rec.record.get("metadata"), dict):  # slime Samples' `metadata` (its default key)
            meta["metadata"] = rec.record["metadata"]
        if self.env is not None:
            task = {"prompt": rec.prompt, "label": rec.label, "id": rec.prompt_id, "record": rec.record}
            self._track(gid, self._run_env_group(gid, rec.prompt_id, meta, task))
            return
        prompt_ids = encode_prompt(self.tokenizer, rec.prompt)
        trajs = [partial.Trajectory(prompt=prompt_ids, max_new_tokens=self.r.rollout.max_new_tokens)
                 for _ in range(self.r.rollout.n_samples)]
        self._launch(gid, rec.prompt_id, meta, trajs)

    def _launch(self, gid: str, prompt_id: str, meta: dict[str, Any], trajs: list[partial.Trajectory]) -> None:
        self._track(gid, self._run_group(gid, prompt_id, meta, trajs))

    def _track(self, gid: str, coro: Any) -> None:
        self.started += 1
        task = asyncio.create_task(coro, name=gid)
        self.inflight[gid] = task
        task.add_done_callback(lambda _t: (self.inflight.pop(gid, None), self._wake.set()))

    async def _resume(self) -> None:
        """Pick up what this producer left in the pool (a stopped or killed run): `partial` groups
        continue from their saved tokens, groups admitted but never stored start again, the
        prompts of every admitted group are not drawn again, and admission control counts the
        groups already started."""
        if getattr(self, "_resumed", False):
            return
        self._resumed = True
        if self.env is not None:
            self.proxy = OpenAIProxy()
            await self.proxy.start()
            if isinstance(self.env, SlimeGenerateHub):
                await self.env.start()
        known = self.pool.producer_groups(self.producer_id)
        self._known = set(known)
        self.started = sum(1 for st, _ in known.values() if st not in (None, "partial", "dropped", "failed"))
        for g in self.pool.partial_groups(self.producer_id):
            prompt = g.prompt_tokens.tolist()
            trajs = [partial.from_sample(s, prompt, self.r.rollout.max_new_tokens) for s in g.samples]
            self.stats["resumed_groups"] += 1
            self._launch(g.group_id, g.prompt_id, {"admitted_ns": g.created_at, **g.metadata}, trajs)
        for gid, (st, admitted_ns) in known.items():
            if st is None:
                _, epoch, index = gid.rsplit(":", 2)
                self.stats["restarted_groups"] += 1
                self._launch_new(gid, self.source.record(int(epoch[1:]), int(index[1:])), admitted_ns)

    async def _run_group(self, gid: str, prompt_id: str, meta: dict[str, Any], trajs: list[partial.Trajectory]) -> None:
        state = {"saving": None}
        try:
            await self._generate(gid, trajs, meta, prompt_id, state)
            if state["saving"] is not None:
                await state["saving"]
            await self._store(await self._finish(gid, prompt_id, meta, trajs))
        except Exception as e:  # noqa: BLE001 - one broken group must not stop the worker
            self._group_error(gid, e)

    async def _run_env_group(self, gid: str, prompt_id: str, meta: dict[str, Any], task: dict[str, Any]) -> None:
        """The recipe's environment runs each sample's episode (streamrl/producers/episode.py); episodes are
        not saved as partial: an environment's state cannot be stored, so a crash restarts the group."""
        try:
            eps = [agent.Episode(self.client, self.tokenizer, sampling=self.sampling,
                                 max_new_tokens=self.r.rollout.max_new_tokens, max_context=self.max_context,
                                 policy=self.policy, retries=partial.ENGINE_RETRIES) for _ in range(self.r.rollout.n_samples)]
            prompt, samples = await agent.play_group(self.env, self.proxy, eps, task, self.rewards, meta)
            if isinstance(self.env, SlimeGenerateHub):
                self.env.amend(eps, samples)
            for ep in eps:
                self.stats["gen_tokens"] += ep.stats["gen_tokens"]
                self.stats["interrupted_calls"] += ep.stats["interruptions"]
                self.stats["discarded_tokens"] += ep.stats["discarded_tokens"]
                self.stats["engine_errors"] += ep.stats["engine_errors"]
            self.stats["failed_samples"] += sum(s.failed for s in samples)
            await self._store(self._group(gid, prompt_id, prompt, samples, meta))
        except Exception as e:  # noqa: BLE001 - one broken group must not stop the worker
            self._group_error(gid, e)

    async def _store(self, group: SampleGroup) -> None:
        await self.pool.append_async([group])
        if self.r.rollout.schedule != "fifo":  # fifo orders nothing: no history to keep
            self.lengths.observe(group.prompt_id, [len(s.response_tokens) for s in group.samples if not s.failed])
        self.log.event(GroupAppended(group_ids=[group.group_id], status=group.status, producer_id=self.producer_id,
                                     at=now_ns()))
        if group.status == "complete":
            self._accepted += 1
            self._failed_in_a_row = 0
            self.stats["groups_complete"] += 1
        else:
            self.started -= 1  # a dropped or failed group does not use up staleness capacity
            self.stats[f"groups_{group.status}"] += 1
            if group.status == "failed":
                self._failed_in_a_row += 1
                self._last_failure = group.drop_reason

    def _group_error(self, gid: str, e: Exception) -> None:
        log.exception("group %s failed; it stays in flight in the ledger", gid)
        self.stats["group_errors"] += 1
        self._failed_in_a_row += 1
        self._last_failure = f"{type(e).__name__}: {e}"

    def _check_failing(self) -> None:
        """Every sample of many groups in a row failed, or a filter raised on each of them (engines
        unreachable, a reward, environment or filter function that always raises): stop instead of
        replacing them forever."""
        limit = max(8, 2 * self.r.rollout.groups_per_step)
        if self._failed_in_a_row >= limit:
            raise RuntimeError(f"{self.producer_id}: the last {self._failed_in_a_row} groups all failed; the last "
                               f"error: {self._last_failure}")

    async def _generate(self, gid: str, trajs: list[partial.Trajectory], meta: dict[str, Any], prompt_id: str,
                        state: dict[str, Any]) -> None:
        """Generate the group's unfinished responses, one batched /generate per remaining budget
        (a group's samples usually share it), until every response is finished."""
        failures = 0
        while not all(t.done for t in trajs):
            by_budget: dict[int, list[int]] = {}
            for i, t in enumerate(trajs):
                if not t.done:
                    by_budget.setdefault(t.remaining, []).append(i)
            # No rids: sglang-router 0.3.2 refuses a list of them (422), and we abort by pausing, not by rid.
            # one remaining budget = as many tokens kept = one routed_experts_start_len for the whole call
            calls = [self._generation_client().generate_batch(
                [partial.next_request(trajs[i])[0] for i in idx],
                api.SamplingParams(**self.sampling, max_new_tokens=budget),
                routed_experts_start_len=partial.routed_start(trajs[idx[0]]) if self.routing else None)
                for budget, idx in by_budget.items()]
            aborted = failed = refused = False
            for idx, res in zip(by_budget.values(), await asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(res, ENGINE_FAILURES):
                    # Nothing came back from this call (e.g. its engine died): resubmit from what we have.
                    failed, error = True, f"{type(res).__name__}: {res}"
                    self._direct_failed = bool(self.direct)
                    refused = refused or not retryable(res)  # a 4xx: the same request fails again
                    self.stats["engine_errors"] += 1
                    continue
                if isinstance(res, BaseException):
                    raise res
                for i, r in zip(idx, res):
                    self.stats["gen_tokens"] += len(r.output_ids)
                    before = trajs[i].discarded
                    routed = r.routed_experts(*self.routing) if self.routing else None
                    partial.absorb(trajs[i], r.output_ids, r.logprobs, r.version_spans(), r.finish_type, self.policy,
                                   routed_experts=routed)
                    if self.routing and routed is None and r.output_ids:
                        self._no_routing(trajs[i])
                    self.stats["discarded_tokens"] += trajs[i].discarded - before
                    if r.finish_type == "abort":
                        aborted = True
                        self.stats["interrupted_calls"] += 1
            if aborted and state["saving"] is None:
                state["saving"] = asyncio.create_task(self._save_partial(gid, prompt_id, meta, trajs, state))
            if failed:
                failures += 1
                if refused or failures >= partial.ENGINE_RETRIES:
                    why = "the engine refused the request" if refused else f"generation failed {failures} times in a row"
                    for t in trajs:
                        if not t.done:
                            t.error = f"{why}: {error}"
                    return
                await asyncio.sleep(min(5.0, 0.2 * failures))
            else:
                failures = 0

    def _generation_client(self) -> SGLangClient:
        """The router, or with routing an engine in turn (until an engine fails: the router for one call)."""
        if not self.direct or self._direct_failed:
            self._direct_failed = False
            return self.client
        self._next_engine += 1
        return self.direct[self._next_engine % len(self.direct)]

    def _no_routing(self, t: partial.Trajectory) -> None:
        """A response came back without the routed experts it asked for: with `rollout.routing: on`
        its sample fails (the learner must not train it without them), with `auto` it is stored
        without routing."""
        self.stats["routing_missing"] += 1
        why = ("the engine sent no routed experts (SGLang needs --enable-return-routed-experts; sglang-router "
               "0.3.2 drops return_routed_experts from the /generate bodies it forwards)")
        if routing.mode(self.r.rollout.routing) == "on":
            t.error = f"rollout.routing is on but {why}"
        elif self.stats["routing_missing"] == 1:
            log.warning("%s: %s; such samples are stored without routing", self.producer_id, why)

    async def _save_partial(self, gid: str, prompt_id: str, meta: dict[str, Any], trajs: list[partial.Trajectory],
                            state: dict[str, Any]) -> None:
        state["saving"] = None
        group = SampleGroup(group_id=gid, prompt_id=prompt_id, prompt_tokens=trajs[0].prompt,
                            samples=[partial.to_sample(t, i) for i, t in enumerate(trajs)],
                            producer_id=self.producer_id, metadata=meta, created_at=meta.get("admitted_ns", 0))
        await self.pool.save_partial_async([group])
        self.stats["partial_saves"] += 1

    async def _finish(self, gid: str, prompt_id: str, meta: dict[str, Any],
                      trajs: list[partial.Trajectory]) -> SampleGroup:
        texts = [decode_response(self.tokenizer, t.tokens) for t in trajs]
        stored = [partial.to_sample(t, i) for i, t in enumerate(trajs)]
        scored = await self.rewards.score(meta.get("prompt"), meta.get("label"), texts, meta, samples=stored,
                                          prompt_tokens=trajs[0].prompt)
        samples = []
        for t, s, sc in zip(trajs, stored, scored):
            gen_error = t.error
            s.reward, s.rewards = (None, {}) if gen_error else (sc.reward, blame_token(self.tokenizer, t.tokens,
                                                                                       dict(sc.components)))
            s.error = gen_error or sc.error
            s.failed = s.error is not None
            if s.failed:
                self.stats["failed_samples"] += 1
            samples.append(s)
        return self._group(gid, prompt_id, trajs[0].prompt, samples, meta)

    def _group(self, gid: str, prompt_id: str, prompt: list[int], samples: list[Any], meta: dict[str, Any]) -> SampleGroup:
        """The finished group: failed when every sample failed, dropped when a filter says so."""
        group = SampleGroup(group_id=gid, prompt_id=prompt_id, prompt_tokens=prompt, samples=samples,
                            producer_id=self.producer_id, metadata=meta, created_at=meta.get("admitted_ns", 0))
        if all(s.failed for s in samples):
            group.status, group.drop_reason = "failed", samples[0].error
        else:
            reason, error = self.filters.check_error(group)
            if reason is not None:
                group.status, group.drop_reason = "dropped", reason
                self.drops[reason] += 1
            if error is not None:  # a filter that raises on every group must stop the run, not drop them all
                self._failed_in_a_row += 1
                self._last_failure = error
        return group


def model_routing(recipe: Recipe) -> tuple[int, int] | None:
    """(layers, experts per token) of the recipe's model when rollouts ask for routed experts
    (`rollout.routing`), else None."""
    path = Path(recipe.model.path) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if not routing.wanted(recipe.rollout.routing, config):
        return None
    if not (config.get("num_hidden_layers") and config.get("num_experts_per_tok")):
        raise ValueError(f"rollout.routing is on but {path} has no num_hidden_layers and num_experts_per_tok: "
                         "routed experts need a mixture-of-experts model")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def env_hub(recipe: Recipe, router_url: str | None = None, tokenizer: Any = None, evaluation: bool = False) -> Any:
    """The recipe's environment hub: an env function, or slime's custom generate (`style: slime`)."""
    ref = recipe.env
    if ref is None:
        return None
    if ref.style == "slime":
        return SlimeGenerateHub(ref, slime_args(recipe, ref.args, router_url), tokenizer=tokenizer, evaluation=evaluation)
    return agent.EnvHub(ref.fn, ref.args)


def worker_actor(num_cpus: float = 0.5) -> Any:
    """The Ray actor class for a rollout worker (async: its methods share one event loop)."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_concurrency=1000)(_ActorWorker)


class _ActorWorker:
    """Ray wrapper: builds the worker inside the actor's event loop."""

    def __init__(self, recipe_json: bytes, router_url: str, index: int, num_workers: int, version: int,
                 data_state: dict | None, api_key: str | None = None) -> None:
        logging.basicConfig(level=logging.WARNING)
        self._args = (msgspec.json.decode(recipe_json, type=Recipe), router_url, index, num_workers, version,
                      data_state, api_key)
        self.w: RolloutWorker | None = None

    async def _worker(self) -> RolloutWorker:
        if self.w is None:
            self.w = RolloutWorker(*self._args)
        return self.w

    async def ready(self) -> dict[str, Any]:
        return (await self._worker()).report()

    async def stream(self) -> dict[str, Any]:
        return await (await self._worker()).stream()

    async def generate(self, num_groups: int) -> dict[str, Any]:
        return await (await self._worker()).generate(num_groups)

    async def set_version(self, version: int, max_staleness: int | None = None) -> None:
        (await self._worker()).set_version(version, max_staleness)

    async def set_engines(self, urls: list[str]) -> None:
        (await self._worker()).set_engines(urls)

    async def report(self) -> dict[str, Any]:
        return (await self._worker()).report()

    async def add_budget(self, groups: int) -> None:
        (await self._worker()).add_budget(groups)

    async def set_split(self, live_index: int, live: int, reserved: int) -> None:
        (await self._worker()).set_split(live_index, live, reserved)

    async def stop(self) -> dict[str, Any]:
        w = await self._worker()
        await w.stop()
        return w.report()

    async def close(self) -> None:
        if self.w is not None:
            await self.w.close()

