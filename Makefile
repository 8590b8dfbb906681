# Two entry points (see README): `make quickstart` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test deps install browser sglang clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP) browser

# Debian's Chromium for the viewer's browser test (tests/test_view_browser.py drives it with playwright,
# whose own browser download is never used). Installed as root (or with sudo); elsewhere the test
# skips and says why. Not an error: the rest of the suite needs no browser.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	      || echo "make browser: installing chromium failed; the viewer's browser test will be skipped"; \
	  else echo "make browser: no chromium and no root/apt-get to install it; the viewer's browser test will be skipped"; fi; }

# Real SGLang 0.5.23 on this CPU, in a venv of its own (.venv-sglang, ~8 GB, ~3-5 min the first time; a no-op
# after): the reference engine the contract tests and `engines.backend=sglang` use on machines without a GPU
# (docs/engines.md). On a machine with an NVIDIA driver it stops and says so: GPUs install SGLang per docs/gpu.md.
sglang:
	bash connectors/sglang/cpu/install.sh .venv-sglang

quickstart: $(STAMP)
	$(BIN)/streamrl run recipes/quickstart.yaml

# Two workers, whole files each (module fixtures and a file's runs stay together): the suite is
# mostly end-to-end runs waiting on engines, so the second core halves the wall time. PYTEST_ARGS="-n 0" runs it serially.
# Bytecode first: where writing it at run time is off (PYTHONDONTWRITEBYTECODE=1, as on CI) every Ray worker,
# engine and CLI process the tests start would compile the project's modules again.
# The set-up steps are independent (two venvs and a browser): made at once, ~40 s less than one after another.
deps: $(STAMP) browser sglang

test:
	@$(MAKE) --no-print-directory -j3 deps
	$(BIN)/python -m compileall -q streamrl connectors pools recipes benchmarks tests >/dev/null
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-sglang runs
