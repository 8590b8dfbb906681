"""What a run reads before anything starts: the tiny model and task data it may build, the
datasets it checks, the SFT rows and the held-out prompts (also used by replay and benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamrl.connectors.megatron.model_kit import init_model_dir
from streamrl.core.staleness import claimed_per_step
from streamrl.plugins.data import DataError, PromptSource
from streamrl.recipe import Recipe, resolve_fn
from streamrl.recipe.schema import FnRef
from streamrl.runtime import RunFailed
from streamrl.runtime.rollout import encode_prompt
from streamrl.runtime.runlog import RunLog


def prepare_inputs(r: Recipe, log: RunLog) -> int:
    """Build what the recipe says to build when missing: the tiny model, the task data. Returns
    the number of usable training prompts (for `check_enough_prompts`)."""
    if r.model.init is not None and not (Path(r.model.path) / "config.json").exists():
        init_model_dir(r.model.path, r.model.init.preset, r.model.init.seed)
    if r.data.generate is not None:
        generate_data(r.data.generate, Path(r.data.path), log)
    for what, path in (("model.path", Path(r.model.path) / "config.json"), ("data.path", Path(r.data.path)),
                       ("data.eval_path", Path(r.data.eval_path) if r.data.eval_path else None),
                       ("sft.path", Path(r.sft.path) if r.sft else None)):
        if path is not None and not path.exists():
            hint = " (add model.init to build a tiny model, or `streamrl model init DIR`)" if what == "model.path" else ""
            raise RunFailed(f"{what}: {path} does not exist{hint}")

    # Read every dataset once now, so a malformed row stops the run before anything starts.
    d = r.data
    checks = [(d.path, d.prompt_key, d.label_key)]
    prompts = 0
    if d.eval_path:
        checks.append((d.eval_path, d.prompt_key, d.label_key))
    if r.sft is not None:
        checks.append((r.sft.path, r.sft.prompt_key, r.sft.response_key))
    for path, pk, lk in checks:
        try:
            src = PromptSource(path, pk, lk, shuffle=False, on_error=d.on_error)
        except DataError as e:
            raise RunFailed(str(e)) from None
        for msg in src.skipped:
            log.warn(f"skipped a malformed row: {msg}")
        prompts = len(src) if path == d.path else prompts
    return prompts


GENERATED = ".generated.json"  # beside the files: the data.generate fn and args that wrote them


def generate_data(gen: FnRef, path: Path, log: RunLog) -> None:
    """Call data.generate when `path` is missing, or when the files there were written by another
    fn or other args (a recipe whose task changed must not train on the old files). Files without
    the stamp (written by hand, or by StreamRL before 2026-11-29) are never overwritten."""
    stamp = path.parent / GENERATED
    want = json.loads(json.dumps({"fn": gen.fn, "args": gen.args}, default=str))  # as it reads back
    have = json.loads(stamp.read_text()) if stamp.exists() else None
    if path.exists():
        if have is None:
            log.warn(f"data.generate: {path.parent} has no {GENERATED}, so it may not be what {gen.fn} "
                     f"with {gen.args} writes; using it as it is (delete the directory to have it written)")
            return
        if have == want:
            return
        log.info(f"data.generate: {path.parent} was written with {have}; writing it again with {want}")
    resolve_fn(gen.fn)(out_dir=str(path.parent), **gen.args)
    stamp.write_text(json.dumps(want) + "\n")


def check_enough_prompts(r: Recipe, prompts: int) -> None:
    """A run whose steps claim more groups than its prompts make (one group per prompt and epoch)
    can never finish: refuse it before anything starts, rather than hours in with "out of prompts".
    A lower bound only: filtered and stale groups use prompts too. Not with external producers
    (they bring their own prompts) or without rollout workers."""
    if not r.rollout.workers or r.producer_api.enabled:
        return
    per_step = claimed_per_step(r.rollout.groups_per_step, r.rollout.over_sampling)
    need, have = r.run.steps * per_step, prompts * r.data.epochs
    if need > have:
        raise RunFailed(f"data.path: {r.data.path} has {prompts} usable prompts x data.epochs {r.data.epochs} = {have} "
                        f"groups, fewer than run.steps {r.run.steps} x {per_step} groups a step = {need}: raise "
                        f"data.epochs to {-(-need // max(1, prompts))} or more, or lower run.steps to "
                        f"{have // per_step} or less")


def sft_rows(r: Recipe, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + eos) for the SFT warm-start; prompts encoded as rollouts encode them,
    with the row's `tools` (OpenAI's fine-tuning format) when it has them."""
    s = r.sft
    assert s is not None
    src = PromptSource(s.path, s.prompt_key, s.response_key, shuffle=False, on_error=r.data.on_error)
    rows = []
    while (rec := src.next()) is not None:
        resp = list(tokenizer(str(rec.label), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        rows.append((encode_prompt(tokenizer, rec.prompt, rec.record.get("tools")), resp))
    return rows


def eval_records(r: Recipe) -> list[Any]:
    """The held-out prompts evaluations use (data.eval_path, the first data.eval_size)."""
    d = r.data
    if not d.eval_path:
        return []
    src = PromptSource(d.eval_path, d.prompt_key, d.label_key, shuffle=False, on_error=d.on_error)
    recs = []
    while (rec := src.next()) is not None and (d.eval_size is None or len(recs) < d.eval_size):
        recs.append(rec)
    return recs
