"""The crash-test seam (streamrl/runtime/faultpoint.py): unset it does nothing; set, the n-th arrival at
the point freezes until a test writes `thaw`, and the next arrival freezes again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from streamrl.runtime import faultpoint


def _wait(cond, timeout_s: float = 10.0) -> bool:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def _fresh_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faultpoint, "_seen", type(faultpoint._seen)())


def test_unset_or_another_point_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faultpoint.ENV, raising=False)
    faultpoint.reached("publish", tmp_path)
    monkeypatch.setenv(faultpoint.ENV, "checkpoint.files:1")
    faultpoint.reached("publish", tmp_path)
    assert not (tmp_path / faultpoint.FROZEN).exists()


def test_the_nth_arrival_freezes_until_thawed_and_the_next_freezes_again(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faultpoint.ENV, "publish:2")
    frozen, thaw = tmp_path / faultpoint.FROZEN, tmp_path / faultpoint.THAW
    faultpoint.reached("publish", tmp_path)  # the first: goes on
    assert not frozen.exists()
    arrivals: list[int] = []

    def publish_twice() -> None:
        for n in (2, 3):
            faultpoint.reached("publish", tmp_path)
            arrivals.append(n)

    t = threading.Thread(target=publish_twice, daemon=True)
    t.start()
    assert _wait(frozen.exists) and frozen.read_text().startswith("publish:2 pid ")
    time.sleep(0.5)
    assert arrivals == [], "the frozen arrival went on without a thaw"
    thaw.write_text("")
    assert _wait(lambda: arrivals == [2]), arrivals
    assert _wait(frozen.exists) and frozen.read_text().startswith("publish:3 pid ")
    assert not thaw.exists()
    thaw.write_text("")
    t.join(10)
    assert arrivals == [2, 3] and not frozen.exists() and not thaw.exists()


def test_once_freezes_the_nth_arrival_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faultpoint.ENV, "push_bucket:2:once")
    frozen, thaw = tmp_path / faultpoint.FROZEN, tmp_path / faultpoint.THAW
    arrivals: list[int] = []

    def push() -> None:
        for n in (1, 2, 3, 4):
            faultpoint.reached("push_bucket", tmp_path)
            arrivals.append(n)

    t = threading.Thread(target=push, daemon=True)
    t.start()
    assert _wait(frozen.exists) and frozen.read_text().startswith("push_bucket:2 pid ")
    assert arrivals == [1]
    thaw.write_text("")
    t.join(10)
    assert arrivals == [1, 2, 3, 4] and not frozen.exists()  # the 3rd and 4th went on without a thaw
