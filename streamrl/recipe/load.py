"""Reading a recipe: YAML (1.2 floats, no repeated keys) decoded into the schema, `key.sub=value`
overrides, and every problem reported as `FILE:LINE: key.path: what is wrong` (RecipeError; the
CLI exits 2) before any work starts."""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from streamrl.recipe.checks import conflicts
from streamrl.recipe.contracts import fn_refs
from streamrl.recipe.contracts import problem as call_problem
from streamrl.recipe.functions import check_call, choice_problems, fn_paths, resolve_fn
from streamrl.recipe.schema import Recipe, RecipeError

class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats (`1e-5` is a number, not a string) and no silently repeated keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for k, _ in node.value:
            key = self.construct_object(k, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeats the one on line {seen[key]}", k.start_mark)
            seen[key] = k.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def _line_index(text: str) -> dict[str, int]:
    """Key path ("a.b[0].c") -> 1-based line of that key in the YAML text."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                sub = f"{path}.{k.value}" if path else str(k.value)
                lines[sub] = k.start_mark.line + 1
                walk(v, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{path}[{i}]")

    root = yaml.compose(text, Loader=_Loader)
    if root is not None:
        walk(root, "")
    return lines


def _parse_value(raw: str) -> Any:
    try:
        return yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, str]:
    """Set `a.b.c=value` (value parsed as YAML) in place; returns key path -> override text."""
    origin: dict[str, str] = {}
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.(\w+))*", key):
            raise RecipeError(f"override {ov!r}: expected key.sub=value, e.g. rollout.n_samples=4")
        node: Any = data
        parts = key.split(".")
        path = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError(f"override {ov!r}: {path} has no item {part}")
                path += f"[{part}]"
                if last:
                    node[int(part)] = _parse_value(raw)
                else:
                    node = node[int(part)]
                continue
            if not isinstance(node, dict):
                raise RecipeError(f"override {ov!r}: {path} is a value, not a section")
            path = f"{path}.{part}" if path else part
            if last:
                node[part] = _parse_value(raw)
            elif part in node:
                node = node[part]
            elif parts[i + 1].isdigit():
                raise RecipeError(f"override {ov!r}: {path} is not a list in the recipe, so it has no item {parts[i + 1]}")
            else:
                node[part] = {}
                node = node[part]
        origin[path] = ov
    return origin


_ERR_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(err: msgspec.ValidationError, where: str, lines: dict[str, int], origin: dict[str, str]) -> str:
    m = _ERR_PATH.match(str(err))
    msg, path = m.group("msg"), (m.group("path") or "").lstrip(".")
    path = re.sub(r"\['([^']*)'\]", r".\1", path)  # a mapping's key (storage_options['x']) as a dotted key
    field = re.search(r"(?:unknown|missing required) field `([^`]+)`", msg)
    if field:
        path = f"{path}.{field.group(1)}" if path else field.group(1)
        msg = msg.replace("Object contains unknown field", "unknown key").replace(
            "Object missing required field", "missing required key")
        if "unknown key" in msg:
            msg += " (check the spelling; `streamrl check` prints every valid key with its default)"
    elif "matching regex" in msg:
        msg = "must be a dotted function path like `mypkg.rewards:score`"
    elif msg.startswith("Invalid enum value"):
        msg += f"; choose one of {', '.join(map(repr, _choices(path)))}"
    elif msg.startswith("Expected `str`, got"):
        msg += " (quote it: YAML reads true, 1 or 1.5 unquoted as another type)"
    return f"{_locate(where, path, lines, origin)}: {path or '<top level>'}: {msg}"


def _choices(path: str) -> tuple[Any, ...]:
    """The allowed values of the Literal field at `path` in the Recipe schema."""
    typ: Any = Recipe
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        hints = typing.get_type_hints(typ, include_extras=True) if isinstance(typ, type) else {}
        typ = hints.get(part)
        while typing.get_origin(typ) in (list, typing.Annotated, types.UnionType, typing.Union):
            typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def _locate(where: str, path: str, lines: dict[str, int], origin: dict[str, str]) -> str:
    for p, ov in origin.items():
        if any(a == b or a.startswith(b + ".") or a.startswith(b + "[") for a, b in ((path, p), (p, path))):
            return f"override {ov!r}"
    probe = path
    while probe and probe not in lines:  # the nearest enclosing key that is in the file
        shorter = re.sub(r"(^|\.)[^.\[]+$|\[[^\]]*\]$", "", probe)
        if shorter == probe:  # nothing left to strip (never loop forever on an odd path)
            break
        probe = shorter
    return f"{where}:{lines.get(probe, 1)}"


def _yaml_problem(e: yaml.YAMLError, where: str, text: str) -> str:
    """Locate a YAML error where the broken construct starts (an unclosed quote is reported
    at the end of the file by the parser, but the user has to look where it opened)."""
    mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    last = max(1, len(text.splitlines()))
    line = min(mark.line + 1, last) if mark is not None else 1
    detail = ""
    if ctx is not None and getattr(e, "context", None):
        detail = f" ({e.context} that starts here; the parser gave up on line {line})"
        line = ctx.line + 1
    return f"{where}:{line}: not valid YAML: {getattr(e, 'problem', None) or e}{detail}"


def parse_recipe(text: str, where: str = "<recipe>", overrides: list[str] | None = None,
                 resolve: bool = True) -> Recipe:
    """The recipe in `text`; with `resolve`, every function it names is imported (that runs the
    module's code: see streamrl/runtime/user_code.py for recipes from a run directory)."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        lines = _line_index(text)
    except yaml.YAMLError as e:
        raise RecipeError(_yaml_problem(e, where, text)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}:1: a recipe is a mapping of sections (model:, data:, ...), got {type(data).__name__}")
    origin = apply_overrides(data, list(overrides or []))
    try:
        recipe = msgspec.convert(data, Recipe)
    except msgspec.ValidationError as e:
        raise RecipeError(_explain(e, where, lines, origin)) from None
    for key, problem in choice_problems(recipe):
        raise RecipeError(f"{_locate(where, key, lines, origin)}: {key}: {problem}")
    for key, fn in fn_paths(recipe) if resolve else []:
        try:
            check_call(key, fn, resolve_fn(fn))
        except ValueError as e:
            raise RecipeError(f"{_locate(where, key, lines, origin)}: {key}: {e}") from None
    for key, ref in fn_refs(recipe) if resolve else []:  # each hub's call, bound against the function
        if (why := call_problem(key, ref, resolve_fn(ref.fn))) is not None:
            raise RecipeError(f"{_locate(where, key + '.fn', lines, origin)}: {key}.fn: {why}")
    for key, problem in conflicts(recipe):
        raise RecipeError(f"{_locate(where, key, lines, origin)}: {key}: {problem}")
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None, resolve: bool = True) -> Recipe:
    """The recipe at `path`; its directory joins the end of sys.path, so `fn: my_rewards:score`
    may name a module kept next to the recipe (runs ship such modules to every Ray node).
    `resolve=False`: neither that nor any import, only the schema and the settings checked."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RecipeError(f"{p}: cannot read recipe ({e.strerror or e})") from None
    here = str(p.resolve().parent)
    if resolve and here not in sys.path:
        sys.path.append(here)
    return parse_recipe(text, str(p), overrides, resolve)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(msgspec.to_builtins(recipe), sort_keys=False)
