"""A rollout worker on a MoE model stores each sample's routed experts, stitched across the
engine calls of an `abort_resume` partial rollout. The real embedded engine generates every token
and every routing row; a recording proxy in front of it (where the router would be) ends the
first two calls after a few tokens as a version update's abort would (finish_reason abort, the
tokens so far), and loads the next version's weights before answering, so the sample is
interrupted by two version changes at known points instead of at moments a timer picks."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of
from streamrl.connectors.sglang.client import SGLangClient
from streamrl.connectors.sglang.router import Router
from streamrl.core import routing
from streamrl.core.types import SampleGroup
from streamrl.pools import LancePool
from streamrl.recipe import load_recipe
from streamrl.runtime.rollout import RolloutWorker

from enginekit import EngineProc, load_model
from moekit import hf_routes, moe_model_dirs
from streamkit import write_recipe

CUTS = (3, 2)  # tokens the first and second calls get before their "version update"


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return moe_model_dirs(tmp_path_factory.mktemp("moe-versions"), (0, 1, 2))


class _Interrupter:
    """Forwards /generate to the engine, recording each request and answer; call k < len(CUTS)
    gets CUTS[k] tokens and an abort, then the engine loads version k + 1."""

    def __init__(self, engine_url: str, versions: list[Path]) -> None:
        self.engine, self.versions = engine_url, versions
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        k = len(self.calls)
        sent = copy.deepcopy(body)
        if k < len(CUTS):
            sent["sampling_params"]["max_new_tokens"] = CUTS[k]
        async with SGLangClient(self.engine) as c:
            out = await c.json("POST", "/generate", sent)
            if k < len(CUTS):
                for o in out if isinstance(out, list) else [out]:
                    o["meta_info"]["finish_reason"] = {"type": "abort", "message": "weights updated"}
                await c.update_weights_from_disk(str(self.versions[k + 1]), weight_version=k + 1)
        self.calls.append((body, out))
        return web.json_response(out)


def _recipe(tmp_path: Path, model_dir: Path, name: str, routing: str) -> Any:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "abc def", "label": "1"}) + "\n")
    return load_recipe(write_recipe(tmp_path, model_dir, data, {
        "run.dir": str(tmp_path / name), "rollout.n_samples": 1, "rollout.max_new_tokens": 9,
        "rollout.temperature": 0.0, "rollout.routing": routing, "data.epochs": 1}, name=f"{name}.yaml"))


def _stored(recipe: Any) -> SampleGroup:
    with LancePool(recipe.pool_uri) as pool:
        (group,) = pool.groups(list(pool.producer_groups("rollout-0")))
    return group


def test_abort_resume_stores_routing_stitched_across_two_version_changes(moe_dirs, tmp_path):
    engine = EngineProc(moe_dirs[0], tmp_path / "engine.log").wait_ready()
    recipe = _recipe(tmp_path, moe_dirs[0], "run", "auto")
    layers, top_k = 2, 2
    proxy = _Interrupter(engine.url, moe_dirs)

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/generate", proxy.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = listen_socket()
        await web.SockSite(runner, sock).start()
        worker = RolloutWorker(recipe, f"http://127.0.0.1:{port_of(sock)}")
        try:
            await worker.generate(1)
        finally:
            await worker.close()
            await runner.cleanup()

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    assert len(proxy.calls) == 3
    group = _stored(recipe)
    s, P = group.samples[0], len(group.prompt_tokens)
    n = s.num_tokens
    assert [(sp.version, sp.start, sp.end) for sp in s.spans] == [(0, 0, 3), (1, 3, 5), (2, 5, n)]
    # segment 1 asks from 0; a resumed one from the last kept token's position
    starts = [body.get("routed_experts_start_len", 0) for body, _ in proxy.calls]  # 0 is the default, omitted
    assert all(body["return_routed_experts"] for body, _ in proxy.calls)
    assert starts == [0, P + 3 - 1, P + 5 - 1]
    rows = [routing.decode(out[0]["meta_info"]["routed_experts"], layers, top_k) for _, out in proxy.calls]
    assert [len(r) for r in rows] == [P + 3 - 1, 2, n - 5]
    assert s.routed_experts is not None and s.routed_experts.shape == (P + n - 1, layers, top_k)
    np.testing.assert_array_equal(s.routed_experts, np.concatenate(rows))
    # each segment's rows are what its version's weights route there (transformers on the same tokens),
    # and the versions route differently, so rows from the wrong segment would show
    seq = group.prompt_tokens.tolist() + s.response_tokens.tolist()
    models = [load_model(d) for d in moe_dirs]
    ends = [P + 3 - 1, P + 5 - 1, P + n - 1]
    for v, (start, end, got) in enumerate(zip(starts, ends, rows)):
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(hf_routes(models[v], seq[:end])[start:], -1))
    assert not np.array_equal(np.sort(s.routed_experts, -1), np.sort(hf_routes(models[0], seq[:-1]), -1))


def test_through_sglang_router_no_routing_comes_back(moe_dirs, tmp_path):
    """sglang-router 0.3.2 drops return_routed_experts from the /generate bodies it forwards: with
    rollout.routing auto the sample is stored without routing, with on it fails with the reason.
    (When a router forwards the field, this test fails: then runs get routing through it.)"""
    engine = EngineProc(moe_dirs[0], tmp_path / "engine.log").wait_ready()
    router = Router(policy="round_robin", log_dir=tmp_path).start()

    async def run() -> dict[str, dict[str, Any]]:
        await router.add_worker(engine.url)
        await router.client.close()
        for c in router.workers.values():
            await c.close()
        reports = {}
        for routing in ("auto", "on"):
            worker = RolloutWorker(_recipe(tmp_path, moe_dirs[0], routing, routing), router.url)
            try:
                reports[routing] = await worker.generate(1)
            finally:
                await worker.close()
        return reports

    try:
        reports = asyncio.run(run())
    finally:
        router.stop()
        engine.stop()
    auto, on = (_stored(_recipe(tmp_path, moe_dirs[0], r, r)) for r in ("auto", "on"))
    assert auto.status == "complete" and auto.samples[0].routed_experts is None and auto.samples[0].num_tokens == 9
    assert reports["auto"]["routing_missing"] == 1
    assert on.status == "failed" and "rollout.routing is on but the engine sent no routed experts" in on.drop_reason
