"""The recipe reference page, generated from the typed recipe schema so it cannot drift:

    python -m streamrl.tools.recipe_reference > docs/recipe-reference.md

Types, defaults and allowed values come from the msgspec Structs in streamrl/recipe/schema.py; what a key
means comes from the `# comments` beside and above each field there (and each section's
docstring), read with tokenize because comments never reach the running objects.
tests/test_docs.py fails when the page differs from what this module renders.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from typing import Any, Literal

import msgspec

from streamrl.recipe import FnPath, FnRef, Recipe

COMMAND = "python -m streamrl.tools.recipe_reference > docs/recipe-reference.md"
_FN_PATTERN = typing.get_args(FnPath)[1].pattern
_NONE = type(None)


# ---------------------------------------------------------------- comments in the source


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without '#', whether the line holds nothing but the comment)."""
    lines = source.splitlines()
    out: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            out[row] = (tok.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    return out


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> its comment: the comment-only lines right above the field,
    then the comments at the end of its lines. (A comment-only line always belongs to the field
    below it, so a note that runs on should sit above its field.)"""
    notes = _comments(source)
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            row = stmt.lineno - 1
            while row in notes and notes[row][1] and lines[row - 1].strip():
                above.insert(0, notes[row][0])
                row -= 1
            beside = [notes[r][0] for r in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                      if r in notes and not notes[r][1]]
            fields[stmt.target.id] = " ".join(x for x in above + beside if x)
        found[node.name] = fields
    return found


def _comment_for(cls: type, name: str, comments: dict[str, dict[str, str]]) -> str:
    """A field's comment where it is declared; a subclass that re-declares a field without one
    keeps its base class's."""
    for klass in cls.__mro__:
        text = comments.get(klass.__name__, {}).get(name)
        if text:
            return text
    return ""


# ---------------------------------------------------------------- types and defaults


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _meta_text(meta: msgspec.Meta) -> str:
    if meta.pattern == _FN_PATTERN:
        return "a function path `pkg.module:function`"
    bounds = [f"{op} {getattr(meta, attr)}" for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
              if getattr(meta, attr) is not None]
    return " and ".join(bounds)


def type_text(typ: Any, links: dict[type, str]) -> str:
    """A field's type in words, e.g. `int >= 1 or null`, `one of "a", "b"`, `[learner.parallel](#...)`."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Annotated:
        metas = [a for a in args[1:] if isinstance(a, msgspec.Meta)]
        described = " ".join(t for t in (_meta_text(m) for m in metas) if t)
        if described.startswith("a function path"):
            return described
        return f"{type_text(args[0], links)} {described}".strip()
    if origin is Literal:
        values = ", ".join(f"`{v}`" for v in args)
        return f"`{args[0]}`" if len(args) == 1 else f"one of {values}"
    if origin in (types.UnionType, typing.Union):
        parts = [type_text(a, links) for a in args if a is not _NONE]
        text = " or ".join(parts)
        return f"{text} or null" if _NONE in args else text
    if origin is list:
        return f"list of {type_text(args[0], links)}"
    if origin is dict:
        return f"mapping of {type_text(args[0], links)} to {type_text(args[1], links)}"
    if typ is Any:
        return "any value"
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return f"[{links[typ]}](#{slug(links[typ])})" if typ in links else "section"
    return getattr(typ, "__name__", str(typ))


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {_value_text(v).strip('`')}" for k, v in value.items()) + "}`"
    return f"`{json.dumps(value)}`"


def default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    if field.default is not msgspec.NODEFAULT:
        return _value_text(msgspec.to_builtins(field.default))
    made = field.default_factory()
    if isinstance(made, msgspec.Struct) and isinstance(field.default_factory, type):
        return "its defaults"  # a section built from its own fields' defaults
    return _value_text(msgspec.to_builtins(made))


# ---------------------------------------------------------------- the page


def _struct_of(typ: Any) -> type | None:
    """The Struct a field's type holds (through Annotated, `| None` and list), if any."""
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return typ
    for arg in typing.get_args(typ):
        if (found := _struct_of(arg)) is not None:
            return found
    return None


def _sections(root: type) -> list[tuple[str, type]]:
    """(key path, Struct) for every section, depth first in declaration order; a Struct used in
    several places (a function reference) is listed once, at its first path."""
    out: list[tuple[str, type]] = []
    seen: set[type] = set()

    def walk(cls: type, path: str) -> None:
        if cls in seen:
            return
        seen.add(cls)
        out.append((path, cls))
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in msgspec.structs.fields(cls):
            sub = _struct_of(hints[f.name])
            if sub is not None:
                walk(sub, f"{path}.{f.name}" if path else f.name)

    walk(root, "")
    return out


def _cell(text: str) -> str:
    """Text fit for a table cell: pipes escaped, and outside `code` the characters Markdown would
    read as HTML or emphasis (`<dir of path>`, `**args`)."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"(\*|<(?=[A-Za-z/!?]))", r"\\\1", parts[i])
    return "".join(parts).replace("|", "\\|")


def _doc(cls: type) -> str:
    """The class's own docstring on one line (msgspec.Struct's would otherwise be inherited)."""
    return " ".join((cls.__dict__.get("__doc__") or "").split())


def render() -> str:
    """The whole Markdown page."""
    source = inspect.getsource(sys.modules[Recipe.__module__])
    comments = field_comments(source)
    sections = _sections(Recipe)
    names = {cls: ("top level" if not path else path) for path, cls in sections}
    names[FnRef] = "function references"
    links = {cls: name for cls, name in names.items() if cls is not Recipe}
    out = [
        "# Recipe reference",
        "",
        "<!-- Generated from streamrl/recipe/schema.py; do not edit by hand. -->",
        f"Generated from the typed recipe schema (`streamrl/recipe/schema.py`): `{COMMAND}`.",
        "`tests/test_docs.py` fails when this page differs from what that command prints, so change",
        "the schema (types, defaults, the `# comments` beside each field) and regenerate.",
        "",
        "A recipe is YAML; every key below can also be set on the command line as `key.sub=value`",
        "(`streamrl check RECIPE` prints a recipe with every value resolved). How to write one:",
        "[recipes.md](recipes.md).",
        "",
        "Sections: " + ", ".join(f"[{names[cls]}](#{slug(names[cls])})" for _, cls in sections) + ".",
    ]
    for path, cls in sections:
        heading = names[cls]
        out += ["", f"## {heading}", ""]
        if _doc(cls):
            out += [_doc(cls), ""]
        if cls is FnRef:
            others = [p for p, c in _uses(Recipe, FnRef)]
            out += [f"Used by {', '.join(f'`{p}`' for p in others)}.", ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in msgspec.structs.fields(cls):
            key = f"{path}.{f.name}" if path and cls is not FnRef else f.name
            sub = _struct_of(hints[f.name])
            meaning = _comment_for(cls, f.name, comments) or (_doc(sub) if sub else "")
            out.append(f"| `{key}` | {_cell(type_text(hints[f.name], links))} | {_cell(default_text(f))} | "
                       f"{_cell(meaning)} |")
    return "\n".join(out) + "\n"


def _uses(root: type, target: type, path: str = "") -> list[tuple[str, type]]:
    """(key path, Struct) for every field whose type holds `target`, e.g. reward, filters[]."""
    found: list[tuple[str, type]] = []
    hints = typing.get_type_hints(root, include_extras=True)
    for f in msgspec.structs.fields(root):
        sub = _struct_of(hints[f.name])
        key = f"{path}.{f.name}" if path else f.name
        if typing.get_origin(hints[f.name]) is list:
            key += "[]"
        if sub is target:
            found.append((key, sub))
        elif sub is not None:
            found.extend(_uses(sub, target, key))
    return found


if __name__ == "__main__":
    sys.stdout.write(render())
