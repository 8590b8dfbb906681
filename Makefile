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

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
