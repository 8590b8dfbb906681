"""Real SGLang on a machine without a GPU: where its venv is, and the flags and environment it needs.

SGLang 0.5.23 serves on a CPU (docs/engines.md, "Real SGLang on CPU") from a venv of its own that
`make sglang` builds (connectors/sglang/cpu/install.sh): torch 2.14.1, sglang and its kernel package,
and a stand-in for the NVIDIA driver library that the kernel package links (every function returns
an error; on a CPU without AMX SGLang calls none of the kernel package's ops). No Ray here: the engine
actor asks `cpu_launch` for what to add to SGLang's command and environment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

VENV_ENV = "STREAMRL_SGLANG_VENV"  # another venv built by connectors/sglang/cpu/install.sh VENV
# The venv `make sglang` builds beside the Makefile (found through this file in an editable install).
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-sglang"
STUB_DIR = "cpu-driver-stub"  # inside the venv: libcuda.so.1, the stand-in

# What SGLang on CPU needs unless the recipe's engines.extra_args says otherwise: the x86 default
# attention (intel_amx) needs the kernel package's CPU ops; without a token cap ~14 GB of RAM go to the KV
# cache; an idle scheduler spins a core at ~100% without --sleep-on-idle; the default dtype loads a
# float32 checkpoint as float16 (the learner on CPU is float32); the warm-up request adds ~2 min under load.
CPU_FLAGS: tuple[tuple[str, str | None], ...] = (
    ("--device", "cpu"), ("--attention-backend", "torch_native"), ("--max-total-tokens", "8192"),
    ("--dtype", "float32"), ("--sleep-on-idle", None), ("--skip-server-warmup", None))


class SGLangNotInstalled(RuntimeError):
    """No SGLang CPU venv where StreamRL looked; the message says how to build one."""


def venv_python(python: str | None = None) -> str:
    """The interpreter that runs SGLang on CPU: `python` (recipe engines.python) if given, else
    $STREAMRL_SGLANG_VENV/bin/python, else .venv-sglang/bin/python beside the Makefile."""
    if python:
        return python
    venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    exe = venv / "bin" / "python"
    if not exe.exists():
        raise SGLangNotInstalled(
            f"engines.backend 'sglang' on a machine without a GPU runs SGLang from its own venv, and there is none "
            f"at {venv}: build it with `make sglang` (connectors/sglang/cpu/install.sh, ~5 min, ~8 GB), point "
            f"{VENV_ENV} at one it built, or set engines.python")
    return str(exe)


def stub_dir(python: str) -> Path:
    """The driver stand-in's folder in the venv of `python` (VENV/bin/python; not resolved: a venv's
    python is a link to the base interpreter)."""
    return Path(python).parent.parent / STUB_DIR


def cpu_args(extra_args: Sequence[str]) -> list[str]:
    """`extra_args` with CPU_FLAGS appended, each only where the user did not give that flag."""
    given = {a.split("=", 1)[0] for a in extra_args if a.startswith("--")}
    out = list(extra_args)
    for flag, value in CPU_FLAGS:
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out


def cpu_env(python: str, threads: int = 1) -> dict[str, str]:
    """The engine's environment additions: the driver stand-in first on the library path, SGLang's CPU
    engine, no hub look-ups, and `threads` torch threads (a 2-core machine runs two engines beside the
    learner; torch's default of a thread per core oversubscribes it)."""
    stub = stub_dir(python)
    if not (stub / "libcuda.so.1").exists():
        raise SGLangNotInstalled(
            f"no driver stand-in at {stub / 'libcuda.so.1'}: SGLang's kernel package cannot load without one on a "
            f"machine without a GPU; build the venv with connectors/sglang/cpu/install.sh {stub.parent}")
    lib = os.environ.get("LD_LIBRARY_PATH")
    return {"LD_LIBRARY_PATH": f"{stub}:{lib}" if lib else str(stub), "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
