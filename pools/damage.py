"""How a pool that cannot be opened is reported: a message that says what is wrong and what to check."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from streamrl.pools.errors import NoPool, PoolError


def check_files(uri: str, datasets: Iterable[Any]) -> None:
    """Every data file the manifests of `datasets` (pylance) name is there with its recorded
    size (local pools), so a damaged pool is reported when it is opened rather than halfway
    through a query."""
    for ds in datasets:
        if "://" in ds.uri and not ds.uri.startswith("file://"):
            continue
        root = Path(ds.uri.removeprefix("file://")) / "data"
        for frag in ds.get_fragments():
            for df in frag.data_files():
                f = root / df.path
                size = getattr(df, "file_size_bytes", None)
                if not f.is_file() or (size and f.stat().st_size != size):
                    raise PoolError(f"experience pool at {uri} is damaged: data file {f} is "
                                    f"{'missing' if not f.is_file() else 'truncated or replaced'}")


def open_error(uri: str, e: Exception, tables: tuple[str, str]) -> PoolError:
    """The error for a pool at `uri` whose opening raised `e`; `tables` the two it must have."""
    msg = str(e).splitlines()[0][:300]
    if ("not found" in msg.lower() or "does not exist" in msg.lower()) and not any(
            (Path(uri) / f"{t}.lance").exists() for t in tables):
        return NoPool(f"{uri} is not an experience pool (no '{tables[0]}' and '{tables[1]}' tables): {msg}")
    if "://" in uri and any(w in msg for w in ("Failed to connect", "RetryError", "error sending request")):
        return PoolError(f"cannot reach the object store of {uri} ({msg}); check the endpoint and region "
                         "(pool.storage_options) and the credentials in the environment")
    return PoolError(f"experience pool at {uri} is unreadable ({type(e).__name__}: {msg}); its manifest "
                     "or data files are damaged or were written by an incompatible Lance version")
