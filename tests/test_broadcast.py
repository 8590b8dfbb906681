"""VersionBroadcaster (streamrl/runtime/broadcast.py) against the session's embedded engines
behind the real sglang-router: what it sends must pass the SGLang rules the engines enforce."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from streamrl.connectors.sglang.client import SGLangClient
from streamrl.runtime.broadcast import VersionBroadcaster
from streamrl.runtime.runlog import RunLog

from enginekit import get_json

pytestmark = pytest.mark.slow


def test_in_place_publish_with_requests_running(engine, router_proc, model_dirs, tmp_path):
    """Under partial_rollout in_place the requests stay running through the update, so the
    broadcaster must send flush_cache false (SGLang fails a flushing update then); they finish
    on the new version. Disk sync: version 1 is already exported, so no learner is needed."""
    run_dir = tmp_path / "run"
    (run_dir / "weights").mkdir(parents=True)
    os.symlink(model_dirs[1], run_dir / "weights" / "v000001")
    bc = VersionBroadcaster(router_proc, None, "disk", "in_place", run_dir, RunLog(run_dir, echo=False))
    n = 240

    async def main():
        async with SGLangClient(engine.url) as c:
            tasks = [asyncio.create_task(c.generate([5 + i, 6, 7, 8], {"max_new_tokens": n, "ignore_eos": True}))
                     for i in range(2)]
            async with aiohttp.ClientSession() as s:
                while (await get_json(s, engine.url + "/server_info"))[1]["internal_states"][0]["num_requests"] < 2:
                    await asyncio.sleep(0.01)
            try:
                out = await bc.publish(1, 0, interrupt=True)
            finally:
                for w in router_proc.workers.values():  # back to running even when publish failed
                    await w.resume()
                    await w.close()
            return out, await asyncio.gather(*tasks)

    out, results = asyncio.run(main())
    log = run_dir / "run.log"
    assert out["failed_engines"] == 0 and out["path"].endswith("v000001"), (out, log.exists() and log.read_text())
    for r in results:
        assert r.finish_type == "length" and len(r.output_ids) == n
        versions = [s.version for s in r.meta_info.weight_versions]
        assert versions[-1] == "1", versions  # went on, in place, on the new weights
