"""The `trl-gspo` parser on TRL's `TrlParser`: the script and demo arguments, unknown recipe keys and wrong value
types refused before any dataclass is built, and the mixed-precision decision taken from the recipe and flags
before the config exists (fp32 where there is no GPU).
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from ..config import GSPOConfig
from . import recipe_inputs
from .console import ConsoleArguments
from .demo import TASKS as DEMO_TASKS
from .recipe_inputs import RecipeError
from .shipped import load_recipe, recipe_with_bases, take_option


@dataclass
class GSPOScriptArguments(ScriptArguments, ConsoleArguments):
    """Script arguments of `trl-gspo train`: TRL's `ScriptArguments` (dataset_name, splits, ...), rewards and the
    console (cli/console.py).

    `dataset_name` may be a Hub id, a local folder (a `save_to_disk` folder or data files), or a local
    `.json`/`.jsonl`/`.parquet`/`.csv` file. The training split needs a `prompt` column.
    """

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: accuracy_reward, reasoning_accuracy_reward, think_format_reward (TRL's), "
            "math_accuracy_reward, demo_reward, addition_reward (ours), or a dotted import path such as my_pkg.rewards.my_reward."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Optional reward model (Hub id or local folder), used besides reward_funcs."}
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation set, given like dataset_name (a .json/.jsonl/.parquet/.csv file, a folder or a Hub id); "
            "its dataset_test_split is used, or its only split (a single file loads as 'train'). Without it, "
            "evaluation uses dataset_name's dataset_test_split."
        },
    )
    trainer_class: str | None = field(
        default=None,
        metadata={
            "help": "Dotted import path of a GSPOTrainer subclass to train with, e.g. one overriding the "
            "token_advantages hook for GSPO-token (see recipes/per_token_advantages.py). Modules next to the recipe "
            "file and in the working directory are importable. Default: GSPOTrainer."
        },
    )


@dataclass
class DemoArguments(ConsoleArguments):
    """Script arguments of `trl-gspo demo` (its tasks are built in code, cli/demo.py) and the console.

    `task`: `addition` trains a real model (SmolLM2-135M-Instruct by default, `model_name_or_path` for another) on
    two-digit addition; `copy` a tiny model built in code on digit copying. `eval_every` adds held-out scores during
    training (the accuracy curve).
    """

    task: str = field(
        default="copy",
        metadata={
            "help": "The demo's task: 'addition' (a real model, SmolLM2-135M-Instruct unless model_name_or_path says "
            "otherwise; recipe smollm2_addition) or 'copy' (the tiny model built in code; recipe demo).",
            "choices": list(DEMO_TASKS),
        },
    )
    num_train_prompts: int = field(default=2000, metadata={"help": "Training prompts drawn for the task."})
    num_eval_prompts: int = field(
        default=200, metadata={"help": "Held-out prompts, scored greedily (problems training never sees)."}
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Score the held-out prompts every this many optimizer steps as well (the curve in "
            "reward_curve.png and held_out.csv); 0: before and after training only. Each scoring is a greedy "
            "generation over num_eval_prompts, so it costs time."
        },
    )
    moe: bool = field(
        default=False, metadata={"help": "Copy task: a tiny Qwen3-MoE (4 experts, top-2) instead of dense."}
    )


#: `TrainingArguments` fields that transformers 5 removed or renamed, and what a recipe says instead: a recipe written for
#: transformers 4 would otherwise be told the closest valid spelling, which is no replacement.
REMOVED_KEYS = {
    "logging_dir": "transformers 5 removed it; TensorBoard writes under output_dir/runs/, or in the folder the "
    "TENSORBOARD_LOGGING_DIR environment variable names (in a recipe: `env: {TENSORBOARD_LOGGING_DIR: PATH}`); other "
    "trackers (report_to) keep their own settings",
    "warmup_ratio": "transformers 5 removed it; warmup_steps takes the ratio (a value below 1 is that fraction of the "
    "training steps, e.g. warmup_steps: 0.1)",
    "overwrite_output_dir": "transformers 5 removed it; training writes into output_dir whatever it holds: "
    "resume_from_checkpoint continues from a checkpoint there, another output_dir starts afresh",
    "evaluation_strategy": "transformers renamed it eval_strategy",
    "no_cuda": "transformers renamed it use_cpu",
    "per_gpu_train_batch_size": "transformers renamed it per_device_train_batch_size",
    "per_gpu_eval_batch_size": "transformers renamed it per_device_eval_batch_size",
    "push_to_hub_token": "transformers renamed it hub_token",
    "push_to_hub_model_id": "transformers renamed it hub_model_id",
}


def removed_key_problem(key: str, known, label: str) -> str | None:
    """`label` (how the message names `key`) and what replaces `key`, when it is a `REMOVED_KEYS` entry the parser
    does not know (`known`: the keys it knows); else None."""
    if key in known or key not in REMOVED_KEYS:
        return None
    return f"{label}: {REMOVED_KEYS[key]}."


#: Keys only `trl-gspo demo` knows: a recipe holding one is a demo recipe (`train` says so instead of "unknown key").
DEMO_ONLY_KEYS = tuple(DemoArguments.__dataclass_fields__.keys() - GSPOScriptArguments.__dataclass_fields__.keys())


def recipe_values(command: str, argv: list[str], keys: tuple[str, ...]) -> dict:
    """Raw values of `keys` from the recipe (with its bases), the command's defaults and flags, before any config
    class is built (building GSPOConfig already applies the mixed precision that `precision_note` decides on)."""
    recipe, rest = take_option(list(argv), "--config")
    parser = make_parser(command, recipe)
    if command == "demo":
        parser.set_defaults_with_config(**DEMO_TASKS["copy"].settings)
    if recipe is not None:
        config = load_recipe(Path(recipe))
        config.pop("env", None)
        parser.set_defaults_with_config(**config)
    namespace, _ = parser.parse_known_args(rest)
    return {key: getattr(namespace, key, None) for key in keys}


def precision_note(command: str, argv: list[str], accelerate: str | None) -> str | None:
    """`recipe_inputs.reconcile_precision` for this command line: None, or the fp32 note; raises on a GPU conflict."""
    import torch

    values = recipe_values(command, argv, ("bf16", "fp16", "use_cpu"))
    return recipe_inputs.reconcile_precision(accelerate, cuda=torch.cuda.is_available(), **values)


def reconcile_mixed_precision(command: str, argv: list[str]) -> list[str]:
    """In the training process, before the config is built: no mixed precision where there is no GPU (accelerate's
    `ACCELERATE_MIXED_PRECISION` set to "no", `--bf16 false --fp16 false` appended), saying so once (rank 0)."""
    note = precision_note(command, argv, os.environ.get("ACCELERATE_MIXED_PRECISION"))
    if note is None:
        return argv
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    if os.environ.get("RANK", "0") == "0":
        print(f"trl-gspo {command}: {note}", file=sys.stderr, flush=True)
    return [*argv, "--bf16", "false", "--fp16", "false"]


class GSPOParser(TrlParser):
    """`TrlParser` that rejects unknown recipe keys and checks value types before the dataclasses are built, follows a
    recipe's `extends`, and reports a command-line error in one line (argparse prints the whole usage first)."""

    recipe_dir: Path | None = None  # folder of the `--config` recipe: its `extends` base is looked up there first
    recipe_name: str = "RECIPE"  # how the `--config` recipe is named in messages

    def error(self, message: str):
        raise RecipeError(f"{message} (`{self.prog} --help` lists every key.)")

    def set_defaults_with_config(self, **config) -> list[str]:
        config = recipe_with_bases(config, self.recipe_dir)
        actions = {a.dest: a for a in self._actions if a.nargs != 0 and a.dest != "help"}  # nargs=0: --no_x twins
        for key, value in config.items():
            if key not in actions and key in DEMO_ONLY_KEYS:
                raise RecipeError(
                    f"this recipe is `trl-gspo demo`'s (its key {key!r} sets the demo's own task, built in code): run "
                    f"`trl-gspo demo --config {self.recipe_name}`, or give `train` a recipe with a model and a dataset."
                )
            if problem := removed_key_problem(key, actions, f"recipe key {key!r}"):
                raise RecipeError(problem)
            if key not in actions:
                close = difflib.get_close_matches(key, list(actions), n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise RecipeError(f"unknown recipe key {key!r}.{hint} (`--help` lists every valid key.)")
            _check_value(key, value, actions[key])
        return super().set_defaults_with_config(**config)


def _check_value(key, value, action) -> None:
    """Fail fast on a YAML value argparse would pass through unchecked (it converts only string defaults)."""
    if value is None:
        return
    items = value if isinstance(value, list) and action.nargs in ("+", "*") else [value]
    kind = getattr(action.type, "__name__", "")
    for item in items:
        if action.choices is not None and item not in action.choices:
            note = " (YAML reads unquoted no/yes/on/off as booleans: quote it)" if isinstance(item, bool) else ""
            close = difflib.get_close_matches(str(item), [str(c) for c in action.choices], n=1)
            hint = f" Did you mean {close[0]!r}?" if close and not note else ""
            raise RecipeError(f"{key}: {item!r} is not allowed{note}.{hint} Choose one of {list(action.choices)}.")
        if isinstance(item, str):
            continue  # argparse converts string values itself and names the flag if that fails
        ok = {
            "int": isinstance(item, int) and not isinstance(item, bool),
            "float": isinstance(item, (int, float)) and not isinstance(item, bool),
            "string_to_bool": isinstance(item, bool),
        }.get(kind, True)
        if not ok:
            wanted = {"int": "an integer", "float": "a number", "string_to_bool": "true or false"}[kind]
            raise RecipeError(f"{key}: expected {wanted}, got {item!r} ({type(item).__name__}).")


def make_parser(command: str, recipe: str | None = None) -> GSPOParser:
    """The command's parser; `recipe` (the `--config` file) is where `extends` bases are looked up first."""
    classes = (GSPOScriptArguments, GSPOConfig, ModelConfig, DatasetMixtureConfig)
    if command == "demo":
        classes = (DemoArguments, GSPOConfig, ModelConfig)
    parser = GSPOParser(classes, prog=f"trl-gspo {command}", allow_abbrev=False)
    if recipe is not None:
        parser.recipe_dir, parser.recipe_name = Path(recipe).parent, Path(recipe).stem
    return parser


def parse(command: str, argv: list[str], defaults: dict | None = None):
    """Parse `argv` (with `--config recipe.yaml`) into the command's dataclasses; errors become `RecipeError`."""
    recipe, _ = take_option(list(argv), "--config")
    parser = make_parser(command, recipe)
    if defaults:
        parser.set_defaults_with_config(**defaults)
    try:
        *parsed, extra = parser.parse_args_and_config(argv, return_remaining_strings=True)
    except RecipeError:
        raise
    except (ValueError, TypeError) as err:  # dataclass __post_init__ validation (GSPOConfig._validate, TRL, HF)
        raise RecipeError(str(err)) from err
    if extra:
        flags = [a.option_strings[0].lstrip("-") for a in parser._actions if a.option_strings]
        for token in extra:
            name = token[2:].partition("=")[0] if token.startswith("--") else ""
            if problem := removed_key_problem(name, flags, f"--{name}"):
                raise RecipeError(problem)
        close = difflib.get_close_matches(extra[0].lstrip("-"), flags, n=1)
        hint = f" Did you mean --{close[0]}?" if close else ""
        raise RecipeError(f"unknown argument(s) {' '.join(extra)}.{hint}")
    return parsed


def quiet_deepspeed_on_cpu(args) -> None:
    """A run that asked for the CPU tells DeepSpeed (when installed) so, before it is imported: otherwise DeepSpeed
    warns that it could not find a GPU."""
    if args.use_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
