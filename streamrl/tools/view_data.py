"""What `streamrl view` shows, as JSON-ready dicts (streamrl/tools/view.py serves them over HTTP,
or writes them into one static HTML file).

Pages stream from the pool: a page of the sample list is one DuckDB query over a narrow index of
the pool (LIST_COLUMNS, claims applied, kept in memory per pool version), returning at most
PAGE_MAX rows; a sample, a group or a prompt's history reads just those rows. The filter a page
sends is SQL from an untrusted caller: it runs on a sandboxed DuckDB connection (pools/sql.py: no
files, no other databases, no extensions, configuration locked) that holds only the index, with a
time and a row limit, and anything refused is a ViewError (HTTP 400) that says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import yaml

from streamrl.core.algorithms.step import ADVANTAGES, sample_advantages
from streamrl.core.asof import recorded_steps
from streamrl.core.types import Sample, SampleGroup
from streamrl.pools import PoolError
from streamrl.pools.queries import load_decoder
from streamrl.pools.reads import columns_in
from streamrl.pools.schema import META_COLUMNS, POOL_SCHEMA
from streamrl.pools.sql import QueryError, check_filter, connect, run_limited
from streamrl.runtime.runlog import json_safe, read_jsonl

LIST_COLUMNS = ["uid", "group_id", "prompt_id", "sample_index", "status", "reward", "min_version", "max_version",
                "num_tokens", "consumed_step", "consumed_version", "finish_reason", "failed", "created_ns"]
_TOKEN_LISTS = sorted(set(POOL_SCHEMA.names) - set(META_COLUMNS))
PAGE_MAX = 200  # rows one page may ask for
FILTER_TIMEOUT_S = 5.0  # what one filtered query may take
FILTER_LIMITS = {"memory_limit": "1GB", "threads": 1}
INDEXES_KEPT = 4  # indexes (~100 bytes a row each) and past pools kept in memory, least recently used dropped
PROMPT_GROUPS_MAX = 50  # groups of one prompt shown across versions
ORDER = "created_ns, group_id, sample_index"


class ViewError(ValueError):
    """A request the viewer refuses (HTTP 400); the message says why."""


@dataclass(frozen=True)
class Page:
    """What the sample list shows: `where` (SQL over the pool's scalar columns, as `pool query`
    sees them), the step that trained on the sample, a policy version its tokens include, a reward range."""

    where: str | None = None
    step: int | None = None
    version: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    offset: int = 0
    limit: int = 50

    def conditions(self) -> list[str]:
        """The page's own conditions: numbers it parsed itself, never text from the caller."""
        out = []
        if self.step is not None:
            out.append(f"consumed_step = {int(self.step)}")
        if self.version is not None:
            out.append(f"min_version <= {int(self.version)} AND max_version >= {int(self.version)}")
        if self.reward_min is not None:
            out.append(f"reward >= {float(self.reward_min)!r}")
        if self.reward_max is not None:
            out.append(f"reward <= {float(self.reward_max)!r}")
        return out


def advantage_method(run_dir: Path | None) -> str:
    """The run's built-in advantage estimator (`learner.advantage`); grpo for a user function,
    which the viewer does not import (the run directory may come from anyone)."""
    try:
        data = yaml.safe_load((run_dir / "recipe.yaml").read_text()) if run_dir else None
    except (OSError, yaml.YAMLError):
        data = None
    name = ((data or {}).get("learner") or {}).get("advantage", "grpo") if isinstance(data, dict) else "grpo"
    return name if isinstance(name, str) and name in ADVANTAGES else "grpo"


def _versions(sample: Sample) -> list[int | None]:
    out: list[int | None] = [None] * sample.num_tokens
    for sp in sample.spans:
        out[sp.start:sp.end] = [sp.version] * (sp.end - sp.start)
    return out


