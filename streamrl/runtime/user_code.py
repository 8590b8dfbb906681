"""The user's code of a run: the modules the recipe's functions (`fn: pkg.mod:score`) come from
when they are not installed (kept in the working directory or next to the recipe).

- Shipping: they go to the Ray workers as `runtime_env` `py_modules`, so a reward, filter or
  environment that exists only on the driver's machine imports on another node too.
- Resume: a run directory may come from someone else, and its recipe.yaml names modules to
  import. A new run records the files it imported them from (RUN_DIR/user_modules.json: module,
  path, sha256); `--resume` and `replay` import user code only from those files, unchanged,
  never from the run directory, and refuse (naming them) modules that changed, moved or
  appeared since, unless the user passes --trust-run-dir (which records the new set).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

from streamrl.recipe import DRIVER_IMPORTED_ENV, Recipe, fn_paths, load_recipe, parse_recipe
from streamrl.runtime import RunFailed

MODULES_FILE = "user_modules.json"


class UntrustedCode(RunFailed):
    """The run directory's recipe names user code the run did not load when it started."""


def _installed() -> list[Path]:
    return [Path(p).resolve() for key in ("purelib", "platlib", "stdlib", "platstdlib")
            if (p := sysconfig.get_paths().get(key))]


def shipped_modules(recipe: Any) -> list[str]:
    """Paths (a package's directory, or a module's .py file) of the top-level modules that the
    recipe's functions come from and that no node would have: not streamrl, not installed
    (site-packages, the standard library). The recipe was checked: every module imports here."""
    installed = _installed()
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


def locate(module: str) -> list[tuple[str, Path | None]]:
    """(dotted name, the file that would run) for `module` and each package above it that has
    one, found the way `import` finds them but without running any of them; a name not found
    ends the list with None."""
    parts, out = module.split("."), []
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not imported
    except (ImportError, ValueError):
        spec = None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if i:
            where = list(spec.submodule_search_locations or []) if spec is not None else []
            spec = importlib.machinery.PathFinder.find_spec(name, where) if where else None
        if spec is None:
            return [*out, (name, None)]
        if spec.has_location and spec.origin:  # a namespace package or a built-in runs no file
            out.append((name, Path(spec.origin).resolve()))
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_user(name: str, path: Path | None, installed: list[Path]) -> bool:
    return (name.split(".")[0] != "streamrl" and path is not None
            and not any(path.is_relative_to(p) for p in installed))


def user_modules(recipe: Recipe) -> list[dict[str, str]]:
    """The user modules (and their packages) the recipe's functions import: module, path, sha256,
    and `search_path`, the directory `import` found the top-level name in."""
    installed, out, seen = _installed(), [], set()
    for _, fn in fn_paths(recipe):
        chain = locate(fn.partition(":")[0])
        top = chain[0][1] if chain and "." not in chain[0][0] else None
        root = (top.parent.parent if top.name == "__init__.py" else top.parent) if top else None
        for name, path in chain:
            if name in seen or not _is_user(name, path, installed):
                continue
            seen.add(name)
            out.append({"module": name, "path": str(path), "sha256": _sha256(path),  # type: ignore[arg-type]
                        "search_path": str(root) if root else ""})
    return out


def record_modules(recipe: Recipe, run_dir: Path) -> list[dict[str, str]]:
    """Write RUN_DIR/user_modules.json: what `--resume` may import again."""
    mods = user_modules(recipe)
    (run_dir / MODULES_FILE).write_text(json.dumps(mods, indent=1) + "\n")
    return mods


def _recorded(run_dir: Path) -> list[dict[str, str]] | None:
    try:
        data = json.loads((run_dir / MODULES_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UntrustedCode(f"{run_dir / MODULES_FILE} cannot be read ({e}); resume with --trust-run-dir if "
                            "you trust this run directory's code") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) and {"module", "path", "sha256"} <= m.keys()
                                             for m in data):
        raise UntrustedCode(f"{run_dir / MODULES_FILE} is not a list of {{module, path, sha256}}; resume with "
                            "--trust-run-dir if you trust this run directory's code")
    return data


def load_run_recipe(run_dir: str | Path, overrides: list[str] | None = None, *, trust: bool = False,
                    say: Any = None) -> Recipe:
    """RUN_DIR/recipe.yaml with its functions imported from where the run imported them when it
    started (see the module doc); `say(line)` is told which modules those are. With `trust`,
    the recipe's directory joins sys.path as for a new run and the record is rewritten."""
    d = Path(run_dir)
    path = d / "recipe.yaml"
    if trust:
        r = load_recipe(path, overrides)
        record_modules(r, d)
        return r
    inside = d.resolve()
    # Nothing may import from the run directory, the working directory included when it is the run directory.
    sys.path[:] = [p for p in sys.path if not Path(p or ".").resolve().is_relative_to(inside)]
    unchecked = load_recipe(path, overrides, resolve=False)
    recorded = _recorded(d)
    by_name = {m["module"]: m for m in recorded or []}
    for m in recorded or []:  # the record is in the run directory too: it may not point back into it
        if m.get("search_path") and m["search_path"] not in sys.path \
                and not Path(m["search_path"]).resolve().is_relative_to(inside):
            sys.path.append(m["search_path"])
    installed, problems, shown = _installed(), [], []
    for key, fn in fn_paths(unchecked):
        for name, found in locate(fn.partition(":")[0]):
            was = by_name.get(name)
            if was is None:
                if found is not None and not _is_user(name, found, installed):
                    continue  # streamrl, the standard library, an installed package: not the run directory's
                where = f"{found}" if found is not None else "not found outside the run directory"
                problems.append(f"{name} ({key}; {where}): not loaded by the run when it started")
            elif found is not None and found.is_relative_to(inside):
                problems.append(f"{name} ({key}): {found} is in the run directory")
            elif found is None or str(found) != was["path"]:
                problems.append(f"{name} ({key}): the run loaded {was['path']}, now "
                                f"{found if found is not None else 'not found'}")
            elif _sha256(found) != was["sha256"]:
                problems.append(f"{name} ({key}): {found} changed since the run loaded it (sha256 "
                                f"{was['sha256'][:12]}.. -> {_sha256(found)[:12]}..)")
            elif say is not None and name not in shown:
                shown.append(name)
                say(f"user code: {name} from {found} (sha256 {was['sha256'][:12]}.., as the run loaded it)")
    if problems:
        why = "" if recorded is not None else f" ({MODULES_FILE} is missing: the run was made before runs recorded it)"
        raise UntrustedCode(f"{path} names code the run did not load when it started{why}: {'; '.join(problems)}. "
                            "A run directory from elsewhere could run such code on resume: check it, then pass "
                            "--trust-run-dir to import it")
    return parse_recipe(path.read_text(), str(path), overrides)  # now imports, from the checked files only
