"""Extension points: dotted function paths `pkg.module:function` in a recipe (`fn:` keys, and the
learner's advantage / loss / off_policy when they name a function), found, imported and checked
against the call the run will make."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import socket
from typing import Any

import msgspec

from streamrl.core import corrections
from streamrl.recipe.schema import FN_PATH, Recipe

DRIVER_IMPORTED_ENV = "STREAMRL_FNS_CHECKED"  # set for a run's Ray workers: every fn imported on the driver


def resolve_fn(path: str) -> Any:
    """Import `pkg.module:function` and return the callable (raises ValueError saying why not)."""
    mod_name, _, attr = path.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see
        hint = ""
        if isinstance(e, ModuleNotFoundError) and mod_name.split(".")[0] in ("recipes", "connectors", "pools"):
            # The example plugins and connectors are installed under streamrl. since the package layout change.
            hint = f"; the examples are installed as {'streamrl.' + path!r}"
        if os.environ.get(DRIVER_IMPORTED_ENV):  # in a run's Ray worker: the driver imported it when checking
            hint = (f"; it imported on the driver but not on this worker (node {socket.gethostname()}): keep your "
                    "modules in the recipe's directory or the working directory (runs ship those to every node) "
                    "or install them on every node")
        raise ValueError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}){hint}") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ValueError(f"module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{path} is a {type(fn).__name__}, not a function")
    return fn


# Recipe keys that take a built-in name or a function path (streamrl/core/algorithms/step.py).
PLUGGABLE = {f"learner.{key}": key for key in corrections.CHOICES}


def fn_paths(obj: Any, path: str = "") -> list[tuple[str, str]]:
    """(key path, dotted function path) for every function reference in a decoded recipe: each
    `fn:` and each PLUGGABLE key that names a function."""
    found: list[tuple[str, str]] = []
    if isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            val = getattr(obj, name)
            sub = f"{path}.{name}" if path else name
            if (name == "fn" and isinstance(val, str)) or (sub in PLUGGABLE and corrections.is_fn_path(val)):
                found.append((sub, val))
            else:
                found.extend(fn_paths(val, sub))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found.extend(fn_paths(v, f"{path}[{i}]"))
    return found


def choice_problems(r: Recipe) -> list[tuple[str, str]]:
    """PLUGGABLE keys holding neither a built-in name nor a well-formed function path."""
    out = []
    for key, name in PLUGGABLE.items():
        val = getattr(r.learner, name)
        if val in corrections.CHOICES[name]:
            continue
        if not corrections.is_fn_path(val):
            out.append((key, f"unknown value {val!r}; choose one of {', '.join(map(repr, corrections.CHOICES[name]))}, "
                             "or name a function `pkg.mod:fn`"))
        elif not re.match(FN_PATH, val):
            out.append((key, "must be a built-in name or a dotted function path like `mypkg.rl:my_fn`"))
    return out


def check_call(key: str, path: str, fn: Any) -> None:
    """A function named by a PLUGGABLE key accepts the arguments the RL step passes it (ValueError if not)."""
    if key not in PLUGGABLE:
        return
    args = corrections.CALLED_WITH[PLUGGABLE[key]]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the first call will tell
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ValueError(f"{path} cannot be called as fn({', '.join(args)}) ({e})") from None
