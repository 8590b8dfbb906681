"""streamrl/core/engine_dtype.py: the engines' weight dtype (what pushes are cast to), resolved as
sglang 0.5.23's `_get_and_verify_dtype` does (checked against it where the SGLang venv is built)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from streamrl.connectors.sglang.cpu_sglang import DEFAULT_VENV, cpu_args
from streamrl.core.engine_dtype import engine_dtype, flag, sglang_dtype

CONFIGS = [{"torch_dtype": "bfloat16", "model_type": "qwen2"}, {"dtype": "float32", "model_type": "qwen2"},
           {"model_type": "llama"}, {"torch_dtype": "float16", "model_type": "qwen3_moe"},
           {"dtype": "float32", "model_type": "gemma2"}, {"dtype": "bfloat16", "torch_dtype": "float16", "model_type": "x"}]
DTYPES = ["auto", "float32", "bfloat16", "half", "float16", "float", "AUTO"]


@pytest.mark.parametrize(("cfg", "want"), [(CONFIGS[0], "bfloat16"), (CONFIGS[1], "float16"), (CONFIGS[2], "float16"),
                                           (CONFIGS[3], "float16"), (CONFIGS[4], "bfloat16"), (CONFIGS[5], "bfloat16")])
def test_auto_follows_the_config(cfg, want):
    assert sglang_dtype("auto", cfg) == want


def test_the_engines_dtype_from_their_launch_arguments():
    qwen = CONFIGS[0]
    assert engine_dtype(False, ["--dtype", "bfloat16"], qwen) == "float32"  # the embedded engine loads float32
    assert engine_dtype(True, [], qwen) == "bfloat16"  # SGLang on a GPU: auto
    assert engine_dtype(True, cpu_args([]), qwen) == "float32"  # SGLang on CPU: StreamRL's flag
    assert engine_dtype(True, cpu_args(["--dtype=bfloat16"]), qwen) == "bfloat16"  # the recipe's wins
    assert engine_dtype(True, ["--dtype", "half", "--dtype", "float"], qwen) == "float32"  # the last one
    assert flag(["--dtype"], "--dtype") is None


def test_an_unknown_dtype_names_the_recipe_key():
    with pytest.raises(ValueError, match=r"engines.extra_args: --dtype 'fp8'"):
        engine_dtype(True, ["--dtype", "fp8"], CONFIGS[0])


SGLANG = DEFAULT_VENV / "bin" / "python"


@pytest.mark.skipif(not SGLANG.exists(), reason="the SGLang venv is not built (make sglang)")
def test_resolution_equals_sglangs_own():
    """Every config x --dtype above through SGLang's function itself, in its venv."""
    code = ("import json, sys\nfrom sglang.srt.configs.model_config import _get_and_verify_dtype\n"
            "cases = json.loads(sys.argv[1])\n"
            "print(json.dumps([str(_get_and_verify_dtype(c, d)).removeprefix('torch.') for c, d in cases]))")
    cases = [(c, d) for c in CONFIGS for d in DTYPES]
    out = subprocess.run([str(SGLANG), "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent, env={"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1",
                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [sglang_dtype(d, c) for c, d in cases]
