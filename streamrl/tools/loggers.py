"""Optional mirrors of metrics.jsonl / eval.jsonl to TensorBoard and Weights & Biases (`run.loggers`).

metrics.jsonl stays the record; these only copy its numeric scalars. Neither package is a
dependency: asking for one that is not installed fails before the run starts (LoggerUnavailable).

    loggers = open_loggers(["tensorboard"], run_dir, run_name="quickstart", project=None)
    loggers.metrics(row)   # per learner step: step = row["step"]
    loggers.eval(row)      # per evaluation: "eval/<key>", step = row["policy_version"]
    loggers.close()
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class LoggerUnavailable(RuntimeError):
    """A logger was asked for whose package is not installed."""


def _missing(name: str) -> LoggerUnavailable:
    pkg = PACKAGES[name]
    return LoggerUnavailable(f"run.loggers: {name} was asked for but the `{pkg}` package is not installed: "
                             f"pip install {pkg} (or remove it from run.loggers)")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a row (lists, dicts, strings, None and booleans are not plotted)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class _Sink(Protocol):
    def log(self, values: dict[str, float], step: int, axis: str) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises ImportError when the tensorboard package is missing
            raise _missing("tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, run_name: str, project: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        self.run = wandb.init(project=project or run_name, name=run_name, dir=str(run_dir), resume="allow")
        # Steps and evaluated versions are separate x-axes: a background eval of version v may be
        # logged after step v + 3, and W&B's own step counter must never go back.
        self.run.define_metric("step")
        self.run.define_metric("eval/policy_version")
        self.run.define_metric("eval/*", step_metric="eval/policy_version")
        self.defined: set[str] = set()

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        if axis == "step":
            for k in values.keys() - self.defined - {"step"}:
                self.run.define_metric(k, step_metric="step")
                self.defined.add(k)
        self.run.log({**values, axis: step})

    def close(self) -> None:
        self.run.finish()


class Loggers:
    def __init__(self, sinks: list[_Sink]) -> None:
        self.sinks = sinks

    def metrics(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        for s in self.sinks:
            s.log(values, int(row["step"]), "step")

    def eval(self, row: dict[str, Any]) -> None:
        values = {f"eval/{k}": v for k, v in scalars(row).items()}
        for s in self.sinks:
            s.log(values, int(row["policy_version"]), "eval/policy_version")

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_loggers(names: list[str], run_dir: str | Path, run_name: str, project: str | None = None) -> Loggers:
    """Empty `names`: a Loggers that does nothing. Unknown names are a ValueError (the recipe's
    type already restricts them); a missing package is LoggerUnavailable."""
    d = Path(run_dir)
    sinks: list[_Sink] = []
    try:
        for name in dict.fromkeys(names):
            if name == "tensorboard":
                sinks.append(_TensorBoard(d))
            elif name == "wandb":
                sinks.append(_WandB(d, run_name, project))
            else:
                raise ValueError(f"run.loggers: unknown logger {name!r} (tensorboard, wandb)")
    except BaseException:
        Loggers(sinks).close()  # a W&B run already started is finished, not left dangling
        raise
    return Loggers(sinks)
