"""`streamrl report RUN_DIR`: PNG plots and a summary table of a run directory.

Reads RUN_DIR/metrics.jsonl (required), eval.jsonl, summary.json and the experience pool
(RUN_DIR/pool) when they are there, and writes into RUN_DIR/report/ (or `out_dir`):

    reward.png      reward per step (thin) and its rolling mean (thick), held-out accuracy
                    (sampled and greedy), against policy version and against wall time
    staleness.png   consumed groups by staleness (pool); per-step staleness without a pool
    throughput.png  generation / training tokens per second and samples per second over wall time
    drops.png       dropped groups by reason, and failed groups
    learner.png     loss, grad norm, KL, entropy, the off-policy correction's weights and the
                    fractions of tokens it masked or capped (and PPO-clipped), against policy
                    version; steps skipped for a non-finite loss are marked

A step logged twice (a resumed run redoing a step) counts once: the last row wins.

Long file: every plot `streamrl report` draws and the summary it prints, side by side, so the
figures and the table read the same metrics.jsonl columns the same way.

`write_report` returns a JSON-serialisable summary; its keys are stable (new ones may appear,
none are renamed):

    run_dir, mode               the directory; run.mode from summary.json (None if the run was killed)
    steps                       distinct learner steps in metrics.jsonl
    first_version, last_version policy version after the first and the last step
    wall_time_s                 wall time of the last step, from the start of RL
    samples, samples_per_s      samples trained on; per second of wall time
    reward_first, reward_last   mean reward over the first / last 10 steps (None if never scored)
    eval_first, eval_last, eval_best
                                {policy_version, accuracy, greedy_accuracy} or None
    staleness_mean, staleness_max
    staleness_histogram         {str(staleness): consumed groups} (None without a pool)
    staleness_source            "pool" or "metrics"
    drops                       {reason: dropped groups}
    failed_groups               groups whose every sample failed (None without a pool)
    ledger                      {admitted, lost, duplicated, balanced} (None without a pool)
    nonfinite_skipped           optimizer steps skipped for a non-finite loss or gradient norm
    notes                       what could not be read, and why
    files                       the PNG paths written
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from streamrl.pools import PoolError, open_pool, resolve_pool
from streamrl.pools.queries import pool_stats
from streamrl.runtime.runlog import read_jsonl

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EDGE = 10  # steps averaged for reward_first / reward_last
GEN, TRAIN, SAMPLED, GREEDY = "tab:blue", "tab:orange", "tab:green", "tab:purple"


def load_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """One row per step, in step order; the last row logged for a step wins."""
    by_step = {r["step"]: r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def load_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """One row per evaluated version, in version order; the last one wins."""
    by_v = {r["policy_version"]: r for r in read_jsonl(Path(run_dir) / "eval.jsonl")
            if r.get("policy_version") is not None and r.get("accuracy") is not None}
    return [by_v[v] for v in sorted(by_v)]


def _col(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    """A float column; NaN where a row lacks the key or holds null."""
    return np.array([r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in rows], float)


def _window(n: int) -> int:
    return max(1, min(25, round(n / 15)))


def _rolling(y: np.ndarray, w: int) -> np.ndarray:
    """Centred moving average that skips NaN (a step without a scored sample has no reward)."""
    ok = np.isfinite(y)
    s = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    k = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(len(y))
    lo, hi = np.maximum(0, i - w // 2), np.minimum(len(y), i + w - w // 2)
    cnt = k[hi] - k[lo]
    return np.where(cnt > 0, (s[hi] - s[lo]) / np.maximum(cnt, 1), np.nan)


def _mean(y: np.ndarray) -> float | None:
    y = y[np.isfinite(y)]
    return float(y.mean()) if len(y) else None


def _eval_point(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"policy_version": r["policy_version"], "accuracy": r["accuracy"],
            "greedy_accuracy": r.get("greedy_accuracy")}


def _pool_stats(run_dir: Path, notes: list[str]) -> dict[str, Any] | None:
    uri = resolve_pool(str(run_dir))[0]
    if "://" not in uri and not (Path(uri) / "pool.lance").is_dir():
        notes.append("no experience pool (pool/): staleness from metrics.jsonl, no ledger or failed groups")
        return None
    try:
        with open_pool(str(run_dir)) as pool:
            return pool_stats(pool)
    except PoolError as e:
        notes.append(f"experience pool unreadable ({e}): staleness from metrics.jsonl")
        return None


def _figure(**kwargs: Any) -> Figure:
    # matplotlib (~0.3 s) loads when a report is drawn, not on import: the CLI imports this module for every command.
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig: Figure, path: Path, files: list[str]) -> None:
    fig.savefig(path, dpi=110)  # a bare Figure renders through Agg; pyplot's global state is untouched
    files.append(str(path))


def _line(ax: Any, x: np.ndarray, y: np.ndarray, w: int, color: str, label: str) -> None:
    """Raw values thin and faint, their rolling mean thick: the trend reads at a glance."""
    ok = np.isfinite(y)
    if not ok.any():
        return
    ax.plot(x[ok], y[ok], color=color, lw=0.8, alpha=0.35)
    ax.plot(x, _rolling(y, w), color=color, lw=2.2, label=f"{label} (mean of {w})" if w > 1 else label)


def _empty(ax: Any, text: str, y: float = 0.5) -> None:
    ax.text(0.5, y, text, ha="center", va="center", transform=ax.transAxes, color="gray", fontsize=12)


def _plot_reward(rows: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, files: list[str]) -> None:
    reward, w = _col(rows, "reward_mean"), _window(len(rows))
    version, wall = _col(rows, "policy_version"), _col(rows, "wall_time_s")
    finite = reward[np.isfinite(reward)]
    unit = len(finite) == 0 or (finite.min() >= 0 and finite.max() <= 1)
    # Eval rows are placed where their version was published in metrics.jsonl: an eval's own
    # wall_time_s is when it finished (late for background evals, and the pre-RL one is
    # timed from before the start of RL), but the accuracy belongs to the version.
    published = {0: 0.0} | {int(v): t for v, t in zip(version, wall) if np.isfinite(v)}
    ev_v = np.array([r["policy_version"] for r in evals], float)
    ev_t = np.array([published.get(r["policy_version"], r.get("wall_time_s", np.nan)) for r in evals], float)
    ev = {"accuracy": _col(evals, "accuracy"), "greedy_accuracy": _col(evals, "greedy_accuracy")}

    fig = _figure(figsize=(13, 4.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, x, ex, xlabel in ((axes[0], version, ev_v, "policy version"), (axes[1], wall, ev_t, "wall time (s)")):
        _line(ax, x, reward, w, GEN, "train reward")
        eax = ax if unit else ax.twinx()
        for key, color, marker, label in (("accuracy", SAMPLED, "o", "held-out accuracy (sampled)"),
                                          ("greedy_accuracy", GREEDY, "s", "held-out accuracy (greedy)")):
            ok = np.isfinite(ev[key]) & np.isfinite(ex)
            if ok.any():
                eax.plot(ex[ok], ev[key][ok], color=color, marker=marker, ls="--", lw=1.4, ms=6, label=label)
        if unit:
            ax.set_ylim(-0.02, 1.02)
        else:
            eax.set_ylim(-0.02, 1.02)
            eax.set_ylabel("held-out accuracy")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.set_title(f"Reward and accuracy vs {xlabel.split(' (')[0]}")
        if not len(finite):
            _empty(ax, "no scored samples")
    axes[0].set_ylabel("reward / accuracy" if unit else "mean reward per step")
    legend = {lab: h for ax in fig.axes for h, lab in zip(*ax.get_legend_handles_labels())}  # twins: once
    if legend:
        axes[0].legend(legend.values(), legend.keys(), loc="lower right", fontsize=9)
    _save(fig, path, files)


def _plot_staleness(rows: list[dict[str, Any]], hist: dict[str, int] | None, path: Path,
                    files: list[str]) -> None:
    fig = _figure(figsize=(7, 4.4), layout="constrained")
    ax = fig.subplots()
    if hist is not None:
        xs = sorted(int(k) for k in hist)
        ys = [hist[str(x)] for x in xs]
        total = sum(ys)
        bars = ax.bar(xs, ys, color=GEN, width=0.7)
        ax.bar_label(bars, labels=[f"{y} ({y / total:.0%})" for y in ys], padding=2, fontsize=9)
        ax.set_xticks(xs)
        ax.set_xlabel("staleness at consumption (learner version − oldest token version)")
        ax.set_ylabel("consumed groups")
        ax.set_title(f"Staleness of consumed groups ({total} groups)")
        ax.margins(y=0.15)
        if not xs:
            _empty(ax, "no consumed groups")
    else:
        v = _col(rows, "policy_version")
        ax.plot(v, _col(rows, "staleness_mean"), color=GEN, lw=1.5, label="mean over the step's groups")
        ax.step(v, _col(rows, "staleness_max"), color=TRAIN, lw=1.2, where="mid", label="max")
        ax.set_xlabel("policy version")
        ax.set_ylabel("staleness (versions)")
        ax.set_title("Staleness per step (no pool: from metrics.jsonl)")
        ax.margins(y=0.25)
        ax.legend(fontsize=9, loc="upper left", ncols=2)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path, files)


def _plot_throughput(rows: list[dict[str, Any]], path: Path, files: list[str]) -> None:
    wall, w = _col(rows, "wall_time_s"), _window(len(rows))
    fig = _figure(figsize=(13, 4.4), layout="constrained")
    tok, smp = fig.subplots(1, 2, sharex=True)
    _line(tok, wall, _col(rows, "gen_tokens_per_s"), w, GEN, "generation (all engines)")
    _line(tok, wall, _col(rows, "train_tokens_per_s"), w, TRAIN, "training (during train step)")
    tok.set_title("Token throughput")
    tok.set_ylabel("tokens / s")
    # Ratio of rolling sums rather than mean of per-step rates: long steps weigh what they cost.
    dt = np.diff(np.concatenate([[0.0], wall]))
    samples = _col(rows, "samples")
    rate = _rolling(samples, w) / np.where(_rolling(dt, w) > 0, _rolling(dt, w), np.nan)
    smp.plot(wall, samples / np.where(dt > 0, dt, np.nan), color=SAMPLED, lw=0.8, alpha=0.35)
    smp.plot(wall, rate, color=SAMPLED, lw=2.2, label=f"trained samples (over {w} steps)")
    smp.set_title("Sample throughput")
    smp.set_ylabel("samples / s")
    for ax in (tok, smp):
        ax.set_xlabel("wall time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=9, loc="lower right")
    _save(fig, path, files)


def _plot_drops(drops: dict[str, int], failed: int | None, admitted: int | None, path: Path,
                files: list[str]) -> None:
    bars = {**drops, **({"failed (all samples)": failed} if failed else {})}
    items = sorted(bars.items(), key=lambda kv: kv[1])
    fig = _figure(figsize=(7, 1.8 + 0.45 * max(2, len(items))), layout="constrained")
    ax = fig.subplots()
    total = sum(bars.values())
    of = f" of {admitted} admitted" if admitted else ""
    ax.set_title(f"Groups not trained on: {total}{of}")
    ax.set_xlabel("groups")
    if items:
        colors = [TRAIN if k.startswith("failed") else GEN for k, _ in items]
        b = ax.barh([k for k, _ in items], [v for _, v in items], color=colors, height=0.6)
        ax.bar_label(b, padding=3, fontsize=9)
        ax.margins(x=0.15)
        ax.grid(alpha=0.3, axis="x")
    else:
        ax.set_yticks([])
        ax.set_xticks([])
        _empty(ax, "no drops: every claimed group was trained on")
    _save(fig, path, files)


# learner.png: (metrics.jsonl keys, title); off-policy keys: streamrl/core/algorithms/offpolicy.py
LEARNER_PANELS = [
    (("loss",), "Loss"), (("grad_norm",), "Gradient norm (before clipping)"),
    (("kl",), "KL to reference"), (("entropy",), "Entropy (nats / token)"),
    (("is_weight_mean", "is_weight_max", "is_ratio_mean"), "Off-policy weight (applied; ratio = raw prox / behav)"),
    (("is_masked_tokens", "is_capped_tokens", "clip_frac"), "Fraction of loss tokens masked / capped / PPO-clipped"),
]


def _plot_learner(rows: list[dict[str, Any]], path: Path, files: list[str]) -> None:
    version, w = _col(rows, "policy_version"), _window(len(rows))
    skipped = version[np.nan_to_num(_col(rows, "nonfinite_skipped")) > 0]
    fig = _figure(figsize=(11, 9.6), layout="constrained")
    axes = fig.subplots(3, 2, sharex=True).ravel()
    colors = (GEN, TRAIN, SAMPLED, GREEDY)
    for i, (ax, (keys, title)) in enumerate(zip(axes, LEARNER_PANELS)):
        ys = {k: _col(rows, k) for k in keys}
        for j, (key, y) in enumerate(ys.items()):
            _line(ax, version, y, w, colors[j if len(keys) > 1 else i % len(colors)], key)
        vals = np.unique(np.concatenate([y[np.isfinite(y)] for y in ys.values()]))
        if not len(vals):
            _empty(ax, f"{', '.join(keys)} not logged")
        elif len(vals) == 1:  # a flat line reads as a plotting bug; say it is constant, and why if known
            why = " (learner.kl_coef is 0: no KL term)" if keys == ("kl",) and vals[0] == 0 else ""
            _empty(ax, f"constant {vals[0]:g}{why}", y=0.75)
        if len(keys) > 1 and len(vals):
            ax.legend(fontsize=8, loc="best")
        for v in skipped:  # optimizer steps skipped for a non-finite loss or gradient norm
            ax.axvline(v, color="tab:red", lw=1, alpha=0.6)
        ax.set(title=title, ylabel=keys[0] if len(keys) == 1 else "")
        ax.grid(alpha=0.3)
    for ax in axes[4:]:
        ax.set_xlabel("policy version")
    head = f"Learner, per step (thick: mean over {w} steps)" if w > 1 else "Learner, per step"
    fig.suptitle(head + (f"; red: {len(skipped)} step(s) with a non-finite loss skipped" if len(skipped) else ""))
    _save(fig, path, files)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Write the PNGs into `out_dir` (default RUN_DIR/report) and return the summary (module doc)."""
    d = Path(run_dir)
    rows = load_metrics(d)
    if not rows:
        why = "metrics.jsonl has no steps" if (d / "metrics.jsonl").exists() else "no metrics.jsonl"
        raise ValueError(f"{d} is not a StreamRL run directory or has no steps yet ({why})")
    evals = load_evals(d)
    out = Path(out_dir) if out_dir else d / "report"
    out.mkdir(parents=True, exist_ok=True)
    run_summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
    notes: list[str] = []
    stats = _pool_stats(d, notes)

    if stats is not None:
        hist = stats["staleness_histogram"]
        n = sum(hist.values())
        st_mean = sum(int(k) * c for k, c in hist.items()) / n if n else None
        st_max = max((int(k) for k in hist), default=None)
        drops: dict[str, int] = dict(stats["drops_by_reason"])
        failed: int | None = stats["groups_by_status"].get("failed", 0)
        led = stats["ledger"]
        ledger = {k: led[k] for k in ("admitted", "lost", "duplicated", "balanced")}
    else:
        hist, ledger, failed = None, None, None
        st_mean = _mean(_col(rows, "staleness_mean"))
        smax = _col(rows, "staleness_max")
        st_max = int(np.nanmax(smax)) if np.isfinite(smax).any() else None
        # Filter drops are counted by the rollout workers (cumulative); learner drops per step.
        drops = {k: int(v) for k, v in (rows[-1].get("drops") or {}).items()}
        for key, reason in (("dropped_stale", "stale"), ("dropped_over_sampling", "over_sampling")):
            if (c := int(np.nansum(_col(rows, key)))):
                drops[reason] = drops.get(reason, 0) + c

    files: list[str] = []
    _plot_reward(rows, evals, out / "reward.png", files)
    _plot_staleness(rows, hist, out / "staleness.png", files)
    _plot_throughput(rows, out / "throughput.png", files)
    _plot_drops(drops, failed, ledger["admitted"] if ledger else None, out / "drops.png", files)
    _plot_learner(rows, out / "learner.png", files)

    reward = _col(rows, "reward_mean")
    wall = rows[-1].get("wall_time_s")
    samples = int(np.nansum(_col(rows, "samples")))
    return {
        "run_dir": str(d),
        "mode": run_summary.get("mode"),
        "steps": len(rows),
        "first_version": rows[0].get("policy_version"),
        "last_version": rows[-1].get("policy_version"),
        "wall_time_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall if wall else None,
        "reward_first": _mean(reward[:EDGE]),
        "reward_last": _mean(reward[-EDGE:]),
        "eval_first": _eval_point(evals[0] if evals else None),
        "eval_last": _eval_point(evals[-1] if evals else None),
        "eval_best": _eval_point(max(evals, key=lambda r: r["accuracy"]) if evals else None),
        "staleness_mean": st_mean,
        "staleness_max": st_max,
        "staleness_histogram": hist,
        "staleness_source": "pool" if stats is not None else "metrics",
        "drops": drops,
        "failed_groups": failed,
        "ledger": ledger,
        "nonfinite_skipped": int(np.nansum(_col(rows, "nonfinite_skipped"))),
        "notes": notes,
        "files": files,
    }


