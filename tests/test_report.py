"""`streamrl report` (streamrl/tools/report.py) over a synthetic run directory with a real LanceDB
pool, and the optional TensorBoard / W&B loggers (streamrl/tools/loggers.py). No Ray, no engines."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import matplotlib.image
import pytest

from streamrl.tools.loggers import LoggerUnavailable, open_loggers
from streamrl.tools.report import load_metrics, report_command, write_report

from poolkit import admissions_for, make_group

BIG = 10**6
PNGS = ["reward.png", "staleness.png", "throughput.png", "drops.png", "learner.png"]


def reward_of(step: int) -> float | None:
    return None if step == 5 else 0.2 + 0.02 * step  # step 5: no scored sample


def metrics_row(step: int, **over: object) -> dict:
    row = {"step": step, "policy_version": step + 1, "wall_time_s": 1.5 * (step + 1), "reward_mean": reward_of(step),
           "staleness_mean": 0.5, "staleness_max": 1, "dropped_stale": 0, "dropped_over_sampling": 0,
           "loss": 0.01 / (step + 1), "kl": 0.001 * step, "entropy": 0.6 - 0.01 * step, "grad_norm": 1.0,
           "gen_tokens_per_s": 900.0 + step, "train_tokens_per_s": 4000.0, "samples": 128, "train_tokens": 500,
           "wait_s": 0.5, "train_s": 0.12, "push_s": 0.1, "pause_s": 0.15, "drops": {"nonzero_std": step // 10},
           "groups": [f"g{step}-{i}" for i in range(16)]}
    return row | over


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fill_pool(pool) -> None:
    """Consumed groups at staleness 0 (x3), 1 (x3), 2 (x1); dropped: stale x2, over_sampling x2,
    nonzero_std x2; failed x1; one admitted group still in flight."""
    def append(*groups):
        for g in groups:  # one append each: created times increase in order, claims take the oldest
            pool.append([g], admit=True)
            time.sleep(0.001)

    append(make_group("c0"), make_group("c1"))
    assert len(pool.claim(step=0, learner_version=0, num_groups=2, max_staleness=BIG).groups) == 2
    append(make_group("c2"), make_group("c3"), make_group("c4"))
    assert len(pool.claim(step=1, learner_version=1, num_groups=3, max_staleness=BIG).groups) == 3
    append(make_group("c5", versions=(1, 2)))
    assert len(pool.claim(step=2, learner_version=3, num_groups=1, max_staleness=BIG).groups) == 1
    append(make_group("s0"), make_group("s1"))
    assert pool.claim(step=3, learner_version=5, num_groups=1, max_staleness=1) is None  # both too stale
    append(*(make_group(f"o{i}", versions=(5,)) for i in range(3)))
    b = pool.claim(step=3, learner_version=5, num_groups=3, max_staleness=BIG,
                   select=lambda gs: (gs[:1], {g.group_id: "over_sampling" for g in gs[1:]}))
    assert [g.group_id for g in b.groups] == ["o0"]
    append(make_group("f0", status="failed", drop_reason="reward fn raised"),
           make_group("d0", status="dropped", drop_reason="nonzero_std"),
           make_group("d1", status="dropped", drop_reason="nonzero_std"))
    pool.admit(admissions_for([make_group("in-flight")]))


@pytest.fixture
def run(run_dir: Path, pool) -> Path:
    rows = [metrics_row(s) for s in range(14)]
    rows[12] |= {"reward_mean": -7.0, "samples": 999}  # logged, then redone after a crash
    rows[13] |= {"samples": 999}
    rows += [metrics_row(s) for s in range(12, 30)]
    write_jsonl(run_dir / "metrics.jsonl", rows)
    write_jsonl(run_dir / "eval.jsonl", [
        {"policy_version": 0, "step": 0, "wall_time_s": 60.0, "accuracy": 0.2, "greedy_accuracy": 0.35, "prompts": 128},
        {"policy_version": 10, "step": 10, "wall_time_s": 16.0, "accuracy": 0.5, "greedy_accuracy": 0.6, "prompts": 128,
         "mode": "background"},
        {"policy_version": 30, "step": 30, "wall_time_s": 46.0, "accuracy": 0.45, "greedy_accuracy": 0.62,
         "prompts": 128, "mode": "background"},
    ])
    (run_dir / "summary.json").write_text(json.dumps({"mode": "stream", "steps": 30}))
    fill_pool(pool)
    return run_dir


def assert_pngs(out: Path, names: list[str]) -> None:
    for name in names:
        p = out / name
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        img = matplotlib.image.imread(p)
        assert img.shape[0] > 100 and img.shape[1] > 100, (name, img.shape)


def test_report_writes_every_plot_and_a_summary_that_matches_the_run(run: Path):
    s = write_report(run)
    out = run / "report"
    assert_pngs(out, PNGS)
    assert s["files"] == [str(out / n) for n in PNGS]

    assert s["mode"] == "stream" and s["steps"] == 30
    assert (s["first_version"], s["last_version"]) == (1, 30)
    assert s["wall_time_s"] == 45.0 and s["samples"] == 30 * 128  # the redone steps count once
    assert s["samples_per_s"] == pytest.approx(30 * 128 / 45.0)
    first = [reward_of(i) for i in range(10) if reward_of(i) is not None]
    assert s["reward_first"] == pytest.approx(sum(first) / len(first))
    assert s["reward_last"] == pytest.approx(sum(reward_of(i) for i in range(20, 30)) / 10)
    assert s["eval_first"] == {"policy_version": 0, "accuracy": 0.2, "greedy_accuracy": 0.35}
    assert s["eval_last"] == {"policy_version": 30, "accuracy": 0.45, "greedy_accuracy": 0.62}
    assert s["eval_best"]["policy_version"] == 10

    assert s["staleness_source"] == "pool"
    assert s["staleness_histogram"] == {"0": 3, "1": 3, "2": 1}
    assert s["staleness_mean"] == pytest.approx((0 * 3 + 1 * 3 + 2 * 1) / 7) and s["staleness_max"] == 2
    assert s["drops"] == {"stale": 2, "over_sampling": 2, "nonzero_std": 2}
    assert s["failed_groups"] == 1
    assert s["ledger"] == {"admitted": 15, "lost": 0, "duplicated": 0, "balanced": True}
    assert s["notes"] == []
    json.dumps(s)  # serialisable as is


def test_the_last_row_of_a_repeated_step_wins(run: Path):
    rows = load_metrics(run)
    assert [r["step"] for r in rows] == list(range(30))
    assert rows[12]["reward_mean"] == pytest.approx(reward_of(12)) and rows[12]["samples"] == 128


def test_report_command_prints_json_or_a_table(run: Path, tmp_path: Path, capsys):
    assert report_command(str(run), str(tmp_path / "elsewhere"), True) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["files"][0].startswith(str(tmp_path / "elsewhere")) and s["steps"] == 30
    assert report_command(str(run), None, False) == 0
    table = capsys.readouterr().out
    for text in ("policy version 1 → 30", "balanced", "over_sampling 2", "0: 3, 1: 3, 2: 1"):
        assert text in table, table


def test_a_directory_without_metrics_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match=r"is not a StreamRL run directory .*no metrics\.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="has no steps"):
        report_command(str(tmp_path), None, False)


def test_without_a_pool_or_evals_and_with_few_keys_the_plots_still_come(tmp_path: Path):
    # An older run (fewer keys), killed early: no pool, no eval.jsonl, no summary.json.
    rows = [{"step": i, "policy_version": i + 1, "wall_time_s": float(i + 1), "reward_mean": 3.0 * i, "samples": 8,
             "staleness_mean": 1.0, "staleness_max": 2, "dropped_stale": 1, "drops": {"nonzero_std": i}}
            for i in range(5)]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    s = write_report(tmp_path)
    assert_pngs(tmp_path / "report", PNGS)
    assert s["mode"] is None and s["ledger"] is None and s["staleness_histogram"] is None
    assert (s["staleness_source"], s["staleness_mean"], s["staleness_max"]) == ("metrics", 1.0, 2)
    assert s["drops"] == {"nonzero_std": 4, "stale": 5}
    assert s["eval_first"] is None and "no experience pool" in s["notes"][0]


def test_learner_plot_shows_the_correction_and_marks_skipped_steps(tmp_path: Path, capsys):
    rows = [metrics_row(i, is_weight_mean=1.0 + 0.01 * i, is_weight_max=2.0, is_ratio_mean=1.1,
                        is_masked_tokens=0.0, is_capped_tokens=0.02, clip_frac=0.01 * i,
                        nonfinite_skipped=int(i in (3, 7)), loss=float("nan") if i in (3, 7) else 0.1)
            for i in range(12)]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    plain = write_report(tmp_path, tmp_path / "plain")
    assert plain["nonfinite_skipped"] == 2
    assert report_command(str(tmp_path), str(tmp_path / "table"), False) == 0
    assert "2 optimizer step(s): non-finite loss or grad norm" in capsys.readouterr().out
    # the same run without the correction's columns and skips draws a different learner plot
    write_jsonl(tmp_path / "metrics.jsonl", [metrics_row(i) for i in range(12)])
    older = write_report(tmp_path, tmp_path / "older")
    assert older["nonfinite_skipped"] == 0
    new, old = (matplotlib.image.imread(tmp_path / d / "learner.png") for d in ("plain", "older"))
    assert new.shape == old.shape and (new != old).any()


def test_no_drops_still_draws_the_chart(run_dir: Path, pool):
    write_jsonl(run_dir / "metrics.jsonl", [metrics_row(0, drops={})])
    pool.append([make_group("only")], admit=True)
    assert pool.claim(step=0, learner_version=0, num_groups=1, max_staleness=BIG) is not None
    s = write_report(run_dir)
    assert s["drops"] == {} and s["failed_groups"] == 0
    assert_pngs(run_dir / "report", ["drops.png"])


# ---------------------------------------------------------------- loggers


ROW = {"step": 3, "policy_version": 4, "reward_mean": 0.5, "loss": None, "samples": 128, "groups": ["a"],
       "drops": {"x": 1}, "flag": True}


def test_no_loggers_accept_rows(tmp_path: Path):
    lg = open_loggers([], tmp_path, "run", None)
    lg.metrics(ROW)
    lg.eval({"policy_version": 4, "accuracy": 0.5})
    lg.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_logger_whose_package_is_missing_names_the_install(tmp_path: Path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, installed or not
    with pytest.raises(LoggerUnavailable, match=rf"{name} was asked for .* pip install {name} \(or remove it"):
        open_loggers([name], tmp_path, "run", None)


def test_tensorboard_logger_writes_scalars_at_the_right_steps(tmp_path: Path, monkeypatch):
    calls = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, global_step):
            calls.append((tag, value, global_step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    lg = open_loggers(["tensorboard"], tmp_path, "run", None)
    lg.metrics(ROW)
    lg.eval({"policy_version": 4, "step": 4, "accuracy": 0.25, "mode": "inline"})
    lg.close()
    assert calls == [("init", str(tmp_path / "tensorboard")), ("step", 3.0, 3), ("policy_version", 4.0, 3),
                     ("reward_mean", 0.5, 3), ("samples", 128.0, 3),
                     ("eval/policy_version", 4.0, 4), ("eval/step", 4.0, 4), ("eval/accuracy", 0.25, 4), ("close",)]


def test_wandb_logger_keeps_steps_and_eval_versions_on_their_own_axes(tmp_path: Path, monkeypatch):
    run = types.SimpleNamespace(defined={}, logged=[], finished=False)
    run.define_metric = lambda k, step_metric=None: run.defined.__setitem__(k, step_metric)
    run.log = run.logged.append
    run.finish = lambda: setattr(run, "finished", True)
    inits = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: inits.append(kw) or run))
    lg = open_loggers(["wandb"], tmp_path, "qs", None)
    lg.metrics(ROW)
    lg.eval({"policy_version": 4, "accuracy": 0.25})
    lg.close()
    assert inits == [{"project": "qs", "name": "qs", "dir": str(tmp_path), "resume": "allow"}]
    assert run.defined["reward_mean"] == "step" and run.defined["eval/*"] == "eval/policy_version"
    assert run.logged == [{"step": 3, "policy_version": 4.0, "reward_mean": 0.5, "samples": 128.0},
                          {"eval/policy_version": 4, "eval/accuracy": 0.25}]
    assert run.finished


def test_real_tensorboard_writes_an_event_file(tmp_path: Path):
    pytest.importorskip("tensorboard")
    lg = open_loggers(["tensorboard"], tmp_path, "run", None)
    for s in range(3):
        lg.metrics({**ROW, "step": s})
    lg.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
