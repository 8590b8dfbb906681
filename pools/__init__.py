"""Experience-pool implementations (LanceDB first), inspection, export."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from streamrl.pools.errors import NoPool, PoolError

# Lance logs expected events (a new table, a compaction that lost a race and is retried) as WARN.
# LanceDB 0.40 embeds an older Lance that warns, when it opens a table, about every scalar index
# pylance 14 wrote (it cannot use them; all reads go through pylance, which does).
os.environ.setdefault("RUST_LOG", "error")
os.environ.setdefault("LANCE_LOG", "error")
os.environ.setdefault("LANCEDB_LOG", "error")

if TYPE_CHECKING:
    from streamrl.pools.lance_pool import LancePool

__all__ = ["LancePool", "NoPool", "PoolError", "open_pool", "resolve_pool", "resolve_pool_uri"]


def _lance_pool() -> type[LancePool]:
    # The one edge to lancedb: it loads on first use, not by `import streamrl.pools`, because the
    # `streamrl run` driver never opens a pool and a process that loaded lancedb warns on every
    # subprocess it forks (router, engines). Its other modules take a pool, never open one.
    from streamrl.pools.lance_pool import LancePool

    return LancePool


def __getattr__(name: str) -> Any:
    if name == "LancePool":  # `from streamrl.pools import LancePool` (see _lance_pool)
        return _lance_pool()
    raise AttributeError(f"module 'pools' has no attribute {name!r}")


RECORDED_RECIPE = "recipe.yaml"  # the resolved recipe a run directory records (streamrl/runtime/run.py)


def resolve_pool(run_dir_or_uri: str) -> tuple[str, dict[str, str]]:
    """(URI, storage options) of a pool. A run directory means the pool its recorded recipe names
    (`pool.uri`, e.g. on S3, with `pool.storage_options`), else its pool/ subdirectory; anything
    else is taken as a LanceDB URI (object-store settings then come from the environment)."""
    p = Path(run_dir_or_uri)
    if "://" not in run_dir_or_uri:
        recorded = _recorded_pool(p / RECORDED_RECIPE)
        if recorded is not None:
            return recorded
        if (p / "pool").is_dir():
            return str(p / "pool"), {}
    return run_dir_or_uri, {}


def _recorded_pool(recipe_file: Path) -> tuple[str, dict[str, str]] | None:
    try:
        data = yaml.safe_load(recipe_file.read_text())
    except (OSError, yaml.YAMLError):
        return None
    pool = data.get("pool") if isinstance(data, dict) else None
    if not isinstance(pool, dict) or not pool.get("uri"):
        return None
    return str(pool["uri"]), {str(k): str(v) for k, v in (pool.get("storage_options") or {}).items()}


def resolve_pool_uri(run_dir_or_uri: str) -> str:
    return resolve_pool(run_dir_or_uri)[0]


def open_pool(run_dir_or_uri: str | os.PathLike[str], *, create: bool = False, config: Any = None,
              **kwargs: Any) -> LancePool:
    """The one way StreamRL opens a pool. `run_dir_or_uri`: a run directory or a pool URI
    (resolve_pool). `config`: a recipe's `pool` section, whose storage options and commit sizes
    apply; `kwargs` are LancePool's (they win), e.g. compact_every=0 for a process that only
    appends, or write_ahead=config.write_ahead for a producer."""
    uri, options = resolve_pool(str(run_dir_or_uri))
    if config is not None:
        options = {**options, **config.storage_options}
        kwargs = {"commit_max_rows": config.commit_max_rows, "commit_linger_ms": config.commit_linger_ms,
                  "keep_versions": config.keep_versions, **kwargs}
    options = {**options, **kwargs.pop("storage_options", {})}
    return _lance_pool()(uri, create=create, storage_options=options, **kwargs)
