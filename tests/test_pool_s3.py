"""The experience pool on object storage (`pool.uri: s3://...`), against a local S3-compatible
server (benchmarks/_s3.py): the pool's objects land in the bucket, a run directory finds its S3 pool
through its recorded recipe (`streamrl pool stats/query RUN_DIR`), a new run refuses a prefix
that holds another run's pool, and a recipe refuses credentials. Two producer processes and a
claimer on S3: tests/test_pool_processes.py; a run killed and resumed on S3: test_resume_e2e."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from streamrl.pools import LancePool, open_pool
from streamrl.recipe import RecipeError, parse_recipe

from poolkit import admissions_for, assert_group_equal, make_group, partial_of
from benchmarks._s3 import BUCKET

MINIMAL = "model:\n  path: m\ndata:\n  path: d\n"


def _server_env_only(s3_server) -> dict[str, str]:
    """storage_options that name the server; the credentials stay in the environment."""
    return s3_server.storage_options


def test_a_pool_on_s3_appends_claims_compacts_and_balances(s3_server) -> None:
    uri = s3_server.new_uri()
    groups = [make_group(f"s{i}", n=3, versions=(0, 1)) for i in range(6)]
    with LancePool(uri, storage_options=_server_env_only(s3_server), compact_every=0) as pool:
        pool.admit(admissions_for(groups))
        pool.save_partial([partial_of(g, 2, versions=(0,)) for g in groups[:2]])  # then completed: replaced
        pool.append(groups)
        b = pool.claim(step=0, learner_version=1, num_groups=4, max_staleness=4)
        assert b is not None and [g.group_id for g in b.groups] == ["s0", "s1", "s2", "s3"]
        pool.compact()
        assert pool.claim(step=1, learner_version=2, num_groups=2, max_staleness=4) is not None
    prefix = uri.removeprefix(f"s3://{BUCKET}/")
    keys = [o["Key"] for o in s3_server.objects(prefix)]
    assert any(k.endswith(".lance") for k in keys) and any("/_versions/" in k for k in keys), keys[:10]
    with LancePool(uri, create=False, storage_options=_server_env_only(s3_server)) as pool:  # a fresh reader
        led = pool.ledger()
        assert led.balanced and led.consumed == 6 and led.lost == 0 and led.duplicated == 0, led
        (g,) = pool.groups(["s1"])
        assert_group_equal(g, groups[1], status="consumed")


def test_a_run_directory_finds_its_s3_pool_for_the_cli(s3_server, tmp_path) -> None:
    uri = s3_server.new_uri()
    with LancePool(uri, storage_options=_server_env_only(s3_server)) as pool:
        pool.append([make_group(f"c{i}", n=2) for i in range(3)], admit=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # what a run records: its resolved recipe, with the pool's uri and settings
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(
        {"model": {"path": "m"}, "data": {"path": "d"},
         "pool": {"uri": uri, "storage_options": s3_server.storage_options}}))
    assert open_pool(str(run_dir)).uri == uri
    cli = [sys.executable, "-m", "streamrl", "pool"]
    stats = subprocess.run([*cli, "stats", str(run_dir), "--json"], capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0, stats.stderr
    out = json.loads(stats.stdout)
    assert out["uri"] == uri and out["groups"] == 3 and out["ledger"]["balanced"], out
    q = subprocess.run([*cli, "query", str(run_dir), "SELECT count(*) AS n FROM pool WHERE status = 'complete'",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout) == [{"n": 6}], q.stdout
    out = tmp_path / "samples.jsonl"
    ex = subprocess.run([*cli, "export", str(run_dir), str(out), "--kind", "raw", "--quiet"], capture_output=True,
                        text=True, timeout=120)
    assert ex.returncode == 0, ex.stderr
    assert sorted({json.loads(line)["group_id"] for line in out.read_text().splitlines()}) == ["c0", "c1", "c2"]


def test_a_new_run_refuses_a_pool_uri_that_holds_another_runs_pool(s3_server, tmp_path) -> None:
    from streamrl.runtime import run as run_mod

    uri = s3_server.new_uri()
    with LancePool(uri, storage_options=_server_env_only(s3_server)) as pool:
        pool.append([make_group("old0", n=2)], admit=True)
    r = parse_recipe(MINIMAL, overrides=[f"pool.uri={uri}", f"run.dir={tmp_path / 'new'}"] + [
        f'pool.storage_options.{k}="{v}"' for k, v in s3_server.storage_options.items()])
    with pytest.raises(run_mod.RunExists, match=r"already holds an experience pool \(2 rows\)"):
        run_mod.run(r, progress=False)
    assert not (tmp_path / "new").exists(), "nothing is created for a refused run"


def test_a_new_run_may_name_a_pool_uri_where_no_pool_is_yet(s3_server, tmp_path) -> None:
    """Nothing there yet, on S3 or on a local path outside the run directory: the run creates it."""
    from streamrl.runtime import run as run_mod

    for uri in (s3_server.new_uri(), str(tmp_path / "elsewhere" / "pool")):
        r = parse_recipe(MINIMAL, overrides=[f"pool.uri={uri}"] + [
            f'pool.storage_options.{k}="{v}"' for k, v in s3_server.storage_options.items()])
        run_mod._refuse_a_used_pool(r)  # returns: no pool there


def test_a_new_run_on_an_unreachable_object_store_exits_before_it_starts(s3_server, tmp_path) -> None:
    """A wrong endpoint is refused up front with what to check (not "damaged", not mid-run)."""
    from streamrl.runtime import RunFailed
    from streamrl.runtime import run as run_mod

    r = parse_recipe(MINIMAL, overrides=[f"pool.uri={s3_server.new_uri()}", f"run.dir={tmp_path / 'new'}",
                                         'pool.storage_options.aws_endpoint="http://127.0.0.1:9"',
                                         'pool.storage_options.allow_http="true"'])
    with pytest.raises(RunFailed, match=r"^pool\.uri: cannot reach the object store of s3://.*pool\.storage_options"):
        run_mod.run(r, progress=False)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("key", ["aws_secret_access_key", "aws_access_key_id", "AWS_SESSION_TOKEN"])
def test_a_recipe_refuses_credentials_in_storage_options(key: str) -> None:
    with pytest.raises(RecipeError) as ei:
        parse_recipe(MINIMAL + f"pool:\n  uri: s3://b/p\n  storage_options:\n    {key}: x\n", "r.yaml")
    msg = str(ei.value)
    assert f"pool.storage_options.{key}" in msg and "environment" in msg and key.upper() in msg, msg
    assert "r.yaml:" in msg


@pytest.mark.parametrize("after", [False, True], ids=["refused", "done-then-refused"])
def test_writes_and_claims_outlast_an_object_store_that_fails_for_seconds(s3_server, after: bool) -> None:
    """Chaos trial 0 of seed 7 (benchmarks/chaos.py): S3 answering 503 SlowDown to every write for 2.8 s
    failed the learner's claim (Lance gives up after ~2.5 s) and the run stopped with a traceback. Writes and
    claims now wait the outage out; one the store did but answered with an error (`after`) lands once."""
    from benchmarks._s3_faults import FaultyS3

    proxy = FaultyS3(s3_server.url)
    try:
        uri = s3_server.new_uri()
        options = {"aws_endpoint": proxy.url, "allow_http": "true"}
        groups = [make_group(f"o{i}", n=2, versions=(0, 1)) for i in range(6)]
        with LancePool(uri, storage_options=options, compact_every=0) as pool:
            pool.append(groups[:2], admit=True)
            proxy.fail_writes(4.0, after=after)
            pool.append(groups[2:], admit=True)  # waits the outage out
            proxy.fail_writes(4.0, after=after)
            b = pool.claim(step=0, learner_version=1, num_groups=4, max_staleness=4)
            assert b is not None and len(b.groups) == 4
            assert proxy.refused > 0
        with LancePool(uri, create=False, storage_options=options) as pool:
            led = pool.ledger()
            assert led.balanced and led.consumed == 4 and led.lost == 0 and led.duplicated == 0, led
            assert pool.count() == 12 and pool.claims().num_rows == 4, (pool.count(), pool.claims().num_rows)
    finally:
        proxy.close()
