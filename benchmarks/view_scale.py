"""`streamrl view` on a large pool: time to the first page and to open a sample, over real HTTP.

The pool is built as pool_throughput.py --scale builds its sizes (pools/pool_scale.py's history:
consumed 64-sample groups, 50-400-token responses above 100k rows, their claims written in bulk),
then a few real claims so the pool can be read as of a step. Each of --runs runs opens the pool
afresh (a new RunData: nothing cached in the viewer; the OS page cache stays warm after the first)
behind a ViewServer on 127.0.0.1 and times, as a browser loading the page does:

  page_s           GET / (the HTML, script inlined)
  first_page_s     then, as the page's script does, GET /api/summary and GET /api/samples?limit=50 at
                   once: until the first page of the sample list has arrived (the first request
                   builds the viewer's narrow index of the pool, LIST_COLUMNS of every row)
  summary_s        until the summary has arrived (per-step reward/length/staleness, the ledger)
  first_view_s     page_s + the later of the two: until the whole page is filled
  filter_page_s    a filtered page (reward > 0 AND num_tokens > 300, offset 1000) on the built index
  sample_s         GET /api/sample of one sample in the middle of the pool (tokens, versions, advantage)
  group_s          GET /api/group of its group (64 samples side by side)
  as_of_page_s     the first page as of the last step (a second index: the pool table at that version)
  page_bytes       size of the first page's JSON (what the browser holds: a page, not the pool)

Medians with min-max over the runs; peak RSS of this process at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script from a checkout

from benchmarks._common import REPO, emit, git_rev, log, machine  # noqa: E402
from benchmarks._pool import BATCH_GROUPS, GROUP, Store, append_phase, make_groups  # noqa: E402
from benchmarks.pool_scale import history  # noqa: E402
from streamrl.pools import LancePool  # noqa: E402
from streamrl.tools.view import open_run, running  # noqa: E402

FILTER = "reward > 0 AND num_tokens > 300"


def build(uri: Path, rows: int, rng: np.random.Generator) -> tuple[int, str]:
    """A pool of about `rows` rows as a run leaves it; (last step with recorded versions, a uid in the middle)."""
    n_hist = max(rows // GROUP - 3 * BATCH_GROUPS, 1)
    resp = (200, 2000) if rows <= 100_000 else (50, 400)
    with LancePool(uri, compact_every=0) as pool:
        log(f"building {n_hist} consumed groups ({n_hist * GROUP} rows)")
        history(pool, n_hist, resp, rng)
        tail = make_groups(3 * BATCH_GROUPS, rng, "tail", consumed=0, first=n_hist)
        append_phase(pool, Store(uri), tail, 8)
        top = max(g.max_version or 0 for g in tail)
        step0 = n_hist // BATCH_GROUPS + 1  # after the history's steps
        for k in range(3):  # real claims: these steps record the versions they read
            assert pool.claim(step0 + k, top, BATCH_GROUPS, max_staleness=10**6) is not None
        pool.compact()
    return step0 + 2, f"hist:{n_hist // 2}/{GROUP // 2}"


def timed(url: str, token: str) -> tuple[float, int]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        body = r.read()
        assert r.status == 200, body[:200]
    return time.perf_counter() - t0, len(body)


def one_run(uri: Path, last_step: int, uid: str) -> dict[str, Any]:
    data = open_run(str(uri))
    out: dict[str, Any] = {}
    try:
        with running(data) as srv:
            base, tok = srv.url.split("?")[0], srv.token
            out["page_s"], _ = timed(base, tok)
            with ThreadPoolExecutor(2) as ex:  # the page asks for both at once
                summary = ex.submit(timed, f"{base}api/summary", tok)
                first = ex.submit(timed, f"{base}api/samples?limit=50", tok)
                out["summary_s"], _ = summary.result()
                out["first_page_s"], out["page_bytes"] = first.result()
            out["first_view_s"] = out["page_s"] + max(out["summary_s"], out["first_page_s"])
            q = urllib.parse.urlencode({"where": FILTER, "offset": 1000, "limit": 50})
            out["filter_page_s"], _ = timed(f"{base}api/samples?{q}", tok)
            out["sample_s"], out["sample_bytes"] = timed(f"{base}api/sample?uid={urllib.parse.quote(uid)}", tok)
            gid = uid.rpartition("/")[0]
            out["group_s"], _ = timed(f"{base}api/group?group_id={urllib.parse.quote(gid)}", tok)
            out["as_of_page_s"], _ = timed(f"{base}api/samples?limit=50&as_of_step={last_step}", tok)
            with urllib.request.urlopen(urllib.request.Request(f"{base}api/samples?limit=1",
                                                               headers={"Authorization": f"Bearer {tok}"})) as r:
                out["total_rows"] = json.loads(r.read())["total"]
    finally:
        data.close()
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        if k.endswith("_s"):
            out[k] = {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}
        else:
            out[k] = vals[0] if len(set(vals)) == 1 else vals
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the pool (default 1000000)")
    ap.add_argument("--runs", type=int, default=3, help="fresh viewer opens to time (default 3)")
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench", help="where the pool is built (removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the built pool (prints its path)")
    ap.add_argument("--pool", type=Path, help="time a pool this script built and kept before (--keep) instead of building one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    args.dir.mkdir(parents=True, exist_ok=True)
    work = args.pool.parent if args.pool else Path(tempfile.mkdtemp(prefix="view_scale-", dir=args.dir))
    try:
        uri = args.pool or work / "pool"
        t0 = time.perf_counter()
        if args.pool:
            last_step, uid = json.loads((work / "built.json").read_text())
        else:
            last_step, uid = build(uri, args.rows, np.random.default_rng(args.seed))
            (work / "built.json").write_text(json.dumps([last_step, uid]))
        build_s = time.perf_counter() - t0
        runs = []
        for i in range(args.runs):
            log(f"run {i + 1}/{args.runs}")
            runs.append(one_run(uri, last_step, uid))
    finally:
        if args.keep or args.pool:
            log(f"kept {uri} (time it again: --pool {uri})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "view_scale", "rows": runs[0]["total_rows"],
              "build_s": None if args.pool else round(build_s, 1),
              **summarise(runs), "runs": runs, "filter": FILTER,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
              "git": git_rev(), "machine": machine(load0, ("lancedb", "pylance", "pyarrow", "duckdb", "aiohttp")),
              "wall_s": round(time.perf_counter() - wall0, 1)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
