"""Experience-pool implementations (LanceDB first), inspection, export."""

from __future__ import annotations

import os
from pathlib import Path

# Lance logs expected events (a new table, a compaction that lost a race and is retried) as WARN.
# LanceDB 0.40 embeds an older Lance that warns, when it opens a table, about every scalar index
# pylance 14 wrote (it cannot use them; all reads go through pylance, which does).
os.environ.setdefault("RUST_LOG", "error")
os.environ.setdefault("LANCE_LOG", "error")
os.environ.setdefault("LANCEDB_LOG", "error")


from typing import TYPE_CHECKING, Any

from streamrl.pools.base import ExperiencePool, PoolError

if TYPE_CHECKING:
    from streamrl.pools.lance_pool import LancePool

__all__ = ["ExperiencePool", "LancePool", "PoolError", "open_pool", "resolve_pool_uri"]


def __getattr__(name: str) -> Any:
    # lancedb is imported on first use, not by `import pools`: the `streamrl` driver never opens
    # a pool, and a process that loaded lancedb warns on every subprocess it forks (router, engines).
    if name == "LancePool":
        from streamrl.pools.lance_pool import LancePool

        return LancePool
    raise AttributeError(f"module 'pools' has no attribute {name!r}")


def resolve_pool_uri(run_dir_or_uri: str) -> str:
    """A run directory means its pool/ subdirectory; anything else is taken as a LanceDB URI."""
    p = Path(run_dir_or_uri)
    if "://" not in run_dir_or_uri and (p / "pool").is_dir():
        return str(p / "pool")
    return run_dir_or_uri


def open_pool(run_dir_or_uri: str, *, create: bool = False, **kwargs: object) -> LancePool:
    from streamrl.pools.lance_pool import LancePool

    return LancePool(resolve_pool_uri(run_dir_or_uri), create=create, **kwargs)  # type: ignore[arg-type]
