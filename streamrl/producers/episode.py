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
tokenized as it is added, so the stored sample is exactly the sequence the model saw.
`complete()` (and `chat()`, its one-reply text) takes OpenAI-style message lists, with tools and
tool calls, and adds only what is new since the last turn, rendered with the tokenizer's chat
template (streamrl/producers/chat_template.py); tool calls in the model's text are parsed into
OpenAI `tool_calls` (streamrl/core/chat.py). An agent that only speaks the OpenAI API gets
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
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl.connectors.sglang import api
from streamrl.connectors.sglang.client import ENGINE_FAILURES, retryable
from streamrl.core import chat, partial
from streamrl.core.types import Sample, VersionSpan
from streamrl.producers.chat_template import ConversationError, chat_delta
from streamrl.recipe import resolve_fn


class EpisodeError(Exception):
    """The episode cannot go on (context full, engines failing, a conversation that does not
    extend its previous turns); the sample is stored as failed with this message."""


@dataclass
class Turn:
    """One model turn: the exact tokens the engine sampled (with log-probs and policy versions)
    and what the agent is told: `content` and OpenAI `tool_calls` parsed from the text, or
    `tool_call_error` when the tool-call text was malformed (then `content` is the whole text)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # stop | length
    text: str  # what the model wrote: special tokens skipped, cut before a stop string
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_error: str | None = None
    stopped: bool = False  # the turn was cut after one of the request's stop strings

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message as OpenAI returns it."""
        return {"role": "assistant", "content": self.content,
                **({"tool_calls": self.tool_calls} if self.tool_calls else {})}

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.finish


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
        self.replies: list[Turn] = []  # the model turns in the context, in order
        self.stats = {"calls": 0, "interruptions": 0, "engine_errors": 0, "gen_tokens": 0, "discarded_tokens": 0}
        self.base_url: str | None = None  # the OpenAI-compatible proxy, when the run serves one
        self.api_key: str | None = None
        self._history: list[dict[str, Any]] | None = None
        self._tools: Any = None
        self._candidates: list[Turn] = []  # the last chat turn's n replies; the context holds one
        self._turn_start = 0

    @property
    def turns(self) -> list[str]:
        """The text of each model turn."""
        return [t.text for t in self.replies]

    @property
    def finish(self) -> str:
        """Finish reason of the last turn."""
        return self.replies[-1].finish if self.replies else ""

    # ------------------------------------------------------------ what environments call

    def observe(self, content: str | list[int]) -> None:
        """Add context the model did not generate (a prompt, a tool result): loss mask 0."""
        ids = self._encode(content) if isinstance(content, str) else [int(t) for t in content]
        self._add(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))

    async def generate(self, max_new_tokens: int | None = None, stop: list[str] | None = None) -> str:
        """One model turn from the context so far; returns its text (special tokens skipped, cut
        before the first of the `stop` strings)."""
        turn = await self._sample(self.tokens, self._budget(max_new_tokens, len(self.tokens)), stop)
        self._commit(turn)
        return turn.text

    async def complete(self, messages: list[dict[str, Any]], max_new_tokens: int | None = None, tools: Any = None,
                       n: int = 1, stop: list[str] | None = None, parse_tools: bool = True) -> list[Turn]:
        """OpenAI-style turn: `messages` must repeat the previous ones and one of the previous
        turn's replies unchanged, and add new ones; only the new part is tokenized (chat_delta).
        Samples `n` replies to the same context; the first is in the context until a later turn
        continues another one (an episode that ends after an n > 1 turn keeps the first). With
        `tools` (and `parse_tools`), tool calls in the text are parsed (streamrl.core.chat)."""
        if self._history is None and self.tokens:
            raise EpisodeError("chat() continues a conversation started with chat(); this episode began with "
                               "observe()/generate()")
        if self._history is not None and tools != self._tools:
            raise EpisodeError("the tools differ from the previous turn's: they are part of the context the model "
                               "has seen, so a conversation keeps the same tools")
        try:
            delta, chosen = chat_delta(self.tokenizer, self._history,
                                       [(t.tokens, t.message) for t in self._candidates], messages, tools)
        except ConversationError as e:
            raise EpisodeError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a template raising on what an agent sent fails that turn only
            raise EpisodeError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from None
        # Nothing changes until the replies exist: a refused or failed turn leaves the episode as it was.
        kept = self.tokens[:self._turn_start] + self._candidates[chosen].tokens if chosen else self.tokens
        delta_ids = self._encode(delta)
        context = kept + delta_ids
        budget = self._budget(max_new_tokens, len(context))
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._sample(context, budget, stop)) for _ in range(n)]
        except* EpisodeError as group:
            raise group.exceptions[0] from None
        turns = [t.result() for t in tasks]
        if chosen:
            self._replace_last(self._candidates[chosen])
        self.observe(delta_ids)
        names = [(f.get("function") or f).get("name") for f in tools or [] if isinstance(f, dict)]
        for t in turns:
            parsed = chat.parse_tool_calls(t.text, names) if tools and parse_tools else chat.ParsedReply(t.text)
            t.content, t.tool_call_error = parsed.content, parsed.error
            if parsed.error and parsed.error.endswith(f"has no {chat.TOOL_CALL_CLOSE}"):
                ended = "a stop string" if t.stopped else "max_tokens" if t.finish == "length" else "the model's end of turn"
                t.tool_call_error = f"{parsed.error} (the reply ended at {ended})"
            t.tool_calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                            for c in parsed.calls]
        self._commit(turns[0])
        self._candidates, self._history, self._tools = turns, [dict(m) for m in messages], tools
        return turns

    async def chat(self, messages: list[dict[str, Any]], max_new_tokens: int | None = None, tools: Any = None) -> str:
        """`complete()` with one reply; returns its text."""
        return (await self.complete(messages, max_new_tokens, tools))[0].text

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

    def _budget(self, max_new_tokens: int | None, context: int) -> int:
        if not context:
            raise EpisodeError("the episode has no context yet: observe() the prompt first")
        room = self.max_context - context
        if room <= 0:
            raise EpisodeError(f"the context has {context} tokens, the model's limit is {self.max_context}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise EpisodeError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
        # The recipe's limit holds whatever an agent asks: it bounds the memory and time a turn takes.
        return min(max_new_tokens or self.max_new_tokens, self.max_new_tokens, room)

    async def _sample(self, context: list[int], budget: int, stop: list[str] | None) -> Turn:
        """One reply to `context`, across engine calls (partial rollouts, engine failures)."""
        t = partial.Trajectory(prompt=list(context), max_new_tokens=budget)
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
        self.stats["discarded_tokens"] += t.discarded
        versions = [s.version for s in t.spans for _ in range(s.end - s.start)]
        tokens, logprobs, finish = list(t.tokens), list(t.logprobs), t.finish
        cut = chat.stop_cut(pieces := chat.text_pieces(self._decode, tokens), stop) if stop else None
        if cut is not None:  # the engine does not know the stop strings: the turn ends where one ends
            keep, chars = cut
            tokens, logprobs, versions, finish = tokens[:keep], logprobs[:keep], versions[:keep], "stop"
            text = "".join(pieces)[:chars]
        else:
            text = self._decode(tokens)
        return Turn(tokens, logprobs, versions, finish, text, content=text, stopped=cut is not None)

    def _commit(self, turn: Turn) -> None:
        self._turn_start = len(self.tokens)
        self._add(turn.tokens, [1] * len(turn.tokens), turn.logprobs, turn.versions)
        self.replies.append(turn)

    def _replace_last(self, turn: Turn) -> None:
        """The conversation went on from another of the last turn's n replies: it replaces the first."""
        k = self._turn_start
        del self.tokens[k:], self.mask[k:], self.logprobs[k:], self.versions[k:]
        self.replies.pop()
        self._commit(turn)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
                              metadata={"turns": len(ep.replies), "tool_calls": sum(len(t.tool_calls) for t in ep.replies),
                                        "malformed_tool_calls": sum(t.tool_call_error is not None for t in ep.replies),
                                        **ep.stats}))
    return prompt, samples


