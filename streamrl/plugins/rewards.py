"""Reward functions and the hub that calls them for each finished group.

A recipe names one function, `reward: {fn: "pkg.mod:name", args: {...}}`. Built-ins here:
`exact_match`, `math_boxed`, `f1` and `remote_rm` (an HTTP reward model). A user function is a
plain sync or async function taking any of `response` (or `responses`, to score a whole group
in one call), `label`, `prompt`, `record` and the recipe args, and returning a number or a dict
`{"reward": x, **numeric components}`. `RewardHub.score` turns whatever the function does
(returns, raises, hangs) into one `Scored` per response; it never raises.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import string
from collections import Counter
from fractions import Fraction
from typing import Any, NamedTuple

from streamrl.core.types import REWARD_LIMIT, number_problem
from streamrl.recipe import resolve_fn

log = logging.getLogger("streamrl.plugins.rewards")


# ---------------------------------------------------------------- built-in reward functions


def exact_match(response: str, label: str, **_: object) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, nested
    braces included; None when there is none or it is cut off (unbalanced braces)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    j = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    rest = text[j:].lstrip(" ")
    if not rest.startswith("{"):
        m = re.match(r"\s+([^\s$]+)", text[j:])  # `\boxed 5`: the next token
        return m.group(1) if m else None
    depth, k = 0, 0
    while k < len(rest):
        c = rest[k]
        if c == "\\":
            k += 2  # \{ and \} are literal braces, not grouping
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return rest[1:k]
        k += 1
    return None


_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\s*\{?\\circ\}?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}|([+-]?)\\frac(\d)(\d)")
_SLASH = re.compile(r"([+-]?[\d.]+)/([+-]?[\d.]+)")


def normalize_math(answer: str) -> str:
    """Canonical text of a math answer: no $, spaces, \\left/\\right, spacing commands, degree
    signs, trailing %, `\\text{}` wrappers or a leading `x=`; `\\dfrac`/`\\tfrac` -> `\\frac`."""
    s = answer.replace("$", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _TEXT.sub(r"\1", s)
    s = _DEGREE.sub("", s)
    s = "".join(s.split())
    s = re.sub(r"\\?%$", "", s)
    s = re.sub(r"^[A-Za-z]=(?=.)", "", s)
    if re.fullmatch(r"\{[^{}]*\}", s):
        s = s[1:-1]
    return s


def _number(s: str) -> Fraction | None:
    """Exact value of a numeric answer (integers, decimals, 1,000, 1/2, \\frac{1}{2}), else None."""
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if m := _FRAC.fullmatch(s):
            sign, a, b = (m.group(1), m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5), m.group(6))
            value = Fraction(a) / Fraction(b)
            return -value if sign == "-" else value
        if m := _SLASH.fullmatch(s):
            return Fraction(m.group(1)) / Fraction(m.group(2))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_equal(a: str, b: str) -> bool:
    na, nb = normalize_math(a), normalize_math(b)
    if na == nb:
        return bool(na)
    va, vb = _number(na), _number(nb)
    return va is not None and va == vb


def math_boxed(response: str, label: Any, **_: object) -> float:
    """1.0 when the last `\\boxed{}` in the response equals the label (itself boxed or not)
    after `normalize_math`, numbers compared by value (1/2 = 0.5, 1,000 = 1000, 3.0 = 3)."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    gold = str(label)
    gold = last_boxed(gold) if "\\boxed" in gold or "\\fbox" in gold else gold
    return 1.0 if gold is not None and math_answers_equal(answer, gold) else 0.0


_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _squad_tokens(text: str) -> list[str]:
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return _ARTICLES.sub(" ", text).split()


