"""connectors/ports.py: ports are taken without a pick-then-bind race, every server goes through
it, and a server that only takes a port number is started again when its port was taken."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.connectors.ports import (
    PortTaken,
    held_by,
    listen_socket,
    port_of,
    process_tree,
    says_address_in_use,
    start_on_free_port,
    tcp_store,
)

REPO = Path(__file__).resolve().parents[1]


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            addr, hexport = parts[1].rsplit(":", 1)
            if parts[3] == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


def test_listen_socket_is_bound_and_listening_on_loopback():
    with listen_socket() as s:
        port = port_of(s)
        assert port > 0 and s.getsockname()[0] == "127.0.0.1"
        assert _listeners(port) == ["0100007F"]  # 127.0.0.1, and nothing else
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the kernel queues the connection before anyone accepts: no window
        with pytest.raises(OSError):  # the number is never free for another process to bind
            listen_socket(port=port)


def test_start_on_free_port_retries_a_taken_port_with_another():
    tried: list[int] = []

    def start(port: int) -> int:
        tried.append(port)
        if len(tried) < 3:
            raise PortTaken(f"{port} taken")
        return port

    assert start_on_free_port(start) == tried[-1]
    assert len(tried) == 3
    with pytest.raises(PortTaken, match="after 2 attempts"):
        start_on_free_port(lambda port: (_ for _ in ()).throw(PortTaken("always")), attempts=2)
    with pytest.raises(ValueError):  # any other failure is not retried
        start_on_free_port(lambda port: (_ for _ in ()).throw(ValueError("bad")))


def test_held_by_tells_whose_socket_listens():
    with listen_socket() as s:
        port = port_of(s)
        assert held_by(port, [os.getpid()]) is True
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert held_by(port, process_tree(sleeper.pid)) is False
        finally:
            sleeper.kill()
            sleeper.wait()
    assert held_by(port, [os.getpid()]) is None  # nobody listens any more


def test_process_tree_includes_grandchildren():
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert process_tree(child.pid)[:1] == [child.pid] and grandchild in process_tree(child.pid)
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait()


@pytest.mark.parametrize("text,taken", [
    ("OSError: [Errno 98] Address already in use", True),
    ("Error: Os { code: 98, kind: AddrInUse, message: \"Address in use\" }", True),
    ("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000)", True),
    ("RuntimeError: CUDA out of memory", False),
])
def test_address_in_use_is_recognised(text: str, taken: bool):
    assert says_address_in_use(text) is taken


def test_tcp_store_listens_on_loopback_only_and_serves_other_ranks():
    master = tcp_store(2, timeout_s=20)
    assert _listeners(master.port) == ["0100007F"]  # TCPStore's own bind would be every interface
    other = tcp_store(2, rank=1, port=master.port, timeout_s=20)
    other.set("k", "v")
    assert master.get("k") == b"v"


def test_router_on_a_taken_port_is_refused_as_taken(tmp_path: Path):
    """The real sglang-router, started on a port somebody else holds: PortTaken (it exits with
    'address in use', or the port answers from outside its process tree), never a router that
    seems up at somebody else's server."""
    from streamrl.connectors.sglang.router import Router

    with listen_socket() as busy:
        router = Router(port=port_of(busy), log_dir=tmp_path)
        with pytest.raises(PortTaken):
            router.start(timeout_s=30)
        assert router.proc is None or router.proc.poll() is not None
    router = Router(log_dir=tmp_path).start()  # no port given: a free one, through start_on_free_port
    try:
        assert held_by(router.port, process_tree(router.proc.pid)) is True
    finally:
        router.stop()


def test_nothing_binds_a_port_outside_connectors_ports():
    """One way to get a port: no other module binds sockets, builds TCPStores or hands out
    numbers to bind later (the race this module removes)."""
    pattern = re.compile(r"TCPSite\(|\.bind\(\(|TCPStore\(|init_method=|(?<!_on_)free_port\(|run_app\([^)]*port=")
    offenders = []
    for top in ("streamrl", "connectors", "pools", "benchmarks", "recipes", "tests"):
        for f in (REPO / top).rglob("*.py"):
            if f.name in ("ports.py", "test_ports.py"):
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