def context_length(model_path: str) -> int:
    """The longest context an episode of this model may build (its max_position_embeddings)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).max_position_embeddings)


async def play_group(env: EnvHub, proxy: Any, episodes: list[Episode], task: dict[str, Any], rewards: Any,
                     meta: dict[str, Any]) -> tuple[list[int], list[Sample]]:
    """Run the environment once per episode (each served by the OpenAI `proxy` under its own key
    while it runs) and return the group's (prompt tokens, samples), scored: an environment's number
    or {"reward": ...} is the reward; a string is an answer and None means its last turn, both
    scored by `rewards` (a RewardHub: reward.fn) against meta["label"]."""
    keys = [proxy.open(ep) for ep in episodes] if proxy is not None else []
    try:
        outs = await asyncio.gather(*(env.run({**task, "sample": i}, ep) for i, ep in enumerate(episodes)))
    finally:
        for k in keys:
            proxy.close_session(k)
    prompt, samples = to_samples(episodes)
    answers = {i: out if isinstance(out, str) else (episodes[i].turns[-1] if episodes[i].turns else "")
               for i, (out, err) in enumerate(outs)
               if err is None and not samples[i].failed and (out is None or isinstance(out, str))}
    scored = dict(zip(answers, await rewards.score(meta.get("prompt"), meta.get("label"), list(answers.values()), meta,
                                                   samples=[samples[i] for i in answers], prompt_tokens=prompt)))
    for i, (s, (out, err)) in enumerate(zip(samples, outs)):
        if s.failed:
            s.error = err or s.error  # the environment's own error says more than "no model turn"
            continue
        sc = scored.get(i) or (None if err else rewards.convert(out))
        s.reward, s.rewards = (None, {}) if sc is None or sc.reward is None else (sc.reward, dict(sc.components))
        s.error = err or (sc.error if sc else None)
        s.failed = s.error is not None
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
