"""Helpers for the embedded-engine and router tests: test model directories, engine
subprocesses (started, health-checked, stopped, checked for orphans), listening-socket
inspection from /proc, raw HTTP calls, transformers reference computations, and SGLang's
JSON contract module loaded from its wheel; and real SGLang on this CPU, started as the engine actor starts it.

Long file: every engine process the tests start (embedded and real SGLang) and what they inspect of it.

    from enginekit import EngineProc, make_model_dir, post_json
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
import types
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- models

SHARPEN = 8.0


def make_model_dir(out: str | Path, seed: int, sharpen: float = SHARPEN) -> Path:
    """`init_model_dir(out, "tiny", seed)`, then every 2-D weight except the (tied) embedding
    scaled by `sharpen` and saved back.

    Why: a freshly initialised tiny model has tiny weights, so its hidden state is dominated by
    the last token's embedding and, with tied embeddings, greedy decoding just repeats the last
    prompt token forever (for every seed). Greedy-based checks (abort + resume, "the update
    changed the outputs") would then pass trivially. Scaled weights give varied greedy
    sequences that differ between seeds."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.connectors.megatron.model_kit import init_model_dir

    out = init_model_dir(out, "tiny", seed=seed)
    if sharpen != 1.0:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed_tokens" not in name:
                    p.mul_(sharpen)
        model.save_pretrained(out)
    return out


def prompt(i: int, n: int = 8) -> list[int]:
    """Deterministic, distinct prompts of ordinary (non-special) tokens."""
    return [3 + (i * 37 + j * 11) % 500 for j in range(n)]


def load_model(model_dir: str | Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference_logprobs(model: Any, prompt: Sequence[int], output: Sequence[int],
                       temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / temperature) of each output token, from one full forward pass
    over prompt + output (raw logits when temperature is 0)."""
    import torch

    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(output)]
    if temperature > 0:
        rows = rows / temperature
    logp = torch.log_softmax(rows, -1)
    return logp[torch.arange(len(output)), torch.tensor(list(output))].tolist()


def hf_greedy(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    """n greedy (argmax) tokens from transformers with a KV cache, never stopping at EOS and
    never suppressing it either (SGLang's ignore_eos; `generate(min_new_tokens=...)` would
    mask EOS out of the argmax)."""
    import torch

    out_ids: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            if len(out_ids) == n:
                break
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


# ---------------------------------------------------------------- processes


def pid_alive(pid: int) -> bool:
    """True while /proc/<pid> exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (from /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def wait_port(host: str, port: int, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.1)


class EngineProc:
    """One embedded engine in a subprocess: `serve(model_dir, port=P)` with the default host."""

    def __init__(self, model_dir: str | Path, log_path: str | Path, env: dict[str, str] | None = None,
                 **serve_kwargs: object) -> None:
        """`env`: added to the engine's environment (e.g. its keys, connectors/auth.py);
        `serve_kwargs`: more arguments of connectors/sglang/engine_server.serve (e.g. weights_root)."""
        from streamrl.connectors.ports import listen_socket, port_of

        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # One intra-op thread per engine: with torch's default (a thread per core) two engines on a
        # 2-core machine that is also busy with other work decoded 6 x 200 tokens in ~65 s instead
        # of ~0.4 s (thread oversubscription); on an idle machine both take ~0.3 s.
        with listen_socket() as sock:  # the engine inherits it: the port is never free to be taken
            self.port = port_of(sock)
            code = (f"from streamrl.connectors.sglang.engine_server import serve; "
                    f"serve({self.model_dir!r}, port={self.port}, sock_fd={sock.fileno()}, **{serve_kwargs!r})")
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=self._log,
                                         stderr=subprocess.STDOUT, pass_fds=(sock.fileno(),),
                                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                                              **(env or {})})
        self.pid = self.proc.pid
        self.returncode: int | None = None
        self.killed = False
        self.known_descendants: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120) -> EngineProc:
        wait_port("127.0.0.1", self.port, self.proc, timeout_s)
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"engine {self.url} not healthy; log:\n{self.log_tail()}") from None
                time.sleep(0.1)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 20) -> int | None:
        """SIGTERM and wait; SIGKILL (and `killed = True`) if it does not exit within grace_s."""
        if self.proc.poll() is None:
            self.known_descendants.update(descendants(self.pid))
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        self._log.close()
        return self.returncode

    def leftovers(self) -> list[int]:
        """Pids of this engine (or anything it started) still alive."""
        return [p for p in [self.pid, *self.known_descendants] if pid_alive(p)]


