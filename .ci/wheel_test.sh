#!/usr/bin/env bash
# The wheel test: build trl-gspo with `pip install .` (not editable) into a clean venv in a temporary folder and use
# it from there, where the repository is not importable: the offline copy demo, `trl-gspo models list`, `trl-gspo check`, `trl-gspo recipes`, and
# a shipped recipe (GSPO-token, whose trainer_class lives next to it; the wheel installs the top-level recipes/ inside the package) for one step on the tiny
# model; and that every module of every subpackage of trl_gspo/ is in the wheel. Any failing command, missing output
# or module, or a model card that does not name the variant fails the test.
#
# `bash .ci/wheel_test.sh` installs and runs in a temporary folder. `.ci/run` installs early, in the background while
# the tests run (`.ci/wheel_test.sh install DIR`), and runs the checks at its end (`.ci/wheel_test.sh run DIR`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
phase=${1:-all}
if [ "$phase" = all ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
else
    work="$(cd "${2:?usage: wheel_test.sh [install|run] DIR}" && pwd)"
fi
cd "$work"
if [ "$phase" != run ]; then
    python3 -m venv venv
    venv/bin/python -m pip install -q --upgrade pip
    venv/bin/python -m pip install -q torch==2.13.0
    venv/bin/python -m pip install -q "$repo"
fi
if [ "$phase" = install ]; then
    exit 0
fi
export PATH="$work/venv/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

REPO="$repo" python - <<'PY'  # installed as a wheel: the package and its data come from site-packages, not the repository
import importlib, os, pathlib
import trl_gspo, trl_gspo.cli.shipped as shipped
assert "site-packages" in trl_gspo.__file__, trl_gspo.__file__
assert (shipped.SHIPPED["recipe"] / "per_token_advantages.py").is_file() and (shipped.SHIPPED["accelerate config"] / "zero2.yaml").is_file()
# every module of every subpackage of the repository's trl_gspo/ is in the wheel, and every subpackage imports
source, installed = pathlib.Path(os.environ["REPO"]) / "trl_gspo", pathlib.Path(trl_gspo.__file__).parent
modules = {p.relative_to(source) for p in source.rglob("*.py")}
missing = sorted(str(m) for m in modules if not (installed / m).is_file())
assert not missing, f"not in the wheel: {missing}"
for package in sorted({m.parent for m in modules if m.name == "__init__.py"}):
    importlib.import_module(".".join(("trl_gspo", *package.parts)))
print(f"wheel: {len(modules)} modules in {len({m.parent for m in modules})} packages, recipes and accelerate configs")
PY

trl-gspo demo --config demo --output_dir demo-out --max_steps 2 --num_train_prompts 32 --num_eval_prompts 16 \
    --disable_tqdm true
test -f demo-out/model.safetensors && grep -q "trained with GSPO" demo-out/README.md

trl-gspo models list  # where the real model resolves (the copy `make test` prepared, offline)

trl-gspo check

trl-gspo recipes copied && test -f copied/recipes/qwen3_1p7b_gspo_token.yaml && test -f copied/accelerate_configs/zero2.yaml

python - <<'PY'  # a tiny model and a local dataset for the recipe run
from trl_gspo.cli.demo import make_demo_dataset
from trl_gspo.testing import save_tiny_model
save_tiny_model("tiny-model")
make_demo_dataset(32).to_json("copy.jsonl")
PY
trl-gspo train --config qwen3_1p7b_gspo_token --max_steps 1 \
    --model_name_or_path tiny-model --dtype float32 --dataset_name copy.jsonl --reward_funcs demo_reward \
    --use_cpu true --bf16 false --gradient_checkpointing false --per_device_train_batch_size 4 \
    --num_generations 4 --gradient_accumulation_steps 1 --steps_per_generation 4 --max_completion_length 4 \
    --save_strategy no --output_dir recipe-out --disable_tqdm true
test -f recipe-out/model.safetensors && grep -q "trained with GSPO-token" recipe-out/README.md
echo "wheel test: OK (demo, check, recipes, recipe run with its trainer_class, from $work)"
