"""`streamrl pool export`: samples, best-of-n, DPO pairs and raw rows as parquet, jsonl or a
Hugging Face dataset directory, from a real pool (claims applied, streamed in small batches)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from streamrl.core.types import Admission, Sample, SampleGroup, VersionSpan
from streamrl.pools import LancePool, PoolError
from streamrl.pools.export import ExportError, export, guess_format
from streamrl.tools.cli import main

from poolkit import build_char_tokenizer

# group -> (sample rewards, None = unscored; failed sample indices)
GROUPS = {
    "g0": ([0.0, 1.0, 0.5, 1.0], []),  # best: index 1 (first of equal rewards); dpo: 1 vs 0
    "g1": ([0.5, 0.5, 0.5, 0.5], []),  # no preference: no pair
    "g2": ([0.25, None, 0.875, 0.125], [0]),  # failed and unscored samples never chosen: dpo 2 vs 3
    "g3": ([None, None, 1.0, None], []),  # one scored sample: best only, no pair
    "g4": ([0.0, 0.25, 0.75, 0.5], []),  # not claimed: complete
}


def _group(gid: str, tok, rewards: list[float | None], failed: list[int], version: int) -> SampleGroup:
    prompt = tok.encode(f"{gid[-1]}+1=").ids
    samples = []
    for i, r in enumerate(rewards):
        resp = tok.encode(f"{gid[-1]}{i}").ids
        samples.append(Sample(index=i, response_tokens=resp, rollout_logprobs=-np.arange(len(resp), dtype=np.float32),
                              spans=[VersionSpan(version, 0, len(resp))], reward=r, finish_reason="stop",
                              failed=i in failed, error="boom" if i in failed else None))
    return SampleGroup(group_id=gid, prompt_id="p-" + gid, prompt_tokens=prompt, samples=samples)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """g0..g3 consumed by step 0 (learner version 3), g4 still complete; tokenizer recorded."""
    tok = build_char_tokenizer(tmp_path / "tokenizer.json")
    with LancePool(tmp_path / "pool") as pool:
        pool.set_tokenizer(str(tmp_path / "tokenizer.json"))
        pool.admit([Admission(group_id=g, prompt_id="p-" + g, n=4) for g in GROUPS])
        for k, (gid, (rewards, failed)) in enumerate(GROUPS.items()):
            pool.append([_group(gid, tok, rewards, failed, version=k)])
        assert pool.claim(step=0, learner_version=3, num_groups=4, max_staleness=10) is not None
    return tmp_path


def _pool(run: Path) -> LancePool:
    return LancePool(run / "pool", create=False)


def test_samples_parquet_with_a_filter_on_the_claims(run: Path, tmp_path: Path) -> None:
    with _pool(run) as pool:
        info = export(pool, str(tmp_path / "out" / "s.parquet"), where="status = 'consumed' AND reward >= 0.5",
                      progress=False, batch_rows=3)
    t = pq.read_table(tmp_path / "out" / "s.parquet")
    assert info["rows"] == t.num_rows == 9 and info["format"] == "parquet"
    rows = {(r["group_id"], r["sample_index"]): r for r in t.to_pylist()}
    assert set(rows) == {("g0", 1), ("g0", 2), ("g0", 3), ("g2", 2), ("g3", 2)} | {("g1", i) for i in range(4)}
    r = rows[("g2", 2)]
    assert (r["prompt"], r["completion"], r["reward"], r["status"], r["consumed_step"]) == ("2+1=", "22", 0.875,
                                                                                          "consumed", 0)
    tok = build_char_tokenizer(tmp_path / "t.json")
    assert r["completion_tokens"] == tok.encode("22").ids and r["prompt_tokens"] == tok.encode("2+1=").ids
    assert r["version_spans"] == [{"version": 2, "start": 0, "end": 2}] and r["min_version"] == 2


def test_best_of_n_takes_the_first_highest_scored_sample(run: Path, tmp_path: Path) -> None:
    with _pool(run) as pool:
        export(pool, str(tmp_path / "best.jsonl"), kind="best", progress=False, batch_rows=2)
    rows = {r["group_id"]: r for r in map(json.loads, (tmp_path / "best.jsonl").read_text().splitlines())}
    assert {g: (r["sample_index"], r["completion"], r["group_size"]) for g, r in rows.items()} == {
        "g0": (1, "01", 4), "g1": (0, "10", 4), "g2": (2, "22", 2), "g3": (2, "32", 1), "g4": (2, "42", 4)}
    assert rows["g0"]["group_reward_mean"] == pytest.approx(0.625)
    assert rows["g4"]["status"] == "complete" and rows["g0"]["status"] == "consumed"


@pytest.mark.parametrize("batch_rows", [1, 3, 1024])
def test_dpo_pairs_best_against_worst_of_each_group(run: Path, tmp_path: Path, batch_rows: int) -> None:
    out = tmp_path / f"pairs-{batch_rows}.parquet"
    with _pool(run) as pool:
        info = export(pool, str(out), kind="dpo", progress=False, batch_rows=batch_rows)
    rows = {r["group_id"]: r for r in pq.read_table(out).to_pylist()}
    got = {g: (r["chosen_index"], r["rejected_index"], r["chosen"], r["rejected"]) for g, r in rows.items()}
    assert got == {"g0": (1, 0, "01", "00"), "g2": (2, 3, "22", "23"), "g4": (2, 0, "42", "40")}
    assert all(r["chosen_reward"] > r["rejected_reward"] and r["prompt"] == f"{g[-1]}+1=" for g, r in rows.items())
    assert info["rows"] == 3 and info["samples_read"] == 20


def test_hf_directory_loads_with_datasets(run: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the Hugging Face load check needs `datasets` (test extra)")
    out = tmp_path / "hf-pairs"
    with _pool(run) as pool:
        info = export(pool, str(out), kind="dpo", progress=False)
    assert info["format"] == "hf" and [Path(f).name for f in info["files"]] == ["train-00000-of-00001.parquet"]
    card = (out / "README.md").read_text()
    assert "path: data/train-*" in card and "--kind dpo" in card
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 3 and {"prompt", "chosen", "rejected", "chosen_tokens"} <= set(ds.column_names)
    assert sorted(ds["chosen"]) == ["01", "22", "42"]


def test_raw_and_empty_exports(run: Path, tmp_path: Path) -> None:
    with _pool(run) as pool:
        export(pool, str(tmp_path / "raw.parquet"), kind="raw", progress=False)
        info = export(pool, str(tmp_path / "none.parquet"), where="reward > 5", progress=False)
    raw = pq.read_table(tmp_path / "raw.parquet")
    assert raw.num_rows == 20 and "rollout_logprobs" in raw.column_names
    assert sorted(set(raw.filter(pc.equal(raw["status"], "consumed"))["group_id"].to_pylist())) == ["g0", "g1", "g2", "g3"]
    assert info["rows"] == 0 and pq.read_table(tmp_path / "none.parquet").column_names[:2] == ["group_id", "prompt_id"]


def test_bad_requests_are_clear_errors(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert guess_format("a/b.PARQUET") == "parquet" and guess_format("a/b.jsonl") == "jsonl" and guess_format("d") == "hf"
    with _pool(run) as pool:
        with pytest.raises(ExportError, match="--kind 'pairs'"):
            export(pool, str(tmp_path / "x"), kind="pairs", progress=False)
        with pytest.raises(ExportError, match="--tokenizer"):
            export(pool, str(tmp_path / "x"), tokenizer=str(tmp_path / "nothing-here"), progress=False)
        with pytest.raises(ValueError, match="bad filter"):
            export(pool, str(tmp_path / "x.parquet"), where="status = = 1", progress=False)
    assert main(["pool", "export", str(run), str(tmp_path / "y.parquet"), "--where", "nosuchcol > 1"]) == 2
    assert "export failed" in capsys.readouterr().err
    with pytest.raises(PoolError):
        _pool(tmp_path / "nowhere")


def test_cli_export_prints_what_it_wrote(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pairs"
    assert main(["pool", "export", str(run), str(out), "--kind", "dpo", "--quiet"]) == 0
    assert capsys.readouterr().out.strip().startswith(f"wrote 3 dpo rows (hf, from 20 samples) to {out}")
    assert (out / "data" / "train-00000-of-00001.parquet").is_file()


def test_groups_whose_rows_are_not_next_to_each_other(tmp_path: Path) -> None:
    """Lance's merge_insert may write a commit's rows in any order: best and dpo do not rely on
    a group's rows being adjacent."""
    import pyarrow as pa

    from streamrl.pools.schema import admissions_to_table, groups_to_table

    tok = build_char_tokenizer(tmp_path / "tokenizer.json")
    groups = [_group("g1", tok, [0.0, 1.0, 0.5], [], 0), _group("g2", tok, [0.75, 0.25, 0.5], [], 0)]
    t = groups_to_table(groups)
    shuffled = t.take(pa.array([0, 3, 1, 4, 2, 5]))  # g1, g2, g1, g2, g1, g2
    with LancePool(tmp_path / "pool") as pool:
        pool.set_tokenizer(str(tmp_path / "tokenizer.json"))
        pool._open("pool").insert(shuffled)  # noqa: SLF001 - rows as no append would order them
        pool._open("admissions").insert(admissions_to_table(  # noqa: SLF001
            [Admission(group_id=g.group_id, prompt_id=g.prompt_id, n=3) for g in groups]))
        assert pool.ledger().balanced
        export(pool, str(tmp_path / "pairs.parquet"), kind="dpo", progress=False, batch_rows=1)
        export(pool, str(tmp_path / "best.parquet"), kind="best", progress=False, batch_rows=2)
    pairs = {r["group_id"]: (r["chosen_index"], r["rejected_index"]) for r in pq.read_table(tmp_path / "pairs.parquet").to_pylist()}
    assert pairs == {"g1": (1, 0), "g2": (0, 1)}
    best = {r["group_id"]: (r["sample_index"], r["group_size"]) for r in pq.read_table(tmp_path / "best.parquet").to_pylist()}
    assert best == {"g1": (1, 3), "g2": (0, 3)}
