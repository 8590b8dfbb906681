"""`streamrl pool export` on the pool a quick-start run leaves behind (recipes/quickstart.yaml,
shortened: a small SFT, 4 RL steps, one engine; a graded reward so groups have best and worst
answers): DPO pairs as a Hugging Face dataset directory that `datasets` loads, best-of-n as
JSONL and consumed samples as Parquet, each checked against the pool itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamkit import REPO, assert_ledger_balanced, child_env, run_streamrl, streamrl_cmd

pytestmark = pytest.mark.slow


def _query(run_dir: Path, sql: str) -> list[dict]:
    res = subprocess.run(streamrl_cmd(["pool", "query", str(run_dir), sql, "--json"]), cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamrl.connectors.megatron.model_kit import init_model_dir
    from streamrl.plugins.tasks import write_task

    root = tmp_path_factory.mktemp("qs-export")
    init_model_dir(root / "model", "tiny", 0)
    data = write_task(root / "data", seed=0, n_train=300, n_eval=8, n_sft=200)
    run_dir = root / "run"
    run_streamrl(["run", "recipes/quickstart.yaml", f"model.path={root / 'model'}", f"data.path={data['train']}",
                  f"data.eval_path={data['eval']}", f"sft.path={data['sft']}", "sft.steps=10", "sft.batch_size=16",
                  "run.steps=4", "run.checkpoint_every=0", "run.eval_every=0", "data.eval_size=4",
                  "data.eval_samples=1", "rollout.groups_per_step=4", "engines.num=1",
                  "reward.fn=rewardkit:digit_fraction", "--run-dir", str(run_dir), "--quiet"], run_dir=run_dir)
    assert_ledger_balanced(run_dir)
    return run_dir


def test_dpo_pairs_of_a_quickstart_run_load_with_datasets(quickstart_run: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the Hugging Face load check needs `datasets` (test extra)")
    from streamrl.pools import open_pool
    from streamrl.pools.queries import load_decoder

    out = tmp_path / "pairs"
    where = "status = 'consumed'"
    res = run_streamrl(["pool", "export", str(quickstart_run), str(out), "--kind", "dpo", "--where", where])
    assert res.stdout.startswith("wrote ") and "dpo rows (hf" in res.stdout, res.stdout
    # Pairs: one per consumed group whose scored, non-failed samples do not all have the same reward.
    (want,) = _query(quickstart_run, "SELECT count(*) AS n FROM (SELECT group_id, max(reward) AS hi, min(reward) AS lo, "
                                     "count(reward) AS k FROM pool WHERE status = 'consumed' AND reward IS NOT NULL "
                                     "AND NOT failed GROUP BY 1) WHERE k >= 2 AND hi > lo")
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert want["n"] > 0 and ds.num_rows == want["n"]
    with open_pool(str(quickstart_run)) as pool:
        tok = load_decoder(pool.tokenizer)  # the run's own tokenizer, as recorded in the pool
    assert tok is not None
    for row in ds:
        assert row["chosen_reward"] > row["rejected_reward"] and row["status"] == "consumed"
        assert row["chosen"] == tok.decode(row["chosen_tokens"], skip_special_tokens=False)
        assert row["rejected"] == tok.decode(row["rejected_tokens"], skip_special_tokens=False)
        assert row["prompt"] == tok.decode(row["prompt_tokens"], skip_special_tokens=False) and "+" in row["prompt"]
    # Each pair is the group's best and worst sample, as the pool holds them.
    first = ds[0]
    stored = {r["sample_index"]: r["reward"] for r in _query(
        quickstart_run, f"SELECT sample_index, reward FROM pool WHERE group_id = '{first['group_id']}' AND NOT failed")}
    assert first["chosen_reward"] == pytest.approx(max(v for v in stored.values() if v is not None))
    assert first["rejected_reward"] == pytest.approx(min(v for v in stored.values() if v is not None))


def test_best_of_n_and_samples_of_a_quickstart_run(quickstart_run: Path, tmp_path: Path) -> None:
    best, samples = tmp_path / "best.jsonl", tmp_path / "consumed.parquet"
    run_streamrl(["pool", "export", str(quickstart_run), str(best), "--kind", "best", "--quiet"])
    run_streamrl(["pool", "export", str(quickstart_run), str(samples), "--where", "status = 'consumed'", "--quiet"])
    rows = [json.loads(line) for line in best.read_text().splitlines()]
    groups = _query(quickstart_run, "SELECT count(DISTINCT group_id) AS n FROM pool WHERE reward IS NOT NULL AND NOT failed")
    assert len(rows) == groups[0]["n"] and len({r["group_id"] for r in rows}) == len(rows)
    top = {r["group_id"]: r["m"] for r in _query(
        quickstart_run, "SELECT group_id, max(reward) AS m FROM pool WHERE NOT failed GROUP BY 1")}
    assert all(r["reward"] == pytest.approx(top[r["group_id"]]) for r in rows)
    t = pq.read_table(samples)
    (consumed,) = _query(quickstart_run, "SELECT count(*) AS n FROM pool WHERE status = 'consumed'")
    assert t.num_rows == consumed["n"] > 0 and set(t["status"].to_pylist()) == {"consumed"}
    assert all(len(c) == len(m) for c, m in zip(t["completion_tokens"].to_pylist(), t["loss_mask"].to_pylist()))
    assert set(t["consumed_step"].to_pylist()) == {0, 1, 2, 3}
