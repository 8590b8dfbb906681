"""How often each expert was chosen, per policy version and layer, from the routed experts the
pool stores (`streamrl pool experts RUN_DIR`).

A sample's row p (positions [0, P + n - 1)) is what the policy that generated response token
p - P + 1 routed (the prompt's rows: the version of the first token), so each row counts under
that token's version (streamrl/core/routing.py). Rows stream through in batches: memory stays
bounded by one batch of routing data plus the counts.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from streamrl.core.types import MAX_EXPERT_ID
from streamrl.pools.schema import ROUTING_COLUMNS, routing_arrays

if TYPE_CHECKING:
    from streamrl.pools.lance_pool import LancePool

KEY = MAX_EXPERT_ID + 1  # (layer, expert) as one integer while counting
EXPERT_STATS_SCHEMA = pa.schema([("version", pa.int32()), ("layer", pa.int32()), ("expert", pa.int32()),
                                 ("chosen", pa.int64()), ("share", pa.float64())])


def position_versions(spans: list[dict[str, int]], rows: int, num_tokens: int) -> np.ndarray:
    """The policy version behind each of a sample's `rows` routing rows (module doc)."""
    per_token = np.repeat([s["version"] for s in spans], [s["end"] - s["start"] for s in spans])
    prompt_len = rows - num_tokens + 1
    return per_token[np.clip(np.arange(rows) - prompt_len + 1, 0, None)]


def expert_stats(pool: LancePool, where: str | None = None) -> pa.Table:
    """One row per (version, layer, expert) that was chosen: `chosen` times, and its `share` of
    that version and layer's choices (shares of a layer sum to 1 per version)."""
    counts: dict[int, Counter[int]] = {}  # version -> {layer * KEY + expert: times}
    routed = "routed_experts IS NOT NULL"
    reader = pool.reader([*ROUTING_COLUMNS, "version_spans", "num_tokens"], f"({where}) AND {routed}" if where else routed)
    for batch in reader:
        table = pa.Table.from_batches([batch])
        for r, spans, n in zip(routing_arrays(table), table["version_spans"].to_pylist(), table["num_tokens"].to_pylist()):
            if r is None or not r.size or not spans:  # no token generated: no version to count under
                continue
            versions = position_versions(spans, len(r), n)
            keys = (np.arange(r.shape[1], dtype=np.int64)[None, :, None] * KEY + r)  # [rows, layers, top_k]
            for v in np.unique(versions).tolist():
                u, c = np.unique(keys[versions == v], return_counts=True)
                counts.setdefault(v, Counter()).update(dict(zip(u.tolist(), c.tolist())))
    out: dict[str, list] = {f.name: [] for f in EXPERT_STATS_SCHEMA}
    for v in sorted(counts):
        per_layer: Counter[int] = Counter()
        for k, c in counts[v].items():
            per_layer[k // KEY] += c
        for k in sorted(counts[v]):
            layer, expert = divmod(k, KEY)
            out["version"].append(v), out["layer"].append(layer), out["expert"].append(expert)
            out["chosen"].append(counts[v][k]), out["share"].append(counts[v][k] / per_layer[layer])
    return pa.table(out, schema=EXPERT_STATS_SCHEMA)
