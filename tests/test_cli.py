"""The `trl-gspo` CLI end to end (demo and train through `main`), its recipe checks, the demo task and rewards."""

import csv
import os
import sys
from pathlib import Path

import pytest
import yaml
from datasets import DatasetDict
from helpers.recipes import train_recipe, write_recipe

from trl_gspo.cli import commands as cli
from trl_gspo.cli import shipped
from trl_gspo.cli.commands import main
from trl_gspo.cli.demo import copy_score, demo_reward, make_demo_dataset
from trl_gspo.cli.parser import parse
from trl_gspo.cli.recipe_inputs import RecipeError
from trl_gspo.cli.rewards import math_accuracy_reward, resolve_reward
from trl_gspo.cli.shipped import SHIPPED

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--max_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true"]


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------------------------- demo task
def test_copy_score_is_fraction_of_right_positions_over_the_longer():
    assert copy_score("3 7 5", "3 7 5") == 1.0
    assert copy_score("3 0 5", "3 7 5") == pytest.approx(2 / 3)
    assert copy_score("3 7 5 5", "3 7 5") == pytest.approx(3 / 4)  # an extra token costs
    assert copy_score("3", "3 7 5") == pytest.approx(1 / 3)
    assert copy_score("", "3 7 5") == 0.0
    conversational = [[{"role": "assistant", "content": "3 7 5"}], [{"role": "assistant", "content": "5 7 3"}]]
    assert demo_reward(conversational, target=["3 7 5", "3 7 5"]) == [1.0, pytest.approx(1 / 3)]


def test_demo_dataset_held_out_digits_never_appear_in_training():
    train, test = make_demo_dataset(5000, seed=1), make_demo_dataset(500, seed=2, split="test")
    assert set(train["target"]).isdisjoint(test["target"])
    assert train[0]["prompt"] == f"copy {train[0]['target']} :"
    with pytest.raises(ValueError, match="split='val'"):
        make_demo_dataset(3, split="val")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_demo_runs_two_steps_through_the_cli_and_writes_its_outputs(tmp_path, capsys, moe):
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--config",
        "demo",
        "--output_dir",
        str(out),
        *FAST,  # a shipped recipe, by name
        "--num_train_prompts",
        "32",
        "--num_eval_prompts",
        "16",
        "--moe",
        str(moe).lower(),
    ]
    assert main(argv) == 0
    assert "held-out reward (greedy, 16 unseen prompts): before" in capsys.readouterr().out
    model, tokenizer = _load(out)
    assert model.config.model_type == ("qwen3_moe" if moe else "qwen3")
    assert tokenizer.decode(tokenizer("copy 1 2 :")["input_ids"]) == "copy 1 2 :"
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert {"reward", "loss", "clip_ratio/region_mean", "entropy"} <= set(rows[0])
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out / "README.md").read_text()  # the saved model's card names the method, its paper and tags
    assert "trained with GSPO" in card and "2507.18071" in card and "zheng2025gspo" in card
    assert "- gspo" in card and "- trl-gspo" in card and "GSPO-token" not in card


@pytest.mark.slow
def test_demo_learns_the_copy_task(tmp_path):
    """300 of the demo's 2000 steps already lift the held-out reward clearly (seeds 0-3 measured 0.23-0.31)."""
    from trl_gspo.cli.demo import run_demo

    result = run_demo(str(tmp_path / "learn"), num_eval_prompts=100, max_steps=300, logging_steps=20, disable_tqdm=True)
    assert result["before"] <= 0.05 and result["after"] >= 0.15
    rewards = [row["reward"] for row in result["trainer"].state.log_history if "reward" in row]
    assert sum(rewards[-3:]) > sum(rewards[:3])  # sampled (T=1) training reward: noisier, it lags the greedy one


# ---------------------------------------------------------------------------------------------- train
@pytest.fixture
def copy_jsonl(tmp_path):
    path = tmp_path / "copy.jsonl"
    make_demo_dataset(64).to_json(str(path))
    return str(path)


