"""Reward functions for the end-to-end tests (tests/test_stream_e2e.py), named in recipes as
`rewardkit:<name>`. The tests put this directory on PYTHONPATH, so the CLI (which imports
every function path when it loads a recipe) and the Ray rollout workers both import it.

- `digit_fraction`: share of the response's characters that are digits. Varies between the
  responses of a group from the first step on, so group advantages are non-zero and every
  learner step really changes the weights (an all-zero reward would leave every version equal).
- `flaky`: like `digit_fraction`, but raises `RewardKitError` for about a third of the
  responses (chosen by a hash of the text, so the choice is deterministic).
- `gated`: like `digit_fraction`, but holds every call while the file `gate` exists and the
  run's metrics.jsonl has at least N lines (N: the integer in the gate file, else
  `after_lines`). A test uses it to freeze the learner (no group gets scored) at a known step,
  do something to the run (kill an engine), let it go on to a later step by writing a larger N,
  and finally remove the file: the run cannot finish before the test is ready. It is async, so
  held calls take no threads; a call held for `max_wait_s` (under RewardHub's 60 s call
  timeout) raises `GateClosed`: the group's samples all fail together, a failed group is never
  trained on, and the worker starts another in its place, so the learner stays held for as
  long as the gate says.
"""

from __future__ import annotations

import time
import zlib

from streamrl.core.types import SampleGroup

FLAKY_MESSAGE = "rewardkit refuses to score this response"


class RewardKitError(RuntimeError):
    """What `flaky` raises; the tests look for this name in the pool's `error` column."""


def digit_fraction(response: str, **_: object) -> float:
    if not response:
        return 0.0
    return sum(c.isdigit() for c in response) / len(response)


def flaky_fails(response: str) -> bool:
    """True for the responses `flaky` raises on."""
    return zlib.crc32(response.encode("utf-8", "replace")) % 3 == 0


def flaky(response: str, **_: object) -> float:
    if flaky_fails(response):
        raise RewardKitError(f"{FLAKY_MESSAGE} ({len(response)} chars)")
    return digit_fraction(response)


def drop_ids(group: SampleGroup, ids: tuple[str, ...] = (), **_: object) -> bool:
    """A filter: False (drop) for the groups of the prompts with these ids."""
    return group.prompt_id not in ids


_seen: dict[str, tuple[float, int]] = {}  # path -> (when read, lines): many held calls share one read


def _lines(path: str) -> int:
    now = time.monotonic()
    when, n = _seen.get(path, (0.0, 0))
    if now - when < 0.1:
        return n
    try:
        with open(path, "rb") as f:
            n = sum(1 for line in f if line.strip())
    except OSError:
        n = 0
    _seen[path] = (now, n)
    return n


class GateClosed(RuntimeError):
    """What `gated` raises when it has held a call for max_wait_s."""


async def gated(response: str, gate: str, metrics: str, after_lines: int = 2, max_wait_s: float = 45.0,
                **_: object) -> float:
    import asyncio

    deadline = time.monotonic() + max_wait_s
    while True:
        try:
            with open(gate) as f:
                text = f.read().strip()
        except OSError:
            break  # no gate: go
        limit = int(text) if text.isdigit() else after_lines
        if _lines(metrics) < limit:
            break
        if time.monotonic() > deadline:
            raise GateClosed(f"held for {max_wait_s}s by {gate}")
        await asyncio.sleep(0.1)
    return digit_fraction(response)
