# duelq developer commands.  `make demo` and `make test` work on a fresh machine:
# each creates .venv (if missing) and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Where nvidia-smi lists a GPU, `make demo` adds the cuda extra and the demo runs on it.
GPU    := $(shell nvidia-smi -L 2>/dev/null | grep -m1 '^GPU')

.PHONY: demo test gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

demo: $(BIN)/python
ifneq ($(GPU),)
	@echo "make demo: $(GPU): installing the cuda extra (CuPy)"
	$(BIN)/pip install -q -e '.[server,demo,cuda]'
else
	@echo "make demo: no GPU listed by nvidia-smi: the NumPy reference backend"
	$(BIN)/pip install -q -e '.[server,demo]'
endif
	$(BIN)/duelq demo

test: $(BIN)/python
	$(BIN)/pip install -q -e '.[server,demo,test]'
	$(BIN)/python -m pytest

# On a GPU machine: the `gpu` tests, the device benchmarks and the end-to-end bench, with a
# summary at the end (scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
