"""`streamrl view`: the JSON routes over real HTTP on 127.0.0.1 (token, filtered pages, one sample's
tokens against `pool query`, as-of-step), the untrusted SQL filter (refused with a 400 that says
why, nothing read or written), the static report, and the viewer on an S3 pool.
The page in a real browser: tests/test_view_browser.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.pools import LancePool, open_pool
from streamrl.pools.queries import pool_query
from streamrl.tools.cli import main
from streamrl.tools.view import open_run, running
from streamrl.tools.view_data import INDEXES_KEPT, Page

from poolkit import small_run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[str]]]:
    d = tmp_path_factory.mktemp("view") / "run"
    d.mkdir()
    return d, small_run(d)


@pytest.fixture(scope="module")
def server(run):
    data = open_run(str(run[0]))
    data.filter_timeout_s = 1.0
    with running(data) as srv:
        yield srv
    data.close()


def network_refs(html: str) -> list[str]:
    """What in a page would load from another host (a CDN script, style, font or image)."""
    return re.findall(r"""(?:src|href|action)\s*=\s*["']?(?:https?:)?//[^"' >]+|url\(\s*["']?(?:https?:)?//[^)]+|"""
                      r"""@import[^;]+|fetch\(\s*["'`](?:https?:)?//[^"'`]+""", html)