def _segments(mask: list[int]) -> list[dict[str, Any]]:
    """Runs of the loss mask: `model` tokens (trained on) and `env` tokens (tool output, the
    environment's turns: not trained on), so agent turns and tool calls read apart."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(mask):
        kind = "model" if m else "env"
        if out and out[-1]["kind"] == kind:
            out[-1]["end"] = i + 1
        else:
            out.append({"kind": kind, "start": i, "end": i + 1})
    return out


def _finite(a: np.ndarray) -> list[float | None]:
    return [None if not np.isfinite(x) else round(float(x), 5) for x in a]


class RunData:
    """The viewer's reads of one run (a run directory, or a pool URI with no run around it).
    `pool`: a LancePool opened read-only; `run_dir`: where metrics.jsonl and eval.jsonl are."""

    def __init__(self, pool: Any, run_dir: Path | None) -> None:
        self.pool, self.run_dir = pool, run_dir
        self._lock = threading.Lock()
        self._views: dict[int, Any] = {}
        self._index: dict[tuple[Any, ...], pa.Table] = {}
        self._summary: tuple[tuple[Any, ...] | None, dict[str, Any]] = (None, {})
        self._decoder = load_decoder(pool.tokenizer)
        self._advantage = advantage_method(run_dir)
        self.filter_timeout_s = FILTER_TIMEOUT_S

    # ------------------------------------------------------------ sources

    def source(self, as_of_step: int | None) -> Any:
        """The pool now, or as learner step `as_of_step` read it (pools/asof.py)."""
        if as_of_step is None:
            return self.pool
        with self._lock:
            if as_of_step not in self._views:
                try:
                    view = self.pool.as_of(step=as_of_step)
                except PoolError as e:
                    raise ViewError(f"as_of_step {as_of_step}: {e}") from None
                while len(self._views) >= INDEXES_KEPT:
                    self._views.pop(next(iter(self._views)))
                self._views[as_of_step] = view
            return self._views[as_of_step]

    def index(self, as_of_step: int | None, extra: tuple[str, ...] = ()) -> pa.Table:
        """The narrow table the sample list and the charts query: LIST_COLUMNS (+ `extra` scalar
        columns a filter names) of every row, claims applied. Cached: a past pool never changes;
        the live one is read again once one of its tables has a new version (a run still writing)."""
        columns = [*LIST_COLUMNS, *[c for c in extra if c not in LIST_COLUMNS]]
        src = self.source(as_of_step)
        when = self._when(as_of_step)
        key = (*when, *columns)
        with self._lock:
            if key not in self._index:
                if when[0] == "live":  # older versions of the live pool are of no more use
                    self._index = {k: v for k, v in self._index.items() if k[0] != "live" or k[1] == when[1]}
                while len(self._index) >= INDEXES_KEPT:  # the least recently used goes first
                    self._index.pop(next(iter(self._index)))
                self._index[key] = src.scan(columns)
            self._index[key] = self._index.pop(key)  # now the most recently used
            return self._index[key]

    def _when(self, as_of_step: int | None) -> tuple[Any, ...]:
        """What the pool read `as_of_step` is now: a past step's never changes; the live pool's
        changes with any table's version."""
        if as_of_step is not None:
            return ("step", as_of_step)
        return ("live", tuple(sorted(self.pool.versions().items())))

    # ------------------------------------------------------------ queries over the index

    def _query(self, table: pa.Table, sql: str, *params: Any, where: str | None = None,
               max_rows: int = PAGE_MAX) -> pa.Table:
        con = connect(**FILTER_LIMITS)
        try:
            con.register("pool", table)
            if where is not None:
                check_filter(con, where)
            return run_limited(con, sql, *params, timeout_s=self.filter_timeout_s, max_rows=max_rows)
        except QueryError as e:
            raise ViewError(str(e)) from None
        finally:
            con.close()

    def samples(self, page: Page, as_of_step: int | None = None) -> dict[str, Any]:
        """One page of the sample list: {total, offset, limit, rows}."""
        if not 1 <= page.limit <= PAGE_MAX or page.offset < 0:
            raise ViewError(f"limit must be 1..{PAGE_MAX} and offset >= 0 (got limit {page.limit}, offset {page.offset})")
        where = (page.where or "").strip() or None
        extra: tuple[str, ...] = ()
        if where is not None:
            lists = sorted(columns_in(where, _TOKEN_LISTS))
            if lists:
                raise ViewError(f"the filter names {', '.join(lists)}: filters here read scalar columns only "
                                f"({', '.join(META_COLUMNS)})")
            extra = tuple(sorted(columns_in(where, META_COLUMNS) - set(LIST_COLUMNS)))
        table = self.index(as_of_step, extra)
        cond = " AND ".join([f"({where})" if where else "TRUE", *page.conditions()])
        total = self._query(table, f"SELECT count(*) AS n FROM pool WHERE {cond}", where=where, max_rows=1)
        rows = self._query(table, f"SELECT {', '.join(LIST_COLUMNS)} FROM pool WHERE {cond} ORDER BY {ORDER} "
                                  f"LIMIT {int(page.limit)} OFFSET {int(page.offset)}", where=where)
        return {"total": total["n"][0].as_py(), "offset": page.offset, "limit": page.limit,
                "rows": json_safe(rows.to_pylist())}

    def summary(self, as_of_step: int | None = None) -> dict[str, Any]:
        """The run at a glance: per-step reward, length, staleness (pool), wall time and loss
        (metrics.jsonl), accuracy (eval.jsonl), the ledger, and the steps it can be read as of.
        Kept until the pool changes (the ledger reads three columns of every row)."""
        when = self._when(as_of_step)
        if self._summary[0] != when:
            self._summary = (when, self._summarise(as_of_step))
        return self._summary[1]

    def _summarise(self, as_of_step: int | None) -> dict[str, Any]:
        src = self.source(as_of_step)
        table = self.index(as_of_step)
        per_step = self._query(table, """
            SELECT consumed_step AS step, count(DISTINCT group_id) AS groups, avg(reward) AS reward_mean,
                   avg(num_tokens) AS length_mean, avg(consumed_version - min_version) AS staleness_mean,
                   max(consumed_version - min_version) AS staleness_max
            FROM pool WHERE status = 'consumed' GROUP BY 1 ORDER BY 1""", max_rows=10**7).to_pylist()
        counts = self._query(table, "SELECT count(*) AS rows, count(DISTINCT group_id) AS groups, "
                                    "min(min_version) AS vmin, max(max_version) AS vmax FROM pool", max_rows=1)
        last = as_of_step if as_of_step is not None else float("inf")
        metrics = {m["step"]: m for m in self._jsonl("metrics.jsonl") if m.get("step", 0) <= last}
        for row in per_step:
            m = metrics.get(row["step"], {})
            row.update({k: m.get(k) for k in ("wall_time_s", "loss", "policy_version")})
            row["run_reward_mean"] = m.get("reward_mean")
        evals = [{k: e.get(k) for k in ("step", "wall_time_s", "policy_version", "accuracy", "greedy_accuracy")}
                 for e in self._jsonl("eval.jsonl") if e.get("step", 0) <= last]
        ledger = src.ledger()
        steps = recorded_steps(self.pool.claims())
        return json_safe({
            "uri": self.pool.uri, "run_dir": str(self.run_dir) if self.run_dir else None,
            "as_of": None if as_of_step is None else {"step": as_of_step, "label": src.at.label()},
            "steps_recorded": None if steps is None else {"first": steps[0], "last": steps[1]},
            "tokenizer": bool(self._decoder), "advantage": self._advantage,
            **counts.to_pylist()[0], "per_step": per_step, "evals": evals,
            "ledger": {**msgspec.to_builtins(ledger), "balanced": ledger.balanced},
            "columns": META_COLUMNS, "page_max": PAGE_MAX,
        })

    def _jsonl(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / name) if self.run_dir else []

    # ------------------------------------------------------------ one sample, one group, one prompt

    def _group(self, group_id: str, as_of_step: int | None) -> SampleGroup:
        groups = self.source(as_of_step).groups([group_id])
        if not groups:
            raise ViewError(f"no group {group_id!r} in this pool" + (f" as of step {as_of_step}" if as_of_step else ""))
        return groups[0]

    def _text(self, ids: np.ndarray) -> list[str]:
        """Each token's own text (its id where the run recorded no tokenizer)."""
        if self._decoder is None:
            return [str(int(i)) for i in ids]
        return [self._decoder.decode([int(i)], skip_special_tokens=False) for i in ids]

    def _detail(self, g: SampleGroup, s: Sample, advantage: float | None) -> dict[str, Any]:
        learner = s.metadata.get("learner_logprobs")
        mask = s.loss_mask.tolist()
        return json_safe({
            "uid": f"{g.group_id}/{s.index}", "group_id": g.group_id, "prompt_id": g.prompt_id, "index": s.index,
            "status": g.status, "drop_reason": g.drop_reason, "consumed_step": g.consumed_step,
            "consumed_version": g.consumed_version, "producer_id": g.producer_id,
            "reward": s.reward, "rewards": s.rewards, "finish_reason": s.finish_reason, "failed": s.failed,
            "error": s.error, "metadata": s.metadata, "advantage": advantage, "advantage_method": self._advantage,
            "min_version": min((sp.version for sp in s.spans), default=None),
            "max_version": max((sp.version for sp in s.spans), default=None),
            "prompt": {"ids": g.prompt_tokens.tolist(), "text": self._text(g.prompt_tokens)},
            "tokens": {"ids": s.response_tokens.tolist(), "text": self._text(s.response_tokens),
                       "version": _versions(s), "logprob": _finite(s.rollout_logprobs),
                       "learner_logprob": learner if isinstance(learner, list) and len(learner) == s.num_tokens else None,
                       "mask": mask},
            "segments": _segments(mask),
            "turns": s.metadata.get("turns"), "tool_calls": s.metadata.get("tool_calls"),
        })

    def _advantages(self, g: SampleGroup) -> dict[int, float]:
        """Each scored sample's advantage, as the learner computes it for the group (core/algorithms)."""
        scored = [s for s in g.samples if not s.failed and s.reward is not None and s.num_tokens > 0]
        if not scored:
            return {}
        (adv,) = sample_advantages([[float(s.reward) for s in scored]], self._advantage)  # type: ignore[misc]
        return {s.index: a for s, a in zip(scored, adv)}

    def sample(self, uid: str, as_of_step: int | None = None) -> dict[str, Any]:
        """One sample by uid (`<group_id>/<index>`): every token with its version, log-probs and mask."""
        gid, _, idx = uid.rpartition("/")
        if not gid or not idx.isdigit():
            raise ViewError(f"uid {uid!r} is not <group_id>/<sample index>")
        g = self._group(gid, as_of_step)
        s = next((s for s in g.samples if s.index == int(idx)), None)
        if s is None:
            raise ViewError(f"group {gid!r} has no sample {idx}")
        return self._detail(g, s, self._advantages(g).get(s.index))

    def group(self, group_id: str, as_of_step: int | None = None) -> dict[str, Any]:
        """The n samples of one prompt instance, side by side."""
        g = self._group(group_id, as_of_step)
        adv = self._advantages(g)
        return {"group_id": g.group_id, "prompt_id": g.prompt_id, "status": g.status,
                "samples": [self._detail(g, s, adv.get(s.index)) for s in g.samples]}

    def prompt(self, prompt_id: str, as_of_step: int | None = None) -> dict[str, Any]:
        """The groups of one dataset prompt, oldest policy version first: how answers changed."""
        rows = self._query(self.index(as_of_step), """
            SELECT group_id, min(min_version) AS min_version, max(max_version) AS max_version,
                   any_value(status) AS status, any_value(consumed_step) AS consumed_step,
                   avg(reward) AS reward_mean, count(*) AS samples, min(created_ns) AS created_ns
            FROM pool WHERE prompt_id = ? GROUP BY group_id ORDER BY min_version NULLS LAST, created_ns
            LIMIT ?""", prompt_id, PROMPT_GROUPS_MAX)
        groups = {g.group_id: g for g in self.source(as_of_step).groups(rows["group_id"].to_pylist())}
        out = []
        for row in rows.to_pylist():
            g = groups.get(row["group_id"])
            best = max((s for s in g.samples if s.reward is not None), key=lambda s: s.reward, default=None) if g else None
            row["best"] = None if best is None else {"index": best.index, "reward": best.reward,
                                                    "text": "".join(self._text(best.response_tokens))}
            out.append(row)
        return json_safe({"prompt_id": prompt_id, "groups": out})

    def close(self) -> None:
        self.pool.close()

