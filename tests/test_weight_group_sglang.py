"""The weight group against SGLang's own join code: `init_custom_process_group`, read from the
sglang 0.5.23 wheel (tests/enginekit.py downloads it once; sglang itself is not installed) and run
in a child process, joins the group connectors/sglang/weight_sync.py forms, and a bucket crosses
it as SGLang receives one (`torch.distributed.broadcast` of the flattened bytes, src 0). And the
other way round: slime's trainer forms its side with the same function, and StreamRL's engine
side (the embedded engine's `join_group`) joins it."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import json
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

from enginekit import CACHE_DIR, SGLANG_VERSION, sglang_api_types
from streamrl.connectors.ports import PortTaken, held_by, process_tree, says_address_in_use, start_on_free_port
from streamrl.connectors.sglang.weight_sync import (
    broadcast, create_group, dtype_name, join_group, open_store, plan_buckets, receive,
)

TIMEOUT_S = 20

SENT = {"pos": torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64),  # each offset aligned: one bucket
        "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
        "norm.weight": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def sglang_join_source() -> str:
    """`init_custom_process_group`'s source, as the sglang wheel ships it."""
    sglang_api_types()  # downloads the wheel once, or fails with pip's output
    wheel = sorted(CACHE_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        source = z.read("sglang/srt/utils/common.py").decode()
    fn = next(n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    return ast.get_source_segment(source, fn) or ""


def _run_sglang_side(source: str, body: str, port: int, rank: int, world_size: int, group_name: str) -> subprocess.Popen:
    """A child process that joins as `rank` with SGLang's function (its module's one global:
    `torch_release`), then runs `body` with the group as `pg`."""
    script = "\n".join([
        "import datetime, json, torch, torch.distributed",
        "torch_release = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])",
        source,
        # as SGLang's weight updater calls it (the address as a tcp:// URL; rank 0 serves the store)
        f"pg = init_custom_process_group(backend='gloo', **{{'init_method': 'tcp://127.0.0.1:{port}'}}, "
        f"world_size={world_size}, rank={rank}, group_name={group_name!r}, "
        f"timeout=datetime.timedelta(seconds={TIMEOUT_S}))",
        textwrap.dedent(body),
        # Out without torch's C++ teardown: a store or gloo thread destroyed while the other side still
        # holds the group aborts the interpreter at exit ("terminate called without an active exception",
        # seen once under CI load); what is tested has happened by now.
        "import os, sys; sys.stdout.flush(); os._exit(0)",
    ])
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=TIMEOUT_S * 3)
    assert proc.returncode == 0, f"SGLang's side failed ({proc.returncode}):\n{err[-3000:]}"
    return out


def test_sglang_joins_the_learners_group_and_receives_a_bucket(sglang_join_source):
    dtypes = [dtype_name(t.dtype) for t in SENT.values()]
    shapes = [list(t.shape) for t in SENT.values()]
    assert len(plan_buckets(dtypes, shapes)) == 1  # one flattened bucket, SGLang's load_format
    store = open_store(2)
    # SGLang's receiver (weight_updater._receive_bucketed_weights_from_distributed): an empty
    # buffer of the bucket's bytes, one broadcast from rank 0 into it.
    receiver = f"""
        total = {sum(t.numel() * t.element_size() for t in SENT.values())}
        flat = torch.empty(total, dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=pg)
        print(json.dumps(flat.tolist()))
    """
    proc = _run_sglang_side(sglang_join_source, receiver, store.port, 1, 2, "weight_update_group")
    try:
        group = create_group(store, 2, "weight_update_group", "gloo", TIMEOUT_S)
        broadcast(group, list(SENT.values()), bucketed=True)
        got = bytes(json.loads(_finish(proc)))
    finally:
        proc.kill()
    want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in SENT.values())
    assert got == want


def test_streamrl_engine_side_joins_a_group_formed_by_sglangs_code(sglang_join_source):
    """slime's trainer forms rank 0 with the same init_custom_process_group; the embedded
    engine's join_group (TP ranks 1 and 2 of one process here, as an engine with tp=2 joins) must
    meet it on the same keys."""
    sender = """
        for t in [torch.tensor([3, 1, 4, 1, 5]), torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
                  torch.tensor([1.5, -2.0], dtype=torch.bfloat16)]:
            torch.distributed.broadcast(t, src=0, group=pg)
    """

    def start(port: int) -> tuple[subprocess.Popen, int]:
        """SGLang's side as rank 0 takes only a number (as slime's trainer): started on a free
        port the connectors/ports.py way, listening before the engine side joins."""
        child = _run_sglang_side(sglang_join_source, sender, port, 0, 3, "wg")
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if child.poll() is not None:
                err = child.stderr.read() if child.stderr else ""
                if says_address_in_use(err):
                    raise PortTaken(err[-300:])
                pytest.fail(f"SGLang's side exited ({child.returncode}):\n{err[-3000:]}")
            if held_by(port, process_tree(child.pid)):
                return child, port
            time.sleep(0.05)
        child.kill()
        pytest.fail(f"SGLang's side did not listen on {port} within {TIMEOUT_S} s")

    child, port = start_on_free_port(start)
    dtypes, shapes = [dtype_name(t.dtype) for t in SENT.values()], [list(t.shape) for t in SENT.values()]
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            groups = list(ex.map(lambda r: join_group("127.0.0.1", port, r, 3, "wg", "gloo", TIMEOUT_S), (1, 2)))
            got = list(ex.map(lambda g: receive(g, list(SENT), dtypes, shapes), groups))
        _finish(child)
    finally:
        child.kill()
    for g in got:
        assert all(torch.equal(g[k].cpu(), v) for k, v in SENT.items())
