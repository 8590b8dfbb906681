"""The embedded engine's scheduler: continuous batching over a transformers causal LM.

Requests join and leave between decode steps. The running requests' KV caches live in one
left-padded batch cache (per layer, [batch, kv_heads, capacity, head_dim], `_GrowingLayer`)
that a decode step writes into in place: no per-step copy of the cache (transformers'
DynamicCache concatenates, i.e. copies the whole cache, on every step, and once more when
built from tensors). The capacity grows by half when full (amortised O(1) per token). When
requests leave, their rows are dropped with one index_select per layer; only a request that
joins (after its prefill, with a cache of its own) is padded in. No HTTP, no asyncio: the
server (connectors/sglang/engine_server.py) drives it from a thread.

Prefill shares identical sequences: requests admitted together whose prompt (+ kept output)
is the same token list are run as one row and share its KV (views of one tensor; the batch
cache copies them in when they join). SGLang's `n > 1` (a group of n samples of one prompt,
submitted together with `submit_many`) costs one prefill, as SGLang's radix cache makes it.

Stop strings follow SGLang (Req._check_str_based_finish): after each token the last
(longest stop string in tokens + 1) output tokens are decoded and the request stops on the
first listed string found there, before the stop-token and length checks, whatever
ignore_eos and min_new_tokens say.

Device: the GPU when torch sees one (as SGLang), else the CPU; `device=` overrides. Per-request
sampling generators stay on the CPU (a seeded request's tokens do not depend on the device's
random state), so only one uniform per row crosses to the device each step.

Log-probs follow SGLang: log_softmax(logits / temperature) of the sampled token (the raw
logits when temperature is 0, i.e. greedy); top-p/top-k shape sampling, not the log-prob.
Prompt log-probs (`input_logprob_start`) are log_softmax of the raw logits, as SGLang's
InputLogprobProcessor: the entry of the first requested token is None, as in SGLang.

Routed experts (MoE routing replay, SGLang's `--enable-return-routed-experts`): forward hooks on
each layer's router (`mlp.gate`) record its top-k expert ids for every position a forward
processes, kept only for requests that ask (`routed_experts`). A request's rows are its
positions in order as the model processed them (prefill: prompt + kept output, decode: one per
step), so under an in-place weight update each row is what the weights of that moment routed.
A re-prefill (retract) processes every position again and replaces them, as SGLang's capture does.

Long file: the scheduler, its batch cache and the sampling rules are one state machine on one thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Cache
from transformers.cache_utils import DynamicLayer

from streamrl.connectors.sglang.engine_lora import Adapters
from streamrl.connectors.sglang.expert_weights import expert_views

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
    stop_strs: tuple[str, ...] = ()
    stop_window: int = 0  # output tokens decoded to look for stop strings (module doc)
    input_logprob_start: int | None = None  # prompt log-probs from this position; None: none
    input_logprobs: list[float | None] | None = None  # one per input_ids[input_logprob_start:]
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
    routed_experts: bool = False  # keep the router's choices for each position (module doc)
    routing: list[torch.Tensor] | None = None  # [positions, layers, top_k] int32 pieces, in position order
    lora: str | None = None  # the LoRA adapter it runs with from start to finish (SGLang's lora_path)

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
                 weight_version: str = "0", seed: int = 0,
                 decode: Callable[[list[int]], str] | None = None, device: str | None = None,
                 enable_return_routed_experts: bool = True) -> None:
        self.model_dir = str(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device).eval()
        cfg = self.model.config
        self.eos_ids = frozenset([cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id or [])
        self.max_context = max_context or cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.max_running = max_running
        self.prefill_batch = 32  # requests prefilled together per loop turn
        self.weight_version = weight_version
        self.seed = seed
        self.decode = decode  # token ids -> text, for stop strings
        self._waiting: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        self._joining: list[GenRequest] = []  # taken from the queue, being prefilled
        self._paused: str | None = None  # None, or the pause mode
        self._cond = threading.Condition()
        self._stop = False
        self._control: deque[tuple[Callable[[], Any], Any]] = deque()
        self._batch: list[GenRequest] = []  # the rows of _cache, in order
        self._cache: list[_GrowingLayer] = []  # per layer, _batch's rows left-padded to the longest
        self._lens: list[int] = []  # each row's cached length
        self.steps = 0  # decode steps run, for metrics and tests
        self.rebatches = 0  # decode steps whose batch changed (rows dropped or joined)
        self.max_batch_seen = 0
        self.prefill_tokens = 0  # token positions run through prefill (shared rows once)
        self.moe_layers, self.moe_top_k = cfg.num_hidden_layers, getattr(cfg, "num_experts_per_tok", None)
        self._routes: dict[int, torch.Tensor] | None = None  # layer -> this forward's router ids, when asked
        gates = _routers(self.model) if enable_return_routed_experts and self.moe_top_k else []
        for li, gate in gates:
            gate.register_forward_hook(lambda _m, _i, out, li=li: self._on_route(li, out))
        self.captures_routing = bool(gates)
        self.adapters = Adapters(self.model)  # LoRA adapters by name (connectors/sglang/engine_lora.py)

    def _on_route(self, layer: int, out: Any) -> None:
        if self._routes is not None:
            self._routes[layer] = next(t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point())

    def _start_routes(self, reqs: list[GenRequest]) -> None:
        self._routes = {} if self.captures_routing and any(r.routed_experts for r in reqs) else None

    def _take_routes(self, rows: int, cols: int) -> torch.Tensor | None:
        """The hooks' record of the forward just run as [rows, cols, layers, top_k] int32 on the
        CPU (a layer without a router: zeros, as SGLang's buffer); None when nobody asked."""
        got, self._routes = self._routes, None
        if got is None:
            return None
        out = torch.zeros(self.moe_layers, rows * cols, self.moe_top_k, dtype=torch.int32, device=self.device)
        for li, ids in got.items():
            out[li] = ids.reshape(rows * cols, -1)[:, : self.moe_top_k]
        return out.permute(1, 0, 2).reshape(rows, cols, self.moe_layers, self.moe_top_k).cpu()

    # ------------------------------------------------------------ public (any thread)

    def submit(self, req: GenRequest) -> None:
        self.submit_many([req])

    def submit_many(self, reqs: list[GenRequest]) -> None:
        """Queue `reqs` next to each other, so that those with one prompt are admitted (and
        prefilled) together as far as free slots allow."""
        for req in reqs:
            if req.stop_strs and self.decode is None:
                raise ValueError("stop strings need the engine's decode function")
            if req.sampling_seed is not None:
                req.generator = torch.Generator().manual_seed(req.sampling_seed)
        with self._cond:
            self._waiting.extend(reqs)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result (blocking)."""
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

    def uses_adapter(self, name: str) -> bool:
        """Whether a request still queued or running names LoRA adapter `name`."""
        return any(r.lora == name for r in [*self._waiting, *self._joining, *self._running])

    @property
    def paused(self) -> str | None:
        return self._paused

    def load_state_dict(self, state: dict[str, torch.Tensor], version: str | None) -> None:
        """Copy `state` (a subset of the model's weights) into the model; checked whole first, so
        a bad update changes nothing."""
        own = self.model.state_dict()
        plain, experts, unexpected = expert_views(state, own)  # per-expert HF names fill fused tensors
        if unexpected:
            raise ValueError(f"unknown weight names: {sorted(unexpected)[:5]}")
        targets = [*((k, own[k], t) for k, t in plain.items()), *experts]
        wrong = [f"{k}: {tuple(t.shape)} for {tuple(dst.shape)}" for k, dst, t in targets if t.shape != dst.shape]
        if wrong:
            raise ValueError(f"shape mismatch: {'; '.join(wrong[:5])}")
        with torch.no_grad():
            for _, dst, t in targets:
                dst.copy_(t)
        if version is not None:
            self.weight_version = version

    def load_from_disk(self, model_path: str, version: str | None) -> None:
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
            room = self.max_running - len(self._running) - len(self._joining)
            rows: set[tuple[int, ...]] = set()  # prefill_batch bounds distinct sequences, not requests
            while self._waiting and room > 0:
                key = _seq_key(self._waiting[0])
                if key not in rows and len(rows) == self.prefill_batch:
                    break
                rows.add(key)
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
        batch, one row per distinct sequence, and sample one token each; each request keeps its
        row's slice of the KV cache (requests with one sequence share it)."""
        rows: dict[tuple[Any, ...], int] = {}
        row_of = [rows.setdefault(_seq_key(r), len(rows)) for r in reqs]
        seqs = [key[1:] for key in rows]  # the key leads with the request's adapter
        self.adapters.rows = [key[0] for key in rows]
        lens = [len(x) for x in seqs]
        lmax = max(lens)
        ids = torch.zeros(len(seqs), lmax, dtype=torch.long)
        mask = torch.zeros(len(seqs), lmax, dtype=torch.long)
        for i, (x, n) in enumerate(zip(seqs, lens)):
            ids[i, lmax - n:] = torch.tensor(x)
            mask[i, lmax - n:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        want_input = [r.input_logprob_start is not None and r.input_logprobs is None for r in reqs]
        # logits for the last position only unless prompt log-probs are wanted: lm_head over
        # every position costs as much as the rest of a small model's prefill
        keep = 0 if any(want_input) else 1
        self._start_routes(reqs)
        if len(seqs) == 1:  # no padding: the plain call
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep)
        else:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=True, logits_to_keep=keep)
        self.prefill_tokens += sum(lens)
        routes = self._take_routes(len(seqs), lmax)
        layers = out.past_key_values.layers
        kvs = [[(layer.keys[i: i + 1, :, lmax - n:], layer.values[i: i + 1, :, lmax - n:]) for layer in layers]
               for i, n in enumerate(lens)]
        for r, i, want in zip(reqs, row_of, want_input):
            r.kv = kvs[i]
            if routes is not None and r.routed_experts:  # every position again: replaces a retracted request's
                r.routing = [routes[i, lmax - lens[i]:].clone()]  # a copy: a view would keep the whole batch's
            if want:
                r.input_logprobs = _input_logprobs(out.logits[i, lmax - lens[i]:], r)
        self._sample_and_record(reqs, out.logits[:, -1, :][torch.tensor(row_of, device=self.device)])
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
        n_layers = len(self._cache) if kept else len(joined[0].kv)  # type: ignore[arg-type]
        cache: list[_GrowingLayer] = []
        for li in range(n_layers):
            ks, vs = [], []
            if kept:
                idx = torch.tensor([row[id(r)] for r in kept], device=self.device)
                k, v = self._cache[li].keys, self._cache[li].values
                cut = k.shape[2] - max(kept_lens)  # columns no kept row uses
                ks.append(_left_pad(k.index_select(0, idx)[:, :, cut:], lmax))
                vs.append(_left_pad(v.index_select(0, idx)[:, :, cut:], lmax))
            for r in joined:
                k, v = r.kv[li]  # type: ignore[index]
                ks.append(_left_pad(k, lmax))
                vs.append(_left_pad(v, lmax))
            cache.append(_GrowingLayer(torch.cat(ks) if len(ks) > 1 else ks[0], torch.cat(vs) if len(vs) > 1 else vs[0]))
        for r in joined:
            r.kv = IN_BATCH
        self._running = kept + joined
        self._batch, self._cache, self._lens = list(self._running), cache, lens
        self.rebatches += 1

    @torch.inference_mode()
    def _decode(self) -> None:
        if len(self._running) != len(self._batch) or any(a is not b for a, b in zip(self._running, self._batch)) \
                or any(r.kv is not IN_BATCH for r in self._running):
            self._rebatch()
        batch, lens = self._batch, self._lens
        lmax = self._cache[0].n
        mask = torch.zeros(len(batch), lmax + 1, dtype=torch.long)
        for i, n in enumerate(lens):
            mask[i, lmax - n:] = 1
        self._start_routes(batch)
        self.adapters.rows = [r.lora for r in batch]
        out = self.model(
            input_ids=torch.tensor([[r.output_ids[-1]] for r in batch], device=self.device),
            attention_mask=mask.to(self.device),
            position_ids=torch.tensor([[n] for n in lens], device=self.device),
            past_key_values=Cache(layers=self._cache),  # written in place (_GrowingLayer)
            use_cache=True,
        )
        self._lens = [n + 1 for n in lens]
        routes = self._take_routes(len(batch), 1)
        if routes is not None:
            for r, row in zip(batch, routes):
                if r.routing is not None:
                    r.routing.append(row.clone())  # a view would keep the whole step's rows alive
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        self._sample_and_record(list(batch), out.logits[:, -1, :])
        self._running = [r for r in batch if r.finish is None]

    def _sample_and_record(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        for r, picked in zip(reqs, _pick_many(logits.float(), reqs)):
            if isinstance(picked, Exception):  # one request's bad numbers must not end the others
                r.error = f"sampling failed: {type(picked).__name__}: {picked}"
                self._finish(r, {"type": "abort", "message": r.error})
                continue
            tok, lp = picked
            r.record(tok, lp, self.adapters.version(r.lora, self.weight_version))
            n = len(r.output_ids)
            total = len(r.input_ids) + n
            hit = self._stop_str(r)
            if hit is not None:
                self._finish(r, {"type": "stop", "matched": hit})
            elif not r.ignore_eos and n >= r.min_new_tokens and (tok in self.eos_ids or tok in r.stop_token_ids):
                self._finish(r, {"type": "stop", "matched": tok})
            elif n >= r.max_new_tokens or total >= self.max_context:
                self._finish(r, {"type": "length", "length": n})

    def _stop_str(self, r: GenRequest) -> str | None:
        """The first of `r`'s stop strings in the text of its last output tokens (module doc)."""
        if not r.stop_strs:
            return None
        tail = self.decode(r.output_ids[-r.stop_window:])  # type: ignore[misc]
        return next((s for s in r.stop_strs if s in tail), None)

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


class _GrowingLayer(DynamicLayer):
    """One layer of the batch cache: keys/values in buffers with room to grow, written in
    place by the model's `update` (DynamicLayer's protocol, without its concatenation);
    `keys`/`values` are views of the `n` positions in use."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.is_initialized = True
        self.n = keys.shape[2]
        self._k = self._room(keys, self.n + max(16, self.n // 2))
        self._v = self._room(values, self._k.shape[2])
        self.device, self.dtype = keys.device, keys.dtype
        self._views()

    @staticmethod
    def _room(t: torch.Tensor, cap: int) -> torch.Tensor:
        buf = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
        buf[:, :, : t.shape[2]] = t
        return buf

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.n], self._v[:, :, : self.n]

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        m = keys.shape[2]
        if self.n + m > self._k.shape[2]:  # grow by half: amortised O(1) copies per token
            cap = self.n + m + max(16, self.n // 2)
            self._k, self._v = self._room(self.keys, cap), self._room(self.values, cap)
        self._k[:, :, self.n: self.n + m] = keys
        self._v[:, :, self.n: self.n + m] = values
        self.n += m
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n


def _routers(model: Any) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, router module) of each decoder layer whose MLP routes to experts."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [(i, layer.mlp.gate) for i, layer in enumerate(layers)
            if isinstance(getattr(getattr(layer, "mlp", None), "gate", None), torch.nn.Module)]


def routed_rows(r: GenRequest, start: int) -> torch.Tensor | None:
    """SGLang's routed experts of `r`: positions [start, prompt + output - 1) (the last output
    token was never fed through the model); None when nothing was processed or kept."""
    if r.routing is None:
        return None
    rows = torch.cat(r.routing) if len(r.routing) > 1 else r.routing[0]
    return rows[start: len(r.input_ids) + len(r.output_ids) - 1]


def _seq_key(r: GenRequest) -> tuple[Any, ...]:
    """What a request's prefill runs: its LoRA adapter, its prompt and any output kept from before a retract."""
    return (r.lora, *r.input_ids, *r.output_ids)


def _input_logprobs(logits: torch.Tensor, r: GenRequest) -> list[float | None]:
    """SGLang's input_token_logprobs values for `r` from its prefill row's logits (the row's
    positions, padding cut off): log_softmax(raw logits) of each prompt token from
    `input_logprob_start` on, None for the first of them."""
    start, n = r.input_logprob_start, len(r.input_ids)
    assert start is not None
    if start >= n:
        return []
    rows = logits[start: n - 1].float()  # position p predicts token p + 1
    toks = torch.tensor(r.input_ids[start + 1: n], device=rows.device)
    return [None, *torch.log_softmax(rows, -1).gather(-1, toks[:, None])[:, 0].tolist()]


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """`t` ([batch, heads, n, dim]) with zeros in front up to `length` positions."""
    pad = length - t.shape[2]
    return torch.nn.functional.pad(t, (0, 0, pad, 0)) if pad else t


def _pick_many(logits: torch.Tensor, reqs: list[GenRequest]) -> list[tuple[int, float] | Exception]:
    """`_pick` for every row of `logits` [B, V]. Greedy rows and plainly sampled ones
    (temperature > 0, no top-k / top-p: what rollouts use) go through batched ops: a row is
    sampled by inverse CDF from one uniform drawn from its own request's generator, so a seeded
    request's tokens depend on its seed alone, never on the batch around it. Per row in Python
    this was more than half of a decode step of the tiny model at batch 64 (3.7 ms of sampling
    against 2.7 ms of forward). Other rows, and a row whose numbers are not finite, go to `_pick`
    (which raises for the latter: that request fails alone)."""
    out: list[tuple[int, float] | Exception | None] = [None] * len(reqs)
    vocab, dev = logits.shape[-1], logits.device
    greedy = [i for i, r in enumerate(reqs) if r.temperature == 0]
    plain = [i for i, r in enumerate(reqs) if r.temperature > 0 and not 0 < r.top_k < vocab and r.top_p >= 1.0]
    if greedy:
        rows = logits[torch.tensor(greedy, device=dev)]
        tok = rows.argmax(-1)
        lp = torch.log_softmax(rows, -1).gather(1, tok[:, None])[:, 0]
        for i, t, x in zip(greedy, tok.tolist(), lp.tolist()):  # one device-to-host copy each
            if math.isfinite(x):
                out[i] = (t, x)
    if plain:
        temps = torch.tensor([reqs[i].temperature for i in plain], dtype=logits.dtype, device=dev)
        logp = torch.log_softmax(logits[torch.tensor(plain, device=dev)] / temps[:, None], -1)
        cdf = logp.exp().cumsum(-1)
        u = torch.cat([torch.rand(1, generator=reqs[i].generator) for i in plain]).to(dev, logits.dtype)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
        lp = logp.gather(1, tok[:, None])[:, 0]
        ok = torch.isfinite(lp) & torch.isfinite(cdf[:, -1])  # a finite log-prob: never a token of probability 0
        for i, t, x, good in zip(plain, tok.tolist(), lp.tolist(), ok.tolist()):
            if good:
                out[i] = (t, x)
    for i, r in enumerate(reqs):
        if out[i] is None:
            try:
                out[i] = _pick(logits[i].cpu(), r)  # the CPU, where the request's generator is
            except (RuntimeError, ValueError) as e:
                out[i] = e
    return out  # type: ignore[return-value]


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
