"""Engine launcher end to end: a real Ray local cluster, a real sglang-router (round_robin) and two
embedded engines of the tiny model started as Ray actors; one engine is SIGKILLed and must be
detected, restarted, re-registered and served again; nothing may be left running afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

PROMPT = [5, 17, 42, 99, 7]
SAMPLING = {"max_new_tokens": 4, "temperature": 0.0}


# ------------------------------------------------------------ processes, from /proc (no psutil here)

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a process, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] != "Z":
                children.setdefault(st[0], []).append((int(entry), st[2]))
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in out:
                out[pid] = start
                todo.append(pid)
    return out


def _running(pid: int, start: int | None = None) -> bool:
    st = _stat(pid)
    return st is not None and st[1] != "Z" and (start is None or st[2] == start)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def _wait_gone(procs: dict[int, int], timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = {p: s for p, s in procs.items() if _running(p, s)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamrl.connectors.megatron.model_kit import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny")


@pytest.fixture
def stack(tmp_path: Path):
    """Everything the test starts, torn down hard even when the test fails: actors killed (their
    engines follow), router stopped, Ray shut down, and any process the test's process tree
    gained still running after that is SIGKILLed."""
    import ray

    from streamrl.connectors.sglang.launcher import ensure_ray

    before = set(_descendants(os.getpid()))
    seen: dict[int, int] = {}
    state: dict = {"seen": seen, "before": before, "log_dir": tmp_path / "logs"}
    ensure_ray(num_cpus=4)
    try:
        yield state
    finally:
        if state.get("launcher") is not None:
            state["launcher"].kill()
        if state.get("router") is not None:
            state["router"].stop()
        seen.update({p: s for p, s in _descendants(os.getpid()).items() if p not in before})
        ray.shutdown()
        for pid in _wait_gone(seen, 10):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------ tests

def test_engine_commands() -> None:
    import json
    import sys

    from streamrl.connectors.sglang.engine_process import engine_command

    emb = engine_command("embedded", "/m", 1234, weight_version="3", engine_kwargs={"max_running": 8},
                         parent_pid=42)
    assert emb[:3] == [sys.executable, "-u", "-c"] and emb[4:6] == ["42", "embedded"]
    assert json.loads(emb[6]) == {"model_dir": "/m", "host": "127.0.0.1", "port": 1234, "weight_version": "3",
                                  "max_running": 8}
    emb_tp = engine_command("embedded", "/m", 1234, host="10.0.0.5", tp=2)  # engines.host, engines.tp
    assert {k: json.loads(emb_tp[6])[k] for k in ("host", "tp")} == {"host": "10.0.0.5", "tp": 2}
    sgl = engine_command("sglang", "/m", 1234, weight_version=7, tp=2, extra_args=["--mem-fraction-static", 0.7],
                         parent_pid=42)
    assert sgl[4:] == ["42", "sglang", "--model-path", "/m", "--host", "127.0.0.1", "--port", "1234",
                       "--weight-version", "7", "--tp-size", "2", "--mem-fraction-static", "0.7"]
    with pytest.raises(ValueError, match="extra_args"):
        engine_command("embedded", "/m", 1, extra_args=["--x"])
    with pytest.raises(ValueError, match="engine_kwargs"):
        engine_command("sglang", "/m", 1, engine_kwargs={"seed": 1})
    # engines.python: SGLang started by another interpreter (its own environment); the embedded engine cannot be
    own = engine_command("sglang", "/m", 1234, parent_pid=42, python="/envs/sglang/bin/python")
    assert own[0] == "/envs/sglang/bin/python" and own[1:4] == sgl[1:4]  # the same shim
    assert own[4:] == ["42", "sglang", "--model-path", "/m", "--host", "127.0.0.1", "--port", "1234",
                       "--weight-version", "0", "--tp-size", "1"]
    with pytest.raises(ValueError, match="python is for backend='sglang'"):
        engine_command("embedded", "/m", 1, python="/envs/sglang/bin/python")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launcher_restarts_dead_engine_behind_router(tiny_model: Path, stack: dict) -> None:
    import ray

    from streamrl.connectors.sglang.launcher import EngineLauncher
    from streamrl.connectors.sglang.router import Router
    from streamrl.connectors.sglang.client import SGLangClient

    t0 = time.monotonic()
    timings: dict[str, float] = {}
    seen: dict[int, int] = stack["seen"]
    log_dir: Path = stack["log_dir"]
    me = os.getpid()
    before: set[int] = stack["before"]  # processes from before Ray started

    def snapshot() -> None:
        seen.update({p: s for p, s in _descendants(me).items() if p not in before})

    hook_calls: list[str] = []
    hook_failures = [0]  # how many next calls must fail

    async def on_restart(index: int, url: str) -> None:
        # Runs before the engine is back in the router: give it the "current" version.
        hook_calls.append(url)
        if hook_failures[0]:
            hook_failures[0] -= 1
            raise RuntimeError("weight push failed")
        async with SGLangClient(url) as c:
            await c.update_weight_version("12")

    async def versions_via_router(router: Router, n: int) -> list[str]:
        out = []
        for _ in range(n):
            r = await router.client.generate(PROMPT, SAMPLING)
            assert r.finish_type == "length" and len(r.output_ids) == 4
            out.append(r.meta_info.weight_version)
        return out

    async def scenario() -> None:
        router = stack["router"] = Router(policy="round_robin", log_dir=log_dir).start()

        # An engine that cannot start: start() fails with its log, leaves no actor or worker.
        s = time.monotonic()
        bad = EngineLauncher(tiny_model.parent / "missing", 1, router, log_dir=log_dir / "bad")
        with pytest.raises(RuntimeError, match="exited with") as err:
            await bad.start()
        assert "missing" in str(err.value)  # the log's tail names the model directory
        assert bad.actors == [] and await router.list_workers() == []
        timings["failed_start_s"] = time.monotonic() - s
        snapshot()

        launcher = stack["launcher"] = EngineLauncher(tiny_model, 2, router, log_dir=log_dir,
                                                      on_restart=on_restart, startup_timeout_s=120)
        s = time.monotonic()
        urls = await launcher.start()
        timings["start_engines_s"] = time.monotonic() - s
        snapshot()
        assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        assert {w["url"] for w in await router.list_workers()} == set(urls)
        pids = await launcher.pids()
        assert all(p and _running(p) for p in pids)
        started = {p: _stat(p)[2] for p in pids}
        infos = await launcher.info()
        assert [i["backend"] for i in infos] == ["embedded", "embedded"]
        assert all(Path(i["log"]).exists() for i in infos)

        # A different weight version per engine, set on each worker directly (the router does
        # not forward it): round_robin must reach both.
        for url, v in zip(urls, ("10", "11")):
            await router.workers[url].update_weight_version(v)
        assert sorted(set(await versions_via_router(router, 6))) == ["10", "11"]

        # Kill engine 0's process outright.
        victim_pid, victim_url = pids[0], urls[0]
        os.kill(victim_pid, signal.SIGKILL)
        killed_at, s = time.time(), time.monotonic()
        # The router retries on the live worker while the dead one is still registered.
        assert set(await versions_via_router(router, 4)) == {"11"}
        while launcher.restarts < 1:
            assert time.monotonic() - s < 90, f"no restart; failures: {launcher.failures}"
            await asyncio.sleep(0.2)
        timings["detect_restart_register_s"] = time.monotonic() - s
        snapshot()
        assert launcher.restarts == 1 and not launcher.failures
        new_url = launcher.urls[0]
        assert new_url != victim_url and launcher.urls[1] == urls[1]
        assert hook_calls == [new_url]
        ev = launcher.events[0]
        timings["detect_s"] = ev.detected_at - killed_at
        assert ev.detected_at - killed_at < 5  # polled every second
        assert (ev.index, ev.old_url, ev.new_url, ev.reason) == (0, victim_url, new_url, "process exited")
        new_pids = await launcher.pids()
        assert new_pids[0] != victim_pid and _running(new_pids[0]) and new_pids[1] == pids[1]
        assert not _running(victim_pid)
        assert {w["url"] for w in await router.list_workers()} == {new_url, urls[1]}
        # Served again through the router, by both engines (the restarted one at version 12).
        assert sorted(set(await versions_via_router(router, 6))) == ["11", "12"]
        assert "start #2" in (log_dir / "engine-0.log").read_text()

        # Kill engine 1's *actor* process: its engine must not outlive it (watchdog), and the
        # launcher replaces the actor and its engine.
        old_actor_pid = (await launcher.info())[1]["actor_pid"]
        os.kill(old_actor_pid, signal.SIGKILL)
        s = time.monotonic()
        while launcher.restarts < 2:
            assert time.monotonic() - s < 90, f"no restart; failures: {launcher.failures}"
            await asyncio.sleep(0.2)
        timings["actor_death_recovery_s"] = time.monotonic() - s
        snapshot()
        assert launcher.events[1].index == 1 and launcher.events[1].reason == "actor died"
        assert not _wait_gone({pids[1]: started[pids[1]]}, 5), "engine 1 outlived its actor"
        info1 = (await launcher.info())[1]
        assert info1["actor_pid"] != old_actor_pid and info1["alive"] and info1["url"] == launcher.urls[1]
        assert hook_calls == [new_url, launcher.urls[1]]
        assert {w["url"] for w in await router.list_workers()} == set(launcher.urls)
        assert set(await versions_via_router(router, 4)) == {"12"}

        # A failed recovery (here: the on_restart hook raises) is recorded and retried: the
        # half-recovered engine is stopped, never registered, and started afresh.
        hook_failures[0] = 1
        victim2 = (await launcher.pids())[0]
        os.kill(victim2, signal.SIGKILL)
        s = time.monotonic()
        while launcher.restarts < 3:
            assert time.monotonic() - s < 90, f"no restart; failures: {launcher.failures}"
            await asyncio.sleep(0.2)
        timings["failed_then_retried_recovery_s"] = time.monotonic() - s
        snapshot()
        assert len(launcher.failures) == 1 and "weight push failed" in launcher.failures[0][1]
        assert len(hook_calls) == 4 and hook_calls[2] != hook_calls[3] == launcher.urls[0]
        assert {w["url"] for w in await router.list_workers()} == set(launcher.urls)
        assert set(await versions_via_router(router, 4)) == {"12"}
        new_pids = await launcher.pids()

        # Stop everything; remember every pid first.
        engine_pids = {p: _stat(p)[2] for p in [*pids, *new_pids] if _running(p)}
        router_pid = router.proc.pid
        stack["engine_pids"], stack["router_pid"] = engine_pids, router_pid
        s = time.monotonic()
        await launcher.stop()
        assert launcher.actors == [] and launcher.urls == []
        assert await router.list_workers() == []
        await router.close()
        timings["stop_s"] = time.monotonic() - s
        # The launcher itself stops its engines (not only ray.shutdown, later).
        left = _wait_gone(engine_pids, 10)
        assert not left, f"engines still running after launcher.stop(): {[(p, _cmdline(p)) for p in left]}"

    try:
        asyncio.run(scenario())
    finally:
        snapshot()
    s = time.monotonic()
    ray.shutdown()
    timings["ray_shutdown_s"] = time.monotonic() - s
    left = _wait_gone(stack["engine_pids"], 10)
    assert not left, f"engine processes still running: {[(p, _cmdline(p)) for p in left]}"
    assert not _running(stack["router_pid"]), "sglang-router still running"
    left = _wait_gone(seen, 15)
    assert not left, f"processes still running after stop: {[(p, _cmdline(p)) for p in left]}"
    timings["total_s"] = time.monotonic() - t0
    print("launcher timings:", {k: round(v, 2) for k, v in timings.items()})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_router_that_dies_comes_back_at_its_address_with_its_engines(tiny_model: Path, stack: dict) -> None:
    """Chaos trial 3 of seed 1 (benchmarks/chaos.py): the router SIGKILLed mid-run left every rollout worker
    calling a closed port until the run timed out. The launcher's watcher starts it again at the same URL
    (the workers and producers keep theirs) and registers the engines it had."""
    from streamrl.connectors.sglang.launcher import EngineLauncher
    from streamrl.connectors.sglang.router import Router

    async def scenario() -> None:
        router = stack["router"] = Router(policy="round_robin", log_dir=stack["log_dir"]).start()
        launcher = stack["launcher"] = EngineLauncher(tiny_model, 1, router, log_dir=stack["log_dir"],
                                                      poll_interval_s=0.2, startup_timeout_s=120)
        [url] = await launcher.start()
        before, old, direct = router.url, router.proc.pid, router.workers
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while launcher.router_restarts == 0:
            assert time.monotonic() < deadline, "the router was not started again within 60 s"
            await asyncio.sleep(0.2)
        assert router.url == before and router.proc.pid != old and router.exited() is None
        assert [w["url"] for w in await router.list_workers()] == [url]
        # Chaos trial 4 of seed 2: the direct clients (weight pushes, pauses) were replaced while the router came
        # back, and a push in that window reached no engine; they are the ones it had, throughout.
        assert router.workers == direct and router.workers[url] is direct[url]
        r = await router.client.generate(PROMPT, SAMPLING)  # through the router again, at the old URL
        assert len(r.output_ids) == 4
        await launcher.stop()
        await router.close()

    asyncio.run(scenario())
