"""The call each hub makes to a user function, checked when the recipe loads.

Every function reference of a recipe (reward, filters, env, data.generate) is bound against the
exact call its hub will make, in the style the reference names (`style: streamrl`, the default,
or `style: slime`: slime's signatures, streamrl/plugins/slime.py). A function that cannot take
that call is a load error naming the key, the function, the signature it has and the one
expected, so a run never starts only to fail on every group; a slime-style function named
without `style: slime` is told so.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from streamrl.recipe.schema import FnRef, Recipe

# What the reward hub passes by name besides the recipe args (streamrl/plugins/rewards.py).
REWARD_OFFERED = ("response", "responses", "label", "prompt", "record")

EXPECTED = {
    ("reward", "streamrl"): "fn(response, label, prompt, record, **reward.args) per sample, or fn(responses, label, "
                            "...) per group (any subset of those names, sync or async)",
    ("reward", "slime"): "async fn(args, sample, **kwargs), or fn(args, samples, **kwargs) with reward.args.group_rm: "
                         "true (slime's --custom-rm-path with --group-rm)",
    ("filter", "streamrl"): "fn(group, **args) -> bool (not async)",
    ("filter", "slime"): "fn(args, samples, **kwargs) -> bool or an object with keep/reason (not async; slime's "
                         "--dynamic-sampling-filter-path)",
    ("env", "streamrl"): "async fn(task, llm, **env.args)",
    ("env", "slime"): "async fn(args, sample, sampling_params) (slime's --custom-generate-function-path)",
    ("data", "streamrl"): "fn(out_dir, **data.generate.args)",
}

# First parameters of StreamRL-style functions (a slime-style one takes `args` first).
STREAMRL_FIRST = ("response", "responses", "group", "task", "out_dir")

_HUBS = {"reward": "reward", "filters": "filter", "env": "env", "data.generate": "data"}


def fn_refs(r: Recipe) -> list[tuple[str, FnRef]]:
    """(key path, reference) for each user function a hub calls."""
    out: list[tuple[str, FnRef]] = [("reward", r.reward)]
    out += [(f"filters[{i}]", ref) for i, ref in enumerate(r.filters)]
    if r.env is not None:
        out.append(("env", r.env))
    if r.data.generate is not None:
        out.append(("data.generate", r.data.generate))
    return out


def hub_of(key: str) -> str | None:
    return _HUBS.get(re.sub(r"\[\d+\]$", "", key))


def shown(path: str, fn: Any) -> str:
    """`pkg.mod:name(a, b, **kw)`: the function with its parameters (annotations left out)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return f"{path}(...)"
    plain = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                        return_annotation=sig.empty)
    return f"{'async ' if _is_async(fn) else ''}{path}{plain}"


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


def _positional(params: dict[str, inspect.Parameter]) -> list[str]:
    return [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def looks_slime(fn: Any) -> bool:
    """slime's extension points take `args` (its argument namespace) first, then the sample(s)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    pos = _positional(dict(params))
    return len(pos) >= 2 and pos[0] == "args" and pos[1] in ("sample", "samples", "episodes")


def problem(key: str, ref: FnRef, fn: Any) -> str | None:
    """Why `fn` cannot take the call its hub makes (None when it can)."""
    hub = hub_of(key)
    if hub is None:
        return None
    if (hub, ref.style) not in EXPECTED:
        return f"style {ref.style!r} is not available here: {key} calls {EXPECTED[(hub, 'streamrl')]}"
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): the first call will tell
        return None
    why = _why(hub, ref, fn, params)
    if why is None:
        return None
    msg = (f"{shown(ref.fn, fn)} does not fit the call the {hub} hub makes: {why}; "
           f"expected {EXPECTED[(hub, ref.style)]}")
    if ref.style != "slime" and (hub, "slime") in EXPECTED and looks_slime(fn):
        msg += f". This looks like a slime-style function: add `style: slime` to {key} (docs/slime.md)"
    elif ref.style == "slime" and not looks_slime(fn):
        msg += f". It does not look like a slime-style function: remove `style: slime` from {key}?"
    return msg


def _bind(params: dict[str, inspect.Parameter], *args: Any, **kwargs: Any) -> str | None:
    sig = inspect.Signature(list(params.values()))
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _why(hub: str, ref: FnRef, fn: Any, params: dict[str, inspect.Parameter]) -> str | None:
    slime, x = ref.style == "slime", object()
    if hub == "filter" and _is_async(fn):
        return "it is async"
    if hub == "env" and not _is_async(fn):
        return "it is not async"
    if slime:  # recipe args become attributes of the `args` namespace, never keyword arguments
        pos = _positional(params)
        if pos and pos[0] in STREAMRL_FIRST:
            return f"its first parameter is `{pos[0]}`, but a slime-style function gets slime's `args` namespace first"
        if hub == "reward":
            group = bool(ref.args.get("group_rm"))
            if len(pos) >= 2 and pos[1] == "samples" and not group:
                return "it takes `samples` (a whole group) but reward.args.group_rm is not true"
            if len(pos) >= 2 and pos[1] == "sample" and group:
                return "it takes one `sample` but reward.args.group_rm is true (the hub passes the group's samples)"
        third = (x,) if hub == "env" else ()
        return _bind(params, x, x, *third)
    if hub == "reward":
        return _reward_why(ref, params)
    if hub == "filter":
        return _bind(params, x, **ref.args)
    if hub == "env":
        return _bind(params, x, x, **ref.args)
    return _bind(params, out_dir="", **ref.args)  # data.generate


def _reward_why(ref: FnRef, params: dict[str, inspect.Parameter]) -> str | None:
    """The reward hub passes the names in REWARD_OFFERED that the function takes (`response` or
    `responses`), plus reward.args, all by keyword."""
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    clash = sorted(set(ref.args) & set(REWARD_OFFERED))
    if clash:
        return f"reward.args {clash} clash with what the hub passes; rename them"
    named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(ref.args) - named) if not var_kw else []
    if unknown:
        return f"reward.args {unknown} are not parameters of it (fix the spelling or remove them)"
    offered = set(REWARD_OFFERED) - {"response" if "responses" in params else "responses"}
    missing = sorted(k for k, p in params.items() if p.default is p.empty
                     and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                     and (p.kind is p.POSITIONAL_ONLY or (k not in offered and k not in ref.args)))
    if missing:
        return (f"it needs {missing}, which the hub cannot pass (add them under reward.args or give them "
                "defaults; positional-only parameters cannot be passed)")
    return None