class SGLangProc(EngineProc):
    """Real SGLang 0.5.23 on this CPU in a subprocess, started exactly as the engine actor starts it
    (engine_process.engine_command with connectors/sglang/cpu_sglang.py's flags and environment), from
    the venv `make sglang` builds. `keys`: required by the server (its `--config` file, as the actor
    writes it); `extra_args`: more SGLang flags (e.g. --enable-lora)."""

    def __init__(self, model_dir: str | Path, log_path: str | Path, keys: Any = None,
                 extra_args: Sequence[str] = ()) -> None:  # noqa: D107 - EngineProc's attributes, SGLang's process
        import json

        from streamrl.connectors.auth import write_private
        from streamrl.connectors.ports import start_on_free_port
        from streamrl.connectors.sglang import cpu_sglang
        from streamrl.connectors.sglang.engine_actor import copy_redacted, sglang_key_config
        from streamrl.connectors.sglang.engine_process import engine_command

        self.model_dir, self.log_path, self.keys = str(model_dir), Path(log_path), keys
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        extra = list(extra_args)
        if keys is not None:
            conf = self.log_path.with_suffix(".keys.yaml")
            write_private(conf, json.dumps(sglang_key_config(keys)))
            extra += ["--config", str(conf)]
        python = cpu_sglang.venv_python()
        # SGLang binds its port itself: a free one now, as the engine actor picks it (which retries a taken one)
        self.port = start_on_free_port(lambda port: port)
        cmd = engine_command("sglang", self.model_dir, self.port, extra_args=cpu_sglang.cpu_args(extra), python=python)
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **cpu_sglang.cpu_env(python)})
        # the engine actor's log pipe: SGLang prints its server arguments, the keys among them
        secrets = [k.encode() for k in (keys.api, keys.admin) if k] if keys is not None else []
        threading.Thread(target=copy_redacted, args=(self.proc.stdout, self.log_path, secrets), daemon=True).start()
        self.pid = self.proc.pid
        self.returncode = None
        self.killed = False
        self.known_descendants = set()

    def wait_ready(self, timeout_s: float = 600) -> SGLangProc:
        super().wait_ready(timeout_s)  # 30-60 s of imports on an idle 2-core machine, minutes under load
        return self

    def stop(self, grace_s: float = 20) -> int | None:
        self.known_descendants.update(descendants(self.pid))
        code = super().stop(grace_s)
        for pid in self.leftovers():  # SGLang's scheduler and detokenizer, in the engine's process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return code


def start_engines(model_dir: str | Path, log_dir: Path, count: int) -> list[EngineProc]:
    """Start `count` engines at once (their imports overlap) and wait until all are healthy."""
    procs = [EngineProc(model_dir, log_dir / f"engine{i}.log") for i in range(count)]
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.stop(5)
        raise
    for p in procs:
        p.known_descendants.update(descendants(p.pid))
    return procs


