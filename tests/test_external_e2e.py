"""External producers feeding a live run: a run with no rollout workers of its own
(`rollout.workers: 0`, `producer_api.enabled`) trains only on groups that two separate producer
processes (recipes/external_producer.py) generate with its engines and submit over HTTP. One
producer is SIGKILLed while it is submitting and started again; nothing may be lost or stored
twice. Bad submissions against the live service are refused with a 4xx and a reason, and the
run goes on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from streamkit import (
    REPO,
    assert_ledger_balanced,
    check_step_metrics,
    child_env,
    finish_streamrl,
    group_rows,
    kill_session,  # noqa: F401
    pool_rows,
    read_metrics,
    start_streamrl,
    task_data,
    tiny_model,
    wait_for,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS = 6


def _post(url: str, token: str, body: bytes, ctype: str = "application/json") -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _group(gid: str, n: int, version: int, logprobs: int = 2) -> dict[str, Any]:
    return {"group_id": gid, "prompt_id": "bad", "prompt_tokens": [5, 6, 7],
            "samples": [{"index": i, "response_tokens": [8, 9], "rollout_logprobs": [-0.1] * logprobs,
                         "spans": [[version, 0, 2]], "reward": 1.0, "finish_reason": "stop"} for i in range(n)]}


def _producer(run_dir: Path, pid: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "streamrl.recipes.external_producer", str(run_dir), "--producer-id", pid,
                                 "--turns", "2", "--concurrency", "1", "--limit", "200", "--timeout", "5"],
                                cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def _stored(run_dir: Path, producer: str) -> int:
    try:
        return len({r["group_id"] for r in pool_rows(run_dir, ["group_id"], where=f"producer_id = '{producer}'")})
    except Exception:  # noqa: BLE001 - the pool is being written; try again
        return 0


def test_external_producers_feed_a_live_run(tmp_path: Path, tiny_model: Path, task_data: dict[str, Path]) -> None:
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, tiny_model, task_data["train"], {
        "run.steps": STEPS, "rollout.workers": 0, "rollout.max_new_tokens": 4,
        "producer_api": {"enabled": True, "max_body_mb": 0.01, "lease_s": 5}, "engines.max_running": 8})
    proc = start_streamrl(["run", str(recipe), "--run-dir", str(run_dir)], tmp_path / "logs")
    producers: list[subprocess.Popen[bytes]] = []
    try:
        info = wait_for(lambda: (run_dir / "producer.json").exists() and json.loads((run_dir / "producer.json").read_text()),
                        240, "the producer service", alive=proc)
        url, token = info["url"], (run_dir / "producer_token").read_text().strip()
        n = 4  # rollout.n_samples of the test recipe

        # Bad input: each refused with a 4xx and a reason; the run goes on.
        st, body = _post(url + "/v1/leases", "wrong", json.dumps({"producer_id": "ext-a", "groups": 1}).encode())
        assert st == 401, body
        st, body = _post(url + "/v1/groups", token, b"{" + b" " * 20000 + b"}")
        assert st == 413 and "limit" in body, body
        st, body = _post(url + "/v1/groups", token, b'{"lease_id": "x", "group": {"group_id": 3}}')
        assert st in (400, 422), body
        lease = json.loads(_post(url + "/v1/leases", token, json.dumps({"producer_id": "bad", "groups": 2}).encode())[1])
        mismatch = {"lease_id": lease["lease_id"], "group": _group("bad:e0:p0", n, 0, logprobs=3)}
        st, body = _post(url + "/v1/groups", token, json.dumps(mismatch).encode())
        assert st == 422 and "sample 0" in body and "log-probs" in body, body
        future = {"lease_id": lease["lease_id"], "group": _group("bad:e0:p1", n, 99)}
        st, body = _post(url + "/v1/groups", token, json.dumps(future).encode())
        assert st == 422 and "future" in body, body

        # One producer, killed while it is submitting: the run can only wait, so the moment is its own.
        logs = tmp_path / "logs"
        producers = [_producer(run_dir, "ext-a", logs / "ext-a-1.log")]
        wait_for(lambda: _stored(run_dir, "ext-a") >= 2, 180, "ext-a's first groups", poll_s=0.2, alive=proc)
        producers[0].send_signal(signal.SIGKILL)
        producers[0].wait()
        killed_at = _stored(run_dir, "ext-a")
        # Started again with the same id, it skips what the pool holds. Once it stores again (two
        # more: one may be the killed process's last submission landing late), so it cannot miss the
        # run, a second producer joins.
        producers = [_producer(run_dir, "ext-a", logs / "ext-a-2.log")]
        wait_for(lambda: _stored(run_dir, "ext-a") >= killed_at + 2, 180, "ext-a's groups after its restart",
                 poll_s=0.2, alive=proc)
        producers.append(_producer(run_dir, "ext-b", logs / "ext-b.log"))
        finish_streamrl(proc, logs, run_dir=run_dir)
        for p in producers:
            p.wait(60)
    finally:
        for p in producers:
            if p.poll() is None:
                p.kill()
        if proc.poll() is None:
            kill_session(proc, run_dir)

    check_step_metrics(read_metrics(run_dir), STEPS)
    stats = assert_ledger_balanced(run_dir)
    led = stats["ledger"]
    assert led["consumed"] == STEPS * 2 and led["duplicated"] == 0, led
    groups = group_rows(run_dir)
    consumed = {g: r for g, r in groups.items() if r["status"] == "consumed"}
    assert {g.split(":")[0] for g in groups} <= {"ext-a", "ext-b"}
    assert all(r["consumed_version"] - r["min_version"] <= 1 for r in consumed.values()), consumed  # the bound
    assert _stored(run_dir, "ext-a") >= killed_at
    assert not [g for g in groups if g.startswith("bad:")]  # refused groups never reached the pool
    again = (tmp_path / "logs" / "ext-a-2.log").read_text(errors="replace")
    counts = json.loads(again.strip().splitlines()[-1].replace("'", '"'))  # its last line: {"stored", "skipped", ...}
    assert counts["skipped"] >= killed_at and counts["refused"] == 0, again[-2000:]
    refused = (run_dir / "logs" / "producer.log").read_text(errors="replace")
    assert "future" in refused, refused[-2000:]
