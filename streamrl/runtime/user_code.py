"""The user's code a run ships to every Ray node: the modules the recipe's functions
(`fn: pkg.mod:score`) come from when they are not installed — kept in the working directory or
next to the recipe — go to the workers as Ray `runtime_env` `py_modules`, so a reward, filter or
environment that exists only on the driver's machine imports on another node too."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

from streamrl.recipe import DRIVER_IMPORTED_ENV, fn_paths


def shipped_modules(recipe: Any) -> list[str]:
    """Paths (a package's directory, or a module's .py file) of the top-level modules that the
    recipe's functions come from and that no node would have: not streamrl, not installed
    (site-packages, the standard library). The recipe was checked: every module imports here."""
    installed = [Path(p).resolve() for key in ("purelib", "platlib", "stdlib", "platstdlib")
                 if (p := sysconfig.get_paths().get(key))]
    out: list[str] = []
    for _, fn in fn_paths(recipe):
        top = fn.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)
        if top == "streamrl" or spec is None:
            continue
        where = Path(next(iter(spec.submodule_search_locations or []), "") or spec.origin or "")
        if not where.is_absolute() or not where.exists():  # built-in / frozen modules
            continue
        where = where.resolve()
        if any(where.is_relative_to(p) for p in installed) or str(where) in out:
            continue
        out.append(str(where))
    return out


def runtime_env(recipe: Any, env_vars: dict[str, str]) -> dict[str, Any]:
    """The run's Ray runtime_env: `env_vars`, the user's modules, and the flag that lets a worker
    that cannot import one say that the driver could (streamrl.recipe.resolve_fn)."""
    env: dict[str, Any] = {"env_vars": {**env_vars, DRIVER_IMPORTED_ENV: "1"}}
    modules = shipped_modules(recipe)
    if modules:
        env["py_modules"] = modules
    return env