@pytest.mark.parametrize("source", ["jsonl_file", "parquet_file", "save_to_disk_folder", "datasets_mixture"])
def test_train_runs_from_every_local_dataset_form(tmp_path, tiny_model_dir, copy_jsonl, source):
    # `trl grpo` fails when dataset_name points at a .jsonl file; here a file loads as split "train".
    data = make_demo_dataset(64)
    extra = {"dataset_name": copy_jsonl}
    if source == "parquet_file":
        data.to_parquet(str(tmp_path / "copy.parquet"))
        extra = {"dataset_name": str(tmp_path / "copy.parquet")}
    elif source == "save_to_disk_folder":
        DatasetDict({"train": data}).save_to_disk(str(tmp_path / "saved"))
        extra = {"dataset_name": str(tmp_path / "saved")}
    elif source == "datasets_mixture":
        extra = {"dataset_name": None, "datasets": [{"path": "json", "data_files": copy_jsonl, "split": "train"}]}
    recipe = train_recipe(tmp_path, tiny_model_dir, None, reward_funcs=["trl_gspo.cli.demo.demo_reward"], **extra)
    assert main(["train", "--config", recipe, "--max_steps", "1", "--disable_tqdm", "true"]) == 0
    model, _ = _load(tmp_path / "out")
    assert model.config.model_type == "qwen3"
    card = (tmp_path / "out" / "README.md").read_text()  # a local base model is named by its folder, not "[None]"
    assert (
        f"fine-tuned version of `{Path(tiny_model_dir).name}` (a local model folder)" in card and "[None]" not in card
    )


def test_train_of_a_hub_id_the_store_knows_records_the_copy_it_trained(
    tmp_path, tiny_model_dir, copy_jsonl, monkeypatch
):
    """A recipe naming a Hub id the model store knows (SmolLM2; a tiny folder stands in for its prepared copy): the id
    is resolved once (cli/run_model.py: each node's local rank 0 decides in a launch), the run loads what it resolved
    to, and the output says which copy it trained (`model_source.json`)."""
    import json

    from trl_gspo.cli import run_model
    from trl_gspo.common import model_store

    asked, weights = [], "ab" * 32

    def resolve_for_run(name, args, revision=None):
        asked.append(name)
        return model_store.Resolved(tiny_model_dir, f"model {name}: stand-in", "gguf", weights, name)

    monkeypatch.setattr(run_model, "resolve_for_run", resolve_for_run)
    recipe = train_recipe(tmp_path, model_store.SMOLLM2, copy_jsonl, max_steps=1)
    assert main(["train", "--config", recipe, "--disable_tqdm", "true"]) == 0
    assert asked == [model_store.SMOLLM2]
    record = json.loads((tmp_path / "out" / run_model.RECORD).read_text())
    assert record == {"model": model_store.SMOLLM2, "source": "gguf", "sha256": weights}


BESIDE_RECIPE = """
from trl_gspo import GSPOTrainer


class BesideRecipeTrainer(GSPOTrainer):
    calls = 0

    def token_advantages(self, inputs):
        type(self).calls += 1
        return super().token_advantages(inputs)
"""


def test_trainer_class_next_to_the_recipe_runs_when_launched_from_elsewhere(
    tmp_path, tiny_model_dir, copy_jsonl, monkeypatch
):
    recipe_dir, elsewhere = tmp_path / "my_recipes", tmp_path / "elsewhere"
    recipe_dir.mkdir(), elsewhere.mkdir()
    (recipe_dir / "beside_recipe.py").write_text(BESIDE_RECIPE)
    keys = yaml.safe_load(open(train_recipe(tmp_path, tiny_model_dir, copy_jsonl)))
    recipe = write_recipe(
        recipe_dir / "gspo_token.yaml",
        **keys,
        importance_sampling_level="sequence_token",
        trainer_class="beside_recipe.BesideRecipeTrainer",
    )
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the recipe's folder on it; undone after the test
    monkeypatch.delitem(sys.modules, "beside_recipe", raising=False)
    assert main(["train", "--config", recipe, "--max_steps", "1", "--disable_tqdm", "true"]) == 0
    module = sys.modules.pop("beside_recipe")
    assert Path(module.__file__).parent == recipe_dir and module.BesideRecipeTrainer.calls > 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trained with GSPO-token" in card and "- gspo-token" in card and "2507.18071" in card