def _f(v: Any, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt) if isinstance(v, float) else str(v)


def print_summary(s: dict[str, Any]) -> None:
    def ev(e: dict[str, Any] | None) -> str:
        if e is None:
            return "—"
        return f"{e['accuracy']:.3f} @ v{e['policy_version']} (greedy {_f(e['greedy_accuracy'])})"

    t = Table("", "", title=f"{s['run_dir']} ({s['mode'] or 'mode unknown: no summary.json'})", show_header=False)
    t.add_row("steps", f"{s['steps']} (policy version {s['first_version']} → {s['last_version']})")
    t.add_row("wall time", f"{_f(s['wall_time_s'], '.0f')} s; "
              f"{s['samples']} samples ({_f(s['samples_per_s'], '.1f')}/s)")
    t.add_row("train reward", f"{_f(s['reward_first'])} → {_f(s['reward_last'])} (first / last {EDGE} steps)")
    t.add_row("held-out accuracy", f"{ev(s['eval_first'])} → {ev(s['eval_last'])}")
    t.add_row("best accuracy", ev(s["eval_best"]))
    hist = s["staleness_histogram"]
    hist_s = ", ".join(f"{k}: {v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))) if hist else ""
    t.add_row("staleness", f"mean {_f(s['staleness_mean'], '.2f')}, max {_f(s['staleness_max'])}"
              + (f" (groups by staleness {hist_s})" if hist_s else f" ({s['staleness_source']})"))
    drops = ", ".join(f"{k} {v}" for k, v in sorted(s["drops"].items())) or "none"
    t.add_row("dropped groups", drops + (f"; failed {s['failed_groups']}" if s["failed_groups"] else ""))
    led = s["ledger"]
    if led:
        ok = "[green]balanced[/green]" if led["balanced"] else "[red]NOT balanced[/red]"
        t.add_row("ledger", f"{led['admitted']} admitted, lost {led['lost']}, duplicated {led['duplicated']}: {ok}")
    if s["nonfinite_skipped"]:
        t.add_row("skipped steps", f"[red]{s['nonfinite_skipped']} optimizer step(s): non-finite loss or grad norm[/red]")
    for n in s["notes"]:
        t.add_row("note", n)
    t.add_row("plots", "\n".join(s["files"]))
    Console(width=120).print(t)


def report_command(run_dir: str, out: str | None, as_json: bool) -> int:
    """`streamrl report RUN_DIR [--out DIR] [--json]`; ValueError when RUN_DIR has no steps."""
    s = write_report(run_dir, out)
    if as_json:
        print(json.dumps(s, indent=1))
    else:
        print_summary(s)
    return 0
