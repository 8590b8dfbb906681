"""Agent environments: multi-turn, tool-using episodes recorded token-in/token-out.

A recipe names an environment function; the rollout worker calls it once per sample:

    env: {fn: "streamrl.recipes.envs.calculator:solve", args: {turns: 3}}

    async def solve(task, llm, **args):       # task: {"prompt", "label", "id", "record", "sample"}
        llm.observe(task["prompt"])            # context tokens: loss mask 0
        answer = await llm.generate()          # one model turn: loss mask 1, log-probs, versions
        llm.observe(tool(answer))              # tool output: loss mask 0
        ...
        return reward                          # a number or {"reward": x, **components}; a string is an
                                               # answer scored by reward.fn; None scores the last turn

`llm` is an `Episode`. It never re-tokenizes what the model produced: every model turn is the
exact tokens the engine sampled (with their log-probs and policy versions) and everything else is
tokenized as it is added, so the stored sample is exactly the sequence the model saw. `chat()`
takes OpenAI-style message lists and adds only what is new since the last turn, rendered with
the tokenizer's chat template (`chat_delta`). An agent that only speaks the OpenAI API gets
`llm.base_url` and `llm.api_key` (or `llm.openai()`): the run's proxy (streamrl/producers/openai_proxy.py)
serves `/v1/chat/completions` from this same episode.

A version update that interrupts a turn follows `staleness.partial_rollout`: `abort_resume`
continues the turn on the new weights from the tokens so far, `in_place` keeps generating on the
engine, `restart` generates that turn again. Environments hold state the pool cannot store, so an
episode that a crash interrupts starts again from its prompt on resume (never from the middle).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import numpy as np

from streamrl.connectors import sglang_api as api
from streamrl.connectors.sglang_client import ENGINE_FAILURES, retryable
from streamrl.core import partial
from streamrl.core.types import Sample, VersionSpan


class EpisodeError(Exception):
    """The episode cannot go on (context full, engines failing, a conversation that does not
    extend its previous turns); the sample is stored as failed with this message."""


def _content(m: dict[str, Any]) -> str:
    """A message's text; OpenAI content parts ([{"type": "text", "text": ...}]) are joined."""
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c or ""


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
    msgs = [{**m, "content": _content(m)} for m in messages]
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False, **kw)


def chat_delta(tokenizer: Any, history: list[dict[str, Any]] | None, reply_ids: list[int],
               messages: list[dict[str, Any]], tools: Any = None) -> str:
    """The chat-template text to add after the tokens so far so that the context is `messages`
    followed by the assistant prompt.

    `history` is the message list of the previous call (None on the first), `reply_ids` the
    tokens the model generated for it. The new `messages` must start with `history` and the
    reply as the assistant message; only the template text after the reply's tokens is new
    (e.g. the end-of-turn marker, a tool result and the next assistant header). Raises
    EpisodeError when the conversation does not extend the previous one."""
    if history is None:
        return _render(tokenizer, messages, True, tools)
    reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
    expected = [*history, {"role": "assistant", "content": reply}]
    for i, (want, got) in enumerate(zip(expected, messages)):
        if got.get("role") != want.get("role") or _content(got) != _content(want):
            raise EpisodeError(
                f"message {i} ({got.get('role')!r}: {_content(got)[:60]!r}) differs from the one this episode "
                f"generated or was sent ({want.get('role')!r}: {_content(want)[:60]!r}); a trained conversation "
                "must send earlier messages back unchanged (token-in/token-out: the model's own tokens are kept)")
    if len(messages) <= len(expected):
        raise EpisodeError(f"the conversation has {len(messages)} messages; a new turn must add at least one "
                           f"message after the {len(expected)} of the previous turn and its reply")
    before = _render(tokenizer, history, True, tools)
    generated = before + tokenizer.decode(reply_ids, skip_special_tokens=False)
    closed = _render(tokenizer, expected, False, tools)
    full = _render(tokenizer, messages, True, tools)
    if not closed.startswith(generated) and closed.startswith(before + reply):
        generated = before + reply  # the reply ended at a stop token the template writes itself
    if not closed.startswith(generated) or not full.startswith(closed):
        raise EpisodeError("the chat template does not render this conversation as an extension of its previous "
                           "turn, so the new turn cannot reuse the model's tokens")
    return full[len(generated):]


