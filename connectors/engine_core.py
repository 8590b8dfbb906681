"""The embedded engine's scheduler: continuous batching over a transformers causal LM.

Requests join and leave between decode steps. The running requests' KV caches live in one
left-padded batch cache (per layer, [batch, kv_heads, length, head_dim]) that a decode step
extends in place of re-building it: when requests leave, their rows are dropped with one
index_select per layer; only a request that joins (after its prefill, with a cache of its own)
is padded in. Re-padding every request's cache on every step cost as much as the model itself
on long responses (benchmarks/engine_throughput.py). No HTTP, no asyncio: the server
(connectors/engine_server.py) drives it from a thread.

Log-probs follow SGLang: log_softmax(logits / temperature) of the sampled token (the raw
logits when temperature is 0, i.e. greedy); top-p/top-k shape sampling, not the log-prob.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
IN_BATCH: KV = []  # GenRequest.kv of a request whose cache is a row of the engine's batch cache


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    on_done: Callable[[GenRequest], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)  # [version, start, end] of output tokens
    finish: dict[str, Any] | None = None
    kv: KV | None = None
    generator: torch.Generator | None = None
    retractions: int = 0
    error: str | None = None  # this request failed on its own (its sampling); the others go on

    def record(self, token: int, logprob: float, version: str) -> None:
        n = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n + 1
        else:
            self.spans.append([version, n, n + 1])


class EngineCore:
    """Thread-safe: public methods may be called from any thread; `run()` owns the model."""

    def __init__(self, model_dir: str | Path, max_running: int = 64, max_context: int | None = None,
                 weight_version: str = "0", seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        cfg = self.model.config
        self.eos_ids = frozenset([cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id or [])
        self.max_context = max_context or cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.max_running = max_running
        self.prefill_batch = 32  # requests prefilled together per loop turn
        self.weight_version = weight_version
        self.seed = seed
        self._waiting: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        self._joining: list[GenRequest] = []  # taken from the queue, being prefilled
        self._paused: str | None = None  # None, or the pause mode
        self._cond = threading.Condition()
        self._stop = False
        self._control: deque[tuple[Callable[[], Any], Any]] = deque()
        self._batch: list[GenRequest] = []  # the rows of _cache, in order
        self._cache: KV = []  # per layer (keys, values) of _batch, left-padded to the longest
        self._lens: list[int] = []  # each row's cached length
        self.steps = 0  # decode steps run, for metrics and tests
        self.rebatches = 0  # decode steps whose batch changed (rows dropped or joined)
        self.max_batch_seen = 0

    # ------------------------------------------------------------ public (any thread)

    def submit(self, req: GenRequest) -> None:
        if req.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(req.sampling_seed)
        with self._cond:
            self._waiting.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result (blocking)."""
        import concurrent.futures as cf

        fut: cf.Future[Any] = cf.Future()
        with self._cond:
            self._control.append((fn, fut))
            self._cond.notify_all()
        return fut.result()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    @property
    def num_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    # ------------------------------------------------------------ control (engine thread via call)

    def can_flush(self) -> bool:
        """SGLang's rule for flushing the cache (Scheduler.flush_cache: is_fully_idle with
        ignore_waiting while paused): nothing running, and nothing waiting unless paused. An
        `in_place` pause keeps its requests running, so it never can; `retract` and `abort` can."""
        return not self._running and not self._joining and (self._paused is not None or not self._waiting)

    def abort(self, rid: str | None = None) -> int:
        """Finish matching requests now with what they have; returns how many."""
        hit = [r for r in [*self._running, *self._waiting] if rid is None or r.rid == rid]
        for r in hit:
            self._finish(r, {"type": "abort", "message": "Abort before prefill" if not r.output_ids
                             and r.kv is None else "Abort in generation"})
        return len(hit)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort()
        elif mode == "retract":  # drop KV; they are recomputed from prompt + output on continue
            for r in self._running:
                r.kv = None
                r.retractions += 1
            self._waiting.extendleft(reversed(self._running))
            self._running = []
        elif mode != "in_place":
            raise ValueError(f"mode must be abort, retract or in_place, got {mode!r}")
        self._paused = mode

    def resume(self) -> None:
        self._paused = None

    @property
    def paused(self) -> str | None:
        return self._paused

    def load_state_dict(self, state: dict[str, torch.Tensor], version: str | None) -> None:
        """Copy `state` (a subset of the model's weights) into the model; checked whole first, so
        a bad update changes nothing."""
        own = self.model.state_dict()
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise ValueError(f"unknown weight names: {unexpected[:5]}")
        wrong = [f"{k}: {tuple(t.shape)} for {tuple(own[k].shape)}" for k, t in state.items() if t.shape != own[k].shape]
        if wrong:
            raise ValueError(f"shape mismatch: {'; '.join(wrong[:5])}")
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        if version is not None:
            self.weight_version = version

    def load_from_disk(self, model_path: str, version: str | None) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        if "lm_head.weight" not in state and getattr(self.model.config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.load_state_dict(state, version)
        self.model_dir = model_path

    # ------------------------------------------------------------ the loop (engine thread)

    def run(self) -> None:
        torch.manual_seed(self.seed)
        while True:
            with self._cond:
                while not self._stop and not self._control and (
                        self._paused or (not self._waiting and not self._running)):
                    self._cond.wait()
                if self._stop:
                    break
                controls = list(self._control)
                self._control.clear()
            for fn, fut in controls:
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller sees it
                    fut.set_exception(e)
            if self._paused:
                continue
            try:
                self._admit()
                if self._running:
                    self._decode()
            except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
                for r in [*self._running, *self._joining]:
                    self._finish(r, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"})
                self._running, self._joining = [], []
        self.abort()

    def _admit(self) -> None:
        """Prefill up to `prefill_batch` waiting requests in one forward. The rest wait for the
        next loop turn, so pause/abort/weight updates are never held up behind a long queue."""
        with self._cond:
            room = min(self.prefill_batch, self.max_running - len(self._running) - len(self._joining))
            while self._waiting and room > 0:
                self._joining.append(self._waiting.popleft())
                room -= 1
        if not self._joining:
            return
        for r in [r for r in self._joining if r.max_new_tokens == 0]:  # prefill only, as SGLang: nothing generated
            self._finish(r, {"type": "length", "length": 0})
        todo = [r for r in self._joining if r.finish is None]
        if todo:
            self._prefill(todo)
        self._joining = []

    @torch.inference_mode()
    def _prefill(self, reqs: list[GenRequest]) -> None:
        """Run prompts (+ any output kept from before a retract or resume), left-padded into one
        batch, and sample one token each; each request keeps its slice of the KV cache."""
        seqs = [r.input_ids + r.output_ids for r in reqs]
        lens = [len(x) for x in seqs]
        lmax = max(lens)
        ids = torch.zeros(len(reqs), lmax, dtype=torch.long)
        mask = torch.zeros(len(reqs), lmax, dtype=torch.long)
        for i, (x, n) in enumerate(zip(seqs, lens)):
            ids[i, lmax - n:] = torch.tensor(x)
            mask[i, lmax - n:] = 1
        if len(reqs) == 1:  # no padding: the plain call
            out = self.model(input_ids=ids, use_cache=True)
        else:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=True)
        layers = out.past_key_values.layers
        for i, (r, n) in enumerate(zip(reqs, lens)):
            r.kv = [(layer.keys[i: i + 1, :, lmax - n:], layer.values[i: i + 1, :, lmax - n:]) for layer in layers]
        self._sample_and_record(reqs, out.logits[:, -1, :])
        self._running.extend(r for r in reqs if r.finish is None)

    def _rebatch(self) -> None:
        """Make the batch cache hold exactly the running requests: the rows of those still in it
        (one index_select per layer, trimmed to the longest of them), then those that joined."""
        row = {id(r): i for i, r in enumerate(self._batch)}
        kept = [r for r in self._running if r.kv is IN_BATCH and id(r) in row]
        joined = [r for r in self._running if r.kv is not IN_BATCH]
        kept_lens = [self._lens[row[id(r)]] for r in kept]
        lens = kept_lens + [r.kv[0][0].shape[2] for r in joined]  # type: ignore[index]
        lmax = max(lens)
        cache: KV = []
        n_layers = len(self._cache) if kept else len(joined[0].kv)  # type: ignore[arg-type]
        for li in range(n_layers):
            ks, vs = [], []
            if kept:
                idx = torch.tensor([row[id(r)] for r in kept])
                k, v = self._cache[li]
                cut = k.shape[2] - max(kept_lens)  # columns no kept row uses
                ks.append(_left_pad(k.index_select(0, idx)[:, :, cut:], lmax))
                vs.append(_left_pad(v.index_select(0, idx)[:, :, cut:], lmax))
            for r in joined:
                k, v = r.kv[li]  # type: ignore[index]
                ks.append(_left_pad(k, lmax))
                vs.append(_left_pad(v, lmax))
            cache.append((torch.cat(ks) if len(ks) > 1 else ks[0], torch.cat(vs) if len(vs) > 1 else vs[0]))
        for r in joined:
            r.kv = IN_BATCH
        self._running = kept + joined
        self._batch, self._cache, self._lens = list(self._running), cache, lens
        self.rebatches += 1

    @torch.inference_mode()
    def _decode(self) -> None:
        from transformers import DynamicCache

        if len(self._running) != len(self._batch) or any(a is not b for a, b in zip(self._running, self._batch)) \
                or any(r.kv is not IN_BATCH for r in self._running):
            self._rebatch()
        batch, lens = self._batch, self._lens
        lmax = self._cache[0][0].shape[2]
        mask = torch.zeros(len(batch), lmax + 1, dtype=torch.long)
        for i, n in enumerate(lens):
            mask[i, lmax - n:] = 1
        out = self.model(
            input_ids=torch.tensor([[r.output_ids[-1]] for r in batch]),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens]),
            past_key_values=DynamicCache(self._cache),
            use_cache=True,
        )
        self._cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self._lens = [n + 1 for n in lens]
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        self._sample_and_record(list(batch), out.logits[:, -1, :])
        self._running = [r for r in batch if r.finish is None]

    def _sample_and_record(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        logits = logits.float()
        for i, r in enumerate(reqs):
            try:
                tok, lp = _pick(logits[i], r)
            except (RuntimeError, ValueError) as e:  # one request's bad numbers must not end the others
                r.error = f"sampling failed: {type(e).__name__}: {e}"
                self._finish(r, {"type": "abort", "message": r.error})
                continue
            r.record(tok, lp, self.weight_version)
            n = len(r.output_ids)
            total = len(r.input_ids) + n
            if not r.ignore_eos and n >= r.min_new_tokens and (tok in self.eos_ids or tok in r.stop_token_ids):
                self._finish(r, {"type": "stop", "matched": tok})
            elif n >= r.max_new_tokens or total >= self.max_context:
                self._finish(r, {"type": "length", "length": n})

    def _finish(self, r: GenRequest, reason: dict[str, Any]) -> None:
        if r.finish is not None:
            return
        r.finish, r.kv = reason, None
        with self._cond:
            if r in self._waiting:
                self._waiting.remove(r)
        if r in self._running:
            self._running.remove(r)
        if r.on_done is not None:
            r.on_done(r)


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """`t` ([batch, heads, n, dim]) with zeros in front up to `length` positions."""
    pad = length - t.shape[2]
    return torch.nn.functional.pad(t, (0, 0, pad, 0)) if pad else t


def _pick(row: torch.Tensor, r: GenRequest) -> tuple[int, float]:
    """The next token of `r` and its log-prob (module doc: SGLang's definition)."""
    if r.temperature == 0:
        tok = int(torch.argmax(row))
        return tok, float(torch.log_softmax(row, -1)[tok])
    scaled = row / r.temperature
    tok = _sample(scaled, r.top_p, r.top_k, r.generator)
    return tok, float(torch.log_softmax(scaled, -1)[tok])


def _sample(scaled: torch.Tensor, top_p: float, top_k: int, gen: torch.Generator | None) -> int:
    probs = torch.softmax(scaled, -1)
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p * sp.sum()
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
