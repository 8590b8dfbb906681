"""Ports without a pick-then-bind race: the one way this project gets a port for anything it serves.

Picking a free port (bind to 0, read it, close) and binding it later leaves a window in which
another process takes it ("Address already in use", or worse, a health check that reaches
somebody else's server). Two ways close it:

- `listen_socket(host)`: a socket bound to port 0 and listening. The server is handed the socket
  itself, never the number: aiohttp (`web.SockSite`, `web.run_app(sock=...)`), torch.distributed's
  `TCPStore(master_listen_fd=...)` (`tcp_store`), or a child process that inherits its fd (the
  embedded engine). The kernel chose the port and it was never free again.
- `start_on_free_port(start)`: for servers that only take a number on their command line
  (sglang-router, SGLang). `start(port)` launches it and waits until it listens; it raises
  `PortTaken` when the process reports the address in use, or when the port answers but is held
  by a process outside the one just started (`held_by`). Then a fresh port is tried.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
ADDRESS_IN_USE_TEXT = ("address already in use", "addrinuse", "errno 98", "os error 98")


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it could resolve anywhere
        return False


def is_wildcard(host: str) -> bool:
    """True for 0.0.0.0, :: and the empty host: every interface, so every network the machine is on."""
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class PortTaken(OSError):
    """The port a server was started on turned out to be taken; start it again on another."""


def listen_socket(host: str = LOOPBACK, port: int = 0, backlog: int = 4096) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; `port_of` it is its port. Port 0 (the
    default) lets the kernel choose a free one; a port the user configured is bound as asked
    (OSError when it is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: a restart can rebind at once
        s.bind((host, port))
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def says_address_in_use(text: str) -> bool:
    low = text.lower()
    return any(t in low for t in ADDRESS_IN_USE_TEXT)


NODE = "node"  # a bind address resolved where the server runs: its Ray node's cluster address (recipe network.bind)


def bind_host(host: str) -> str:
    """`host`, or for NODE this process's node address as Ray sees it (the address other nodes reach)."""
    if host != NODE:
        return host
    import ray.util

    return str(ray.util.get_node_ip_address())


def start_on_free_port(start: Callable[[int], T], host: str = LOOPBACK, attempts: int = 8) -> T:
    """Call `start(port)` with a fresh free port until it does not raise `PortTaken`."""
    last: PortTaken | None = None
    for _ in range(attempts):
        with listen_socket(host) as probe:
            port = port_of(probe)
        try:
            return start(port)
        except PortTaken as e:
            last = e
    raise PortTaken(f"no free port on {host} after {attempts} attempts (last: {last})")


# ---------------------------------------------------------------- who holds a port (Linux /proc)


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address) in this network namespace."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except OSError:
            continue
    return inodes


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def process_tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += _children(p)
    return seen


def held_by(port: int, pids: Iterable[int]) -> bool | None:
    """Whether one of `pids` holds the listening socket on `port`: True, False (somebody else
    listens there), or None (cannot tell: no /proc, or nobody listens)."""
    inodes = _listening_inodes(port)
    if not inodes or not os.path.isdir("/proc/self/fd"):
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
            except OSError:
                continue
    return False


# ---------------------------------------------------------------- torch.distributed stores


def tcp_store(world_size: int, rank: int = 0, host: str = LOOPBACK, port: int = 0,
              timeout_s: float = 300, listen_fd: int | None = None, serve: bool | None = None) -> Any:
    """A torch.distributed TCPStore. Rank 0 serves it on a socket bound to `host` (so it listens
    on that address only, not on every interface as TCPStore's own bind does): `listen_fd`, a
    listening socket it was handed (bound to `port`), or a new one on port 0. The others
    connect to `host:port`, the port rank 0 reports as `store.port`. `serve=False`: rank 0
    connects too (a store its starter serves)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not (rank == 0 if serve is None else serve):
        return dist.TCPStore(host, port, world_size, False, timeout)
    if listen_fd is None:
        sock = listen_socket(host)
        port, listen_fd = port_of(sock), sock.detach()
    # The store owns the fd from here on (it closes it when the store goes away).
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=listen_fd)