class Episode:
    """One sample's conversation as exact tokens: what the model generated (mask 1) and
    everything else (mask 0), with the log-prob and policy version of every generated token."""

    def __init__(self, client: Any, tokenizer: Any, *, sampling: dict[str, Any], max_new_tokens: int,
                 max_context: int, policy: str = "abort_resume", retries: int = 30) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.sampling, self.max_new_tokens, self.max_context = sampling, max_new_tokens, max_context
        self.policy, self.retries = policy, retries
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # -1 for tokens the model did not generate
        self.turns: list[str] = []  # text of each model turn
        self.finish = ""  # finish reason of the last turn
        self.stats = {"calls": 0, "interruptions": 0, "engine_errors": 0, "gen_tokens": 0}
        self.base_url: str | None = None  # the OpenAI-compatible proxy, when the run serves one
        self.api_key: str | None = None
        self._history: list[dict[str, Any]] | None = None
        self.reply_ids: list[int] = []

    # ------------------------------------------------------------ what environments call

    def observe(self, content: str | list[int]) -> None:
        """Add context the model did not generate (a prompt, a tool result): loss mask 0."""
        ids = self._encode(content) if isinstance(content, str) else [int(t) for t in content]
        self._add(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))

    async def generate(self, max_new_tokens: int | None = None) -> str:
        """One model turn from the context so far; returns its text (special tokens skipped)."""
        if not self.tokens:
            raise EpisodeError("the episode has no context yet: observe() the prompt first")
        room = self.max_context - len(self.tokens)
        if room <= 0:
            raise EpisodeError(f"the context has {len(self.tokens)} tokens, the model's limit is {self.max_context}")
        budget = min(max_new_tokens or self.max_new_tokens, room)
        t = partial.Trajectory(prompt=list(self.tokens), max_new_tokens=budget)
        failures = 0
        while not t.done:
            try:
                r = await self.client.generate(partial.next_request(t)[0],
                                               api.SamplingParams(**self.sampling, max_new_tokens=t.remaining))
            except ENGINE_FAILURES as e:  # the engine died or was restarted: resubmit what we have
                failures += 1
                self.stats["engine_errors"] += 1
                if not retryable(e) or failures >= self.retries:  # a 4xx: the same request fails again
                    raise EpisodeError(f"generation failed {failures} times in a row: {type(e).__name__}: {e}") from e
                await asyncio.sleep(min(5.0, 0.2 * failures))
                continue
            failures = 0
            self.stats["gen_tokens"] += len(r.output_ids)
            partial.absorb(t, r.output_ids, r.logprobs, r.version_spans(), r.finish_type, self.policy)  # type: ignore[arg-type]
            if r.finish_type == "abort":
                self.stats["interruptions"] += 1
        self.stats["calls"] += t.calls
        versions = [s.version for s in t.spans for _ in range(s.end - s.start)]
        self._add(t.tokens, [1] * len(t.tokens), t.logprobs, versions)
        self.reply_ids, self.finish = list(t.tokens), t.finish
        text = self.tokenizer.decode(t.tokens, skip_special_tokens=True)
        self.turns.append(text)
        return text

    async def chat(self, messages: list[dict[str, Any]], max_new_tokens: int | None = None, tools: Any = None) -> str:
        """OpenAI-style turn: `messages` must repeat the previous ones (and this episode's reply)
        unchanged and add new ones; only the new part is tokenized (chat_delta)."""
        if self._history is None and self.tokens:
            raise EpisodeError("chat() continues a conversation started with chat(); this episode began with "
                               "observe()/generate()")
        delta = chat_delta(self.tokenizer, self._history, self.reply_ids, messages, tools)
        self.observe(delta)
        text = await self.generate(max_new_tokens)
        self._history = [dict(m) for m in messages]
        return text

    def openai(self) -> Any:
        """An `openai.AsyncOpenAI` client bound to this episode (needs the `openai` package)."""
        if self.base_url is None:
            raise EpisodeError("this episode has no OpenAI endpoint (the rollout worker starts one for env runs)")
        try:
            import openai
        except ImportError:
            raise EpisodeError("pip install openai (needed for llm.openai())") from None
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0)

    # ------------------------------------------------------------ internals

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _add(self, ids: list[int], mask: list[int], lps: list[float], versions: list[int]) -> None:
        self.tokens += ids
        self.mask += mask
        self.logprobs += list(map(float, lps))
        self.versions += versions


