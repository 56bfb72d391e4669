# Set-up on a fresh clone is part of each target: `make demo` and `make test` create .venv, install torch==2.13.0
# first (a CPU build here; an unpinned torch pulls gigabytes of CUDA packages), then trl-gspo with its test tools.
# On a GPU machine pick your CUDA build: `make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test check
demo: $(VENV)/.installed
	$(BIN)/trl-gspo demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

check: $(VENV)/.installed
	$(BIN)/trl-gspo check

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@
