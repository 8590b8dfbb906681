"""Prompt datasets: JSONL and Parquet reading, seeded per-epoch order, resumable state,
malformed rows (fail / skip) and file-level errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.plugins.data import DataError, PromptRecord, PromptSource, read_records
from streamrl.recipe import load_recipe
from streamrl.recipe.schema import FnRef
from streamrl.runtime import RunFailed
from streamrl.runtime.inputs import check_enough_prompts, generate_data
from streamrl.runtime.runlog import RunLog


def _jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Rows as JSON lines; raw_lines puts verbatim text at those 0-based positions."""
    lines = [json.dumps(r) for r in rows]
    for pos, text in sorted((raw_lines or {}).items()):
        lines.insert(pos, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(n)]


def _drain(src: PromptSource) -> list[PromptRecord]:
    out = []
    while (r := src.next()) is not None:
        out.append(r)
    return out


def test_jsonl_records_fields(tmp_path: Path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    p = _jsonl(tmp_path / "d.jsonl", [{"id": 7, "prompt": "2+3=", "label": "5", "extra": 1},
                                      {"prompt": chat, "label": ["a", "b"]}], raw_lines={1: ""})
    src = PromptSource(p, shuffle=False)
    a, b = src.next(), src.next()
    assert (a.epoch, a.index, a.line, a.prompt_id, a.prompt, a.label) == (0, 0, 1, "7", "2+3=", "5")
    assert a.record == {"id": 7, "prompt": "2+3=", "label": "5", "extra": 1}
    assert (b.index, b.line, b.prompt_id, b.prompt, b.label) == (1, 3, "L3", chat, ["a", "b"])  # blank line 2
    assert src.next() is None and src.skipped == []


def test_custom_keys(tmp_path: Path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": 3}])
    r = PromptSource(p, prompt_key="question", label_key="answer").next()
    assert (r.prompt, r.label) == ("q", 3)
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing key 'label'.*'question', 'answer'.*data\.label_key"):
        PromptSource(p, prompt_key="question")


def test_parquet(tmp_path: Path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "a", "prompt": "x", "label": "1"},
        {"id": None, "prompt": "y", "label": "2"},
        {"id": "c", "prompt": "", "label": "3"},
    ]), p)
    with pytest.raises(DataError, match=r"d\.parquet:row 2: key 'prompt' is an empty string"):
        PromptSource(p)
    src = PromptSource(p, shuffle=False, on_error="skip")
    recs = _drain(src)
    assert [(r.prompt_id, r.line, r.prompt, r.label) for r in recs] == [("a", 1, "x", "1"), ("L2", 2, "y", "2")]
    assert len(src.skipped) == 1 and src.skipped[0].startswith(f"{p}:row 2: ")


