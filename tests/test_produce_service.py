"""The producer API end to end: `streamrl produce serve` as a real subprocess on a run directory
with a real LanceDB pool, spoken to over HTTP by the SDK (streamrl.producers.sdk) and by raw aiohttp.

The run directory holds what the service reads: recipe.yaml (producer_api enabled, no rollout
workers, n=4, 2 groups per step, max_staleness 1), the model's config.json and events.jsonl,
to which tests append version_published lines as a learner would.

Long file: every route and refusal of the producer API against one real service and pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import yaml

from streamrl.core.types import Admission, SampleGroup, VersionPublished, make_group_id, to_json, to_msgpack
from streamrl.pools import LancePool
from streamrl.producers.intake import Submission
from streamrl.producers.sdk import ProducerClient, ProducerError
from streamrl.producers.api_process import start_service_process, stop_service_process
from streamrl.runtime.runlog import RunLog

from poolkit import assert_sample_equal, make_group

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
MAX_BODY_MB = 0.05  # ~52 KB: a normal test group is ~1 KB


def make_run(root: Path, **api: Any) -> Path:
    """root/run with recipe.yaml; paths in it are relative to root (the run's working directory)."""
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "model" / "config.json").write_text(json.dumps({"vocab_size": 50_000, "max_position_embeddings": 256}))
    (root / "run").mkdir(exist_ok=True)
    recipe = {"run": {"name": "ext", "dir": "run", "mode": "stream"}, "model": {"path": "model"},
              "data": {"path": "train.jsonl"}, "rollout": {"workers": 0, "n_samples": 4, "groups_per_step": 2},
              "staleness": {"max_staleness": 1}, "producer_api": {"enabled": True, "max_body_mb": MAX_BODY_MB, **api}}
    (root / "run" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root / "run"


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


class Service:
    def __init__(self, root: Path) -> None:
        self.root, self.run = root, root / "run"
        self.proc, self.url = start_service_process("run", root, root / "service.log")
        self.token = (self.run / "producer_token").read_text().strip()
        self.version = 0

    def client(self, producer_id: str = "env") -> ProducerClient:
        return ProducerClient.from_run_dir(self.run, producer_id, timeout_s=20)

    def publish(self, version: int) -> None:
        """Append a version_published event (as the learner does) and wait until the service saw it."""
        RunLog(self.run, echo=False).event(VersionPublished(version=version, step=version - 1, at=0))
        self.version = version
        deadline = time.monotonic() + 10
        while http("GET", self.url + "/v1/status", token=self.token)[1]["version"] != version:
            assert time.monotonic() < deadline, "the service did not pick up the new version"
            time.sleep(0.05)

    def make_room(self, groups: int) -> None:
        st = http("GET", self.url + "/v1/status", token=self.token)[1]
        if st["room"] < groups:
            self.publish(st["version"] + groups)  # each version adds groups_per_step=2 slots

    def ledger(self):
        from streamrl.pools import LancePool

        with LancePool(self.run / "pool", create=False) as pool:
            return pool.ledger()

    def stop(self) -> None:
        stop_service_process(self.proc)


def http(method: str, url: str, *, token: str | None = None, body: bytes | None = None,
         ctype: str | None = None, json_body: Any = None) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if ctype:
            headers["Content-Type"] = ctype
        async with aiohttp.ClientSession() as s, s.request(method, url, data=body, json=json_body,
                                                            headers=headers) as r:
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def run(coro):
    return asyncio.run(coro)


def group(i: int, version: int = 0, producer: str = "env", **kw):
    return make_group(make_group_id(producer, 0, i), producer_id=producer, versions=(version,), **kw)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("produce")
    make_run(root)
    s = Service(root)
    yield s
    s.stop()
    assert s.proc.returncode == 0, (root / "service.log").read_text()
    assert not (s.run / "producer.json").exists()  # removed on a clean stop


# ---------------------------------------------------------------- the service


def test_health_auth_and_status(svc: Service):
    assert http("GET", svc.url + "/health") == (200, {"ok": True})
    assert oct((svc.run / "producer_token").stat().st_mode & 0o777) == "0o600"
    for token in (None, "  ", "wrong", svc.token + "x"):
        for method, path in (("GET", "/v1/status"), ("POST", "/v1/leases"), ("POST", "/v1/groups"),
                             ("GET", "/v1/groups/env:e0:p0")):
            status, body = http(method, svc.url + path, token=token, body=b"x")
            assert status == 401, (method, path, body)
            assert ("wrong bearer token" if (token or "").strip() else "missing 'Authorization: Bearer <token>'") in \
                body["error"]["reason"]
    status, st = http("GET", svc.url + "/v1/status", token=svc.token)
    assert status == 200
    assert {k: st[k] for k in ("max_staleness", "groups_per_step", "n_samples", "router_url")} == \
        {"max_staleness": 1, "groups_per_step": 2, "n_samples": 4, "router_url": None}
    for key in ("version", "room", "outstanding", "started", "stored", "accepted", "duplicates", "refused"):
        assert key in st
    assert json.loads((svc.run / "producer.json").read_text())["pid"] == svc.proc.pid
    (svc.run / "endpoints.json").write_text(json.dumps({"router_url": "http://127.0.0.1:1", "api_key": "k"}))
    st = http("GET", svc.url + "/v1/status", token=svc.token)[1]
    assert (st["router_url"], st["router_api_key"]) == ("http://127.0.0.1:1", "k")  # to authenticated producers


def test_numbers_that_would_poison_the_weights_are_refused(svc: Service):
    """A huge or non-finite reward, NaN log-probs, a mask of 255, a msgpack array of the wrong byte
    length: each a 4xx naming the problem, never stored, never a 500."""
    import msgspec
    import numpy as np

    from streamrl.core.types import to_msgpack

    svc.make_room(1)
    url = svc.url + "/v1/groups"
    lease = run(_lease(svc))
    ok = json.loads(to_json(Submission(lease_id=lease, group=group(150))))

    def sample0(**change: Any) -> bytes:
        bad = json.loads(json.dumps(ok))
        bad["group"]["samples"][0].update(change)
        return json.dumps(bad).encode()

    for body, words in ((sample0(reward=1e39), "reward 1e+39 is not a finite number"),
                        (sample0(rewards={"judge": -1e7}), "is not a finite number within"),
                        (sample0(rollout_logprobs=[1e39] * len(ok["group"]["samples"][0]["rollout_logprobs"])),
                         "rollout_logprobs must hold finite numbers")):
        status, out = http("POST", url, token=svc.token, body=body, ctype="application/json")
        assert status == 422 and words in out["error"]["reason"], out
    g = group(151)
    g.samples[0].rollout_logprobs = np.full_like(g.samples[0].rollout_logprobs, np.nan)
    g.samples[1].loss_mask = np.full_like(g.samples[1].loss_mask, 255)
    status, out = http("POST", url, token=svc.token, body=to_msgpack(Submission(lease_id=lease, group=g)),
                       ctype="application/msgpack")
    assert status == 422 and "must hold finite numbers" in out["error"]["reason"], out
    raw = msgspec.msgpack.decode(to_msgpack(Submission(lease_id=lease, group=group(152))))
    raw["group"]["prompt_tokens"] = msgspec.msgpack.Ext(1, b"\x01\x00\x00")  # 3 bytes of int32
    status, out = http("POST", url, token=svc.token, body=msgspec.msgpack.encode(raw), ctype="application/msgpack")
    assert status == 422 and "not a multiple of 4" in out["error"]["reason"], out
    status, _ = http("GET", svc.url + "/v1/groups/env:e0:p150", token=svc.token)
    assert status == 404  # nothing was stored


def test_oversize_body_is_413_before_decoding(svc: Service):
    body = b"\x00" * 200_000
    status, out = http("POST", svc.url + "/v1/groups", token=svc.token, body=body, ctype="application/msgpack")
    assert status == 413
    err = out["error"]
    assert err["limit_bytes"] == int(MAX_BODY_MB * 2**20) and err["size_bytes"] == len(body)
    assert f"body is {len(body)} bytes; the limit is {err['limit_bytes']} bytes" in err["reason"]
    # A big but valid group is refused the same way through the SDK.
    big = group(900, num_tokens=4000)
    with pytest.raises(ProducerError) as e:
        run(_submit_one(svc, big))
    assert e.value.status == 413


async def _submit_one(svc: Service, g, producer: str = "env") -> dict[str, Any]:
    async with svc.client(producer) as c:
        return await c.submit(g, await c.lease(1, wait=False))


def test_malformed_bodies(svc: Service):
    svc.make_room(1)
    url = svc.url + "/v1/groups"
    lease = run(_lease(svc))
    ok = to_json(Submission(lease_id=lease, group=group(100)))

    assert http("POST", url, token=svc.token, body=b"\xc1\xc1", ctype="application/msgpack")[0] == 400
    status, out = http("POST", url, token=svc.token, body=b"{not json", ctype="application/json")
    assert status == 400 and "body is not valid JSON" in out["error"]["reason"]
    assert http("POST", url, token=svc.token, body=ok, ctype="text/plain")[0] == 415
    status, out = http("POST", url, token=svc.token, body=b'{"lease_id": "x"}', ctype="application/json")
    assert status == 422 and "missing required field `group`" in out["error"]["reason"]
    # Three response tokens, two log-probs in sample 2: the message names the sample.
    bad = json.loads(ok)
    bad["group"]["samples"][2]["rollout_logprobs"] = bad["group"]["samples"][2]["rollout_logprobs"][:2]
    status, out = http("POST", url, token=svc.token, body=json.dumps(bad).encode(), ctype="application/json")
    assert status == 422 and "sample 2:" in out["error"]["reason"] and "log-probs" in out["error"]["reason"]
    assert "samples[2]" in out["error"]["reason"]
    # The same group, well-formed, as JSON with plain lists: accepted under the same lease.
    status, out = http("POST", url, token=svc.token, body=ok, ctype="application/json")
    assert (status, out) == (200, {"stored": True, "group_id": "env:e0:p100"})


async def _lease(svc: Service, n: int = 1, producer: str = "env") -> str:
    async with svc.client(producer) as c:
        return (await c.lease(n, wait=False)).lease_id


def test_groups_the_rules_refuse_are_422_with_the_reason(svc: Service):
    svc.make_room(3)
    future = group(101, version=svc.version + 2)
    with pytest.raises(ProducerError, match=f"version {svc.version + 2} is from the future: the run has published "
                                            f"version {svc.version}") as e:
        run(_submit_one(svc, future))
    assert e.value.status == 422
    no_reward = group(102)
    no_reward.samples[2].reward = None
    with pytest.raises(ProducerError, match=r"samples\[2\].reward is None; every sample that is not failed needs a "
                                            "reward"):
        run(_submit_one(svc, no_reward))
    with pytest.raises(ProducerError, match="must start with 'env:'"):
        run(_submit_one(svc, group(103, producer="other")))
    log = (svc.run / "logs" / "producer.log").read_text()
    assert "refused 422 rejected" in log and "samples[2].reward is None" in log


def test_bad_producer_ids_are_400(svc: Service):
    for pid in ("rollout-0", "has space", "", "x" * 65):
        status, out = http("POST", svc.url + "/v1/leases", token=svc.token, json_body={"producer_id": pid, "groups": 1})
        assert status == 400, pid
        assert "producer_id" in out["error"]["reason"]
    status, out = http("POST", svc.url + "/v1/leases", token=svc.token, json_body={"producer_id": "env", "groups": 0})
    assert status == 400 and "groups" in out["error"]["reason"]
    with pytest.raises(ValueError, match="must not start with 'rollout-'"):
        ProducerClient(svc.url, svc.token, "rollout-1")


def test_lease_errors_are_409(svc: Service):
    svc.make_room(1)
    with pytest.raises(ProducerError, match="unknown lease 'nope'") as e:
        run(_submit_with(svc, group(110), "nope"))
    assert e.value.status == 409
    lease = run(_lease(svc, 1))
    assert run(_submit_with(svc, group(111), lease))["stored"] is True
    with pytest.raises(ProducerError, match="has used all of its 1 slots"):
        run(_submit_with(svc, group(112), lease))

    async def with_sdk_lease() -> tuple[str, Any, dict[str, Any]]:
        async with svc.client() as c:
            held = await c.lease(1, wait=False)
            assert (await c.submit(group(113), held))["stored"] is True
            first = held.lease_id
            out = await c.submit(group(114), held)  # used up: the SDK takes a new lease and submits again
            return first, held, out

    svc.make_room(2)

    first, held, out = run(with_sdk_lease())
    assert out["stored"] is True and held.lease_id != first and held.used == 1


async def _submit_with(svc: Service, g, lease_id: str) -> dict[str, Any]:
    async with svc.client() as c:
        return await c.submit(g, lease_id)


def test_staleness_bound_429_and_a_new_version_frees_room(svc: Service):
    svc.make_room(1)

    async def go() -> None:
        async with svc.client() as c:
            st = await c.status()
            lease = await c.lease(st["room"] + 5, wait=False)
            assert lease.slots == st["room"]  # granted what there is room for
            with pytest.raises(ProducerError) as e:
                await c.lease(1, wait=False)
            assert e.value.status == 429
            err = e.value.body["error"]
            assert err["retry_after_s"] > 0
            assert err["reason"].startswith(f"staleness bound: learner at version {st['version']} allows ")
            assert f"{st['started']} started + {st['outstanding'] + lease.slots} leased" in err["reason"]
            # A waiting lease is granted once the learner publishes the next version.
            waiting = asyncio.create_task(c.lease(1, wait=True))
            await asyncio.sleep(0.8)
            assert not waiting.done()
            await asyncio.to_thread(svc.publish, st["version"] + 1)
            got = await asyncio.wait_for(waiting, 10)
            assert got.slots == 1 and got.version == st["version"] + 1

    run(go())


def test_idempotent_submissions_store_each_group_once(svc: Service):
    svc.make_room(4)

    async def go() -> None:
        async with svc.client() as c:
            lease = await c.lease(3, wait=False)
            g = group(120)
            assert await c.stored(g.group_id) is None
            assert (await c.submit(g, lease))["stored"] is True
            assert await c.submit(group(120), lease) == {"stored": False, "duplicate": True, "group_id": g.group_id}
            assert lease.used == 1  # the duplicate used no slot
            assert await c.stored(g.group_id) == "complete"
            changed = group(120)
            changed.samples[0].reward = 0.3
            with pytest.raises(ProducerError, match="already stored with different content") as e:
                await c.submit(changed, lease)
            assert e.value.status == 409
            # The same new group twice at once: one stores it, the other waits and hears duplicate.
            outs = await asyncio.gather(c.submit(group(121), lease), c.submit(group(121), lease))
            assert sorted(o["stored"] for o in outs) == [False, True]
            # A duplicate needs no valid lease (a retry after the lease was used up or expired).
            assert (await c.submit(group(121), "gone"))["duplicate"] is True

    run(go())
    led = svc.ledger()
    assert led.balanced and led.admitted == led.complete and led.duplicated == 0 and led.unadmitted == 0, led


PRODUCER = textwrap.dedent("""
    import asyncio, sys
    from poolkit import assert_sample_equal, make_group
    from streamrl.producers.sdk import ProducerClient
    from streamrl.core.types import make_group_id

    async def main(run_dir, count):
        async with ProducerClient.from_run_dir(run_dir, "killable", timeout_s=20) as c:
            for i in range(count):
                gid = make_group_id("killable", 0, i)
                if await c.stored(gid):
                    print("skip", i, flush=True)
                    continue
                lease = await c.lease(1)
                out = await c.submit(make_group(gid, producer_id="killable"), lease)
                print("stored" if out["stored"] else "duplicate", i, flush=True)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def test_producer_killed_mid_stream_then_restarted_stores_each_group_once(svc: Service, tmp_path: Path):
    count = 10
    svc.make_room(count + 2)
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    cmd = [sys.executable, str(script), str(svc.run), str(count)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    lines = []
    for line in proc.stdout:  # SIGKILL once a few groups are in, mid-way through the next submission
        lines.append(line.decode().split())
        if len(lines) == 3:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(20)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert lines == [["stored", str(i)] for i in range(3)]
    again = subprocess.run(cmd, capture_output=True, env=child_env(), timeout=60)
    assert again.returncode == 0, again.stderr.decode()
    out = [line.split() for line in again.stdout.decode().splitlines()]
    assert out[:3] == [["skip", str(i)] for i in range(3)]
    assert [int(i) for _, i in out] == list(range(count))
    from streamrl.pools import LancePool

    with LancePool(svc.run / "pool", create=False) as pool:
        ids = pool.scan(["group_id"], where="producer_id = 'killable'")["group_id"].to_pylist()
        adm = pool.scan(["group_id"], where="producer_id = 'killable'", table="admissions")["group_id"].to_pylist()
        led = pool.ledger()
    assert sorted(set(ids)) == sorted(make_group_id("killable", 0, i) for i in range(count))
    assert len(ids) == 4 * count and sorted(adm) == sorted(set(ids))  # 4 rows each, one admission each
    assert led.balanced and led.admitted == led.complete and led.duplicated == 0 and led.unadmitted == 0, led


def test_the_service_keeps_serving_after_refusals(svc: Service):
    def refusals() -> dict[str, int]:
        return http("GET", svc.url + "/v1/status", token=svc.token)[1]["refused"]

    before = refusals()
    svc.make_room(2)
    url, tok = svc.url + "/v1/groups", svc.token
    stored = group(140)
    assert run(_submit_one(svc, stored))["stored"] is True
    changed = group(140)
    changed.prompt_tokens[0] += 1
    lease = run(_lease(svc))
    for body, ctype, token in ((b"x", "application/json", "bad"), (b"x" * 100_000, "application/json", tok),
                               (b"\xc1", "application/msgpack", tok), (b"{}", "application/json", tok),
                               (to_msgpack(Submission(lease_id=lease, group=group(141, version=10**6))),
                                "application/msgpack", tok),
                               (to_msgpack(Submission(lease_id="nope", group=group(142))), "application/msgpack", tok),
                               (to_msgpack(Submission(lease_id=lease, group=changed)), "application/msgpack", tok)):
        assert http("POST", url, token=token, body=body, ctype=ctype)[0] >= 400
    assert http("POST", svc.url + "/v1/leases", token=tok, json_body={"producer_id": "a b"})[0] == 400
    while http("POST", svc.url + "/v1/leases", token=tok, json_body={"producer_id": "env"})[0] != 429:
        pass
    after = refusals()
    for key in ("unauthorized", "too_large", "undecodable", "invalid", "rejected", "lease", "conflict",
                "staleness", "bad_request"):
        assert after.get(key, 0) > before.get(key, 0), (key, before, after)
    assert svc.proc.poll() is None and http("GET", svc.url + "/health")[0] == 200
    assert run(_submit_with(svc, group(143), lease))["stored"] is True  # the lease's slot was not used up
    st = http("GET", svc.url + "/v1/status", token=tok)[1]
    assert st["stored"] == st["started"] and st["accepted"] >= 2
    log = (svc.run / "logs" / "producer.log").read_text().splitlines()
    assert any("refused 409 conflict" in line for line in log) and any("refused 413 too_large" in line for line in log)
    status, out = http("GET", svc.url + "/v1/groups/env:e0:p999", token=tok)
    assert status == 404 and "no external producer's group" in out["error"]["reason"]


# ---------------------------------------------------------------- start-up


def _serve_cli(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl", "produce", "serve", "run", *extra], cwd=root,
                          capture_output=True, text=True, env=child_env(), timeout=60)


def test_refuses_runs_without_producer_api_or_not_streaming(tmp_path: Path):
    make_run(tmp_path, enabled=False)
    res = _serve_cli(tmp_path)
    assert res.returncode == 2 and "producer_api.enabled is false" in res.stderr, res.stderr
    recipe = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    recipe["producer_api"]["enabled"] = True
    recipe["run"]["mode"] = "lockstep"
    (tmp_path / "run" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    res = _serve_cli(tmp_path)
    assert res.returncode == 2 and "need run.mode: stream (got 'lockstep')" in res.stderr, res.stderr


@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # this process opened the pool, then starts the service
def test_one_service_per_run_and_a_group_admitted_but_not_stored_is_stored_once(tmp_path: Path):
    run_dir = make_run(tmp_path)
    from streamrl.pools import LancePool

    # A service killed between its two commits left this admission without rows.
    orphan = group(0, producer="env")
    with LancePool(run_dir / "pool") as pool:
        pool.admit([Admission(group_id=orphan.group_id, prompt_id=orphan.prompt_id, n=4, producer_id="env")])
    s = Service(tmp_path)
    try:
        second = _serve_cli(tmp_path)
        assert second.returncode == 2
        assert f"already running (pid {s.proc.pid} at {s.url})" in second.stderr, second.stderr
        st = http("GET", s.url + "/v1/status", token=s.token)[1]
        assert (st["started"], st["stored"], st["room"]) == (1, 0, 3)
        assert run(_submit_with(s, orphan, "no-lease-needed"))["stored"] is True
        assert run(_submit_with(s, group(0), "x"))["duplicate"] is True
        led = s.ledger()
        assert led.admitted == led.complete == 1 and led.balanced, led
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_version_tail_reads_only_whole_new_lines(tmp_path: Path):
    from streamrl.producers.api_app import VersionTail

    path = tmp_path / "events.jsonl"
    tail = VersionTail(path)
    assert tail.poll() == 0  # no file yet
    log = RunLog(tmp_path, echo=False)
    log.event(VersionPublished(version=2, step=1, at=0))
    with open(path, "ab") as f:
        f.write(b'{"type":"batch_claimed","step":5}\n{"type":"version_published","version":7,"st')
    assert tail.poll() == 2  # the half-written line is not read yet
    with open(path, "ab") as f:
        f.write(b'ep":6,"at":0}\n{"type":"run_resumed","checkpoint_step":3,"redone_steps":[],"version":4,"at":0}\n')
    assert tail.poll() == 7  # the max of published and resumed versions
    path.unlink()
    log.event(VersionPublished(version=1, step=0, at=0))  # a new run replaced the file
    assert tail.poll() == 1


def test_direct_producer_validates_and_is_idempotent(tmp_path: Path):
    from streamrl.producers.sdk import DirectProducer

    uri = tmp_path / "pool"
    gs = [group(i, producer="direct", version=1) for i in range(3)]
    with DirectProducer(uri, "direct", n_samples=4, vocab_size=50_000, max_tokens=256) as dp:
        assert dp.append(gs[:2], version=1) == {"stored": [g.group_id for g in gs[:2]], "duplicates": []}
        with pytest.raises(ValueError, match="version 1 is from the future: the run has published version 0"):
            dp.append([gs[2]], version=0)
        dp.pool.admit([Admission(group_id=gs[2].group_id, prompt_id="p", n=4, producer_id="direct")])
    with DirectProducer(uri, "direct") as dp:  # a restarted producer: ids already admitted are skipped
        out = dp.append([group(i, producer="direct", version=1) for i in range(3)] + [gs[0]])
        assert out == {"stored": [gs[2].group_id], "duplicates": [gs[0].group_id, gs[1].group_id, gs[0].group_id]}
        led = dp.pool.ledger()
    assert led.balanced and led.admitted == led.complete == 3, led


@pytest.mark.parametrize("admission_committed", [True, False])
def test_a_failed_pool_write_is_retried_without_a_second_admission(tmp_path: Path, monkeypatch,
                                                                   admission_committed: bool):
    """In-process service whose first pool write fails (after or before the admission commit):
    the SDK retries the 503, and the group ends up admitted once and stored once."""
    from aiohttp.test_utils import TestServer

    from streamrl.producers.api_process import open_service

    make_run(tmp_path)
    monkeypatch.chdir(tmp_path)  # recipe paths are relative to the run's working directory
    svc = open_service("run", quiet=True)
    real, calls = svc.pool.append_async, []

    async def flaky(groups, admit=False):
        calls.append(admit)
        if len(calls) == 1:
            if admission_committed:
                g = groups[0]
                await svc.pool.admit_async([Admission(group_id=g.group_id, prompt_id=g.prompt_id, n=4,
                                                      producer_id=g.producer_id)])
            raise OSError("disk full")
        await real(groups, admit=admit)

    monkeypatch.setattr(svc.pool, "append_async", flaky)

    async def go() -> dict[str, Any]:
        async with TestServer(svc.app()) as server:
            async with ProducerClient(str(server.make_url("")), svc.token.decode(), "env") as c:
                return await c.submit(group(0), await c.lease(1))

    try:
        assert run(go()) == {"stored": True, "group_id": "env:e0:p0"}
        # The retry found the admission (rows only) or found none (the lease's slot was given back).
        assert calls == [True, not admission_committed]
        led = svc.pool.ledger()
        assert led.balanced and led.admitted == led.complete == 1, led
        assert (svc.started, svc.stored) == (1, 1)
    finally:
        svc.close()


def test_a_group_one_version_ahead_waits_for_the_publish_in_progress(svc: Service):
    """Engines serve version v+1 a moment before the run logs it as published: such a group is held
    until the log says so (here 0.5 s later), not refused as coming from the future."""
    import threading

    svc.make_room(1)
    ahead = group(130, version=svc.version + 1)
    later = threading.Timer(0.5, svc.publish, args=(svc.version + 1,))
    later.start()
    t0 = time.monotonic()
    out = run(_submit_one(svc, ahead))
    later.join()
    assert out["stored"] is True and time.monotonic() - t0 >= 0.4


def test_routed_experts_from_producers_are_stored_or_refused_with_the_reason(tmp_path: Path):
    """A MoE run (3 layers, top 2 of 8 experts): a group whose samples carry routed experts, as JSON
    nested lists and as msgpack, is stored exactly; rows that miss a position, another model's
    shape and ids past the experts are refused with the reason."""
    run_dir = make_run(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "vocab_size": 50_000, "max_position_embeddings": 256, "num_hidden_layers": 3, "num_experts_per_tok": 2,
        "num_local_experts": 8}))
    svc = Service(tmp_path)

    def routed(i: int, layers: int = 3, top_k: int = 2, top: int = 8) -> SampleGroup:
        g = group(i)
        rng = np.random.default_rng(i)
        for s in g.samples:
            s.routed_experts = rng.integers(0, top, (len(g.prompt_tokens) + s.num_tokens - 1, layers, top_k), np.int32)
        return g

    try:
        svc.make_room(6)
        url = svc.url + "/v1/groups"
        sent = routed(200)
        body = to_json(Submission(lease_id=run(_lease(svc)), group=sent))
        assert http("POST", url, token=svc.token, body=body, ctype="application/json")[0] == 200
        packed = routed(201)
        run(_submit_one(svc, packed))  # the SDK: msgpack
        short = json.loads(to_json(Submission(lease_id=run(_lease(svc)), group=routed(202))))
        short["group"]["samples"][1]["routed_experts"].pop()
        status, out = http("POST", url, token=svc.token, body=json.dumps(short).encode(), ctype="application/json")
        assert status == 422 and "sample 1: routed_experts has" in out["error"]["reason"], out
        for g, why in ((routed(203, layers=2), r"samples\[0\].routed_experts has 2 layers x top 2; this run's model "
                                                "routes 3 x top 2"),
                       (routed(204, top=9), r"routed_experts holds expert id 8; this run's model has 8 experts")):
            with pytest.raises(ProducerError, match=why) as e:
                run(_submit_one(svc, g))
            assert e.value.status == 422
    finally:
        svc.stop()
    with LancePool(run_dir / "pool", create=False) as pool:
        got = {g.group_id: g for g in pool.groups([sent.group_id, packed.group_id])}
    for want in (sent, packed):  # the service adds the content hash to the group's metadata
        for a, b in zip(got[want.group_id].samples, want.samples, strict=True):
            assert_sample_equal(a, b, want.group_id)
