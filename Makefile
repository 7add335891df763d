# duelq developer commands.  `make demo` and `make test` work on a fresh machine:
# each creates .venv (if missing) and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/duelq demo

test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m pytest

# On a GPU machine: the `gpu` tests and the device benchmark, with a table at the end.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