def to_samples(episodes: list[Episode]) -> tuple[list[int], list[Sample]]:
    """(prompt tokens, samples) of a group of episodes. The prompt is the context every episode
    shares before any of them generated; the rest of each episode is its response, masked 0
    where the model did not generate it. Tokens the model did not generate take the version of
    the generated token before them (after them when none came before), so version spans tile
    the response. An episode that generated nothing becomes a failed sample."""
    firsts = [ep.mask.index(1) if 1 in ep.mask else len(ep.tokens) for ep in episodes]
    cut = min(firsts) if episodes else 0
    for ep in episodes:
        k = 0
        while k < cut and k < len(ep.tokens) and ep.tokens[k] == episodes[0].tokens[k]:
            k += 1
        cut = k
    prompt = episodes[0].tokens[:cut] if episodes else []
    samples = []
    for i, ep in enumerate(episodes):
        if cut == 0 or 1 not in ep.mask:
            why = "the environment finished without a model turn" if 1 not in ep.mask else \
                "the group's episodes share no first token, so they have no common prompt"
            samples.append(Sample(index=i, response_tokens=np.empty(0, np.int32), rollout_logprobs=np.empty(0, np.float32),
                                  failed=True, error=why))
            continue
        versions = _fill_versions(ep.versions[cut:])
        spans: list[VersionSpan] = []
        for pos, v in enumerate(versions):
            if spans and spans[-1].version == v:
                spans[-1] = VersionSpan(v, spans[-1].start, pos + 1)
            else:
                spans.append(VersionSpan(v, pos, pos + 1))
        samples.append(Sample(index=i, response_tokens=np.asarray(ep.tokens[cut:], np.int32),
                              rollout_logprobs=np.asarray(ep.logprobs[cut:], np.float32),
                              loss_mask=np.asarray(ep.mask[cut:], np.uint8), spans=spans,
                              finish_reason=ep.finish or "stop",
                              metadata={"turns": len(ep.turns), **ep.stats}))
    return prompt, samples


def _fill_versions(versions: list[int]) -> list[int]:
    out, last = [], next((v for v in versions if v >= 0), 0)
    for v in versions:
        last = v if v >= 0 else last
        out.append(last)
    # Non-decreasing is what spans require: a context token keeps the version before it.
    return [int(v) for v in np.maximum.accumulate(out)] if out else out


class EnvHub:
    """Calls the recipe's environment function for one sample; never raises for what it does."""

    def __init__(self, fn: str, args: dict[str, Any] | None = None, timeout_s: float = 600) -> None:
        from streamrl.recipe import resolve_fn

        try:
            self.fn = resolve_fn(fn)
        except ValueError as e:
            raise ValueError(f"env.fn {fn!r}: {e}") from None
        if not (inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))):
            raise ValueError(f"env.fn {fn!r} must be an async function (async def {fn.rpartition(':')[2]}(task, llm))")
        self.path, self.args, self.timeout_s = fn, dict(args or {}), timeout_s

    async def run(self, task: dict[str, Any], episode: Episode) -> tuple[Any, str | None]:
        """(what the function returned, None) or (None, the error that failed the sample)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.fn(task, episode, **self.args), None
        except TimeoutError:
            return None, f"{self.path}: no result within {self.timeout_s}s"
        except Exception as e:  # noqa: BLE001 - a broken episode fails its sample, never the run
            return None, f"{self.path}: {type(e).__name__}: {e}"