def test_parquet_chat_prompts(tmp_path: Path):
    p = tmp_path / "chat.parquet"
    chat = [{"role": "user", "content": "hello"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": chat, "label": 1}]), p)
    assert PromptSource(p).next().prompt == chat


def test_unreadable_parquet(tmp_path: Path):
    p = tmp_path / "bad.parquet"
    p.write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as Parquet"):
        PromptSource(p)


def test_shuffle_deterministic_per_seed_and_different_per_epoch(tmp_path: Path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(50))

    def order(seed: int) -> list[tuple[int, int, str]]:
        return [(r.epoch, r.index, r.prompt_id) for r in _drain(PromptSource(p, seed=seed, epochs=3))]

    o1, o2, other = order(1), order(1), order(2)
    assert o1 == o2 and o1 != other
    epochs = [[pid for e, _, pid in o1 if e == k] for k in range(3)]
    assert all(sorted(ep) == sorted(f"L{i}" for i in range(1, 51)) for ep in epochs)  # each a permutation
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != [f"L{i}" for i in range(1, 51)]  # actually shuffled
    assert [i for e, i, _ in o1 if e == 1] == list(range(50))  # index = position in the epoch
    plain = [r.prompt_id for r in _drain(PromptSource(p, shuffle=False, epochs=2))]
    assert plain == [f"L{i}" for i in range(1, 51)] * 2


def test_epochs_len_and_remaining(tmp_path: Path):
    src = PromptSource(_jsonl(tmp_path / "d.jsonl", _rows(4)), epochs=3)
    assert len(src) == 4 and src.peek_remaining() == 12
    for left in range(11, -1, -1):
        assert src.next() is not None and src.peek_remaining() == left
    assert src.next() is None and src.next() is None
    assert src.state() == {"epoch": 3, "position": 0} and src.peek_remaining() == 0


def test_state_restore_continues_exactly(tmp_path: Path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(7))
    full = [(r.epoch, r.index, r.prompt_id) for r in _drain(PromptSource(p, seed=3, epochs=2))]
    for cut in (0, 3, 7, 10, 14):
        first = PromptSource(p, seed=3, epochs=2)
        head = [first.next() for _ in range(cut)]
        state = json.loads(json.dumps(first.state()))  # survives a JSON checkpoint
        resumed = PromptSource(p, seed=3, epochs=2)
        resumed.restore(state)
        assert resumed.peek_remaining() == 14 - cut
        tail = _drain(resumed)
        assert [(r.epoch, r.index, r.prompt_id) for r in head + tail] == full


@pytest.mark.parametrize("state", [{"epoch": 0}, {"epoch": 0, "position": 9}, {"epoch": 5, "position": 0},
                                   {"epoch": 2, "position": 1}, {"epoch": "0", "position": 0}, None])
def test_restore_rejects_foreign_state(tmp_path: Path, state):
    src = PromptSource(_jsonl(tmp_path / "d.jsonl", _rows(3)), epochs=2)
    with pytest.raises(DataError, match="cannot restore"):
        src.restore(state)
    assert src.state() == {"epoch": 0, "position": 0}


MALFORMED = [
    ('{"prompt": "a", "label": 1', "not valid JSON"),
    ('[1, 2]', "expected a JSON object per line, got list"),
    ('{"label": 1}', "missing key 'prompt'"),
    ('{"prompt": "a"}', "missing key 'label'"),
    ('{"prompt": 5, "label": 1}', "key 'prompt' is int 5; it must be a non-empty string or a list of chat"),
    ('{"prompt": "  ", "label": 1}', "key 'prompt' is an empty string"),
    ('{"prompt": [], "label": 1}', "key 'prompt' is an empty list"),
    ('{"prompt": ["hi"], "label": 1}', "key 'prompt' item 0 is str 'hi'"),
    ('{"prompt": [{"role": "user"}], "label": 1}', "key 'prompt' item 0 has no 'content'"),
    ('{"prompt": [{"role": 1, "content": "x"}], "label": 1}', "key 'prompt' item 0: \"role\" is 1"),
    ('{"prompt": "a", "label": 1, "tools": {"name": "f"}}', "key 'tools': tools is dict, not a list"),
    ('{"prompt": "a", "label": 1, "tools": [{"type": "function", "function": {}}]}', "key 'tools': tools[0] is not"),
]


@pytest.mark.parametrize("line,expect", MALFORMED)
def test_malformed_row_fails_with_file_line_and_key(tmp_path: Path, line: str, expect: str):
    p = _jsonl(tmp_path / "d.jsonl", _rows(3), raw_lines={2: line})
    with pytest.raises(DataError) as ei:
        PromptSource(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:3: ") and expect in msg and "on_error='skip'" in msg


def test_fail_reports_the_first_bad_row(tmp_path: Path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(2), raw_lines={1: "{", 2: "[]"})
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        PromptSource(p)


def test_skip_collects_messages_and_keeps_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    p = _jsonl(tmp_path / "d.jsonl", _rows(5), raw_lines={1: "{oops", 4: '{"prompt": "x"}'})
    p.write_bytes(p.read_bytes() + b'{"prompt": "\xff", "label": 1}\n')  # not UTF-8
    with caplog.at_level(logging.WARNING, logger="streamrl.plugins.data"):
        src = PromptSource(p, shuffle=False, on_error="skip")
    assert len(src) == 5
    assert [m.split(": ")[0] for m in src.skipped] == [f"{p}:2", f"{p}:5", f"{p}:8"]
    assert "missing key 'label'" in src.skipped[1]
    assert len([r for r in caplog.records if r.name == "streamrl.plugins.data" and r.levelno == logging.WARNING]) == 3
    assert [r.label for r in _drain(src)] == ["1", "2", "3", "4", "5"]


def test_all_rows_bad_or_empty_or_missing(tmp_path: Path):
    bad = _jsonl(tmp_path / "bad.jsonl", [], raw_lines={0: "x", 1: "y"})
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable prompts \(all 2 rows are malformed, first: .*:1: "):
        PromptSource(bad, on_error="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable prompts \(the file has no rows\)"):
        PromptSource(empty)
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        PromptSource(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        PromptSource(tmp_path)


def test_bad_arguments(tmp_path: Path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(2))
    with pytest.raises(DataError, match="on_error='ignore'"):
        PromptSource(p, on_error="ignore")
    with pytest.raises(DataError, match="epochs=0"):
        PromptSource(p, epochs=0)


def test_read_records_for_eval_sets(tmp_path: Path):
    p = _jsonl(tmp_path / "eval.jsonl", _rows(3), raw_lines={0: "{}"})
    recs, skipped = read_records(p, on_error="skip")
    assert [(r.index, r.line, r.label) for r in recs] == [(0, 2, "1"), (1, 3, "2"), (2, 4, "3")]
    assert len(skipped) == 1 and skipped[0].startswith(f"{p}:1: missing key 'prompt'")


def test_write_task_chain_rows_continue_problems_with_exact_totals(tmp_path):
    """tasks.write_task(chain_turns=3): SFT rows after earlier turns, each next problem the exact
    running total plus a digit; chain_turns=1 writes the same files as before the option existed."""
    import re

    from streamrl.plugins.tasks import write_task

    plain = write_task(tmp_path / "a", seed=3, n_train=20, n_eval=4, n_sft=30)
    again = write_task(tmp_path / "b", seed=3, n_train=20, n_eval=4, n_sft=30, chain_turns=1)
    assert all(plain[k].read_text() == again[k].read_text() for k in plain)
    text = write_task(tmp_path / "c", seed=3, n_train=20, n_eval=4, n_sft=30, chain_turns=3)
    chat = write_task(tmp_path / "d", seed=3, n_train=20, n_eval=4, n_sft=30, chain_turns=3, chat=True)
    rows = [json.loads(x) for x in text["sft"].read_text().splitlines()]
    for i, row in enumerate(rows):
        turns = row["prompt"].split("<|im_end|>")
        assert len(turns) == 1 + i % 3
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=.*", turns[0]).groups())
        total = a + b
        for t in turns[1:]:
            shown, d = map(int, re.fullmatch(r"(\d+)\+(\d)=.*", t).groups())
            assert shown == total  # the calculator's total is exact whatever the teacher answered
            total += d
    messages = [json.loads(x)["prompt"] for x in chat["sft"].read_text().splitlines()]
    assert [len(m) for m in messages[:3]] == [1, 3, 5] and messages[2][3]["role"] == "assistant"
    assert messages[1][2] == {"role": "tool", "content": rows[1]["prompt"].split("<|im_end|>")[1]}


@pytest.mark.parametrize("overrides, refused", [
    (["run.steps=10", "rollout.groups_per_step=3"], False),  # 30 groups from 10 prompts x 3 epochs: just enough
    (["run.steps=11", "rollout.groups_per_step=3"], True),
    (["run.steps=10", "rollout.groups_per_step=2", "rollout.over_sampling=1.5"], False),  # claims 3 a step
    (["run.steps=11", "rollout.groups_per_step=2", "rollout.over_sampling=1.5"], True),
    (["run.steps=100", "producer_api.enabled=true"], False),  # external producers bring their own prompts
])
def test_a_run_claiming_more_groups_than_its_prompts_make_is_refused(overrides: list[str], refused: bool) -> None:
    r = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml", ["data.epochs=3", *overrides])
    if not refused:
        check_enough_prompts(r, 10)
        return
    with pytest.raises(RunFailed, match=r"10 usable prompts x data.epochs 3 = 30 groups, fewer than run.steps 11 x 3 "
                                        r"groups a step = 33: raise data.epochs to 4 or more, or lower run.steps to 10"):
        check_enough_prompts(r, 10)


def test_generated_data_is_written_again_when_its_args_change(tmp_path: Path):
    log, train = RunLog(tmp_path / "log", echo=False), tmp_path / "data" / "train.jsonl"
    gen = FnRef(fn="streamrl.plugins.tasks:write_task", args={"seed": 0, "n_train": 5, "n_eval": 2, "n_sft": 2})
    generate_data(gen, train, log)
    first = train.read_text()
    assert len(first.splitlines()) == 5
    assert json.loads((train.parent / ".generated.json").read_text()) == {"fn": gen.fn, "args": gen.args}
    train.write_text(first + first)  # untouched while fn and args are the same
    generate_data(gen, train, log)
    assert train.read_text() == first + first
    generate_data(FnRef(fn=gen.fn, args={**gen.args, "seed": 1}), train, log)
    assert len(train.read_text().splitlines()) == 5 and train.read_text() != first
    # files that carry no stamp (by hand, or an older StreamRL) are used as they are, with a warning
    (train.parent / ".generated.json").unlink()
    train.write_text("mine\n")
    generate_data(gen, train, log)
    assert train.read_text() == "mine\n"
    assert "has no .generated.json" in (tmp_path / "log" / "run.log").read_text()
