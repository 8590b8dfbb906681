"""The prompt dataset rollout workers draw from: JSONL or Parquet, validated up front.

Each row is an object with a prompt (text, or chat messages `[{"role", "content"}]`) and a
label (whatever the reward function compares against), optionally an `id`:

    {"id": "q1", "prompt": "2+3=", "label": "5"}

A row may also carry `tools` (OpenAI function definitions, as in OpenAI's fine-tuning format):
chat prompts are then rendered with them (SFT rows for tool calling, streamrl/plugins/tool_tasks.py).

The whole file is read and checked when the source is built, so a typo in row 90 000 stops the
run before any GPU time is spent (or, with `on_error="skip"`, is reported once and left out).
`PromptSource.next()` walks the rows epoch by epoch, each epoch in its own seeded order, and
`state()`/`restore()` make that walk resumable from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamrl.core.chat import check_tools

log = logging.getLogger("streamrl.plugins.data")

OnError = Literal["fail", "skip"]


class DataError(Exception):
    """A dataset problem the user must fix; row errors start with `FILE:LINE: ` (Parquet:
    `FILE:row N: `, N counted from 0) and name the key and value that are wrong."""


@dataclass(frozen=True)
class PromptRecord:
    epoch: int
    index: int  # position in this epoch's (shuffled) order; (epoch, index) names the instance
    line: int  # 1-based line in the JSONL file (row number + 1 for Parquet)
    prompt_id: str  # record["id"] when present, else f"L{line}"
    prompt: str | list[dict[str, Any]]
    label: Any
    record: dict[str, Any]


def _head(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_prompt(prompt: Any, key: str) -> str | None:
    """Why `prompt` is not usable, or None when it is."""
    if isinstance(prompt, str):
        # Whitespace-only prompts are as useless as empty ones and usually a broken export.
        return None if prompt.strip() else f"key {key!r} is an empty string; give the prompt text"
    if isinstance(prompt, list):
        if not prompt:
            return f"key {key!r} is an empty list; give the prompt text or at least one chat message"
        for i, msg in enumerate(prompt):
            if not isinstance(msg, dict):
                return (f"key {key!r} item {i} is {type(msg).__name__} {_head(msg)}; chat messages are "
                        'objects like {"role": "user", "content": "..."}')
            missing = [k for k in ("role", "content") if k not in msg]
            if missing:
                return (f"key {key!r} item {i} has no {' or '.join(map(repr, missing))} "
                        f"(keys: {sorted(msg)}); chat messages need both \"role\" and \"content\"")
            if not isinstance(msg["role"], str) or not msg["role"]:
                return f"key {key!r} item {i}: \"role\" is {_head(msg['role'])}; use a role name like \"user\""
            if not isinstance(msg["content"], (str, list)):
                return (f"key {key!r} item {i}: \"content\" is {type(msg['content']).__name__} "
                        f"{_head(msg['content'])}; use text (or a list of content parts)")
        return None
    return (f"key {key!r} is {type(prompt).__name__} {_head(prompt)}; it must be a non-empty string or a "
            'list of chat messages [{"role": ..., "content": ...}]')


def _check_row(obj: Any, prompt_key: str, label_key: str) -> str | None:
    if not isinstance(obj, dict):
        return f"expected a JSON object per line, got {type(obj).__name__} {_head(obj)}"
    for key, setting in ((prompt_key, "prompt_key"), (label_key, "label_key")):
        if key not in obj:
            return (f"missing key {key!r} (keys present: {', '.join(map(repr, obj)) or 'none'}); add it to the "
                    f"row or set data.{setting} in the recipe to the key that holds it")
    if "tools" in obj and (why := check_tools(obj["tools"])) is not None:
        return f"key 'tools': {why}"
    return _check_prompt(obj[prompt_key], prompt_key)


def _raw_rows(path: Path) -> list[tuple[int, str, Any, str | None]]:
    """(line, location prefix, decoded row or None, why it could not be decoded) per row."""
    if not path.exists():
        raise DataError(f"{path}: no such file (data.path in the recipe; relative paths start at "
                        f"{Path.cwd()})")
    if path.is_dir():
        raise DataError(f"{path}: is a directory; data.path must name a .jsonl or .parquet file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only Parquet users pay for the import

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any reader failure means the file is unusable
            raise DataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
        return [(i + 1, f"{path}:row {i}", row, None) for i, row in enumerate(rows)]
    out: list[tuple[int, str, Any, str | None]] = []
    try:
        with path.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue  # blank lines (a trailing newline, spacing) are not rows
                try:
                    out.append((n, f"{path}:{n}", json.loads(raw), None))
                except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                    text = raw.decode("utf-8", "replace").strip()
                    out.append((n, f"{path}:{n}", None, f"not valid JSON ({e}): {_head(text)}"))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    return out


def read_records(path: str | Path, prompt_key: str = "prompt", label_key: str = "label",
                 on_error: OnError = "fail") -> tuple[list[PromptRecord], list[str]]:
    """Valid rows in file order (epoch 0, index = position among valid rows) and one message
    per skipped row. `on_error="fail"` raises DataError at the first bad row instead."""
    if on_error not in ("fail", "skip"):
        raise DataError(f"{path}: on_error={on_error!r}; use 'fail' or 'skip'")
    p = Path(path)
    raw = _raw_rows(p)
    records: list[PromptRecord] = []
    skipped: list[str] = []
    for line, where, obj, problem in raw:
        problem = problem or _check_row(obj, prompt_key, label_key)
        if problem is not None:
            msg = f"{where}: {problem}"
            if on_error == "fail":
                raise DataError(msg + " (or set on_error='skip' to leave bad rows out)")
            log.warning("skipping bad row: %s", msg)
            skipped.append(msg)
            continue
        rid = obj.get("id")
        records.append(PromptRecord(
            epoch=0, index=len(records), line=line,
            prompt_id=str(rid) if rid is not None else f"L{line}",
            prompt=obj[prompt_key], label=obj[label_key], record=obj,
        ))
    if not records:
        why = f"all {len(skipped)} rows are malformed, first: {skipped[0]}" if skipped else "the file has no rows"
        raise DataError(f"{p}: no usable prompts ({why})")
    return records, skipped


class PromptSource:
    """Prompt instances for rollout, epoch after epoch; thread-safe and resumable.

    Epoch `e` visits every valid row once, in the order of a permutation drawn from
    `random.Random(seed + e)` (file order when `shuffle=False`), so the order depends only on
    the seed and the epoch, never on how far an earlier run got.
    """

    def __init__(self, path: str | Path, prompt_key: str = "prompt", label_key: str = "label",
                 shuffle: bool = True, seed: int = 0, epochs: int = 1, on_error: OnError = "fail") -> None:
        if not isinstance(epochs, int) or epochs < 1:
            raise DataError(f"{path}: epochs={epochs!r}; it must be an integer >= 1")
        self.path = Path(path)
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self._rows, self.skipped = read_records(path, prompt_key, label_key, on_error)
        self._epoch, self._position = 0, 0
        self._order_epoch, self._order = -1, list(range(len(self._rows)))
        self._lock = threading.Lock()  # workers may draw from several threads

    def __len__(self) -> int:
        return len(self._rows)

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self._rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def next(self) -> PromptRecord | None:
        """The next prompt instance, or None once every epoch is used up."""
        with self._lock:
            if self._epoch >= self.epochs:
                return None
            epoch, pos = self._epoch, self._position
            row = self._rows[self._order_for(epoch)[pos]]
            self._position += 1
            if self._position == len(self._rows):
                self._epoch, self._position = epoch + 1, 0
        return dataclasses.replace(row, epoch=epoch, index=pos)

    def record(self, epoch: int, index: int) -> PromptRecord:
        """The instance `next()` returned (or will return) as (epoch, index): a resumed run restarts
        a group that was in flight from its id alone."""
        with self._lock:
            row = self._rows[self._order_for(epoch)[index]]
        return dataclasses.replace(row, epoch=epoch, index=index)

    def state(self) -> dict[str, int]:
        with self._lock:
            return {"epoch": self._epoch, "position": self._position}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a `state()`; the next `next()` returns what it would have then."""
        try:
            epoch, position = state["epoch"], state["position"]
        except (KeyError, TypeError):
            raise DataError(f"{self.path}: cannot restore from {_head(state)}; expected "
                            "{'epoch': int, 'position': int} as returned by state()") from None
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, position))
        # epoch == epochs with position 0 is the legitimate "all used up" state
        if not ok or not (0 <= epoch <= self.epochs and 0 <= position < len(self._rows)) or (
                epoch == self.epochs and position != 0):
            raise DataError(f"{self.path}: cannot restore epoch={epoch!r} position={position!r}: this source has "
                            f"{self.epochs} epoch(s) of {len(self._rows)} rows; was the dataset or data.epochs "
                            "changed since the checkpoint?")
        with self._lock:
            self._epoch, self._position = epoch, position

    def peek_remaining(self) -> int:
        """Prompt instances left across all epochs."""
        with self._lock:
            return max(0, (self.epochs - self._epoch) * len(self._rows) - self._position)
