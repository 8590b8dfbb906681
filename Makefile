# Two entry points (see README): `make quickstart` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/streamrl run recipes/quickstart.yaml

# Two workers, whole files each (module fixtures and a file's runs stay together): the suite is
# mostly end-to-end runs waiting on engines, so the second core halves the wall time. PYTEST_ARGS="-n 0" runs it serially.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
