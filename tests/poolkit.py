"""Shared helpers for experience-pool tests: deterministic group factories, comparisons,
pool inspection, and running child Python processes against a pool.

Everything a group holds is derived from its group id (seeded RNG), so a child process can
write `make_group(gid)` and the parent can rebuild the exact expected content from `gid` alone.

    from poolkit import make_group, admissions_for, assert_group_equal
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.core.types import Admission, Sample, SampleGroup, VersionSpan

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------- factories


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("|".join(map(str, key)).encode()))


def split_spans(num_tokens: int, versions: Sequence[int]) -> list[VersionSpan]:
    """Tile [0, num_tokens) with one contiguous, non-empty span per version, in order."""
    if not versions or num_tokens == 0:
        return []
    if num_tokens < len(versions):
        raise ValueError(f"{num_tokens} tokens cannot hold {len(versions)} non-empty spans")
    cuts = np.linspace(0, num_tokens, len(versions) + 1).round().astype(int)
    return [VersionSpan(int(v), int(a), int(b)) for v, a, b in zip(versions, cuts[:-1], cuts[1:])]


def make_sample(
    group_id: str,
    index: int,
    *,
    num_tokens: int = 6,
    versions: Sequence[int] = (0,),
    spans: Sequence[tuple[int, int, int]] | None = None,
    finish_reason: str = "stop",
    failed: bool = False,
    error: str | None = None,
) -> Sample:
    """One response with random (but id-determined) tokens, log-probs, a loss mask with some
    zeros (tool output), a reward, raw reward components and metadata."""
    rng = _rng(group_id, "sample", index)
    if spans is not None:
        vspans = [VersionSpan(*s) for s in spans]
        num_tokens = vspans[-1].end if vspans else 0
    else:
        vspans = split_spans(num_tokens, versions)
    mask = (rng.random(num_tokens) < 0.8).astype(np.uint8)
    reward = float(np.float32(rng.integers(0, 5) / 4))  # exactly representable in float32
    return Sample(
        index=index,
        response_tokens=rng.integers(0, 50_000, num_tokens, dtype=np.int32),
        rollout_logprobs=-rng.random(num_tokens, dtype=np.float32) * 5,
        loss_mask=mask,
        spans=vspans,
        reward=reward,
        rewards={"correct": reward, "format": 0.5},
        finish_reason=finish_reason,
        failed=failed,
        error=error,
        metadata={"index": index, "note": f"sample {index} of {group_id}", "unicode": "é✓"},
    )


def make_group(
    group_id: str,
    *,
    n: int = 4,
    num_tokens: int = 6,
    versions: Sequence[int] = (0,),
    spans: Sequence[tuple[int, int, int]] | None = None,
    prompt_len: int = 5,
    status: str = "complete",
    producer_id: str = "test-producer",
    prompt_id: str | None = None,
    created_at: int = 0,
    drop_reason: str | None = None,
    vary_lengths: bool = True,
) -> SampleGroup:
    """A group of `n` samples whose content is fully determined by `group_id` and the options.

    `versions`: the policy versions of each response, in order (one contiguous span per
    version, e.g. (0, 1) for a partial rollout resumed under version 1). With
    `vary_lengths`, sample i has `num_tokens + i` tokens so rows differ in length."""
    rng = _rng(group_id, "prompt")
    samples = [
        make_sample(group_id, i, num_tokens=num_tokens + (i if vary_lengths else 0),
                    versions=versions, spans=spans)
        for i in range(n)
    ]
    return SampleGroup(
        group_id=group_id,
        prompt_id=prompt_id if prompt_id is not None else f"prompt-{group_id}",
        prompt_tokens=rng.integers(0, 50_000, prompt_len, dtype=np.int32),
        samples=samples,
        status=status,  # type: ignore[arg-type]
        producer_id=producer_id,
        created_at=created_at,
        drop_reason=drop_reason,
        metadata={"source": "poolkit", "group": group_id, "tags": ["a", "b"]},
    )


def partial_of(group: SampleGroup, keep: int, *, versions: Sequence[int] | None = None) -> SampleGroup:
    """The in-flight state of `group` after `keep` tokens per sample: prefixes of its arrays
    and spans, no reward, empty finish reason, status partial. A fresh object."""
    samples = []
    for s in group.samples:
        k = min(keep, s.num_tokens)
        if versions is None:
            spans = [VersionSpan(sp.version, sp.start, min(sp.end, k)) for sp in s.spans if sp.start < k]
        else:
            spans = split_spans(k, versions)
        samples.append(Sample(
            index=s.index,
            response_tokens=s.response_tokens[:k].copy(),
            rollout_logprobs=s.rollout_logprobs[:k].copy(),
            loss_mask=s.loss_mask[:k].copy(),
            spans=spans,
            reward=None,
            rewards={},
            finish_reason="",
            metadata=dict(s.metadata),
        ))
    return SampleGroup(
        group_id=group.group_id,
        prompt_id=group.prompt_id,
        prompt_tokens=group.prompt_tokens.copy(),
        samples=samples,
        status="partial",
        producer_id=group.producer_id,
        created_at=group.created_at,
        metadata=dict(group.metadata),
    )


def admissions_for(groups: Iterable[SampleGroup], *, version: int = 0) -> list[Admission]:
    return [
        Admission(group_id=g.group_id, prompt_id=g.prompt_id, n=len(g.samples),
                  producer_id=g.producer_id, version=version, admitted_at=1)
        for g in groups
    ]


# ---------------------------------------------------------------- comparisons


def assert_sample_equal(got: Sample, want: Sample, where: str = "") -> None:
    w = f"{where} sample {want.index}"
    assert got.index == want.index, w
    for name, dtype in (("response_tokens", np.int32), ("rollout_logprobs", np.float32), ("loss_mask", np.uint8)):
        a, b = getattr(got, name), getattr(want, name)
        assert isinstance(a, np.ndarray) and a.dtype == dtype, f"{w}: {name} is {type(a)} {getattr(a, 'dtype', '')}"
        np.testing.assert_array_equal(a, b, err_msg=f"{w}: {name}")
    assert list(got.spans) == list(want.spans), f"{w}: spans"
    assert got.reward == want.reward, f"{w}: reward"
    assert got.rewards == want.rewards, f"{w}: rewards"
    assert got.finish_reason == want.finish_reason, f"{w}: finish_reason"
    assert got.failed == want.failed, f"{w}: failed"
    assert got.error == want.error, f"{w}: error"
    assert got.metadata == want.metadata, f"{w}: metadata"
    if want.routed_experts is None:
        assert got.routed_experts is None, f"{w}: routed_experts"
    else:
        assert got.routed_experts is not None and got.routed_experts.dtype == np.int32, f"{w}: routed_experts"
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts, err_msg=f"{w}: routed_experts")


def assert_group_equal(got: SampleGroup, want: SampleGroup, *, status: str | None = None,
                       loss_masks: dict[int, np.ndarray] | None = None) -> None:
    """Content equality (tokens, log-probs, masks, spans, rewards, metadata). `status`
    defaults to `want.status`; `loss_masks` overrides the expected mask per sample index."""
    w = f"group {want.group_id}:"
    assert got.group_id == want.group_id, w
    assert got.prompt_id == want.prompt_id, w
    assert got.producer_id == want.producer_id, w
    assert got.status == (status or want.status), f"{w} status {got.status}"
    assert got.metadata == want.metadata, f"{w} metadata"
    assert got.prompt_tokens.dtype == np.int32, w
    np.testing.assert_array_equal(got.prompt_tokens, want.prompt_tokens, err_msg=f"{w} prompt_tokens")
    assert [s.index for s in got.samples] == [s.index for s in want.samples], f"{w} sample indices"
    for gs, ws in zip(got.samples, want.samples):
        if loss_masks and ws.index in loss_masks:
            ws = Sample(**{**{f: getattr(ws, f) for f in ws.__struct_fields__}, "loss_mask": loss_masks[ws.index]})
        assert_sample_equal(gs, ws, w)


# ---------------------------------------------------------------- pool inspection


def rows_per_group(pool: Any) -> dict[str, int]:
    return dict(Counter(pool.scan(["group_id"])["group_id"].to_pylist()))


def group_status(pool: Any) -> dict[str, set[str]]:
    """group_id -> the set of statuses its rows carry (one element for a healthy group)."""
    t = pool.scan(["group_id", "status"])
    out: dict[str, set[str]] = {}
    for gid, st in zip(t["group_id"].to_pylist(), t["status"].to_pylist()):
        out.setdefault(gid, set()).add(st)
    return out


def column_by_group(pool: Any, column: str) -> dict[str, set[Any]]:
    t = pool.scan(["group_id", column])
    out: dict[str, set[Any]] = {}
    for gid, v in zip(t["group_id"].to_pylist(), t[column].to_pylist()):
        out.setdefault(gid, set()).add(v)
    return out


def expected_token_mask(sample: Sample, learner_version: int, max_staleness: int) -> np.ndarray:
    """The loss mask after the `mask` policy, computed here from first principles."""
    versions = np.empty(sample.num_tokens, np.int64)
    for sp in sample.spans:
        versions[sp.start : sp.end] = sp.version
    within = (learner_version - versions) <= max_staleness
    return (sample.loss_mask * within).astype(np.uint8)


# ---------------------------------------------------------------- child processes


def child_env() -> dict[str, str]:
    """Environment for `sys.executable` children: repo root and tests/ importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(TESTS_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("RUST_LOG", "error")
    return env


def popen_python(code: str, *args: object, **kwargs: Any) -> subprocess.Popen[str]:
    """Start `python -c code args...` with poolkit importable; stdout/stderr piped as text."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


# A character-level tokenizer for pool tests that decode stored tokens (no model needed).
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


# ---------------------------------------------------------------- a small run directory (viewer, time travel)


def small_run(run_dir: Path, steps: int = 4, groups_per_step: int = 2, n: int = 4) -> dict[int, list[str]]:
    """A run directory as `streamrl run` leaves it, made in a second without a run: a pool whose
    groups (tokens a character tokenizer decodes, two policy versions per response, some tokens
    masked as tool output) are claimed by `steps` learner steps with appends between them, the
    tokenizer recorded, metrics.jsonl and eval.jsonl. Returns {step: group ids it trained on}."""
    import json

    from streamrl.pools import LancePool

    build_char_tokenizer(run_dir / "tokenizer" / "tokenizer.json")
    trained: dict[int, list[str]] = {}
    with LancePool(run_dir / "pool", compact_every=0) as pool:
        pool.set_tokenizer(str(run_dir / "tokenizer"))
        for step in range(steps):
            groups = [make_group(f"s{step}g{i}", n=n, num_tokens=12, versions=(step, step + 1),
                                 prompt_id=f"p{i}") for i in range(groups_per_step)]
            for g in groups:
                g.prompt_tokens = g.prompt_tokens % len(ALPHABET) + 1
                for s in g.samples:
                    s.response_tokens = s.response_tokens % len(ALPHABET) + 1
                    s.metadata = {**s.metadata, "turns": 2, "tool_calls": 1}
            pool.append(groups, admit=True)
            b = pool.claim(step=step, learner_version=step + 1, num_groups=groups_per_step, max_staleness=4)
            assert b is not None
            trained[step] = sorted(g.group_id for g in b.groups)
        pool.append([make_group(f"late{i}", n=n, versions=(steps,)) for i in range(2)], admit=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(steps):
            f.write(json.dumps({"step": step, "policy_version": step + 1, "wall_time_s": 2.0 * (step + 1),
                                "reward_mean": 0.1 * step, "loss": 1.0 / (step + 1)}) + "\n")
    with open(run_dir / "eval.jsonl", "w") as f:
        for step in range(0, steps + 1, 2):
            f.write(json.dumps({"step": step, "policy_version": step, "wall_time_s": 2.0 * step,
                                "accuracy": 0.2 + 0.05 * step, "greedy_accuracy": 0.3}) + "\n")
    return trained
