#!/usr/bin/env bash
# The venvs .ci/run's later steps use, built one after another while its first steps run the tests: pip mostly
# downloads and unpacks, so this overlaps well with tests that use the CPU, where a second test run would only share
# the cores. One at a time because each install builds trl-gspo in the checkout (its trl_gspo.egg-info): two at once
# could collide. After each venv it writes $LOGS/<name>.built, which .ci/run waits for before the step that uses it.
# Usage: bash .ci/install_venvs.sh LOGS WHEEL_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
logs=$1
wheel_dir=$2
SECONDS=0
built() {
    echo "== $1 built ($SECONDS s)"
    touch "$logs/$1.built"
}

# step 1b's: vLLM's CPU build (the Makefile's recipe; `make test-vllm` then finds it up to date)
make .venv-vllm/.installed
built vllm

# step 2's: the oldest supported set (.ci/oldest.txt); torch first, pinned: this version is served as a CPU build, an
# unpinned torch pulls the CUDA wheels.
python3 -m venv .venv-oldest
.venv-oldest/bin/python -m pip install -q --upgrade pip
.venv-oldest/bin/python -m pip install -q torch==2.13.0
.venv-oldest/bin/python -m pip install -q -c .ci/oldest.txt -e ".[dev]"
built oldest

# step 2b's: the newest set, into which .ci/run installs each TRL release in turn
python3 -m venv .venv-releases
.venv-releases/bin/python -m pip install -q --upgrade pip
.venv-releases/bin/python -m pip install -q torch==2.13.0
.venv-releases/bin/python -m pip install -q -e ".[dev]"
built releases

# step 3's: the wheel, in a clean venv outside the checkout
bash .ci/wheel_test.sh install "$wheel_dir"
built wheel
