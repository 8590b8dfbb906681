"""Shared fixtures. Keep this small; helpers live in tests/poolkit.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import poolkit` from any test


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def pool(run_dir: Path):
    """A fresh LanceDB experience pool in RUN_DIR/pool (closed after the test)."""
    from pools import LancePool

    p = LancePool(run_dir / "pool")
    yield p
    p.close()
