"""A discrete-event model of a StreamRL cluster in virtual time.

The scheduling is StreamRL's own: admission control and its split between rollout workers
(`staleness.admission_capacity` within the run's `run_budget`, `capacity_share`), the learner's
claim (`staleness.select_groups`, oldest started first, whole groups, the consumption policy),
partial-rollout transitions (`partial.Trajectory`, `next_request`, `absorb`) and the ledger
(`ledger.compute_ledger`). The three loops below read like `streamrl/runtime/loop.py`. What is modelled
instead of run: engines (decode-iteration time vs batch size, prefill, a cap on running requests,
pauses), the learner (time per token per GPU) and the weight broadcast (bytes / bandwidth + latency).

Time advances between events: an engine's running requests all gain one token per decode
iteration, so the next event of an engine is its earliest finishing request; nothing is
simulated token by token. Lengths are counted in blocks of `token_block` tokens (1 = exact) so
that trajectories of thousands of tokens stay small in memory.

Long file: the engines, learner, broadcast and the three loops of one discrete-event model must be read together.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.core import lengths, partial, spans, staleness
from streamrl.core.ledger import compute_ledger
from streamrl.core.types import VersionSpan

# ------------------------------------------------------------------ parameters


@dataclass
class Lengths:
    """Response lengths in tokens: lognormal(median, sigma) or an empirical histogram, capped at
    `max_new_tokens` (a capped response finishes with `length`)."""

    max_new_tokens: int
    median: float = 1000.0
    sigma: float = 1.0
    values: list[int] | None = None  # empirical: lengths with their counts
    counts: list[int] | None = None
    # The share of the (normal-score) length variance within one prompt's samples: 1 = no prompt runs
    # longer than another (nothing to predict); 0.3 = a prompt's own scale explains 70% of it.
    within: float = 1.0

    def at(self, z: float) -> int:
        """The length at standard-normal score z (the distribution's quantile at Phi(z)): a prompt
        draws its score, its samples spread around it (a Gaussian copula, any marginal)."""
        if self.values:
            cum = list(itertools.accumulate(self.counts or [1] * len(self.values)))
            u = 0.5 * (1 + math.erf(z / math.sqrt(2)))
            return min(self.max_new_tokens, self.values[min(len(self.values) - 1, bisect.bisect_right(cum, u * cum[-1]))])
        return max(1, min(self.max_new_tokens, int(math.exp(math.log(self.median) + self.sigma * z))))

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        if self.values:
            vals, cum = self.values, list(itertools.accumulate(self.counts or [1] * len(self.values)))
            return lambda: min(self.max_new_tokens, vals[min(len(vals) - 1, bisect.bisect_right(cum, rng.random() * cum[-1]))])
        mu = math.log(self.median)
        return lambda: max(1, min(self.max_new_tokens, int(rng.lognormvariate(mu, self.sigma))))


@dataclass
class Cluster:
    """Hardware and model. Defaults: a 7B dense model in bf16 on H100s (SGLang, tp 1)."""

    engines: int = 8
    decode_base_s: float = 0.008  # one decode iteration at batch 1
    decode_per_seq_s: float = 4e-5  # added per running request (memory traffic of its KV cache)
    prefill_tokens_per_s: float = 40_000.0
    request_overhead_s: float = 0.0  # engine time per call outside prefill/decode (HTTP, scheduling): ~0 on GPUs
    max_running: int = 256
    learner_gpus: int = 3
    learner_tokens_per_s_per_gpu: float = 7_000.0  # forward+backward+log-prob recompute, all tokens
    learner_step_overhead_s: float = 1.0  # optimizer step, claim, per-step fixed costs
    model_bytes: float = 15.2e9
    broadcast_bytes_per_s: float = 25e9
    broadcast_latency_s: float = 0.5


@dataclass
class Workload:
    mode: str = "stream"  # stream | lockstep | one_step_off
    steps: int = 20
    groups_per_step: int = 512
    n_samples: int = 16
    prompt_tokens: int = 256
    lengths: Lengths = field(default_factory=lambda: Lengths(8192))
    max_staleness: int = 1
    policy: str = "drop"  # consumption policy
    partial_rollout: str = "abort_resume"  # abort_resume | in_place | restart
    workers: int = 4
    max_concurrency: int = 1 << 30  # groups generating at once per worker
    prompts: int = 0  # distinct prompts, visited epoch after epoch (shuffled); 0 = every group a new prompt
    schedule: str = "fifo"  # rollout.schedule (streamrl/core/lengths.py): fifo | longest_first | tail_batching
    schedule_window: int = 0  # prompts per ordered chunk, all workers together; 0 = 4 x groups_per_step
    tail_fraction: float = 0.25
    token_block: int = 16
    warmup_steps: int = 0  # steps left out of the steady-state throughput
    seed: int = 0


# ------------------------------------------------------------------ the event loop


class Signal:
    """Fires once; processes `yield` it to wait."""

    def __init__(self, sim: Sim) -> None:
        self.sim, self.done, self.value, self.waiters = sim, False, None, []

    def fire(self, value: Any = None) -> None:
        self.done, self.value = True, value
        for w in self.waiters:
            self.sim.at(self.sim.now, w)
        self.waiters = []


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn))

    def spawn(self, gen: Generator[Any, Any, Any]) -> Signal:
        """Run a process: it yields seconds to sleep or a Signal to wait for."""
        done = Signal(self)

        def step(value: Any = None) -> None:
            try:
                y = gen.send(value)
            except StopIteration as e:
                done.fire(e.value)
                return
            if isinstance(y, Signal):
                if y.done:
                    self.at(self.now, lambda: step(y.value))
                else:
                    y.waiters.append(lambda: step(y.value))
            else:
                self.at(self.now + float(y), step)

        self.at(self.now, step)
        return done

    def run_until(self, sig: Signal) -> None:
        while self._q and not sig.done:
            t, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()


# ------------------------------------------------------------------ engines


@dataclass(eq=False)
class Request:
    traj: partial.Trajectory
    group: Group
    index: int
    target_blocks: int  # response length this sample will reach (blocks)
    start_s: float = 0.0  # when the sample was first sent
    end_s: float = 0.0  # when it finished (its last call)
    engine: Engine | None = None
    join_g: float = 0.0
    finish_g: float = 0.0
    marks: list[tuple[float, int]] = field(default_factory=list)  # (progress, version) from here on


class Engine:
    """Continuous batching: each decode iteration gives every running request one token and
    takes `decode_base_s + decode_per_seq_s * running`; joining requests stall it for their prefill."""

    def __init__(self, c: Cluster, sim: Sim, block: int, on_finish: Callable[[Request, int, str], None]) -> None:
        self.c, self.sim, self.block, self.on_finish = c, sim, block, on_finish
        self.version = 0
        self.running: dict[int, Request] = {}
        self.heap: list[tuple[float, int, Request]] = []
        self.waiting: deque[Request] = deque()
        self.g = 0.0  # decode iterations (in blocks) every running request has seen
        self.t_last = 0.0
        self.stall_until = 0.0
        self.epoch = 0
        self.decode_s = self.prefill_s = self.paused_s = self.batch_s = self.tokens = 0.0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _iter_s(self) -> float:
        return self.block * (self.c.decode_base_s + self.c.decode_per_seq_s * len(self.running))

    def _advance(self) -> None:
        now, start = self.sim.now, max(self.t_last, self.stall_until)
        if self.running and now > start:
            gained = (now - start) / self._iter_s()
            self.g += gained
            self.tokens += gained * len(self.running) * self.block
            self.decode_s += now - start
            self.batch_s += (now - start) * len(self.running)
        self.t_last = now

    def _schedule(self) -> None:
        self.epoch += 1
        while len(self.running) < self.c.max_running and self.waiting:
            self._join(self.waiting.popleft())
        if not self.heap:
            return
        t = max(self.sim.now, self.stall_until) + max(0.0, self.heap[0][0] - self.g) * self._iter_s()
        epoch = self.epoch
        self.sim.at(t, lambda: self._on_event(epoch))

    def _join(self, r: Request) -> None:
        prefill = ((len(r.traj.prompt) + len(r.traj.tokens)) * self.block / self.c.prefill_tokens_per_s
                   + self.c.request_overhead_s)
        self.stall_until = max(self.stall_until, self.sim.now) + prefill
        self.prefill_s += prefill
        r.engine, r.join_g, r.marks = self, self.g, [(self.g, self.version)]
        r.finish_g = self.g + (r.target_blocks - len(r.traj.tokens))
        self.running[id(r)] = r
        heapq.heappush(self.heap, (r.finish_g, id(r), r))

    def submit(self, r: Request) -> None:
        self._advance()
        self.waiting.append(r)
        self._schedule()

    def _on_event(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._advance()
        while self.heap and self.heap[0][0] <= self.g + 1e-6:
            _, _, r = heapq.heappop(self.heap)
            del self.running[id(r)]
            self.on_finish(r, r.target_blocks - len(r.traj.tokens), "finish")
        self._schedule()

    def pause(self, mode: str, seconds: float) -> None:
        """`abort`: running requests return what they have; `in_place`: they wait and go on."""
        self._advance()
        self.stall_until = max(self.stall_until, self.sim.now) + seconds
        self.paused_s += seconds
        if mode == "abort":
            done = list(self.running.values())
            self.running, self.heap = {}, []
            for r in done:
                left = r.target_blocks - len(r.traj.tokens)
                produced = min(left, int(self.g - r.join_g + 1e-6))
                self.on_finish(r, produced, "finish" if produced == left else "abort")
        self._schedule()

    def set_version(self, version: int) -> None:
        self._advance()
        self.version = version
        for r in self.running.values():
            r.marks.append((self.g, version))


def segment_spans(r: Request, produced: int) -> list[VersionSpan]:
    """Version spans of the `produced` tokens of this call (in_place calls cross versions)."""
    out: list[VersionSpan] = []
    cuts = [min(produced, max(0, round(g - r.join_g))) for g, _ in r.marks[1:]] + [produced]
    start = 0
    for (_, v), end in zip(r.marks, cuts):
        if end > start:
            out = spans.extend(out, v, end - start)
            start = end
    return out


# ------------------------------------------------------------------ rollout workers, pool, learner


@dataclass(eq=False)
class Group:
    gid: str
    seq: int
    worker: int
    admitted_version: int
    requests: list[Request] = field(default_factory=list)
    pending: int = 0
    status: str = "generating"
    done_signal: Signal | None = None
    prompt: int = -1  # the prompt's index in the dataset (-1: a fresh prompt)
    score: float = 0.0  # the prompt's length score (Lengths.at)
    step: int = -1  # the step that trained on it

    @property
    def min_version(self) -> int | None:
        return min((v for r in self.requests if (v := spans.min_version(r.traj.spans)) is not None), default=None)


class Run:
    """Engines, rollout workers, the pool and the learner of one simulated run."""

    def __init__(self, c: Cluster, w: Workload) -> None:
        self.c, self.w, self.sim = c, w, Sim()
        self.rng = random.Random(w.seed)
        self.length = w.lengths.sampler(self.rng)
        self.engines = [Engine(c, self.sim, w.token_block, self._finished) for _ in range(c.engines)]
        self.prompt = [0] * math.ceil(w.prompt_tokens / w.token_block)
        self.max_blocks = math.ceil(w.lengths.max_new_tokens / w.token_block)
        self.version = 0  # published; the workers admit under it
        self.started = [0] * w.workers
        self.inflight = [0] * w.workers
        # Streaming admits only what the run's steps claim, plus what the learner drops as stale.
        self.budget = staleness.run_budget(w.steps, w.groups_per_step)
        self.streaming = False
        self.groups: list[Group] = []
        self.complete: dict[int, Group] = {}  # seq -> group, waiting to be claimed
        self.pool_changed = Signal(self.sim)
        self.steps: list[dict[str, Any]] = []
        self.staleness: list[int] = []
        self.wasted_blocks = self.interruptions = self.masked_blocks = 0
        self.train_s = 0.0
        # prompts: a dataset of w.prompts length scores, drawn in chunks ordered by w.schedule
        self.scores = [self.rng.gauss(0.0, 1.0) for _ in range(w.prompts)]
        self.history = lengths.LengthHistory()
        self.chunks: list[deque[int]] = [deque() for _ in range(w.workers)]
        self.drawn = 0  # prompt instances drawn so far, all epochs
        self.epoch_order: list[int] = []

    # ---- rollout workers (streamrl/runtime/rollout.py)
    def _capacity(self, i: int) -> int:
        total = min(self.budget, staleness.admission_capacity(self.version, self.w.max_staleness,
                                                              self.w.groups_per_step))
        return staleness.capacity_share(total, i, staleness.capacity_shares(self.w.workers, False))

    def _pump(self) -> None:
        if not self.streaming:
            return
        for i in range(self.w.workers):
            room = min(self._capacity(i) - self.started[i], self.w.max_concurrency - self.inflight[i])
            for _ in range(max(0, room)):
                self._start_group(i)

    def _start_group(self, worker: int, signal: Signal | None = None) -> Group:
        g = Group(gid=f"w{worker}-{len(self.groups):08d}", seq=len(self.groups), worker=worker,
                  admitted_version=self.version, done_signal=signal)
        if self.w.prompts:
            g.prompt = self._next_prompt(worker)
            g.score = self.scores[g.prompt]
        elif self.w.lengths.within < 1.0:
            g.score = self.rng.gauss(0.0, 1.0)
        self.groups.append(g)
        self.started[worker] += 1
        self.inflight[worker] += 1
        for k in range(self.w.n_samples):
            t = partial.Trajectory(prompt=self.prompt, max_new_tokens=self.max_blocks)
            g.requests.append(Request(t, g, k, self._new_target(g), start_s=self.sim.now))
        g.pending = self.w.n_samples
        for r in g.requests:
            self._route(r)
        return g

    def _next_prompt(self, worker: int) -> int:
        """The worker's next prompt: chunks of the dataset's epochs, ordered by the schedule from the
        lengths seen so far (one history for all workers: the runtime reads the pool's each epoch)."""
        chunk = self.chunks[worker]
        if not chunk:
            drawn = []
            for _ in range(math.ceil((self.w.schedule_window or 4 * self.w.groups_per_step) / self.w.workers)):
                if self.drawn % self.w.prompts == 0:
                    self.epoch_order = list(range(self.w.prompts))
                    random.Random(self.w.seed + self.drawn).shuffle(self.epoch_order)
                drawn.append(self.epoch_order[self.drawn % self.w.prompts])
                self.drawn += 1
            chunk.extend(lengths.order(drawn, [self.history.predict(str(p)) for p in drawn], self.w.schedule,
                                       self.w.tail_fraction))
        return chunk.popleft()

    def _new_target(self, g: Group) -> int:
        if g.prompt < 0 and self.w.lengths.within >= 1.0:
            return math.ceil(self.length() / self.w.token_block)
        w = self.w.lengths.within
        z = math.sqrt(1.0 - w) * g.score + math.sqrt(w) * self.rng.gauss(0.0, 1.0)
        return math.ceil(self.w.lengths.at(z) / self.w.token_block)

    def _route(self, r: Request) -> None:
        a, b = self.rng.sample(self.engines, 2) if len(self.engines) > 1 else (self.engines[0],) * 2
        (a if a.load <= b.load else b).submit(r)  # sglang-router's power_of_two

    def _finished(self, r: Request, produced: int, how: str) -> None:
        """An engine call ended: feed it through the partial-rollout transitions."""
        t = r.traj
        if how == "finish":
            finish = "length" if r.target_blocks >= self.max_blocks else "stop"
        else:
            finish = "abort"
            self.interruptions += 1
        if finish == "abort" and self.w.partial_rollout == "restart":
            self.wasted_blocks += len(t.tokens) + produced
        partial.absorb(t, [0] * produced, [0.0] * produced, segment_spans(r, produced), finish, self.w.partial_rollout)
        if not t.done:
            if self.w.partial_rollout == "restart":
                r.target_blocks = self._new_target(r.group)  # a new sample
            self._route(r)
            return
        g = r.group
        g.pending -= 1
        r.end_s = self.sim.now
        if g.pending == 0:
            if g.prompt >= 0:
                self.history.observe(str(g.prompt), [len(q.traj.tokens) * self.w.token_block for q in g.requests])
            g.status = "complete"
            self.inflight[g.worker] -= 1
            self.complete[g.seq] = g
            if g.done_signal is not None:
                g.done_signal.fire()
            self._changed()
            self._pump()

    def _changed(self) -> None:
        sig, self.pool_changed = self.pool_changed, Signal(self.sim)
        sig.fire()

    def generate(self, num_groups: int) -> Generator[Any, Any, None]:
        """Lockstep / one-step-off: exactly `num_groups` groups, split between the workers."""
        sigs = []
        for i in range(self.w.workers):
            for _ in range(staleness.capacity_share(num_groups, i, self.w.workers)):
                sigs.append(Signal(self.sim))
                self._start_group(i, sigs[-1])
        for s in sigs:
            yield s

    def start_streaming(self) -> None:
        self.streaming = True
        self._pump()

    # ---- the learner (LancePool.claim + the training step)
    def _claim(self, step: int) -> list[Group] | None:
        if len(self.complete) < self.w.groups_per_step:
            return None
        order = [self.complete[k] for k in sorted(self.complete)]
        take, mask, drop = staleness.select_groups(((g.gid, g.min_version) for g in order), step,
                                                   self.w.groups_per_step, self.w.max_staleness, self.w.policy)
        by_id = {g.gid: g for g in order}
        for gid in drop:
            g = by_id[gid]
            g.status = "dropped"
            del self.complete[g.seq]
            self.wasted_blocks += sum(len(r.traj.tokens) for r in g.requests)
        if drop:  # the driver grows the workers' budget by the learner's stale drops
            self.budget += len(drop)
            self._pump()
        if len(take) < self.w.groups_per_step:
            return None
        out = []
        for gid in take:
            g = by_id[gid]
            g.status, g.step = "consumed", step
            del self.complete[g.seq]
            if gid in mask:
                self.masked_blocks += sum(int((staleness.stale_token_mask(r.traj.spans, step, self.w.max_staleness) == 0)
                                              .sum()) for r in g.requests)
            self.staleness.append(staleness.staleness(step, g.min_version))
            out.append(g)
        return out

    def train_step(self, step: int) -> Generator[Any, Any, dict[str, Any]]:
        t0 = self.sim.now
        while (batch := self._claim(step)) is None:
            yield self.pool_changed
        waited = self.sim.now - t0
        tokens = sum((len(r.traj.prompt) + len(r.traj.tokens)) * self.w.token_block
                     for g in batch for r in g.requests)
        train = self.c.learner_step_overhead_s + tokens / (self.c.learner_gpus * self.c.learner_tokens_per_s_per_gpu)
        yield train
        self.train_s += train
        m = {"step": step, "wait_s": waited, "train_s": train, "samples": len(batch) * self.w.n_samples,
             "tokens": tokens}
        return m

    def publish(self, step: int, m: dict[str, Any], interrupt: bool) -> Generator[Any, Any, None]:
        seconds = self.c.broadcast_latency_s + self.c.model_bytes / self.c.broadcast_bytes_per_s
        mode = ("in_place" if self.w.partial_rollout == "in_place" else "abort") if interrupt else None
        for e in self.engines:
            e.pause(mode or "idle", seconds)
        yield seconds
        for e in self.engines:
            e.set_version(step + 1)
        self.version = step + 1
        m["end_s"] = self.sim.now
        self.steps.append(m)
        self._pump()


# ------------------------------------------------------------------ the three loops (streamrl/runtime/loop.py)


def stream(cl: Run, steps: int) -> Generator[Any, Any, None]:
    cl.start_streaming()
    for step in range(steps):
        m = yield cl.sim.spawn(cl.train_step(step))
        yield cl.sim.spawn(cl.publish(step, m, interrupt=True))  # the learner's next step waits for the push


def lockstep(cl: Run, steps: int) -> Generator[Any, Any, None]:
    for step in range(steps):
        yield cl.sim.spawn(cl.generate(cl.w.groups_per_step))
        m = yield cl.sim.spawn(cl.train_step(step))
        yield cl.sim.spawn(cl.publish(step, m, interrupt=False))


def one_step_off(cl: Run, steps: int) -> Generator[Any, Any, None]:
    gen = cl.sim.spawn(cl.generate(cl.w.groups_per_step))
    for step in range(steps):
        yield gen
        gen = cl.sim.spawn(cl.generate(cl.w.groups_per_step)) if step + 1 < steps else None
        m = yield cl.sim.spawn(cl.train_step(step))
        if gen is not None:
            yield gen
        yield cl.sim.spawn(cl.publish(step, m, interrupt=False))


LOOPS = {"stream": stream, "lockstep": lockstep, "one_step_off": one_step_off}


# ------------------------------------------------------------------ one run


def ledger_of(groups: Iterable[Group]) -> dict[str, int]:
    gids, n, rg, ri, rs = [], [], [], [], []
    for g in groups:
        gids.append(g.gid)
        n.append(len(g.requests))
        if g.status != "generating":
            for r in g.requests:
                rg.append(g.gid)
                ri.append(r.index)
                rs.append(g.status)
    adm = pa.table({"group_id": pa.array(gids, pa.string()), "n": pa.array(n, pa.int32())})
    rows = pa.table({"group_id": pa.array(rg, pa.string()), "sample_index": pa.array(ri, pa.int32()),
                     "status": pa.array(rs, pa.string())})
    led = compute_ledger(adm, rows)
    return {k: getattr(led, k) for k in ("admitted", "in_flight", "complete", "consumed", "dropped",
                                         "lost", "duplicated", "unadmitted")}


def tail_share_of(groups: Iterable[Group]) -> float | None:
    """Seer's tail share over the steps: each step's batch is the requests of the groups it trained on."""
    by_step: dict[int, tuple[list[float], list[float]]] = {}
    for g in groups:
        if g.status == "consumed":
            starts, ends = by_step.setdefault(g.step, ([], []))
            starts.extend(r.start_s for r in g.requests)
            ends.extend(r.end_s for r in g.requests)
    return lengths.tail_share(list(by_step.values()))


def peak_tokens_per_s(c: Cluster) -> float:
    """One engine's output tokens/s with `max_running` requests decoding."""
    return c.max_running / (c.decode_base_s + c.decode_per_seq_s * c.max_running)


def simulate(c: Cluster, w: Workload) -> dict[str, Any]:
    if w.mode not in LOOPS:
        raise ValueError(f"mode must be one of {', '.join(LOOPS)}, got {w.mode!r}")
    cl = Run(c, w)
    done = cl.sim.spawn(LOOPS[w.mode](cl, w.steps))
    cl.sim.run_until(done)
    end = cl.sim.now
    warm = min(w.warmup_steps, w.steps - 1)
    t_from = cl.steps[warm - 1]["end_s"] if warm else 0.0
    samples = sum(m["samples"] for m in cl.steps[warm:])
    tokens = sum(m["tokens"] for m in cl.steps[warm:])
    for e in cl.engines:
        e._advance()
    eng_time = end * len(cl.engines)
    decode = sum(e.decode_s for e in cl.engines)
    st = np.asarray(cl.staleness or [0])
    return {
        "mode": w.mode, "max_staleness": w.max_staleness, "partial_rollout": w.partial_rollout,
        "steps": w.steps, "wall_s": end, "steady_s": end - t_from,
        "samples_per_s": samples / max(1e-12, end - t_from),
        "train_tokens_per_s": tokens / max(1e-12, end - t_from),
        "response_tokens_mean": w.token_block * float(np.mean(
            [len(r.traj.tokens) for g in cl.groups if g.status == "consumed" for r in g.requests] or [0])),
        "engine_utilisation": sum(e.tokens for e in cl.engines) / max(1e-12, eng_time * peak_tokens_per_s(c)),
        "engine_busy": (decode + sum(e.prefill_s for e in cl.engines)) / max(1e-12, eng_time),
        "engine_mean_batch": sum(e.batch_s for e in cl.engines) / max(1e-12, decode),
        "engine_paused_fraction": sum(e.paused_s for e in cl.engines) / max(1e-12, eng_time),
        "learner_utilisation": cl.train_s / max(1e-12, end),
        "learner_wait_s_per_step": float(np.mean([m["wait_s"] for m in cl.steps])),
        "staleness_mean": float(st.mean()), "staleness_max": int(st.max()),
        "interrupted_calls": cl.interruptions,
        "tail_share": tail_share_of(cl.groups),
        "wasted_token_fraction": cl.wasted_blocks / max(1, cl.wasted_blocks + sum(
            len(r.traj.tokens) for g in cl.groups for r in g.requests if g.status == "consumed")),
        "masked_tokens": cl.masked_blocks * w.token_block,
        "ledger": ledger_of(cl.groups),
    }
