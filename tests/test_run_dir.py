"""Where a new run writes (streamrl/runtime/run.py new_run_dir): nothing an earlier run left is ever
deleted implicitly. Default runs get a fresh dated directory and runs/<name> links to the newest;
an explicit directory that holds a run is refused (exit 2, before anything starts) unless
--overwrite."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from streamrl.recipe import load_recipe
from streamrl.runtime.run import RunExists, holds_run, new_run_dir
from streamrl.tools.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe():
    return load_recipe(REPO / "recipes" / "quickstart.yaml")


def _fake_run(d: Path) -> None:
    """What a run leaves (enough for holds_run), plus a file the user put there."""
    (d / "pool").mkdir(parents=True)
    (d / "pool" / "data.lance").write_text("rows")
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "notes.txt").write_text("mine")


def test_default_runs_get_fresh_directories_and_a_link_to_the_newest(recipe, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # run.dir unset: runs/<run.name> relative to where streamrl runs
    first = new_run_dir(recipe)
    _fake_run(first)
    second = new_run_dir(recipe)
    link = tmp_path / "runs" / "quickstart"
    assert first != second and first.parent == second.parent == Path("runs")
    assert first.name.startswith("quickstart-") and second.name.startswith("quickstart-")
    assert link.is_symlink() and link.resolve() == second.resolve()
    assert (first / "pool" / "data.lance").read_text() == "rows"  # the first run is untouched
    assert not any(second.iterdir())
    assert not list(link.parent.glob(".quickstart.*"))  # no temporary link left behind


def test_an_old_real_directory_at_the_link_name_is_kept(recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs" / "quickstart"
    _fake_run(old)  # a run directory made before runs got dated directories
    d = new_run_dir(recipe)
    assert d != old and not old.is_symlink() and (old / "pool" / "data.lance").exists()


def test_an_explicit_directory_holding_a_run_is_refused_unless_overwrite(recipe, tmp_path: Path) -> None:
    d = tmp_path / "run"
    _fake_run(d)
    with pytest.raises(RunExists, match="--resume") as e:
        new_run_dir(recipe, d)
    assert "--overwrite" in str(e.value)
    assert (d / "pool" / "data.lance").exists()
    r = msgspec.structs.replace(recipe, run=msgspec.structs.replace(recipe.run, dir=str(d)))
    with pytest.raises(RunExists):  # run.dir in the recipe is as explicit as --run-dir
        new_run_dir(r)
    assert new_run_dir(recipe, d, overwrite=True) == d
    assert not holds_run(d) and not (d / "pool").exists()
    assert (d / "notes.txt").read_text() == "mine"  # --overwrite removes a run's files, nothing else


def test_a_directory_that_is_not_a_run_is_never_deleted(recipe, tmp_path: Path) -> None:
    d = tmp_path / "thesis"
    d.mkdir()
    (d / "chapter1.tex").write_text("...")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="not a StreamRL run directory"):
            new_run_dir(recipe, d, overwrite=overwrite)
    assert (d / "chapter1.tex").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert new_run_dir(recipe, empty) == empty


def test_cli_run_into_an_existing_run_exits_2_before_anything_starts(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    _fake_run(d)
    before = sorted(p.relative_to(d) for p in d.rglob("*"))
    assert main(["run", str(REPO / "recipes" / "quickstart.yaml"), "--run-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"streamrl run --resume {d}" in err and "--overwrite" in err
    assert sorted(p.relative_to(d) for p in d.rglob("*")) == before and not (d / "run.log").exists()
    assert main(["run", "--resume", str(d), "--overwrite"]) == 2  # --overwrite is for new runs only
    assert "--overwrite" in capsys.readouterr().err
    assert os.path.exists(d / "metrics.jsonl")


def test_a_log_line_still_being_written_is_not_read(tmp_path: Path) -> None:
    """metrics.jsonl while the run appends: a reader that catches half of a row's `write` gets the
    complete rows only (the half row is not a record yet), and the row once it is whole."""
    from streamrl.runtime.runlog import RunLog, read_jsonl

    log = RunLog(tmp_path, echo=False)
    log.metrics({"step": 0, "loss": 0.5})
    path = tmp_path / "metrics.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 1, "lo')
    assert [m["step"] for m in read_jsonl(path)] == [0]
    path.write_bytes(whole + b'{"step": 1, "loss": 0.25}\n')
    assert [m["step"] for m in read_jsonl(path)] == [0, 1]
    assert read_jsonl(tmp_path / "eval.jsonl") == []
