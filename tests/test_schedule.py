"""`rollout.schedule` in a real rollout worker: prompts start chunk by chunk in the order the pool's
length history gives, and a resumed worker draws again from the oldest prompt not admitted (the
ones admitted out of order are known and skipped), so no prompt is lost or trained twice.
The worker is real (its LanceDB pool, its data source, its tokenizer); no engine is called."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from streamrl.pools import LancePool
from streamrl.pools.queries import group_lengths
from streamrl.recipe import load_recipe
from streamrl.runtime.rollout import RolloutWorker

from poolkit import make_group
from streamkit import tiny_model, write_recipe

__all__ = ["tiny_model"]  # fixture

LENGTHS = {"p0": 5, "p1": 40, "p2": 12, "p3": 90, "p4": 7, "p5": 60, "p6": 30, "p7": 3}


def _worker(tmp_path: Path, model: Path, schedule: str) -> RolloutWorker:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": p, "prompt": f"{k} + 1 =", "label": str(k + 1)}) + "\n"
                            for k, p in enumerate(LENGTHS)))
    recipe = load_recipe(write_recipe(tmp_path, model, data, {
        "run.dir": str(tmp_path / "run"), "data.epochs": 3, "data.shuffle": False, "rollout.schedule": schedule,
        "rollout.groups_per_step": 1, "rollout.schedule_window": 4}, name=f"{schedule}.yaml"))
    # epoch 0 already ran: one finished group per prompt, of known lengths (sample i: length + i)
    with LancePool(recipe.pool_uri, create=True) as pool:
        pool.append([make_group(f"old:e0:p{k}", n=2, num_tokens=n, prompt_id=p, created_at=k)
                     for k, (p, n) in enumerate(LENGTHS.items())], admit=True)
    w = RolloutWorker(recipe, "http://127.0.0.1:9")  # nothing is generated: no router needed
    w.source.restore({"epoch": 1, "position": 0})
    return w


def test_history_orders_each_chunk_and_resume_restarts_at_the_oldest_prompt_not_admitted(tmp_path, tiny_model):
    w = _worker(tmp_path, tiny_model, "longest_first")
    try:
        order = [w._next_record().prompt_id for _ in range(8)]
        # chunks of 4 in file order (p0-p3, p4-p7), each longest first by epoch 0's lengths
        assert order == ["p3", "p1", "p2", "p0", "p5", "p6", "p4", "p7"], order
        assert w.lengths.predict("p3") == 90.5 and w._history_epoch == 1
        # after p3, p1 of the second epoch's first chunk are taken: p0 (position 0) is the oldest not taken
        w._chunk.clear()
        w.source.restore({"epoch": 1, "position": 0})
        taken = [w._next_record().prompt_id for _ in range(2)]
        assert taken == ["p3", "p1"] and w._resume_state() == {"epoch": 1, "position": 0}
        taken += [w._next_record().prompt_id for _ in range(2)]  # p2, p0: the whole chunk
        assert w._resume_state() == {"epoch": 1, "position": 4}
    finally:
        asyncio.run(w.close())


def test_fifo_keeps_the_drawn_order_and_reads_no_history(tmp_path, tiny_model):
    w = _worker(tmp_path, tiny_model, "fifo")
    try:
        assert [w._next_record().prompt_id for _ in range(8)] == list(LENGTHS)
        assert w._history_epoch == -1 and not w.lengths.means
    finally:
        asyncio.run(w.close())


def test_group_lengths_reads_finished_groups_in_the_order_they_started(tmp_path):
    with LancePool(str(tmp_path / "pool"), create=True) as pool:
        pool.append([make_group("g2", n=2, num_tokens=9, prompt_id="b", created_at=2),
                     make_group("g1", n=3, num_tokens=4, prompt_id="a", created_at=1)], admit=True)
        assert group_lengths(pool) == [("a", [4, 5, 6]), ("b", [9, 10])]