def _f1_one(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:  # SQuAD: two empty answers agree, one empty one does not
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(response: str, label: Any, **_: object) -> float:
    """SQuAD token F1 (lowercased, punctuation and a/an/the removed); a list label is a set of
    acceptable answers and the best one counts."""
    golds = label if isinstance(label, (list, tuple)) else [label]
    if not golds:
        raise ValueError("f1: the label is an empty list; give at least one acceptable answer")
    pred = _squad_tokens(response)
    return max(_f1_one(pred, _squad_tokens(g)) for g in golds)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


async def remote_rm(response: str, label: Any, *, url: str, prompt: Any = None, timeout_s: float = 30,
                    api_key_env: str | None = None, **_: object) -> float | dict[str, float]:
    """Score with a reward-model server: POST {"prompt", "response", "label"} as JSON to `url`.

    The server answers a JSON number, or an object with a numeric "reward" and optionally other
    numeric keys, which come back as reward components.
    """
    import aiohttp  # the HTTP client is only needed by recipes that use a remote RM

    headers = {}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise RuntimeError(f"environment variable {api_key_env} (reward.args.api_key_env) is not "
                               "set; export the API key there")
        headers["Authorization"] = f"Bearer {key}"
    # One session per call: a session is bound to the event loop that made it and the hub can
    # be driven from several loops; a call costs a connection, not a leaked session.
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(url, json={"prompt": prompt, "response": response, "label": label},
                         headers=headers) as resp,
        ):
            status, body = resp.status, await resp.text(errors="replace")
    except TimeoutError:
        raise TimeoutError(f"POST {url} did not answer within {timeout_s}s "
                           "(reward.args.timeout_s)") from None
    except aiohttp.ClientError as e:
        raise ConnectionError(f"cannot reach {url} ({type(e).__name__}: {e})") from None
    head = body[:200]
    if not 200 <= status < 300:
        raise RuntimeError(f"POST {url} answered HTTP {status}: {head!r}")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if _is_number(data):
        return float(data)
    if isinstance(data, dict) and _is_number(data.get("reward")):
        extra = {k: float(v) for k, v in data.items() if k != "reward" and _is_number(v)}
        return {"reward": float(data["reward"]), **extra}
    raise ValueError(f"POST {url} answered HTTP {status} with {head!r}; expected a JSON number or an "
                     'object with a numeric "reward"')


# ---------------------------------------------------------------- the hub


class Scored(NamedTuple):
    reward: float | None  # None when scoring failed; `error` says why
    components: dict[str, float]
    error: str | None


_OFFERED = ("response", "responses", "label", "prompt", "record")


