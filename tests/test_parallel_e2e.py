"""A run whose learner has several ranks (learner.parallel): the Ray actor group trains end to
end, the ledger balances, and `streamrl replay` (the same layout on a Ray instance of its own)
gives exactly the losses and gradient norms the run logged. That each layout equals one process
is tests/test_mcore_parallel.py's to show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamkit import (
    assert_ledger_balanced,
    read_metrics,
    run_log,
    run_recipe,
    run_streamrl,
    task_data,
    tiny_model,
    write_recipe,
)

pytestmark = pytest.mark.slow
__all__ = ["task_data", "tiny_model"]  # fixtures

STEPS = 4


# One run with pp 2 x dp 2 (4 ranks): dp 2 and pp 2 were a run each until CI neared 30 minutes.
@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2}], ids=["pp2-dp2"])
def test_parallel_learner_run_matches_one_process(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path],
                                                  layout: dict[str, int]) -> None:
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": STEPS, **{f"learner.parallel.{k}": v for k, v in layout.items()}})
    run_recipe(recipe, run_dir)
    ranks = {"tp": 1, "pp": 1, "dp": 1} | layout
    n = ranks["tp"] * ranks["pp"] * ranks["dp"]
    assert f"learner: {n} ranks (tp {ranks['tp']} x pp {ranks['pp']} x dp {ranks['dp']})" in run_log(run_dir)
    metrics = read_metrics(run_dir)
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
    assert any(m["grad_norm"] > 0 for m in metrics), metrics  # the steps trained something
    ledger = assert_ledger_balanced(run_dir)["ledger"]
    assert ledger["consumed"] == STEPS * 2, ledger

    res = run_streamrl(["replay", str(run_dir), "--steps", f"0-{STEPS - 1}", "--json"])
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == STEPS and all(r["identical"] for r in rows), rows
