"""Helpers for learner tests: megatron and torch.distributed keep global state per process,
so each scenario runs as a script in a fresh interpreter that prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str) -> Any:
    """Run `script` as `python -c SCRIPT *args` and return the JSON its last stdout line holds."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model-kit directory, built once per test module."""
    from streamrl.connectors.megatron.model_kit import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny")