def get(server: Any, route: str, token: str | None = "ok", **params: Any) -> tuple[int, Any]:
    """GET `route` with the server's token (or `token` when given as another string, none for None)."""
    base = server.url.split("?")[0]
    q = {k: v for k, v in params.items() if v is not None}
    headers = {}
    if token == "ok":
        headers["Authorization"] = f"Bearer {server.token}"
    elif token is not None:
        q["token"] = token
    req = urllib.request.Request(f"{base}{route.lstrip('/')}?{urllib.parse.urlencode(q)}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_it_listens_on_127_0_0_1_and_every_route_wants_the_token(server) -> None:
    assert server.url.startswith("http://127.0.0.1:") and f"token={server.token}" in server.url
    for route in ("/", "/api/summary", "/api/samples"):
        assert get(server, route, token=None)[0] == 401
        assert get(server, route, token="wrong")[0] == 401
    status, page = get(server, "/", token=server.token)  # the printed URL's way: ?token=
    assert status == 200 and "<html" in page
    assert not network_refs(page), network_refs(page)


def test_a_filtered_page_has_the_rows_pool_query_selects(server, run) -> None:
    status, page = get(server, "/api/samples", where="status = 'consumed'", reward_min=0.5, limit=5)
    assert status == 200, page
    with open_pool(str(run[0]), create=False) as pool:
        want = pool_query(pool, "SELECT uid FROM pool WHERE status = 'consumed' AND reward >= 0.5 "
                                "ORDER BY created_ns, group_id, sample_index")["uid"].to_pylist()
    assert page["total"] == len(want) > 5
    assert [r["uid"] for r in page["rows"]] == want[:5]
    assert all(r["reward"] >= 0.5 and r["status"] == "consumed" for r in page["rows"])
    status, nxt = get(server, "/api/samples", where="status = 'consumed'", reward_min=0.5, limit=5, offset=5)
    assert [r["uid"] for r in nxt["rows"]] == want[5:10]
    assert get(server, "/api/samples", limit=100000)[0] == 400  # a page is bounded


def test_a_samples_tokens_carry_the_versions_pool_query_stores(server, run) -> None:
    _, page = get(server, "/api/samples", step=2, limit=1)
    uid = page["rows"][0]["uid"]
    status, d = get(server, "/api/sample", uid=uid)
    assert status == 200, d
    with open_pool(str(run[0]), create=False) as pool:
        spans = pool_query(pool, f"SELECT version_spans, response_tokens FROM pool WHERE uid = '{uid}'").to_pylist()[0]
    want = [sp["version"] for sp in spans["version_spans"] for _ in range(sp["end"] - sp["start"])]
    assert d["tokens"]["version"] == want and set(want) == {2, 3}
    assert d["tokens"]["ids"] == spans["response_tokens"]
    assert "".join(d["tokens"]["text"]) and d["advantage"] is not None and d["consumed_step"] == 2
    assert {s["kind"] for s in d["segments"]} == {"model", "env"}  # tool output (mask 0) apart from model turns
    status, g = get(server, "/api/group", group_id=d["group_id"])
    assert status == 200 and [s["index"] for s in g["samples"]] == [0, 1, 2, 3]
    status, p = get(server, "/api/prompt", prompt_id=d["prompt_id"])
    assert status == 200 and [r["min_version"] for r in p["groups"]] == sorted(r["min_version"] for r in p["groups"])


def test_the_viewer_keeps_a_few_indexes_not_one_per_step_viewed(run) -> None:
    data = open_run(str(run[0]))
    for step in (0, 1, 2, 3, 0, 1, 2, 3):
        data.samples(Page(limit=1), as_of_step=step)
    data.samples(Page(where="drop_reason IS NULL", limit=1))
    assert len(data._index) <= INDEXES_KEPT and len(data._views) <= INDEXES_KEPT
    assert ("live",) == next(reversed(data._index))[:1]  # the one used last is kept
    data.close()


def test_as_of_step_pages_show_the_pool_as_that_step_read_it(server, run) -> None:
    trained = run[1]
    status, page = get(server, "/api/samples", as_of_step=1, where="status = 'consumed'", limit=200)
    assert status == 200, page
    assert sorted({r["group_id"] for r in page["rows"]}) == sorted(trained[0] + trained[1])
    _, summary = get(server, "/api/summary", as_of_step=1)
    assert [s["step"] for s in summary["per_step"]] == [0, 1] and summary["as_of"]["step"] == 1
    status, err = get(server, "/api/samples", as_of_step=99999)
    assert status == 400 and "0..3" in err["error"]


@pytest.mark.parametrize("where, says", [
    ("reward >>> 1", "bad filter"),
    ("reward > ", "syntax error"),
    ("no_such_column = 1", "no_such_column"),
    ("", None),
    ("reward > 0; DROP TABLE pool", "statements"),
    ("len(response_tokens) > 3", "scalar columns only"),
    ("group_id IN (SELECT group_id FROM claims)", "may read only"),
])
def test_a_bad_filter_is_a_400_that_says_why(server, where, says) -> None:
    status, body = get(server, "/api/samples", where=where)
    if says is None:  # an empty filter is no filter
        assert status == 200
        return
    assert status == 400 and says in body["error"], body


def test_filters_that_read_write_attach_or_load_are_refused_and_touch_nothing(server, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-4711\n")
    target = tmp_path / "written.csv"
    db = tmp_path / "attached.duckdb"
    attempts = [
        f"group_id IN (SELECT content FROM read_text('{secret}'))",
        f"group_id IN (SELECT * FROM read_csv('{secret}', header=false))",
        f"EXISTS (SELECT * FROM glob('{tmp_path}/*'))",
        f"1=1; COPY (SELECT 1) TO '{target}'",
        f"reward > 0 AND 1 = (SELECT 1) ; COPY pool TO '{target}' (FORMAT csv)",
        f"1=1; ATTACH '{db}' AS other",
        f"group_id IN (SELECT * FROM sqlite_scan('{db}', 't'))",
        "1=1; INSTALL httpfs",
        "1=1; LOAD httpfs",
        "st_area(st_point(1, 2)) > 0",  # a function of an extension: autoload is off
        "1=1; SET enable_external_access = true",
        "current_setting('enable_external_access') OR getenv('HOME') IS NOT NULL",
    ]
    for where in attempts:
        status, body = get(server, "/api/samples", where=where)
        assert status == 400, (where, body)
        assert body["error"], where
        assert "TOP-SECRET" not in json.dumps(body), where
    assert not target.exists() and not db.exists()


def test_a_filter_that_runs_too_long_is_stopped(server) -> None:
    status, body = get(server, "/api/samples", where="reward < (SELECT count(*) FROM range(10000000000000))")
    assert status == 400 and "longer than" in body["error"], body


@pytest.mark.slow
def test_the_static_report_holds_the_filtered_samples_and_loads_nothing(run, tmp_path) -> None:
    out = tmp_path / "report.html"
    r = subprocess.run([sys.executable, "-m", "streamrl", "view", str(run[0]), "--html", str(out), "--where",
                        "reward >= 0.75", "--samples", "10"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert not network_refs(html), network_refs(html)
    data = json.loads(html.split('<script id="embedded" type="application/json">')[1].split("</script>")[0])
    assert 0 < len(data["rows"]) <= 10 and all(row["reward"] >= 0.75 for row in data["rows"])
    assert set(data["groups"]) == {row["group_id"] for row in data["rows"]}
    bad = subprocess.run([sys.executable, "-m", "streamrl", "view", str(run[0]), "--html", str(out),
                          "--as-of-step", "99999"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "0..3" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_the_viewer_reads_a_pool_on_s3(s3_server, tmp_path) -> None:
    uri = s3_server.new_uri()
    local = tmp_path / "local"
    local.mkdir()
    small_run(local, steps=2)  # the same run, its pool copied to S3 by reading and appending it
    with LancePool(local / "pool", create=False) as src, LancePool(uri, storage_options=s3_server.storage_options,
                                                                   compact_every=0) as dst:
        groups = src.groups(sorted(set(src.scan(["group_id"])["group_id"].to_pylist())))
        for g in groups:  # stored as produced; the S3 pool's own learner claims them
            g.status, g.consumed_step, g.consumed_version = "complete", None, None
        dst.append(sorted(groups, key=lambda g: g.created_at), admit=True)
        b = dst.claim(step=0, learner_version=1, num_groups=2, max_staleness=4)
        assert b is not None
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(
        {"model": {"path": "m"}, "data": {"path": "d"},
         "pool": {"uri": uri, "storage_options": s3_server.storage_options}}))
    data = open_run(str(run_dir))
    with running(data) as srv:
        status, summary = get(srv, "/api/summary")
        assert status == 200 and summary["uri"] == uri and summary["ledger"]["balanced"], summary
        status, page = get(srv, "/api/samples", step=0, limit=20)
        assert status == 200 and page["total"] == 8
        status, d = get(srv, "/api/sample", uid=page["rows"][0]["uid"], as_of_step=0)
        assert status == 200 and d["consumed_step"] == 0
        assert get(srv, "/api/samples", where="EXISTS (SELECT * FROM glob('/etc/*'))")[0] == 400
    data.close()


def test_view_flags_that_cannot_work_exit_2(run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(run[0]), "--where", "reward > 0"]) == 2
    assert "--where goes with --html" in capsys.readouterr().err
    assert main(["view", str(run[0]), "--as-of-step", "99999"]) == 2  # checked before serving
    assert "0..3" in capsys.readouterr().err
