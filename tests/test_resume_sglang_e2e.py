"""Lossless resume with a real SGLang 0.5.23 engine on this CPU (`make sglang`): the run is frozen in a weight
push to SGLang over the gloo group, SIGKILLed as a whole, and `streamrl run --resume` finishes it, with
everything tests/test_resume_e2e.py checks (every step trained once in order, ledger balanced, partial groups
continued, replay identical) and SGLang's log showing both starts and neither run's key. Its own file so that
the two test workers can run it beside test_resume_e2e.py (a real SGLang start is 1-2 minutes here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit import task_data, tiny_model
from test_resume_e2e import test_kill_and_resume_loses_nothing as kill_and_resume

pytestmark = pytest.mark.slow
__all__ = ["task_data", "tiny_model"]  # fixtures


def test_kill_mid_push_to_real_sglang_and_resume_loses_nothing(tmp_path: Path, tiny_model: Path,
                                                                task_data: dict[str, Path], request: pytest.FixtureRequest) -> None:
    kill_and_resume(tmp_path, tiny_model, task_data, "publish:4-sglang", request)
