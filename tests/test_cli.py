"""The inspection CLI against real pools: stats, query (also while another process writes),
show, export, bad paths."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamrl.core.types import Admission, Sample, SampleGroup, VersionSpan
from streamrl.pools import LancePool
from streamrl.pools.schema import POOL_SCHEMA
from streamrl.tools.cli import main

from poolkit import build_char_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _group(gid: str, tok, version: int, rewards: list[float], status: str = "complete") -> SampleGroup:
    prompt = tok.encode("12+30=").ids
    resp = tok.encode("42").ids
    return SampleGroup(
        group_id=gid, prompt_id="p-" + gid, prompt_tokens=prompt, status=status,
        samples=[Sample(index=i, response_tokens=resp, rollout_logprobs=[-0.5] * len(resp),
                        spans=[VersionSpan(version, 0, len(resp))], reward=r, finish_reason="stop")
                 for i, r in enumerate(rewards)],
    )


@pytest.fixture
def filled_run(tmp_path: Path) -> Path:
    """A run directory whose pool holds 3 consumed, 1 complete and 1 in-flight group."""
    tok = build_char_tokenizer(tmp_path / "tokenizer.json")
    with LancePool(tmp_path / "pool") as pool:
        pool.set_tokenizer(str(tmp_path / "tokenizer.json"))
        pool.admit([Admission(group_id=f"g{i}", prompt_id=f"p-g{i}", n=2) for i in range(5)])
        pool.append([_group(f"g{i}", tok, version=i, rewards=[1.0, float(i % 2)]) for i in range(4)])
        batch = pool.claim(step=0, learner_version=3, num_groups=3, max_staleness=5)
        assert batch is not None
    return tmp_path


def test_stats_json(filled_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "stats", str(filled_run), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["rows"] == 8 and s["groups"] == 4
    assert s["groups_by_status"] == {"complete": 1, "consumed": 3}
    assert s["versions"] == {"min": 0, "max": 3}
    assert s["staleness_histogram"] == {"1": 1, "2": 1, "3": 1}  # consumed at learner version 3
    assert [r["mean_reward"] for r in s["reward_by_version"]] == [0.5, 1.0, 0.5, 1.0]
    led = s["ledger"]
    assert (led["admitted"], led["in_flight"], led["consumed"], led["complete"]) == (5, 1, 3, 1)
    assert led["lost"] == 0 and led["duplicated"] == 0 and led["balanced"] is True


def test_stats_text_and_unbalanced_exit_code(filled_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "stats", str(filled_run)]) == 0
    assert "balanced" in capsys.readouterr().out
    with LancePool(filled_run / "pool") as pool:
        pool._pool.delete("group_id = 'g3' AND sample_index = 1")  # a stored group loses a sample
    assert main(["pool", "stats", str(filled_run), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["ledger"]["lost"] == 1


def test_query_formats(filled_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT status, count(*) AS n FROM pool GROUP BY 1 ORDER BY 1"
    assert main(["pool", "query", str(filled_run), sql, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"status": "complete", "n": 2}, {"status": "consumed", "n": 6}]
    assert main(["pool", "query", str(filled_run), sql, "--csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"status","n"', '"complete",2', '"consumed",6']
    assert main(["pool", "query", str(filled_run), "SELECT count(*) AS a FROM admissions"]) == 0
    assert "5" in capsys.readouterr().out
    assert main(["pool", "query", str(filled_run), "SELECT * FROM pool WHERE consumed_step = 0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6 and all(r["consumed_version"] == 3 for r in rows)


def test_query_error_is_exit_2(filled_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "query", str(filled_run), "SELECT nosuchcolumn FROM pool"]) == 2
    assert "nosuchcolumn" in capsys.readouterr().err


def test_show_decodes_text(filled_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "show", str(filled_run), "g2"]) == 0
    out = capsys.readouterr().out
    assert "'12+30='" in out and "'42'" in out and "v2[0:2)" in out and "status consumed" in out
    assert main(["pool", "show", str(filled_run), "nope"]) == 2


def test_export_where(filled_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    assert main(["pool", "export", str(filled_run), str(out), "--where", "status = 'complete'"]) == 0
    t = pq.read_table(out)
    assert t.num_rows == 2 and set(t["group_id"].to_pylist()) == {"g3"}
    assert t["completion_tokens"].to_pylist()[0] == build_char_tokenizer(tmp_path / "t.json").encode("42").ids
    assert t["completion"].to_pylist() == ["42", "42"] and t["prompt"].to_pylist()[0] == "12+30="
    raw = tmp_path / "raw.parquet"
    assert main(["pool", "export", str(filled_run), str(raw), "--kind", "raw", "--where", "consumed_step = 0"]) == 0
    assert pq.read_table(raw).num_rows == 6 and pq.read_table(raw).schema.names == POOL_SCHEMA.names


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl", *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize("damage", ["missing", "not_a_pool", "corrupt"])
def test_bad_pool_dir_is_a_clear_error(filled_run: Path, tmp_path: Path, damage: str) -> None:
    if damage == "missing":
        target = tmp_path / "does-not-exist"
    elif damage == "not_a_pool":
        target = tmp_path / "empty"
        target.mkdir()
    else:
        for f in (filled_run / "pool" / "pool.lance" / "_versions").iterdir():
            f.write_bytes(b"garbage")
        target = filled_run
    r = _cli("pool", "stats", str(target))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "streamrl: error:" in r.stderr and str(target) in r.stderr


@pytest.mark.slow
def test_query_while_another_process_writes(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    # The writer goes on until the reader has seen the pool grow: a fixed number of appends can
    # finish before the first `pool query` process has even started.
    writer = textwrap.dedent(f"""
        import os, sys, numpy as np
        from streamrl.pools import LancePool
        from streamrl.core.types import Sample, SampleGroup, VersionSpan
        pool = LancePool({str(tmp_path / 'pool')!r})
        i = 0
        while not os.path.exists({str(stop)!r}) and i < 20_000:
            g = SampleGroup(group_id=f"w{{i}}", prompt_id="p", prompt_tokens=[1, 2],
                samples=[Sample(index=j, response_tokens=np.arange(50), rollout_logprobs=np.zeros(50),
                                spans=[VersionSpan(0, 0, 50)]) for j in range(4)])
            pool.append([g], admit=True)
            i += 1
            if i == 6:
                print("ready", flush=True)
        pool.close()
        print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        counts = []
        while proc.poll() is None and len(counts) < 4:
            r = _cli("pool", "query", str(tmp_path), "SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM pool", "--json")
            assert r.returncode == 0, r.stderr
            row = json.loads(r.stdout)[0]
            assert row["n"] == 4 * row["g"]  # whole groups only, never half a commit
            counts.append(row["n"])
            time.sleep(0.2)
        stop.touch()
        written = int(proc.stdout.readline())
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert len(counts) >= 2 and counts[-1] > counts[0] > 0, counts
    r = _cli("pool", "stats", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ledger"]["complete"] == written >= counts[-1] // 4


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`streamrl run --resume`: bad input exits 2 with the reason, before anything starts."""
    from streamrl.recipe import dump_recipe, load_recipe

    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "has no recipe.yaml" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "needs a RECIPE" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(dump_recipe(load_recipe(REPO / "recipes" / "quickstart.yaml")))
    assert main(["run", "--resume", str(run_dir), "rollout.workers=3"]) == 2
    err = capsys.readouterr().err
    assert "rollout.workers cannot change on --resume (1 -> 3)" in err
    assert main(["run", "--resume", str(run_dir), "--run-dir", str(tmp_path)]) == 2
    assert "--resume takes the run directory" in capsys.readouterr().err
    assert main(["run", "--resume", str(run_dir), "rollout.n_samples=0"]) == 2  # the recipe's own checks apply
    assert "rollout.n_samples" in capsys.readouterr().err
    assert not (run_dir / "run.log").exists()  # nothing started
