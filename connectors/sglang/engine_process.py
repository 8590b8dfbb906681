"""The engine process's command line (embedded engine or real SGLang) under a parent watchdog.

No Ray here: the engine actor (connectors/sglang/engine_actor.py) runs this command, and so do the
benchmarks that start engines as plain processes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# Runs inside the engine process before the engine itself: argv[1] is the actor's pid, argv[2]
# the backend, the rest its arguments. The watchdog makes the engine exit with its actor.
_SHIM = r"""# streamrl engine process (connectors/sglang/engine_process.py)
import os, sys, threading, time
_parent = int(sys.argv[1])
def _watchdog():
    while True:
        if os.getppid() != _parent:
            os._exit(70)
        time.sleep(0.25)
threading.Thread(target=_watchdog, name="parent-watchdog", daemon=True).start()
_backend, _args = sys.argv[2], sys.argv[3:]
if _backend == "embedded":
    import json
    from streamrl.connectors.sglang.engine_process import serve_embedded
    serve_embedded(**json.loads(_args[0]))
else:
    import runpy
    sys.argv = ["sglang.launch_server", *_args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def engine_command(backend: str, model_dir: str, port: int, *, host: str = "127.0.0.1", weight_version: str = "0",
                   tp: int = 1, extra_args: Sequence[str] = (), engine_kwargs: dict[str, Any] | None = None,
                   parent_pid: int | None = None, sock_fd: int | None = None, python: str | None = None) -> list[str]:
    """The engine process's command line. `backend` is "embedded" (`serve(**kwargs)`, which
    takes `engine_kwargs` such as max_running, seed, and `sock_fd`: a listening socket the
    process inherits, bound to `port` by the parent with streamrl.connectors.ports.listen_socket; pass it
    in Popen's pass_fds) or "sglang" (`sglang.launch_server` with `extra_args` appended, which
    binds `port` itself). Both run under the shim's parent watchdog (`parent_pid`: the pid the
    engine must not outlive, default this process). `python` (recipe engines.python, "sglang" only):
    the interpreter that runs it, default this one; the shim imports nothing of StreamRL for SGLang,
    so an environment holding only sglang will do."""
    if python and backend != "sglang":
        raise ValueError(f"python is for backend='sglang'; the embedded engine runs in this interpreter (got {python!r})")
    head = [python or sys.executable, "-u", "-c", _SHIM, str(parent_pid or os.getpid()), backend]
    if backend == "embedded":
        if extra_args:
            raise ValueError(f"extra_args are for backend='sglang'; the embedded engine takes "
                             f"engine_kwargs (got {list(extra_args)})")
        kw = {"model_dir": str(model_dir), "host": host, "port": int(port), "weight_version": str(weight_version),
              **({"tp": int(tp)} if tp != 1 else {}), **({"sock_fd": sock_fd} if sock_fd is not None else {}),
              **(engine_kwargs or {})}
        return [*head, json.dumps(kw)]
    if backend == "sglang":
        if engine_kwargs:
            raise ValueError(f"engine_kwargs are for backend='embedded'; pass SGLang options as extra_args "
                             f"(got {engine_kwargs})")
        return [*head, "--model-path", str(model_dir), "--host", host, "--port", str(port),
                "--weight-version", str(weight_version), "--tp-size", str(tp), *map(str, extra_args)]
    raise ValueError(f"no engine command for backend {backend!r}")


def serve_embedded(**kwargs: Any) -> None:
    """Serve the embedded engine in this process until interrupted (engine_server.serve's
    arguments): the engine process above runs this, and so does `streamrl engine serve`."""
    # The one edge to the embedded engine, which loads torch and transformers (~2 s): importing
    # this module (the launcher, the CLI for every command) does not.
    from streamrl.connectors.sglang.engine_server import serve

    serve(**kwargs)