def test_trainer_class_that_does_not_resolve_names_both_places(tmp_path, tiny_model_dir, copy_jsonl, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    recipe = train_recipe(tmp_path, tiny_model_dir, copy_jsonl, trainer_class="nowhere_module.Trainer")
    with pytest.raises(RecipeError, match="trainer_class: cannot import module 'nowhere_module'"):
        cli.train(["--config", recipe])


# ------------------------------------------------------------------------------- shipped files by name
def test_config_and_accelerate_config_resolve_by_name_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve_shipped("demo", "recipe") == SHIPPED["recipe"] / "demo.yaml"
    assert shipped.resolve_shipped("zero2.yaml", "accelerate config") == SHIPPED["accelerate config"] / "zero2.yaml"
    with pytest.raises(RecipeError, match=r"'recipes/demo.yaml': no such file .* is `--config demo`"):
        shipped.resolve_shipped("recipes/demo.yaml", "recipe")  # a path is a path: no silent shipped fallback
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text("max_steps: 3\n")
    assert shipped.resolve_shipped("recipes/demo.yaml", "recipe") == tmp_path / "recipes" / "demo.yaml"  # a file wins
    assert shipped.resolve_shipped("demo", "recipe") == tmp_path / "recipes" / "demo.yaml"  # copies before shipped
    with pytest.raises(RecipeError, match=r"accelerate config 'zero22': no such file.*Did you mean 'zero2'\?"):
        shipped.resolve_shipped("zero22", "accelerate config")


def test_accelerate_config_relaunches_under_accelerate_with_the_shipped_file(monkeypatch):
    calls = []
    monkeypatch.setattr("subprocess.call", lambda cmd: calls.append(cmd) or 0)
    argv = ["--config", "demo", "--accelerate_config", "zero2", "--num_processes", "2", "--max_steps", "3"]
    assert main(["demo", *argv]) == 0
    (cmd,) = calls
    assert cmd[1:] == [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(SHIPPED["accelerate config"] / "zero2.yaml"),
        "--num_processes",
        "2",
        "-m",
        "trl_gspo",
        "demo",
        "--config",
        "demo",
        "--max_steps",
        "3",
    ]


def test_recipes_command_copies_out_lists_and_refuses_to_overwrite(tmp_path, capsys):
    assert main(["recipes", str(tmp_path)]) == 0
    shipped = {p.name for kind in SHIPPED.values() for p in kind.iterdir() if p.suffix in (".yaml", ".py", ".jsonl")}
    copied = {p.name for p in (tmp_path / "recipes").iterdir()} | {
        p.name for p in (tmp_path / "accelerate_configs").iterdir()
    }
    assert copied == shipped and {"per_token_advantages.py", "custom_task_reward.py", "custom_task.jsonl"} <= copied
    (tmp_path / "recipes" / "demo.yaml").write_text("edited")
    assert main(["recipes", str(tmp_path)]) == 2
    assert "would overwrite" in capsys.readouterr().err and (tmp_path / "recipes" / "demo.yaml").read_text() == "edited"
    assert main(["recipes", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "recipes" / "demo.yaml").read_text() == (SHIPPED["recipe"] / "demo.yaml").read_text()
    assert main(["recipes", "--list"]) == 0
    assert "qwen3_1p7b_gspo_token" in capsys.readouterr().out


def test_python_dash_m_entry_point(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "trl_gspo", "trian"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 2 and "Did you mean 'train'?" in result.stderr


def test_flags_override_the_recipe(tmp_path, tiny_model_dir, copy_jsonl):
    recipe = train_recipe(tmp_path, tiny_model_dir, copy_jsonl)
    _, args, model_args, _ = parse("train", ["--config", recipe, "--learning_rate", "0.25", "--use_peft", "true"])
    assert args.learning_rate == 0.25 and args.max_steps == 5 and model_args.use_peft


def test_help_lists_every_group_of_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for key in (
        "--importance_sampling_level",
        "--epsilon_high",
        "--reward_funcs",
        "--trainer_class",
        "--dataset_name",
        "--lora_r",
        "--use_peft",
        "--model_name_or_path",
        "--datasets",
        "--learning_rate",
        "--use_vllm",
    ):
        assert key in text, key


# ------------------------------------------------------------------------------------------- bad recipes
NO_MODEL = "/nonexistent/model"  # a check that ran after model loading would fail on this path instead


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"learning_rat": 1e-5}, "unknown recipe key 'learning_rat'. Did you mean 'learning_rate'?"),
        ({"per_device_train_batch_size": 2.5}, "per_device_train_batch_size: expected an integer, got 2.5"),
        ({"use_peft": "maybe"}, "use_peft"),
        ({"learning_rate": [1, 2]}, "learning_rate: expected a number, got [1, 2]"),
        ({"save_strategy": False}, "save_strategy: False is not allowed (YAML reads unquoted no/yes/on/off"),
        ({"importance_sampling_level": "seqence"}, "'seqence' is not allowed. Did you mean 'sequence'?"),
        ({"epsilon": 1.5}, "epsilon=1.5 is out of range"),
        ({"reward_funcs": ["acuracy_reward"]}, "unknown reward 'acuracy_reward'. Did you mean 'accuracy_reward'?"),
        ({"reward_funcs": ["no_such_pkg.reward"]}, "cannot import module 'no_such_pkg'"),
        ({"reward_funcs": ["accuracy_reward"]}, "reward 'accuracy_reward' needs dataset column(s) ['solution']"),
        ({"trainer_class": "trl_gspo.GSPOConfig"}, "trainer_class='trl_gspo.GSPOConfig' is not a subclass"),
        ({"dataset_train_split": "validation"}, "dataset_train_split='validation' not found"),
        (
            {"dataset_test_split": "validation"},
            "dataset_test_split='validation' not found; the dataset has splits ['train']",
        ),
        (
            {"eval_strategy": "steps", "eval_steps": 1},
            "eval_strategy='steps' needs an evaluation set, but the dataset has no 'test' split (dataset_test_split; "
            "splits found: ['train']). Give an eval file or dataset with eval_dataset_name, set dataset_test_split to one "
            "of ['train'], or set eval_strategy: 'no'.",
        ),
        (
            {"eval_dataset_name": "eval.jsonl"},
            "eval_dataset_name='eval.jsonl' is set but eval_strategy is 'no', so nothing would evaluate on it",
        ),
        (
            {"remove_unused_columns": True},
            "remove_unused_columns=True removes the dataset column(s) ['target'] that reward 'demo_reward' reads "
            "(GRPOTrainer keeps only ['prompt', 'image', 'images']); set remove_unused_columns: false",
        ),
        (
            {"num_generations": 3},
            "num_generations=3 must divide the generation batch of 32 completions = per_device_train_batch_size 8 x 1 "
            "process(es) x steps_per_generation 4 (the default: 4 x gradient_accumulation_steps=1, the paper's 4 "
            "mini-batches per rollout)",
        ),
        ({}, f"model_name_or_path={NO_MODEL!r}: no such folder"),  # the last check: every other key here is valid
    ],
    ids=lambda x: str(x)[:40],
)
def test_bad_recipe_fails_before_loading_a_model(tmp_path, copy_jsonl, capsys, keys, message):
    recipe = train_recipe(tmp_path, NO_MODEL, copy_jsonl, **keys)
    try:
        code = main(["train", "--config", recipe])
    except SystemExit as err:  # argparse's own type errors (a string that is not a bool/number) exit with 2
        code = err.code
    assert code == 2
    assert message in _error_line(capsys.readouterr().err)


