"""Real SGLang on this CPU, the launch side: the files and flags StreamRL hands SGLang 0.5.23, read by
SGLang's own argument parser in the venv `make sglang` builds; the keys SGLang prints, blanked on their
way to the log; the venv and its driver stand-in found or a clear error; the stand-in never shipped."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from streamrl.connectors.auth import Keys, write_private
from streamrl.connectors.sglang import cpu_sglang
from streamrl.connectors.sglang.engine_actor import copy_redacted, sglang_key_config

REPO = Path(__file__).resolve().parent.parent

# SGLang's own parser (server_args.prepare_server_args: argparse + the --config YAML merged in), run in
# the SGLang venv on exactly the arguments the engine actor builds.
PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
for args in json.loads(sys.argv[1]):  # one import of SGLang (~10-40 s), several command lines
    try:
        a = prepare_server_args(args)
    except SystemExit as e:
        print(json.dumps({"exit": e.code}))
        continue
    print(json.dumps({k: getattr(a, k) for k in ("api_key", "admin_api_key", "device", "attention_backend", "dtype",
                                                  "max_total_tokens", "sleep_on_idle", "skip_server_warmup", "port")}))
"""


def _sglang_parse(*command_lines: list[str]) -> tuple[list[dict], str]:
    """What SGLang's parser makes of each command line ({"exit": code} where it exits), and its stderr."""
    python = cpu_sglang.venv_python()
    r = subprocess.run([python, "-W", "ignore", "-c", PARSE, json.dumps(command_lines)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **cpu_sglang.cpu_env(python)})
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")], r.stderr


def test_sglang_takes_the_keys_file_the_engine_actor_writes(tmp_path, model_dirs):
    """The actor's `--config` file with the run's keys parses in SGLang 0.5.23 to its api_key and
    admin_api_key, and the CPU flags to what they say. Before: the file said `api_key`, which SGLang
    turns into the flag `--api_key`; argparse knows only `--api-key`, so every real SGLang engine exited 2
    at start, printing both keys in the error (the second half below shows that file failing)."""
    keys = Keys.new()
    conf, old = tmp_path / "engine-0.keys.yaml", tmp_path / "old.keys.yaml"
    write_private(conf, json.dumps(sglang_key_config(keys)))
    write_private(old, json.dumps({"api_key": keys.api, "admin_api_key": keys.admin}))  # what the actor wrote before
    (got, before), stderr = _sglang_parse(
        cpu_sglang.cpu_args(["--model-path", model_dirs[0], "--port", "31111", "--config", str(conf)]),
        ["--model-path", model_dirs[0], "--config", str(old)])
    assert got == {"api_key": keys.api, "admin_api_key": keys.admin, "device": "cpu", "attention_backend": "torch_native",
                   "dtype": "float32", "max_total_tokens": 8192, "sleep_on_idle": True, "skip_server_warmup": True,
                   "port": 31111}
    assert before == {"exit": 2} and "unrecognized arguments: --api_key" in stderr


def test_cpu_flags_yield_to_the_users(tmp_path):
    """engines.extra_args wins over each CPU default it names (`--dtype bfloat16`, `--max-total-tokens=4096`)."""
    args = cpu_sglang.cpu_args(["--dtype", "bfloat16", "--max-total-tokens=4096"])
    assert args.count("--dtype") == 1 and args[args.index("--dtype") + 1] == "bfloat16"
    assert "--max-total-tokens" not in args and "--max-total-tokens=4096" in args
    assert "--sleep-on-idle" in args and args[args.index("--device") + 1] == "cpu"


def test_no_venv_or_no_stand_in_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_sglang.VENV_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(cpu_sglang.SGLangNotInstalled, match="make sglang"):
        cpu_sglang.venv_python()
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").touch()
    monkeypatch.setenv(cpu_sglang.VENV_ENV, str(tmp_path / "v"))
    python = cpu_sglang.venv_python()
    assert python == str(tmp_path / "v" / "bin" / "python")
    with pytest.raises(cpu_sglang.SGLangNotInstalled, match="install.sh"):
        cpu_sglang.cpu_env(python)
    stub = tmp_path / "v" / cpu_sglang.STUB_DIR
    stub.mkdir()
    (stub / "libcuda.so.1").touch()
    env = cpu_sglang.cpu_env(python, threads=3)
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(stub) and env["OMP_NUM_THREADS"] == "3"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_the_log_pipe_blanks_every_key(tmp_path):
    """SGLang logs `server_args={... 'api_key': '...', 'admin_api_key': '...'}` at start: what reaches
    the engine log has neither key, the rest of each line intact."""
    keys = Keys.new()
    out = tmp_path / "engine.log"
    out.write_bytes(b"header\n")
    src = io.BytesIO(f"server_args={{'api_key': '{keys.api}', 'admin_api_key': '{keys.admin}', 'port': 1}}\n"
                     f"no key here\nBearer {keys.admin}".encode())
    copy_redacted(src, out, [keys.api.encode(), keys.admin.encode()])
    assert out.read_text() == ("header\nserver_args={'api_key': '<redacted>', 'admin_api_key': '<redacted>', 'port': 1}\n"
                               "no key here\nBearer <redacted>")


def test_the_driver_stand_in_is_built_and_never_shipped():
    """`make sglang` built the stand-in from the kernel package's own undefined cu* symbols; the repository
    holds only the script that builds it (no .so, no .c), and the wheel's package list has no cpu/ folder."""
    stub = Path(cpu_sglang.venv_python()).parent.parent / cpu_sglang.STUB_DIR
    symbols = (stub / "symbols.txt").read_text().split()
    assert symbols and all(s.startswith("cu") for s in symbols) and (stub / "libcuda.so.1").exists()
    tracked = subprocess.run(["git", "ls-files", "connectors/sglang/cpu"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert sorted(Path(t).name for t in tracked) == ["install.sh", "requirements.in", "requirements.lock"]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "connectors.sglang.cpu" not in pyproject and "cpu/*" not in pyproject
