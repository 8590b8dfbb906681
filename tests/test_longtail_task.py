"""The long-tail countdown task (streamrl/plugins/tasks.py): its verifier, the shape of its
response lengths in the model kit's tokens, and that its files are a function of the seed."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from streamrl.plugins.tasks import (countdown_chain, countdown_problem, countdown_reward, countdown_steps,
                                    countdown_text, teacher_chain, write_longtail_task)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _exact(prompt: str) -> str:
    a, d = map(int, re.fullmatch(r"(\d+)-(\d)=", prompt).groups())
    return countdown_text(a, d, countdown_chain(a, d))


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_longtail_task(tmp_path_factory.mktemp("longtail"), seed=0)


def test_chain_stops_at_the_first_value_below_the_hundred():
    assert countdown_chain(957, 7) == [950, 943, 936, 929, 922, 915, 908, 901, 894]
    assert countdown_text(312, 5, countdown_chain(312, 5)) == "307;307-5=302;302-5=297"
    assert countdown_chain(100, 1) == [99]
    rng = random.Random(1)
    for _ in range(500):
        a, d = countdown_problem(rng, 2, 24)
        chain = countdown_chain(a, d)
        assert 2 <= len(chain) <= 24 and 100 <= a <= 999 and 1 <= d <= 9
        assert all(x // 100 == a // 100 for x in chain[:-1]) and chain[-1] < a // 100 * 100


def test_verifier_scores_the_whole_chain():
    label = "307;307-5=302;302-5=297"
    assert countdown_reward(label, label) == {"reward": 1.0, "exact": 1.0, "prefix": 1.0, "final": 1.0,
                                              "steps_right": 1.0, "first_error": -1.0}
    assert countdown_reward(f" {label}\n", label)["reward"] == 1.0
    slipped = countdown_reward("307;307-5=303;303-5=298", label)  # a wrong step carried on
    assert slipped["reward"] == 0.0 and slipped["final"] == 0.0 and slipped["steps_right"] == pytest.approx(1 / 3)
    early = countdown_reward("307;307-5=302", label)  # stops inside the hundred
    assert early["reward"] == 0.0 and early["final"] == 0.0
    late = countdown_reward(label + ";297-5=292", label)  # goes past the stop
    assert late["reward"] == 0.0 and late["final"] == 0.0 and late["steps_right"] == 1.0
    lucky = countdown_reward("307;307-5=301;301-5=297", label)  # right end through a wrong step
    assert lucky["reward"] == 0.0 and lucky["final"] == 1.0
    for junk in ("", ";;;", "abc", "297"):
        assert countdown_reward(junk, label)["reward"] == 0.0


def test_partial_credit_rewards_the_right_prefix_and_only_an_exact_chain_in_full():
    label = "307;307-5=302;302-5=297"  # 3 pieces
    half = {"partial_credit": 0.5}
    assert countdown_reward(label, label, **half)["reward"] == 1.0
    # first piece right, second wrong: prefix 1/3 -> 0.5 * 0 + 0.5 * 1/3
    assert countdown_reward("307;307-5=303;303-5=298", label, **half)["reward"] == pytest.approx(1 / 6)
    # stops one step early: 2 of 3 -> 1/3; one step late: 3 right of 4 written -> 0.5 * 3/4
    assert countdown_reward("307;307-5=302", label, **half)["reward"] == pytest.approx(1 / 3)
    assert countdown_reward(label + ";297-5=292", label, **half)["reward"] == pytest.approx(3 / 8)
    # a right end through a wrong step earns only the prefix before the slip
    assert countdown_reward("307;307-5=301;301-5=297", label, **half)["prefix"] == pytest.approx(1 / 3)
    assert countdown_reward("", label, partial_credit=1.0)["reward"] == 0.0
    assert countdown_reward("307", label, partial_credit=1.0)["reward"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="partial_credit"):
        countdown_reward(label, label, partial_credit=1.5)


def test_splits_are_disjoint_and_labels_exact(task: dict[str, Path]):
    rows = {k: _rows(p) for k, p in task.items()}
    assert {k: len(v) for k, v in rows.items()} == {"train": 3000, "eval": 128, "sft": 6000}
    prompts = {k: {r["prompt"] for r in v} for k, v in rows.items()}
    assert not prompts["train"] & prompts["eval"] and not prompts["sft"] & prompts["eval"]
    assert not prompts["train"] & prompts["sft"]
    for k in ("train", "eval"):
        assert all(r["label"] == _exact(r["prompt"]) for r in rows[k])
    # The noisy teacher: a step slips with probability 0.1, so a longer chain is wrong more often.
    right = [(len(_exact(r["prompt"]).split(";")), r["response"] == _exact(r["prompt"])) for r in rows["sft"]]
    short = np.mean([ok for n, ok in right if n <= 3])
    long = np.mean([ok for n, ok in right if n >= 15])
    assert 0.6 < short < 0.95 and long < 0.35


def test_response_lengths_have_a_long_tail_and_fit_the_tiny_model(task: dict[str, Path]):
    from connectors.megatron.model_kit import PRESETS, build_tokenizer

    tok = build_tokenizer()  # as every model family loads it (tests/test_model_kit.py): digits one by one

    def n_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    train = _rows(task["train"])
    lengths = np.array([n_tokens(r["label"]) + 1 for r in train])  # + EOS
    p10, p50, p90, top = np.percentile(lengths, [10, 50, 90, 100])
    assert p10 <= 16 and 25 <= p50 <= 80 and p90 >= 120 and top >= 200  # ~an order of magnitude, long tail
    assert top / p50 >= 3 and lengths.mean() > p50  # skewed to the right
    # recipes/longtail.yaml: prompt + up to 240 new tokens within the tiny preset's positions.
    positions = PRESETS["tiny"]["max_position_embeddings"]
    every = [(r["prompt"], r.get("label") or r["response"]) for p in task.values() for r in _rows(p)]
    assert max(n_tokens(p) for p, _ in every) + 240 <= positions
    # every exact chain can be generated in 240 new tokens (with EOS); the teacher's, which may run one
    # step longer, are trained on, not generated: they fit the positions
    assert max(n_tokens(r["label"]) + 1 for k in ("train", "eval") for r in _rows(task[k])) <= 240
    assert max(n_tokens(p) + n_tokens(x) + 1 for p, x in every) <= positions


def test_same_seed_same_files_other_seed_other_files(tmp_path: Path, task: dict[str, Path]):
    again = write_longtail_task(tmp_path / "a", seed=0)
    assert all(again[k].read_text() == task[k].read_text() for k in task)
    other = write_longtail_task(tmp_path / "b", seed=1, n_train=50, n_eval=8, n_sft=50)
    assert _rows(other["train"])[:20] != _rows(task["train"])[:20]


def test_teacher_that_forgets_borrows():
    rng = random.Random(0)
    assert teacher_chain(rng, 957, 7, slip_rate=0.0) == countdown_chain(957, 7)
    # Always forgetting: every borrow keeps the tens (950-7 -> 953), so the chain never leaves the
    # hundred and stops one step after the exact chain's 9.
    assert teacher_chain(rng, 957, 7, 0.0, borrow_slip_rate=1.0) == [950, 953, 956, 959, 952, 955, 958, 951, 954, 957]
    # 312-1: 13 exact steps; 310-1 forgets -> 319, and round again until the cap of 14
    assert teacher_chain(rng, 312, 1, 0.0, borrow_slip_rate=1.0) == [311, 310, 319, 318, 317, 316, 315, 314, 313, 312,
                                                                     311, 310, 319, 318]
    # At 0.6 a borrow step is forgotten ~60% of the time; a step without a borrow is never touched.
    forgot, borrows = 0, 0
    for _ in range(2000):
        a, d = countdown_problem(rng, 2, 24)
        x, y = a, teacher_chain(rng, a, d, 0.0, borrow_slip_rate=0.6)[0]
        borrows += x % 10 < d
        forgot += y == x - d + 10
        assert y in (x - d, x - d + 10) and (x % 10 < d or y == x - d)
    assert 0.55 < forgot / borrows < 0.65


def test_bad_step_range_is_refused():
    with pytest.raises(ValueError, match="min_steps"):
        countdown_problem(random.Random(0), 5, 2)


def test_countdown_steps_mark_borrows_and_stop_at_the_first_wrong_step():
    # 957 950 943 936 929 922 915 908 901 -> 894: a step borrows from a units digit below 7
    steps = countdown_steps("957-7=", _exact("957-7="))
    assert [b for b, _ in steps] == [False, True, True, True, False, True, True, False, True]
    assert all(ok for _, ok in steps)
    assert countdown_steps("957-7=", "950;950-7=953;953-7=946") == [(False, True), (True, False)]
    # 312 -> 307 borrows (2 < 5), 307 -> 302 does not; the step past the chain's end is not counted
    assert countdown_steps("312-5=", "307;307-5=302;302-5=297;297-5=292") == [(True, True), (False, True),
                                                                              (True, True)]
    assert countdown_steps("312-5=", "abc") == [(True, False)]
    assert countdown_steps("312-5=", "307") == [(True, True)]  # stopped short: nothing more counted
