"""Verifier-located credit (learner.negative_credit: first_error; streamrl/core/credit.py): the
verifier's first wrong character, the token holding it, and the learner rows that train a
below-average sample on that token alone. Values worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from learnerkit import model_dir  # noqa: F401 - fixture
from streamrl.core import credit
from streamrl.core.types import Sample, SampleGroup, VersionSpan
from streamrl.plugins.tasks import countdown_reward
from streamrl.runtime.learner import learner_rows
from streamrl.runtime.rollout import blame_token


@pytest.mark.parametrize("response, want", [
    ("950;950-7=943", -1),         # exact: nothing to blame
    (" 950;950-7=942", 13),        # the leading space counts: " 950;950-7=94" is 13 characters, then "2"
    ("950;950-7=943;943-7=936", 13),  # went on past the end: the ";" where it should have stopped
    ("950", 3),                    # stopped short: its end
    ("951;951-7=944", 2),          # the first step already wrong
])
def test_countdown_reward_names_the_first_wrong_character(response: str, want: int) -> None:
    assert countdown_reward(response, "950;950-7=943")["first_error"] == want


def test_token_of_char_maps_offsets_through_prefix_lengths() -> None:
    ends = [3, 4, 7, 7, 9]  # token texts "950", ";", "950", "" (a special token), "-7"
    asked: list[int] = []

    def end_of(k: int) -> int:
        asked.append(k)
        return ends[k]

    def token(offset: float) -> int | None:
        return credit.token_of_char(end_of, len(ends), offset)

    assert token(0) == 0 and token(2) == 0
    assert token(3) == 1 and token(6) == 2
    assert token(7) == 4  # the empty token holds no character
    assert token(9) == 4 and token(50) == 4  # past the end: the last token
    assert token(-1) is None and credit.token_of_char(end_of, 0, 0) is None
    asked.clear()
    many = [2 * k + 2 for k in range(200)]
    assert credit.token_of_char(lambda k: asked.append(k) or many[k], 200, 101) == 50  # "end 102" holds char 101
    assert len(asked) <= 9  # a binary search: a decode per question


def test_error_mask_keeps_only_the_blamed_token_of_a_negative_sample() -> None:
    assert credit.error_mask([1, 1, 1, 1], -0.5, 2) == [0, 0, 1, 0]
    assert credit.error_mask([1, 1, 1, 1], 0.5, None) == [1, 1, 1, 1]  # above average, nothing wrong: every token
    assert credit.error_mask([1, 1, 1, 1], 0.0, 2) == [1, 1, 1, 1]
    assert credit.error_mask([1, 1, 1, 1], -0.5, None) == [1, 1, 1, 1]  # no located error: GRPO's spread
    assert credit.error_mask([1, 0, 1, 1], -0.5, 1) == [1, 0, 1, 1]  # blamed token not trained on (tool output)
    assert credit.error_mask([1, 1], -0.5, 7) == [1, 1]  # out of range: ignored, not an index error


def test_error_mask_credits_only_the_right_prefix_of_a_positive_sample() -> None:
    # above average yet wrong (a partial-credit reward): the tokens before the blamed one, not it or after
    assert credit.error_mask([1, 1, 1, 1], 0.5, 2) == [1, 1, 0, 0]
    assert credit.error_mask([1, 1, 1, 1], 0.5, 0) == [0, 0, 0, 0]  # wrong from its first token: nothing to credit
    assert credit.error_mask([0, 1, 1, 1, 1], 0.25, 3) == [0, 1, 1, 0, 0]  # untrained tokens stay untrained
    assert credit.error_mask([1, 1, 0, 1], 0.5, 2) == [1, 1, 0, 1]  # blamed token not trained on: own mask


def test_blame_token_finds_the_token_of_the_wrong_digit(model_dir: Path) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text, label = "950;950-7=942", "950;950-7=943"
    ids = tok.encode(text, add_special_tokens=False)
    comps = blame_token(tok, ids, countdown_reward(text, label))
    k = int(comps[credit.ERROR_TOKEN])
    assert tok.decode(ids[k:k + 1]) == "2" and tok.decode(ids[:k]) == "950;950-7=94"
    # stopped short: the stop token at the end carries the blame
    short = tok.encode("950", add_special_tokens=False) + [tok.eos_token_id]
    comps = blame_token(tok, short, countdown_reward(tok.decode(short, skip_special_tokens=True), label))
    assert comps[credit.ERROR_TOKEN] == len(short) - 1
    exact = countdown_reward(label, label)
    assert blame_token(tok, tok.encode(label, add_special_tokens=False), exact) == exact  # nothing to blame


def _group(rewards: list[float], blamed: list[int | None]) -> SampleGroup:
    samples = [Sample(index=i, response_tokens=[10, 11, 12, 13], rollout_logprobs=[-1.0] * 4,
                      spans=[VersionSpan(0, 0, 4)], reward=r,
                      rewards={} if b is None else {credit.ERROR_CHAR: 0.0, credit.ERROR_TOKEN: float(b)})
               for i, (r, b) in enumerate(zip(rewards, blamed))]
    return SampleGroup(group_id="g", prompt_id="p", prompt_tokens=[1, 2], samples=samples)


def test_learner_rows_under_first_error_mask_around_the_blamed_token() -> None:
    group = _group([1.0, 0.0, 0.0, 0.75], [None, 2, None, 1])
    seq, _ = learner_rows([group], "grpo")
    assert all(r.loss_mask == [1, 1, 1, 1] for r in seq)
    rows, _ = learner_rows([group], "grpo", "first_error")
    assert [r.advantage for r in rows] == pytest.approx([r.advantage for r in seq])  # advantages unchanged
    # sample 1 (below average, blamed token 2) trains on token 2 alone; sample 2 has no located error;
    # sample 3 is above average (partial credit) but wrong from token 1: only token 0 is credited
    assert [r.loss_mask for r in rows] == [[1, 1, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
