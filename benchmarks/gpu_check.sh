#!/usr/bin/env bash
# StreamRL's checks for one lent GPU machine, in one prepared run that prints ONE JSON object
# (benchmarks/gpu_check.py says what each check is; docs/gpu.md how to run it).
#
#   here, with the package registry, once:  benchmarks/gpu_check.sh --fetch-wheels [PYTHON_VERSION]
#       downloads into .whl/ (git-ignored through info/exclude) the wheels the device machine lacks:
#       msgspec, megatron-core, mbridge, transformers and what transformers checks at import (~21 MB;
#       default Python 3.12, the device's)
#   there (no registry; its python3 holds a CUDA torch):  bash benchmarks/gpu_check.sh [gpu_check.py flags]
#       installs .whl/*.whl into a temporary --target when the interpreter lacks StreamRL's learner
#       packages, then runs every check, each under its own time limit, all within --budget-s (420 s)
#   anywhere without a GPU:  benchmarks/gpu_check.sh --cpu   (the CUDA-only checks are skipped, with why)
#
# The interpreter: $PY, else the checkout's .venv/bin/python when it has torch, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
# transformers checks at import the versions of tokenizers, huggingface-hub, safetensors and regex (its
# dependency_versions_check): the device's own are older, so they travel too (5.19.0's METADATA bounds)
WHEELS=(msgspec==0.22.0 megatron-core==0.16.1 mbridge==0.15.1 transformers==5.19.0
        tokenizers==0.23.3 huggingface-hub==1.31.0 safetensors==0.8.0 regex==2026.11.19)

if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  pyver=${2:-3.12}
  plats=(--platform manylinux2014_x86_64)
  for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p .whl "$(dirname "$exclude")"
  grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${plats[@]}" -d .whl "${WHEELS[@]}"
  ls -l .whl >&2
  exit 0
fi

if ! "$PY" -c "import msgspec, megatron.core, mbridge" 2>/dev/null; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    site=${GPU_CHECK_SITE:-/tmp/streamrl-gpu-check-site}
    echo "[gpu_check.sh] $PY lacks StreamRL's learner packages: installing .whl/*.whl into $site" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[gpu_check.sh] $PY lacks msgspec / megatron-core / mbridge and there is no .whl/: run" \
         "'benchmarks/gpu_check.sh --fetch-wheels' where the registry is (the checks that need them will fail)" >&2
  fi
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
# a backstop only: gpu_check.py ends its checks within --budget-s (420 s default) and prints the JSON
exec timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" benchmarks/gpu_check.py "$@"