def _as_float(value: Any) -> float | None:
    """A Python float for a real scalar (int, float, bool, numpy/torch 0-d), else None."""
    if isinstance(value, (str, bytes)) or getattr(value, "ndim", 0) != 0 or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class RewardHub:
    """Calls one reward function for a group's responses; see the module docstring."""

    def __init__(self, fn: str, args: dict[str, Any] | None = None, timeout_s: float = 60) -> None:
        try:
            self.fn = resolve_fn(fn)
        except ValueError as e:
            raise ValueError(f"reward.fn {fn!r}: {e}") from None
        self.path, self.args, self.timeout_s = fn, dict(args or {}), timeout_s
        self.name = getattr(self.fn, "__name__", fn.rpartition(":")[2])
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # some builtins have no signature: offer everything
            params = {}
        self._var_kw = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.per_group = "responses" in params
        clash = sorted(set(self.args) & set(_OFFERED))
        if clash:
            raise ValueError(f"reward.args {clash} clash with what the hub passes ({', '.join(_OFFERED)}); rename them")
        named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(self.args) - named) if not self._var_kw else []
        if unknown:
            raise ValueError(f"reward.args {unknown} are not parameters of {fn} (it takes {sorted(named)}); "
                             "fix the spelling or remove them")
        offered = set(_OFFERED) - {"response" if self.per_group else "responses"}
        missing = sorted(k for k, p in params.items() if p.default is p.empty
                         and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                         and (p.kind is p.POSITIONAL_ONLY or (k not in offered and k not in self.args)))
        if missing:
            raise ValueError(f"{fn} needs {missing}, which the hub cannot pass; add them under reward.args "
                             "(or give them defaults; positional-only parameters cannot be passed)")
        self._accepts = None if self._var_kw else named
        # an object with `async def __call__` is async too
        self._is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)
        self._warned = False

    def _kwargs(self, **offered: Any) -> dict[str, Any]:
        kw = {k: v for k, v in offered.items() if self._accepts is None or k in self._accepts}
        return {**kw, **self.args}

    async def _call(self, kw: dict[str, Any], pos: tuple[Any, ...] = ()) -> Any:
        """The function's return value; raises _HubTimeout when it takes longer than timeout_s."""
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                # A sync function may be slow (a verifier, a sandbox): keep it off the loop. On
                # timeout its thread runs on to the end; only its result is thrown away.
                result = self.fn(*pos, **kw) if self._is_async else await asyncio.to_thread(self.fn, *pos, **kw)
                if inspect.isawaitable(result):
                    result = await result
                return result
        except TimeoutError:
            if deadline.expired():  # ours; a TimeoutError the function raised is its own error
                raise _HubTimeout from None
            raise

    def _error(self, e: BaseException) -> str:
        if isinstance(e, _HubTimeout):
            msg = f"{self.name}: TimeoutError: no result within {self.timeout_s}s (RewardHub timeout_s)"
        else:
            msg = f"{self.name}: {type(e).__name__}: {e}"
        if not self._warned:  # the samples carry every error; the log only flags that they exist
            self._warned = True
            log.warning("reward %s failed (further failures are recorded on the samples only): %s", self.path, msg)
        return msg

    def convert(self, value: Any) -> Scored:
        """One return value -> Scored; a value that is not a finite reward becomes an error."""
        comps: dict[str, float] = {}
        if isinstance(value, dict):
            if "reward" not in value:
                return self._bad(f"returned a dict without a 'reward' key: {_head(value)}")
            reward = _as_float(value["reward"])
            for k, v in value.items():
                if k == "reward":
                    continue
                f = _as_float(v)
                if f is None or number_problem(f):
                    return self._bad(f"component {k!r} is {_head(v)}; components must be finite numbers "
                                     f"within +-{REWARD_LIMIT:g}")
                comps[str(k)] = f
            shown = value["reward"]
        else:
            reward, shown = _as_float(value), value
        if reward is None:
            return self._bad(f"returned {type(shown).__name__} {_head(shown)}; return a number or "
                             "{'reward': number, **numeric components}")
        if why := number_problem(reward):
            return self._bad(f"returned the reward {why}")
        return Scored(reward, comps, None)

    def _bad(self, what: str) -> Scored:
        return Scored(None, {}, self._error(ValueError(what)))

    async def _one(self, prompt: Any, label: Any, response: str, record: dict[str, Any] | None) -> Scored:
        try:
            value = await self._call(self._kwargs(response=response, label=label, prompt=prompt, record=record))
        except Exception as e:  # noqa: BLE001 - a reward bug fails its sample, never the run
            return Scored(None, {}, self._error(e))
        return self.convert(value)

    async def _group(self, prompt: Any, label: Any, responses: list[str],
                     record: dict[str, Any] | None) -> list[Scored]:
        n = len(responses)
        try:
            values = await self._call(self._kwargs(responses=list(responses), label=label, prompt=prompt,
                                                   record=record))
        except Exception as e:  # noqa: BLE001 - a reward bug fails its group, never the run
            msg = self._error(e)
            return [Scored(None, {}, msg) for _ in range(n)]
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != n:
            length = len(values) if hasattr(values, "__len__") and not isinstance(values, str) else None
            what = (f"returned {length} values for {n} responses" if length is not None else
                    f"returned {type(values).__name__} {_head(values)}; a per-group function returns one "
                    "value per response")
            bad = self._bad(what)
            return [Scored(None, {}, bad.error) for _ in range(n)]
        return [self.convert(v) for v in values]

    async def score(self, prompt: Any, label: Any, responses: list[str], record: dict[str, Any] | None = None,
                    samples: list[Any] | None = None, prompt_tokens: list[int] | None = None) -> list[Scored]:
        """One Scored per response, in order. Never raises for anything the function does.
        `samples` and `prompt_tokens` (the stored samples being scored) are for slime-style
        functions (streamrl/plugins/slime.py); this hub does not pass them on."""
        if not responses:
            return []
        if self.per_group:
            return await self._group(prompt, label, responses, record)
        return list(await asyncio.gather(*(self._one(prompt, label, r, record) for r in responses)))


class _HubTimeout(Exception):
    """The hub's per-call deadline passed (kept apart from TimeoutErrors the function raises)."""


def _head(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