def _error_line(err: str) -> str:
    """The CLI's one error line (stderr may also hold library log lines); the whole message must be on it."""
    lines = [line for line in err.splitlines() if line.startswith("trl-gspo ") and ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def test_dataset_without_prompt_column_names_the_column(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    recipe = train_recipe(tmp_path, NO_MODEL, str(data), reward_funcs=["math_accuracy_reward"])
    assert main(["train", "--config", recipe]) == 2
    assert "has no 'prompt' column (columns: ['question', 'answer'])" in capsys.readouterr().err


def test_unknown_flag_and_command_suggest_the_closest(tmp_path, copy_jsonl, capsys):
    recipe = train_recipe(tmp_path, NO_MODEL, copy_jsonl)
    assert main(["train", "--config", recipe, "--max_step", "3"]) == 2
    assert "unknown argument(s) --max_step 3. Did you mean --max_steps?" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "unknown command 'trian'. Did you mean 'train'?" in capsys.readouterr().err


def test_parse_raises_recipe_error_for_library_use(tmp_path, copy_jsonl):
    recipe = train_recipe(tmp_path, NO_MODEL, copy_jsonl, num_generation=4)
    with pytest.raises(RecipeError, match="Did you mean 'num_generations'"):
        parse("train", ["--config", recipe])


# ---------------------------------------------------------------------------------------------- rewards
def test_math_accuracy_reward_with_math_verify():
    completions = [
        "so the answer is \\boxed{42}",
        "it is 41",
        [{"role": "assistant", "content": "$x=\\frac{1}{2}$"}],
        "The answer is 0.5",
        "whatever",
    ]
    golds = ["Natalia sold 48/2 = 24 ... #### 42", "#### 42", "\\frac{1}{2}", "1/2", "no math here ???"]
    assert math_accuracy_reward(completions, answer=golds) == [1.0, 0.0, 1.0, 1.0, None]
    assert math_accuracy_reward(["\\boxed{3}"], solution=["$3$"]) == [1.0]
    with pytest.raises(ValueError, match="'solution' or an 'answer' column"):
        math_accuracy_reward(["1"])


def test_builtin_reward_names_resolve_to_trl_functions():
    from trl.rewards import accuracy_reward, think_format_reward

    assert resolve_reward("accuracy_reward") is accuracy_reward
    assert resolve_reward("think_format_reward") is think_format_reward
    assert resolve_reward("trl_gspo.cli.demo.demo_reward") is demo_reward


def test_model_card_fields_per_variant():
    from trl import GRPOTrainer

    from trl_gspo.common.model_card import card_fields

    assert card_fields("sequence", "grpo", GRPOTrainer._paper)[0::2] == ("GSPO", ["trl", "trl-gspo", "gspo"])
    name, paper, tags = card_fields("sequence_token", "luspo", GRPOTrainer._paper)
    assert name == "GSPO-token (luspo loss)" and paper["id"] == "2507.18071" and "gspo-token" in tags
    name, paper, tags = card_fields("token", "grpo", GRPOTrainer._paper)
    assert name == "GRPO" and paper is GRPOTrainer._paper and "grpo" in tags


# ---------------------------------------------------------------------- the first hour: paths, model, eval, precision
RECIPE_MODULE = """
from trl_gspo import GSPOTrainer
from trl_gspo.cli.demo import demo_reward


def copy_reward(completions, target, **kwargs):
    return demo_reward(completions, target=target)


class ProbeTrainer(GSPOTrainer):
    seen = {}

    def evaluate(self, *args, **kwargs):
        type(self).seen["eval_rows"] = len(self.eval_dataset)
        return super().evaluate(*args, **kwargs)

    def train(self, *args, **kwargs):
        type(self).seen.update(bf16=self.args.bf16, mixed_precision=self.accelerator.mixed_precision)
        return super().train(*args, **kwargs)
"""


def _recipe_folder(tmp_path, tiny_model_dir, **keys):
    """recipes/ holding a recipe that names its model folder, data file and module by relative paths."""
    import shutil

    folder = tmp_path / "recipes"
    (folder / "data").mkdir(parents=True)
    shutil.copytree(tiny_model_dir, folder / "model")
    make_demo_dataset(32, seed=1).to_json(str(folder / "data" / "copy.jsonl"))
    (folder / "first_hour.py").write_text(RECIPE_MODULE)
    base = yaml.safe_load(open(train_recipe(tmp_path, "model", "data/copy.jsonl")))
    base.update(reward_funcs=["first_hour.copy_reward"], trainer_class="first_hour.ProbeTrainer", max_steps=1, **keys)
    return write_recipe(folder / "recipe.yaml", **base)


@pytest.fixture
def recipe_module(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the recipe's folder on it; undone after the test
    monkeypatch.delitem(sys.modules, "first_hour", raising=False)
    yield lambda: sys.modules["first_hour"].ProbeTrainer.seen
    sys.modules.pop("first_hour", None)


def test_recipe_paths_resolve_next_to_the_recipe_first_then_the_working_directory(
    tmp_path, tiny_model_dir, monkeypatch, recipe_module
):
    """Model folder, data file and module next to the recipe are found when launched from elsewhere, and win over
    a same-named file in the working directory; the eval file exists only in the working directory."""
    recipe = _recipe_folder(
        tmp_path,
        tiny_model_dir,
        eval_dataset_name="eval.jsonl",
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=8,
    )
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "copy.jsonl").write_text('{"question": "not the recipe\'s data"}\n')  # would fail the checks
    make_demo_dataset(8, seed=2, split="test").to_json(str(elsewhere / "eval.jsonl"))
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", recipe, "--disable_tqdm", "true"]) == 0
    assert recipe_module()["eval_rows"] == 8  # the working directory's eval file was used for evaluation
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_eval_file_split_choice():
    from trl_gspo.cli.recipe_inputs import pick_eval_split

    assert pick_eval_split("e.jsonl", "test", ["train"]) == "train"  # a single file loads as "train"
    assert pick_eval_split("org/data", "test", ["train", "test"]) == "test"
    with pytest.raises(
        RecipeError,
        match=r"eval_dataset_name='org/data' has splits \['train', 'dev'\] and none is "
        r"dataset_test_split='test'; set dataset_test_split",
    ):
        pick_eval_split("org/data", "test", ["train", "dev"])


@pytest.mark.parametrize(
    "model, message",
    [
        (
            "empty_folder",
            "model_name_or_path='{path}' is a folder without config.json (not a saved model); give the "
            "folder save_pretrained wrote, or a Hub id.",
        ),
        (
            "./models/qwen-typo",
            "model_name_or_path='./models/qwen-typo': no such folder next to the recipe ({dir}) or in "
            "the working directory ({cwd}); give an existing model folder (relative paths: next to the "
            "recipe, then the working directory) or a Hub id.",
        ),
        ("not a hub id", "model_name_or_path='not a hub id': no such folder, and not a valid Hub id (org/name)"),
        (
            "some-org/not-cached-model",
            "model_name_or_path='some-org/not-cached-model': not a local folder (next to the "
            "recipe ({dir}) or in the working directory), and HF_HUB_OFFLINE is set but the "
            "Hugging Face cache holds no copy of it; download it first",
        ),
    ],
)
def test_model_that_cannot_load_fails_in_one_line_before_loading(
    tmp_path, copy_jsonl, capsys, monkeypatch, model, message
):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as a machine without the Hub runs
    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "empty_folder").mkdir(parents=True)
    recipe = write_recipe(recipe_dir / "r.yaml", **yaml.safe_load(open(train_recipe(tmp_path, model, copy_jsonl))))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", recipe]) == 2
    path = recipe_dir / "empty_folder"
    assert message.format(path=path, dir=recipe_dir, cwd=tmp_path) in _error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------- mixed precision
def test_precision_rules():
    from trl_gspo.cli.recipe_inputs import reconcile_precision

    # no CUDA: fp32, naming what is ignored; nothing to say when nothing asked for mixed precision
    assert reconcile_precision("bf16", False, False, False, cuda=False) == (
        "no CUDA device: mixed precision off (no autocast), ignoring mixed_precision='bf16' from accelerate launch."
    )
    assert reconcile_precision(None, None, False, False, cuda=False) == (
        "no CUDA device: mixed precision off (no autocast), ignoring the recipe's bf16 (GRPOConfig's default when neither bf16 nor "
        "fp16 is set)."
    )
    assert reconcile_precision("no", False, False, True, cuda=True) is None
    assert reconcile_precision("fp16", False, False, True, cuda=True).startswith("use_cpu is set: mixed precision off")
    # GPU: accelerate and the recipe agree, or accelerate is off (the recipe decides): nothing to do
    for accelerate, bf16, fp16 in (
        ("bf16", True, False),
        ("bf16", None, False),
        ("fp16", False, True),
        ("no", True, False),
        (None, False, False),
    ):
        assert reconcile_precision(accelerate, bf16, fp16, False, cuda=True) is None
    with pytest.raises(
        RecipeError,
        match=r"mixed precision: accelerate launch asks for mixed_precision='bf16' \(the "
        r"accelerate config or --mixed_precision\) but the recipe trains in no \(bf16: false, fp16: "
        r"false \(fp32\)\)\. Make them agree: set bf16: true in the recipe, or pass --mixed_precision "
        r"no",
    ):
        reconcile_precision("bf16", False, False, False, cuda=True)
    with pytest.raises(
        RecipeError,
        match=r"asks for mixed_precision='fp16' .* trains in bf16 \(bf16 \(GRPOConfig's "
        r"default",
    ):
        reconcile_precision("fp16", None, False, False, cuda=True)


def test_accelerate_bf16_on_a_cpu_machine_trains_fp32_and_says_so(
    tmp_path, tiny_model_dir, monkeypatch, capsys, recipe_module
):
    """What `accelerate launch` with a bf16 config exports, and a recipe that leaves bf16 to TRL's default (True):
    without CUDA the run is fp32 (TrainingArguments would otherwise take bf16 from the environment)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    recipe = _recipe_folder(tmp_path, tiny_model_dir, use_cpu=False)
    keys = yaml.safe_load(open(recipe))
    del keys["bf16"]
    write_recipe(Path(recipe), **keys)
    assert main(["train", "--config", recipe, "--disable_tqdm", "true"]) == 0
    assert recipe_module() == {"bf16": False, "mixed_precision": "no"}
    err = capsys.readouterr().err
    note = (
        "trl-gspo train: no CUDA device: mixed precision off (no autocast), ignoring mixed_precision='bf16' from accelerate launch "
        "and the recipe's bf16 (GRPOConfig's default when neither bf16 nor fp16 is set)."
    )
    assert err.count(note) == 1, err


def test_gpu_precision_conflict_fails_before_launching(tmp_path, copy_jsonl, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    monkeypatch.setattr("subprocess.call", lambda cmd: calls.append(cmd) or 0)
    recipe = train_recipe(tmp_path, NO_MODEL, copy_jsonl, use_cpu=False)  # bf16: false in the recipe
    assert main(["train", "--config", recipe, "--accelerate_config", "zero2", "--num_processes", "2"]) == 2
    assert not calls  # stopped before any process started
    assert "accelerate launch asks for mixed_precision='bf16'" in _error_line(capsys.readouterr().err)
    assert main(["train", "--config", recipe, "--accelerate_config", "zero2", "--mixed_precision", "no"]) == 0
    assert calls and calls[0][calls[0].index("--mixed_precision") + 1] == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # the same inside `accelerate launch -m trl_gspo train`
    assert main(["train", "--config", recipe]) == 2
    assert "asks for mixed_precision='bf16'" in _error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------- version, warnings
def test_version_is_one_line_with_the_library_versions(capsys):
    from importlib import metadata

    import trl_gspo

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == (
        f"trl-gspo {trl_gspo.__version__} (trl {metadata.version('trl')}, transformers "
        f"{metadata.version('transformers')}, torch {metadata.version('torch')})\n"
    )


def test_gradient_checkpointing_deprecation_noise_is_filtered_in_the_cli_only(tmp_path, tiny_model_dir, copy_jsonl):
    import warnings

    from trl_gspo import GSPOConfig

    def deprecations(caught):
        return [
            str(w.message)
            for w in caught
            if "gradient_checkpointing" in str(w.message) and "deprecated" in str(w.message)
        ]

    recipe = train_recipe(tmp_path, tiny_model_dir, copy_jsonl, gradient_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--config", recipe, "--max_steps", "1", "--disable_tqdm", "true"]) == 0
        inside = deprecations(caught)
        GSPOConfig(str(tmp_path / "x"), use_cpu=True, bf16=False, report_to=[], gradient_checkpointing=True)
    if not deprecations(caught):
        pytest.skip("the installed transformers does not deprecate gradient_checkpointing: nothing to filter")
    assert inside == []  # the control above warned: outside the CLI (the filter is undone after it), the library does