# ---------------------------------------------------------------- sockets


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _hex_to_ip(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # IPv6 in /proc is four little-endian 32-bit words
    words = b"".join(raw[i: i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pids: Iterable[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids`."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addr, port = f[1].split(":")
                found.append((_hex_to_ip(addr), int(port, 16)))
    return found


def non_loopback_address() -> str | None:
    """This machine's outward IPv4 address, if it has one (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


# ---------------------------------------------------------------- raw HTTP


async def call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
               data: bytes | None = None, timeout_s: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; `body` is sent as JSON, `data` raw."""
    kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
    if data is not None:
        kw["data"] = data
        kw["headers"] = {"Content-Type": "application/json"}
    elif body is not None:
        kw["json"] = body
    async with session.request(method, url, **kw) as r:
        raw = await r.read()
        try:
            import json

            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw.decode(errors="replace")


async def post_json(session: aiohttp.ClientSession, url: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    return await call(session, "POST", url, body, **kw)


async def get_json(session: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    return await call(session, "GET", url, **kw)


async def reset_engine(url: str, model_dir: str) -> None:
    """Back to the initial state: running, nothing in flight, initial weights, version "0"."""
    async with aiohttp.ClientSession() as s:
        for path, body in (("/continue_generation", {}), ("/abort_request", {"abort_all": True}),
                           ("/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"})):
            status, out = await post_json(s, url + path, body)
            assert status == 200, (path, status, out)
        await post_json(s, url + "/end_weight_update", {})  # a weight-update session a failed test left open (else 400)


# ---------------------------------------------------------------- SGLang's JSON contract

SGLANG_VERSION = "0.5.23"
CACHE_DIR = Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))
CONTRACT_MEMBER = "sglang/api/v1/api_types.py"


def sglang_api_types() -> types.ModuleType:
    """SGLang's generated JSON contract (`sglang.api.v1.api_types`), loaded by path from the
    sglang wheel (downloaded once with `pip download --no-deps` into ~/.cache/streamrl;
    sglang itself is not installed). Raises with a clear message when it cannot be had."""
    wheels = sorted(CACHE_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # The same Linux/CPython 3.11 wheel whatever the host: only one pure-Python file is read.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
               "--implementation", "cp", f"sglang=={SGLANG_VERSION}", "-d", str(CACHE_DIR)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download the sglang {SGLANG_VERSION} wheel for the contract test "
                               f"({' '.join(cmd)} -> {r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    target = CACHE_DIR / f"sglang-{SGLANG_VERSION}-api_types.py"
    if not target.exists():
        with zipfile.ZipFile(wheels[-1]) as z:
            if CONTRACT_MEMBER not in z.namelist():
                raise RuntimeError(f"{wheels[-1].name} has no {CONTRACT_MEMBER}")
            target.write_bytes(z.read(CONTRACT_MEMBER))
    spec = importlib.util.spec_from_file_location("sglang_api_v1_api_types", target)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the Structs' string annotations through it
    spec.loader.exec_module(mod)
    return mod


def check_generate_response(sgl: types.ModuleType, raw: dict[str, Any], finish_cls: type) -> None:
    """`raw` (one /generate result) decodes with SGLang's GenerateResponse, its finish reason is a
    `finish_cls`, and its ids, spans and log-prob entries agree with each other."""
    r = sgl.GenerateResponse.from_json_value(raw)
    m = r.meta_info
    assert m is not None and m.id == raw["meta_info"]["id"]
    # the decoder falls back to a plain dict when a finish reason breaks its arm's contract
    assert isinstance(m.finish_reason, finish_cls), m.finish_reason
    assert isinstance(m.weight_version, str)
    assert r.output_ids == raw["output_ids"] and m.completion_tokens == len(r.output_ids)
    assert sum(s.end - s.start for s in m.weight_versions) == len(r.output_ids)
    if m.output_token_logprobs is not None:
        assert [e.token_id for e in m.output_token_logprobs] == r.output_ids
        assert all(isinstance(e.logprob, float) for e in m.output_token_logprobs)
    if m.input_token_logprobs:  # SGLang: None for the first requested prompt token only
        assert m.input_token_logprobs[0].logprob is None and len(m.input_token_logprobs) <= m.prompt_tokens
        assert all(isinstance(e.logprob, float) for e in m.input_token_logprobs[1:])
