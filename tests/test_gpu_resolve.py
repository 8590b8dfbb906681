"""The GPU install is one environment (docs/gpu.md): StreamRL, sglang 0.5.23 and torch 2.14.1 for the learner
and the engines alike, since they share an NCCL weight group and NCCL is not promised to work across the
builds that torch 2.13 and 2.14.1 ship. The fast tests keep the pins in step (pyproject's range admits the
CPU and the GPU torch, each constraints file pins its own); the slow one asks pip, against the package
registry, whether `pip install -c constraints-gpu.txt '.[gpu]'` resolves for Linux x86_64 / CPython 3.11,
without installing or (with pip's fast-deps, HTTP range requests) downloading the wheels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
GPU_CONSTRAINTS = REPO / "constraints-gpu.txt"
CPU_CONSTRAINTS = REPO / "constraints.txt"
# The oldest glibc a GPU machine is assumed to have: 2.35 (Ubuntu 22.04). sglang 0.5.23's wheel needs 2.34.
GLIBC_MAX = 35


def pins(path: Path) -> dict[str, str]:
    """name -> version of each `name==version` line."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            req = Requirement(line.split("#")[0].strip())
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not a pin"
            out[req.name.lower()] = spec.version
    return out


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirement(name: str, reqs: list[str]) -> Requirement:
    (req,) = [r for r in map(Requirement, reqs) if r.name.lower() == name]
    return req


def test_torch_range_admits_the_cpu_and_the_gpu_pin() -> None:
    deps = project()["dependencies"]
    cpu, gpu = pins(CPU_CONSTRAINTS), pins(GPU_CONSTRAINTS)
    assert cpu["torch"] == "2.13.0", "the CPU venv keeps the CPU wheel on this machine's disk"
    assert gpu["torch"] == "2.14.1" and gpu["sglang"] == "0.5.23"
    for name in ("torch", "transformers", "sglang-router", "megatron-core", "mbridge"):
        spec = requirement(name, deps).specifier
        for which, p in (("constraints.txt", cpu), ("constraints-gpu.txt", gpu)):
            if name in p:
                assert spec.contains(p[name]), f"pyproject's {name}{spec} excludes {which}'s {p[name]}"
    gpu_extra = project()["optional-dependencies"]["gpu"]
    assert str(requirement("sglang", gpu_extra).specifier) == f"=={gpu['sglang']}"


def _pip(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _registry_or_skip() -> None:
    """Skip (not fail) where the registry cannot be reached: the question is then unanswerable here."""
    try:
        p = _pip("index", "versions", "sglang", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("package registry unreachable: `pip index versions sglang` took over 120 s")
    if p.returncode != 0 or not re.search(r"\b0\.5\.23\b", p.stdout):
        pytest.skip(f"package registry unreachable or without sglang 0.5.23: `pip index versions sglang` "
                    f"exited {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_install_resolves_in_one_environment(tmp_path: Path) -> None:
    _registry_or_skip()
    wheels = tmp_path / "wheels"
    p = _pip("wheel", "-q", "--no-deps", str(REPO), "-w", str(wheels), timeout=300)
    if p.returncode != 0 and re.search(r"(?i)connection|resolve|network|timed out|No matching distribution", p.stderr):
        pytest.skip(f"cannot build the streamrl wheel without the registry (setuptools): {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = wheels.glob("streamrl-*.whl")
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(GLIBC_MAX, 16, -1)] + ["manylinux2014_x86_64"]
    report = tmp_path / "report.json"
    argv = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--only-binary=:all:",
            *[a for pl in platforms for a in ("--platform", pl)], "--python-version", "3.11", "--implementation",
            "cp", "--target", str(tmp_path / "target"), "-c", str(GPU_CONSTRAINTS), f"{wheel}[gpu]"]
    # fast-deps: pip reads each wheel's METADATA through HTTP range requests; a registry without PEP 658
    # metadata (this machine's) would otherwise have it download ~1.6 GB of wheels to resolve
    t = time.perf_counter()
    p = _pip(*argv[:1], "--use-feature=fast-deps", *argv[1:], timeout=540)
    fast = not (p.returncode != 0 and "fast-deps" in p.stderr)  # a pip that dropped the feature refuses it
    if not fast:
        p = _pip(*argv, timeout=540)
    took = time.perf_counter() - t
    assert p.returncode == 0, f"the GPU set does not resolve ({took:.0f} s):\n{p.stderr[-4000:]}"
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    print(f"resolved {len(resolved)} distributions in {took:.0f} s (fast-deps: {bool(fast)}): "
          + " ".join(f"{n}=={resolved[n]}" for n in ("torch", "sglang", "sglang-router", "megatron-core",
                                                      "mbridge", "transformers", "flashinfer-python",
                                                      "nvidia-nccl-cu13") if n in resolved))
    for name, version in pins(GPU_CONSTRAINTS).items():
        assert resolved.get(name) == version, f"{name}: pinned {version}, resolved {resolved.get(name)}"
    assert resolved["torch"] == "2.14.1" and resolved["sglang"] == "0.5.23"
    assert resolved["megatron-core"].startswith("0.16."), resolved["megatron-core"]
    assert resolved["streamrl"] == project()["version"]
    for name in ("ray", "lancedb", "pyarrow", "msgspec"):  # the rest of StreamRL, in the same set
        assert name in resolved, f"{name} missing from the resolved set"
