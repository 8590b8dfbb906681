"""The experience-pool demo run by `make quickstart` until the streaming loop lands.

Producer threads stream groups of a synthetic arithmetic task into the pool under admission
control; a learner loop claims batches under the staleness bound and publishes versions.
Generation is simulated (random digits, more often right as the version grows) so the demo
shows the pool's life cycle without a model: admission, partial rollouts resumed across a
version bump (several version spans), drops by filter and by staleness, rewards from the
recipe's reward function, and a balanced ledger at the end.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pools import LancePool
from streamrl import spans, staleness
from streamrl.recipe import Recipe, resolve_fn
from streamrl.types import Admission, Sample, SampleGroup, make_group_id

ALPHABET = list("0123456789+-*= ")
EOS = "<eos>"


def build_char_tokenizer(path: Path) -> object:
    """A character-level tokenizer saved as tokenizer.json (no download needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate([EOS, *ALPHABET])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    tok.add_special_tokens([EOS])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def make_dataset(path: Path, n: int, seed: int) -> list[dict[str, str]]:
    """Two-digit additions; written as JSONL the first time so later runs read the same file."""
    if not path.exists():
        rng = random.Random(seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for i in range(n):
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                f.write(json.dumps({"id": f"add-{i}", "prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Learner:
    """Shared version counter; producers wait on it for admission."""

    def __init__(self) -> None:
        self.version = 0
        self.started = 0
        self.stop = False
        self.cond = threading.Condition()


def run_demo(recipe: Recipe, producers: int = 3, chunk_tokens: int = 1, seconds_per_chunk: float = 0.02) -> int:
    run_dir = recipe.run_dir
    tok = build_char_tokenizer(run_dir / "tokenizer.json")
    data = make_dataset(Path(recipe.data.path), 2000, recipe.data.seed)
    reward_fn = resolve_fn(recipe.reward.fn)
    filters = [(f.fn, resolve_fn(f.fn), f.args) for f in recipe.filters]
    ro, st = recipe.rollout, recipe.staleness
    if Path(recipe.pool_uri).is_dir():  # the demo restarts from version 0: an old pool would clash
        print(f"demo: replacing the previous demo pool at {recipe.pool_uri}")
        shutil.rmtree(recipe.pool_uri)
    pool = LancePool(recipe.pool_uri, run_id=recipe.run.name, commit_max_rows=recipe.pool.commit_max_rows,
                     commit_linger_ms=recipe.pool.commit_linger_ms, compact_every=recipe.pool.compact_every)
    pool.set_tokenizer(str(run_dir / "tokenizer.json"))
    lrn = _Learner()
    order = list(range(len(data)))
    random.Random(recipe.data.seed).shuffle(order)
    counter = iter(range(10**9))
    lock = threading.Lock()

    def produce(pid: str) -> None:
        rng = np.random.default_rng(zlib.crc32(pid.encode()) + recipe.run.seed)
        while True:
            with lrn.cond:
                while not lrn.stop and not staleness.may_start(lrn.started, lrn.version, st.max_staleness,
                                                              ro.groups_per_step):
                    lrn.cond.wait(0.1)
                if lrn.stop:
                    return
                lrn.started += 1
                v0 = lrn.version
            with lock:
                k = next(counter)
            rec = data[order[k % len(data)]]
            gid = make_group_id(pid, k // len(data), k)
            pool.admit([Admission(group_id=gid, prompt_id=rec["id"], n=ro.n_samples, producer_id=pid, version=v0)])
            group = _generate(rec, gid, pid, v0, rng, tok, pool, lrn, chunk_tokens, seconds_per_chunk, ro.n_samples)
            _score(group, rec, tok, reward_fn, recipe.reward.args)
            for name, fn, args in filters:
                if group.status == "complete" and not fn(group, **args):
                    group.status, group.drop_reason = "dropped", name
            pool.append([group])

    threads = [threading.Thread(target=produce, args=(f"producer-{i}",), daemon=True) for i in range(producers)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    with tqdm(total=recipe.run.steps, desc="learner steps", unit="step") as bar:
        step = 0
        while step < recipe.run.steps:
            batch = pool.claim(step, lrn.version, ro.groups_per_step, st.max_staleness, st.policy)
            if batch is None:
                time.sleep(0.01)
                continue
            rewards = [s.reward for g in batch.groups for s in g.samples if s.reward is not None]
            time.sleep(0.05)  # stands in for the optimizer step
            with lrn.cond:
                lrn.version += 1
                lrn.cond.notify_all()
            step += 1
            bar.set_postfix(version=lrn.version, reward=f"{np.mean(rewards):.2f}" if rewards else "-",
                            dropped=len(batch.dropped))
            bar.update()
    with lrn.cond:
        lrn.stop = True
        lrn.cond.notify_all()
    for t in threads:
        t.join()
    pool.compact()
    elapsed = time.monotonic() - t0
    pool.close()

    from pools import inspect as pi
    from pools import open_pool
    from streamrl.cli import _print_stats

    stats = pi.pool_stats(open_pool(recipe.pool_uri))
    _print_stats(stats)
    print(f"\n{recipe.run.steps} learner steps in {elapsed:.1f}s. Look inside the pool:")
    print(f"  streamrl pool stats {run_dir} --json")
    print(f"  streamrl pool query {run_dir} \"SELECT max_version, avg(reward) FROM pool GROUP BY 1 ORDER BY 1\"")
    print(f"  streamrl pool query {run_dir} \"SELECT DISTINCT group_id FROM pool WHERE len(version_spans) > 1 LIMIT 3\"")
    print(f"  streamrl pool show {run_dir} <GROUP_ID>")
    return 0 if stats["ledger"]["balanced"] else 3


def _generate(rec: dict[str, str], gid: str, pid: str, v0: int, rng: np.random.Generator, tok: object,
              pool: LancePool, lrn: _Learner, chunk: int, seconds_per_chunk: float, n: int) -> SampleGroup:
    """Decode `n` responses chunk by chunk; when the version moves mid-generation, store the
    group as partial (abort_resume) and carry on under the new version."""
    prompt = np.array(tok.encode(rec["prompt"]).ids, np.int32)  # type: ignore[attr-defined]
    targets = []
    for _ in range(n):
        right = rng.random() < min(0.9, 0.15 + 0.05 * v0)
        answer = rec["label"] if right else str(rng.integers(0, 199))
        targets.append(np.array(tok.encode(answer).ids + [0], np.int32))  # type: ignore[attr-defined]
    logprobs = [-rng.random(len(t), np.float32) for t in targets]
    made = [0] * n
    span_lists: list[list] = [[] for _ in range(n)]
    version = v0
    group = SampleGroup(group_id=gid, prompt_id=rec["id"], prompt_tokens=prompt, producer_id=pid, samples=[])
    while any(m < len(t) for m, t in zip(made, targets)):
        time.sleep(seconds_per_chunk)
        if lrn.version != version:
            group.samples = _samples(targets, logprobs, made, span_lists, finished=False)
            pool.save_partial([group])
            version = lrn.version
        for i, t in enumerate(targets):
            k = min(chunk, len(t) - made[i])
            span_lists[i] = spans.extend(span_lists[i], version, k)
            made[i] += k
    group.samples = _samples(targets, logprobs, made, span_lists, finished=True)
    group.status = "complete"
    return group


def _samples(targets: list[np.ndarray], logprobs: list[np.ndarray], made: list[int], span_lists: list[list],
             finished: bool) -> list[Sample]:
    return [
        Sample(index=i, response_tokens=t[: made[i]], rollout_logprobs=logprobs[i][: made[i]],
               spans=list(span_lists[i]), finish_reason="stop" if finished else "abort")
        for i, t in enumerate(targets)
    ]


def _score(group: SampleGroup, rec: dict[str, str], tok: object, reward_fn: object, args: dict) -> None:
    """Per-sample reward; a reward function that raises marks that sample failed, not the run."""
    for s in group.samples:
        text = tok.decode(s.response_tokens.tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]
        try:
            s.reward = float(reward_fn(text, rec["label"], **args))  # type: ignore[operator]
        except Exception as e:  # noqa: BLE001 - user code
            s.failed, s.error, s.reward = True, f"{type(e).__name__}: {e}", None
    if all(s.failed for s in group.samples):
        group.status = "failed"
