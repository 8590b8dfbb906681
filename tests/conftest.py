"""Shared fixtures. Keep this small; helpers live in tests/poolkit.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import poolkit` from any test


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def pool(run_dir: Path):
    """A fresh LanceDB experience pool in RUN_DIR/pool (closed after the test)."""
    from streamrl.pools import LancePool

    p = LancePool(run_dir / "pool")
    yield p
    p.close()


# ---------------------------------------------------------------- embedded engines (tests/enginekit.py)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny Qwen2 model directories built once per session: seed 0 (what the engines
    serve) and seed 1 (the weights pushed by update tests); see enginekit.make_model_dir."""
    from enginekit import make_model_dir

    root = tmp_path_factory.mktemp("models")
    return str(make_model_dir(root / "seed0", seed=0)), str(make_model_dir(root / "seed1", seed=1))


@pytest.fixture(scope="session")
def ref0(model_dirs: tuple[str, str]):
    """transformers' seed-0 model (what the engines serve), float32, eval mode."""
    from enginekit import load_model

    return load_model(model_dirs[0])


@pytest.fixture(scope="session")
def ref1(model_dirs: tuple[str, str]):
    """transformers' seed-1 model (the weights update tests push)."""
    from enginekit import load_model

    return load_model(model_dirs[1])


@pytest.fixture(scope="session")
def engines(model_dirs: tuple[str, str], tmp_path_factory: pytest.TempPathFactory):
    """Two embedded engines (subprocesses, default host) serving the seed-0 model, started once
    per session. Stopped with SIGTERM at the end; fails the session if one needs SIGKILL or
    leaves a process behind."""
    from enginekit import start_engines

    procs = start_engines(model_dirs[0], tmp_path_factory.mktemp("engine-logs"), 2)
    yield procs
    for p in procs:
        p.stop()
    problems = [f"engine {p.pid}: needed SIGKILL" for p in procs if p.killed]
    problems += [f"engine {p.pid}: pids still alive {p.leftovers()}" for p in procs if p.leftovers()]
    assert not problems, problems


@pytest.fixture
def engine(engines, model_dirs: tuple[str, str]):
    """The first session engine, reset first: running, nothing in flight, seed-0 weights, version "0"."""
    import asyncio

    from enginekit import reset_engine

    asyncio.run(reset_engine(engines[0].url, model_dirs[0]))
    return engines[0]


@pytest.fixture(scope="session")
def router_proc(engines):
    """The real sglang-router (round_robin, 127.0.0.1) with both session engines registered."""
    import asyncio

    from streamrl.connectors.sglang.router import Router

    from enginekit import descendants, pid_alive

    router = Router(policy="round_robin").start()

    async def register() -> None:
        try:
            for e in engines:
                await router.add_worker(e.url)
        finally:  # the clients' aiohttp sessions belong to this event loop: close them here
            await router.client.close()
            for c in router.workers.values():
                await c.close()

    try:
        asyncio.run(register())
    except BaseException:
        router.stop()
        raise
    pids = [router.proc.pid, *descendants(router.proc.pid)]
    yield router
    router.stop()
    assert not [p for p in pids if pid_alive(p)], f"sglang-router processes {pids} still alive after stop()"


# ---------------------------------------------------------------- object storage (benchmarks/_s3.py)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A local S3-compatible server (moto) with one bucket, started once per session. Its endpoint
    and credentials are in this process's environment while it runs (children inherit them), as a
    user sets them for a cluster; tests that want the recipe's route pass storage_options too."""
    from benchmarks._s3 import start_s3

    server = start_s3(tmp_path_factory.mktemp("s3") / "moto.log")
    env = {**server.env, "AWS_ENDPOINT": server.url, "AWS_ALLOW_HTTP": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


# The long files first, longest first (their summed test seconds in a --durations=0 run, 2026-12-02): xdist's
# --dist loadfile hands files out in collection order only with --no-loadscope-reorder (the Makefile passes it);
# by default it reorders them by their number of tests, which put the one-test SGLang resume file (~300 s) last.
SLOW_FIRST = ("test_stream_e2e.py",  # 615 s
              "test_resume_e2e.py",  # 575
              "test_benchmarks.py",  # 375
              "test_cluster_e2e.py",  # 366
              "test_resume_sglang_e2e.py",  # 316
              "test_engine_contract.py",  # 235
              "test_mcore_learner.py",  # 201
              "test_env_e2e.py",  # 196
              "test_mcore_checkpoint_layouts.py", "test_slime_e2e.py", "test_replay_e2e.py",  # ~160 each
              "test_parallel_e2e.py", "test_pool_processes.py", "test_shared_machine_e2e.py",  # ~145
              "test_packaging.py", "test_mcore_parallel.py", "test_pool_export_e2e.py")  # ~115-155


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: each file's order kept
