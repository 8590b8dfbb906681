#!/usr/bin/env bash
# Builds the SGLang CPU venv that `engines.backend: sglang` uses on a machine without a GPU (make sglang).
#
#   connectors/sglang/cpu/install.sh [VENV]        # default .venv-sglang beside the Makefile
#
# 1. VENV with exactly requirements.lock (SGLang 0.5.23, its CPU-usable requirements, torch 2.14.1),
#    installed --no-deps so the result never depends on what a resolver picks that day.
# 2. A stand-in for the NVIDIA driver library, VENV/cpu-driver-stub/libcuda.so.1: sglang imports its
#    kernel package (sgl_kernel) unconditionally, and that package's .so files link libcuda.so.1. The
#    stand-in defines exactly the cu* functions those files use, each returning an error
#    (CUDA_ERROR_NOT_FOUND). It is honest on a CPU without AMX because SGLang's CPU path then calls none of
#    the kernel package's ops (plain torch for norm, rotary, activation and attention; docs/engines.md).
#    A test fixture for CPU machines: never built where a real driver is installed, never in the wheel.
# 3. Bytecode for every installed module, then a check that SGLang's server module imports under the stand-in.
#
# Idempotent: a stamp records the lock's and this script's hash; a second run with both unchanged does
# nothing. pip's own cache makes a rebuild after a change take ~3 min instead of ~5.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$(realpath -m "${1:-$HERE/../../../.venv-sglang}")"
PY="${PY:-python3.11}"
LOCK="$HERE/requirements.lock"
STAMP="$VENV/.installed"
want="$(cat "$LOCK" "$0" | sha256sum | cut -d' ' -f1)"
fail() { echo "make sglang: $*" >&2; exit 1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "make sglang: $VENV is up to date (SGLang 0.5.23 CPU venv)"; exit 0
fi
command -v "$PY" >/dev/null || PY=python3
command -v gcc >/dev/null && command -v nm >/dev/null \
  || fail "gcc and nm are needed to build the driver stand-in: apt-get install gcc binutils"
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  fail "this machine has an NVIDIA driver (libcuda.so.1 in ldconfig): the CPU venv and its stand-in are for machines without one; on GPUs install SGLang as docs/gpu.md says"
fi

t0=$SECONDS
echo "make sglang: building $VENV (SGLang 0.5.23 on CPU: ~8 GB, ~3-5 min)"
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || fail "could not create a venv with $PY"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v 'is ignored' || true
"$VENV/bin/python" -m pip install -q --no-deps --no-compile -r "$LOCK" 2>&1 | grep -v 'is ignored' || true
"$VENV/bin/python" -c 'import sglang, sgl_kernel' 2>/dev/null || \
  "$VENV/bin/python" -m pip show -q sglang sglang-kernel torch >/dev/null \
  || fail "pip did not install every package of $LOCK into $VENV (see its output above)"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Bytecode now (~75 s on 2 cores): where the environment forbids writing it at run time
# (PYTHONDONTWRITEBYTECODE=1, as on the CI machines) every SGLang process would compile all it imports
# each time; an engine was ready in 82 s without it and 31 s with it. Some packages ship files that do not
# compile (Python 2 examples): compileall's exit status is not the venv's.
"$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true

STUB="$VENV/cpu-driver-stub"
mkdir -p "$STUB"
find "$SITE/sgl_kernel" -name '*.so' -print0 | xargs -0 -n1 nm -D --undefined-only \
  | awk '$2 ~ /^cu[A-Z]/ {print $2}' | sort -u > "$STUB/symbols.txt"
[ -s "$STUB/symbols.txt" ] || fail "found no cu* symbols in $SITE/sgl_kernel/*.so: is sglang-kernel installed?"
{ echo "/* Stand-in for libcuda.so.1 on CPU machines: connectors/sglang/cpu/install.sh wrote this. */"
  sed 's/.*/int &(void) { return 500; }  \/* CUDA_ERROR_NOT_FOUND *\//' "$STUB/symbols.txt"; } > "$STUB/cuda_stub.c"
gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so.1" "$STUB/cuda_stub.c" \
  || fail "gcc could not build $STUB/libcuda.so.1"

if ! out="$(LD_LIBRARY_PATH="$STUB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 \
      "$VENV/bin/python" -W ignore -c 'import sgl_kernel, sglang.srt.entrypoints.http_server' 2>&1)"; then
  echo "$out" >&2; fail "SGLang does not import in $VENV under the driver stand-in (above)"
fi
echo "$want" > "$STAMP"
echo "make sglang: $VENV ready in $((SECONDS - t0)) s ($(wc -l < "$STUB/symbols.txt") driver functions stood in)"
