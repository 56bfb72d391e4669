"""`trl-gspo` command line, on TRL's `TrlParser` like `trl grpo`.

    trl-gspo demo    [--config demo] [--flag value ...]                   # SmolLM2 on addition; --config demo: tiny
    trl-gspo train   --config RECIPE [--accelerate_config zero2] [--flag value ...]   # any model / dataset / reward
    trl-gspo check                                                        # versions + parity with stock GRPOTrainer
    trl-gspo recipes [DEST] [--list] [--force]                            # copy the shipped recipes out for editing

`--config` and `--accelerate_config` take a path, or a name: `NAME.yaml` in the working directory, then
`recipes/NAME.yaml` (`accelerate_configs/NAME.yaml`) below it, where `trl-gspo recipes` copies the shipped files, then
the shipped file (the repository's top-level `recipes/` and `accelerate_configs/`, installed inside the package); a
value with a folder part is a path and must exist. The first line a command prints names the recipe file it loaded.
Without `--accelerate_config` the command runs in the current process (what `accelerate launch -m trl_gspo train ...`
runs on each rank); with it, the command relaunches itself under `accelerate launch`, like `trl grpo`.
A recipe's keys are the fields of `GSPOConfig` (every `GRPOConfig`/`TrainingArguments` field), TRL's `ModelConfig`
(model, dtype, `use_peft`, `lora_*`), TRL's dataset mixture (`datasets:`) and the script arguments below; command
line flags override the recipe. Unlike TRL's parser, a key no class knows is an error (with the closest valid key),
and values of the wrong type fail before anything is loaded. A recipe may start from another with
`extends: NAME|PATH` (a file next to it first, then a shipped recipe): the base's keys apply, then its own, so a
variant lists only what differs.
Paths in a recipe (data files, model folders, modules) are looked up next to the recipe first, then in the working
directory; what a recipe points at is checked before any model loads (`cli/recipe_inputs.py`).

Here: the commands, `main` and the `accelerate launch` relaunch. Shipped files and `extends` are shipped.py; the
parser, its argument classes and the mixed-precision decision are parser.py.
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from pathlib import Path

from .. import __version__
from ..common import engine, model_store, trl_compat
from ..common.engine import quiet_deepspeed_collectives
from ..common.imports import import_object
from ..common.validation import check_int
from ..guards.checkpointing import ResumeError
from ..rollout.vllm_setup import check_vllm_setup
from ..trainer import GSPOTrainer
from . import failures, recipe_inputs, run_model
from .check import main as check_main
from .console import (
    final_eval_line,
    generation_line,
    library_bars_off_terminal,
    progress_bar_default,
    quiet_library_deprecations,
    quiet_saving,
    tied_weights_restored,
    use_console,
)
from .demo import TASKS as DEMO_TASKS
from .demo import run_demo
from .models import main as models_main
from .parser import (
    GSPOScriptArguments,
    parse,
    precision_note,
    quiet_deepspeed_on_cpu,
    recipe_values,
    reconcile_mixed_precision,
)
from .recipe_inputs import RecipeError
from .resources import (
    deepspeed_cpu_problem,
    oversubscription,
    pick_threads,
    resources_line,
    single_process_note,
    threads_source,
)
from .rewards import missing_columns, needed_columns, resolve_reward
from .run_notes import precision_line, precision_refusal_as_recipe_error, say_deepspeed_builds
from .shipped import SHIPPED, is_shipped, resolve_config_argument, resolve_shipped, shipped_names, take_option

#: `accelerate launch` options `--accelerate_config` runs accept besides the config (none is a recipe key).
LAUNCH_OPTIONS = (
    "--num_processes",
    "--num_machines",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
    "--mixed_precision",
)


def launch_with_accelerate(command: str, argv: list[str]) -> int | None:
    """With `--accelerate_config NAME|PATH` in argv, rerun `trl-gspo COMMAND` under `accelerate launch` and return
    its exit code (like `trl grpo --accelerate_config zero2`); without it, None (run in this process)."""
    config, argv = take_option(argv, "--accelerate_config")
    if config is None:
        refuse_launch_options(argv)
        return None
    config_file = resolve_shipped(config, "accelerate config")
    launch, given = ["--config_file", str(config_file)], {}
    for option in LAUNCH_OPTIONS:
        value, argv = take_option(argv, option)
        if value is not None:
            launch += [option, value]
            given[option] = value
    import yaml

    with open(config_file) as f:
        accelerate = yaml.safe_load(f) or {}
    given.setdefault("--mixed_precision", accelerate.get("mixed_precision"))
    recipe_argv = resolve_config_argument(argv)[0]
    check_deepspeed_device(command, recipe_argv, accelerate.get("distributed_type") == "DEEPSPEED")  # once, here
    precision_note(command, recipe_argv, given["--mixed_precision"])  # a precision conflict on GPUs fails here too
    import subprocess

    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "trl_gspo", command, *argv]
    return subprocess.call(cmd)


def check_deepspeed_device(command: str, argv: list[str], deepspeed: bool) -> None:
    """DeepSpeed on a machine without CUDA and a recipe without `use_cpu: true`: a RecipeError (resources.py)."""
    import torch

    use_cpu = recipe_values(command, argv, ("use_cpu",))["use_cpu"] if deepspeed else None
    if problem := deepspeed_cpu_problem(deepspeed, use_cpu, torch.cuda.is_available()):
        raise RecipeError(problem)


def refuse_launch_options(argv: list[str]) -> None:
    """A launch option (`--num_processes 2`) without `--accelerate_config`: say where it goes instead of "unknown
    argument"."""
    for index, token in enumerate(argv):
        option, _, value = token.partition("=")
        if option in LAUNCH_OPTIONS:
            value = value or (argv[index + 1] if index + 1 < len(argv) else "N")
            raise RecipeError(
                f"{option} {value} is an option of `accelerate launch`, which trl-gspo runs only with "
                "--accelerate_config: add --accelerate_config multi_gpu (DDP; without a CUDA device its processes run "
                "on the CPU) or another accelerate config (`trl-gspo recipes --list` lists them)."
            )


def say_recipe(command: str, recipe: Path | None) -> None:
    """The console's first line: which recipe file this run loaded (rank 0 only)."""
    if os.environ.get("RANK", "0") != "0":
        return
    text = "no recipe (--config)" if recipe is None else f"recipe {recipe}{' (shipped)' if is_shipped(recipe) else ''}"
    print(f"trl-gspo {command}: {text}", flush=True)


def say_resources(command: str, args, threads_note: str) -> None:
    """The console's line on what the run runs on (processes, devices, threads on CPU; main process only), and a
    warning when that is not what was likely meant (more threads than cores, a single process under accelerate)."""
    if args.process_index != 0:
        return
    print(f"trl-gspo {command}: {resources_line(args.world_size, args.device, threads_note)}", flush=True)
    for note in (oversubscription(args.world_size, args.device), single_process_note(args.world_size, command)):
        if note is not None:
            print(f"trl-gspo {command}: warning: {note}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- demo
#: The recipe plain `trl-gspo demo` runs: the real model. `--config demo` runs the tiny model's copy task.
DEFAULT_DEMO_RECIPE = "smollm2_addition.yaml"


def demo(argv: list[str]) -> int:
    from trl import get_peft_config

    launched = launch_with_accelerate("demo", argv)
    if launched is not None:
        return launched
    argv, recipe = resolve_config_argument(argv)
    if recipe is None:  # plain `trl-gspo demo` runs the shipped recipe (not a copy that happens to be here)
        argv, recipe = resolve_config_argument(["--config", str(SHIPPED["recipe"] / DEFAULT_DEMO_RECIPE), *argv])
    say_recipe("demo", recipe)
    check_deepspeed_device("demo", argv, engine.uses_deepspeed(os.environ))  # launched without our relaunch
    argv = reconcile_mixed_precision("demo", argv)
    say_deepspeed_builds("demo")
    task = recipe_values("demo", argv, ("task",))["task"]
    if task not in DEMO_TASKS:
        raise RecipeError(f"task={task!r}; allowed: {', '.join(DEMO_TASKS)}.")
    defaults = {**DEMO_TASKS[task].settings, "output_dir": "outputs/demo", **progress_bar_default()}
    demo_args, args, model_args = parse("demo", argv, defaults=defaults)
    try:
        check_int("eval_every", demo_args.eval_every, 0, "0: held-out scores before and after training only")
    except ValueError as err:
        raise RecipeError(str(err)) from err
    quiet_deepspeed_on_cpu(args)
    threads = DEMO_TASKS[task].threads
    if threads is None:
        say_resources("demo", args, threads_source())
    else:
        why = "the demo's choice for its tiny model; OMP_NUM_THREADS overrides"
        say_resources("demo", args, pick_threads(threads, why))
    result = run_demo(
        args.output_dir,
        demo_args.num_train_prompts,
        demo_args.num_eval_prompts,
        demo_args.moe,
        args=args,
        peft_config=get_peft_config(model_args),
        console=demo_args.console,
        task=task,
        model_name_or_path=model_args.model_name_or_path,
        eval_every=demo_args.eval_every,
    )
    trl_compat.end_training(result["trainer"])  # trackers and process group, as `trl grpo` does
    return 0


# ---------------------------------------------------------------------------------------------------- train
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_any_dataset(name: str, config: str | None = None, streaming: bool = False):
    """A Hub id, a local folder, or a local data file -> `DatasetDict` (a single file becomes split `train`)."""
    from datasets import load_dataset, load_from_disk

    path = Path(name).expanduser()
    if path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise RecipeError(f"dataset_name={name!r}: unsupported file type; use one of {sorted(DATA_FILE_BUILDERS)}.")
        return load_dataset(builder, data_files=str(path), streaming=streaming)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return load_from_disk(str(path))  # a folder written by `save_to_disk`
    return load_dataset(name, name=config, streaming=streaming)


def resolve_rewards(script_args, search_dirs: tuple = ()) -> list:
    funcs = [resolve_reward(name, search_dirs) for name in script_args.reward_funcs or []]
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    if not funcs:
        raise RecipeError("no reward: set reward_funcs (and/or reward_model_name_or_path) in the recipe.")
    return funcs


def check_columns(dataset, reward_funcs, split: str, remove_unused_columns: bool = False) -> None:
    """The prompt column and every column a reward function needs must exist, and survive `remove_unused_columns`,
    before a model is loaded."""
    from trl.data_utils import get_dataset_column_names

    columns = get_dataset_column_names(dataset)
    if "prompt" not in columns:
        raise RecipeError(f"dataset split {split!r} has no 'prompt' column (columns: {columns}); GSPO needs one.")
    needs = {}  # reward name -> the dataset columns it reads
    for func in reward_funcs:
        if not callable(func):
            continue
        name = getattr(func, "__name__", repr(func))
        if missing := missing_columns(func, columns):
            raise RecipeError(f"reward {name!r} needs dataset column(s) {missing}; split {split!r} has {columns}.")
        required, one_of = needed_columns(func)
        needs[name] = [*required, *(column for column in one_of if column in columns)]
    if remove_unused_columns and (problem := recipe_inputs.removed_columns_problem(needs, columns)):
        raise RecipeError(problem)


def load_eval_set(script_args, args, dataset):
    """The evaluation set, or None: `eval_dataset_name` if given, else `dataset_test_split` of the training dataset;
    an eval strategy without one (or a `dataset_test_split` set to a split that does not exist) is a RecipeError."""
    split, strategy = script_args.dataset_test_split, str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if script_args.eval_dataset_name:
        name = script_args.eval_dataset_name
        if strategy == "no":
            raise RecipeError(
                f"eval_dataset_name={name!r} is set but eval_strategy is 'no', so nothing would evaluate on it; set "
                "eval_strategy: 'steps' (with eval_steps) or 'epoch', or remove eval_dataset_name."
            )
        eval_data = load_any_dataset(name, None, script_args.dataset_streaming)
        return eval_data[recipe_inputs.pick_eval_split(name, split, list(eval_data))]
    default = GSPOScriptArguments.__dataclass_fields__["dataset_test_split"].default
    if problem := recipe_inputs.eval_split_problem(strategy, split, list(dataset), default):
        raise RecipeError(problem)
    return dataset[split] if strategy != "no" else None


def resolve_trainer_class(path: str | None, search_dirs: tuple = ()):
    """`trainer_class` -> a GSPOTrainer subclass, imported by dotted path (never evaluated); modules in
    `search_dirs` (the recipe's folder) and in the working directory are importable."""
    if path is None:
        return GSPOTrainer
    try:
        cls = import_object(path, search_dirs)
    except ValueError as err:
        raise RecipeError(f"trainer_class: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, GSPOTrainer)):
        raise RecipeError(f"trainer_class={path!r} is not a subclass of trl_gspo.GSPOTrainer.")
    return cls


def train(argv: list[str]) -> int:
    from trl import get_dataset, get_peft_config, get_quantization_config

    launched = launch_with_accelerate("train", argv)
    if launched is not None:
        return launched
    argv, recipe = resolve_config_argument(argv)
    say_recipe("train", recipe)
    recipe_dir = recipe.parent if recipe is not None else None
    search_dirs = (str(recipe_dir),) if recipe is not None else ()  # a recipe's own modules sit next to it
    check_deepspeed_device("train", argv, engine.uses_deepspeed(os.environ))  # launched without our relaunch
    argv = reconcile_mixed_precision("train", argv)
    say_deepspeed_builds("train")
    script_args, args, model_args, mixture = parse("train", argv, defaults=progress_bar_default())
    quiet_deepspeed_on_cpu(args)
    say_resources("train", args, threads_source())
    if not model_args.model_name_or_path:
        raise RecipeError("model_name_or_path is required (a Hub id or a local folder).")
    recipe_inputs.resolve_recipe_paths(script_args, model_args, mixture, recipe_dir)
    resolved = None
    if model_args.model_name_or_path in model_store.OFFLINE_SOURCES:  # the Hub, or the copy prepared for offline use
        # once per node, the same on every rank of a node, at the recipe's model_revision
        resolved = run_model.resolve_for_run(model_args.model_name_or_path, args, model_args.model_revision)
        if run_model.resolves_here(args):
            print(f"trl-gspo train: {resolved.note}", flush=True)
        model_args.model_name_or_path = resolved.path
        if resolved.revision:  # the snapshot the record names, not whatever the Hub's main is when the model loads
            model_args.model_revision = resolved.revision
    try:
        reward_funcs = resolve_rewards(script_args, search_dirs)
    except ValueError as err:
        raise RecipeError(str(err)) from err
    trainer_cls = resolve_trainer_class(script_args.trainer_class, search_dirs)
    if mixture.datasets:
        dataset = get_dataset(mixture)
    elif script_args.dataset_name:
        dataset = load_any_dataset(script_args.dataset_name, script_args.dataset_config, script_args.dataset_streaming)
    else:
        raise RecipeError("no dataset: set dataset_name (Hub id, folder or file) or a `datasets:` list.")
    split = script_args.dataset_train_split
    if split not in dataset:
        raise RecipeError(f"dataset_train_split={split!r} not found; the dataset has splits {list(dataset)}.")
    check_columns(dataset[split], reward_funcs, split, args.remove_unused_columns)
    eval_set = load_eval_set(script_args, args, dataset)
    if eval_set is not None:
        check_columns(eval_set, reward_funcs, "eval", args.remove_unused_columns)
    recipe_inputs.check_model_source("model_name_or_path", model_args.model_name_or_path, recipe_dir)
    loading = dict(revision=model_args.model_revision, trust_remote_code=args.trust_remote_code)
    for name, data in ((split, dataset[split]), ("eval", eval_set)):  # the tokenizer loads first: chat prompts
        recipe_inputs.check_chat_template(data, name, model_args.model_name_or_path, **loading)
    recipe_inputs.check_resume(args.resume_from_checkpoint, args.output_dir, model_args.model_name_or_path, **loading)
    if script_args.reward_model_name_or_path:
        recipe_inputs.check_model_source("reward_model_name_or_path", script_args.reward_model_name_or_path, recipe_dir)
    try:
        check_vllm_setup(args, model_args.model_name_or_path)  # before the model loads and vLLM starts
    except ValueError as err:
        raise RecipeError(str(err)) from err

    # Same model loading switches as `trl grpo`; trust_remote_code stays False unless the recipe sets it.
    args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(args.model_init_kwargs or {}),
    }
    with failures.removed_if_left_empty(args.output_dir):
        with precision_refusal_as_recipe_error():
            trainer = trainer_cls(
                model=model_args.model_name_or_path,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=dataset[split],
                eval_dataset=eval_set,
                peft_config=get_peft_config(model_args),
                quantization_config=get_quantization_config(model_args),
            )
        use_console(trainer, script_args.console)
        trainer.accelerator.print(f"trl-gspo train: {generation_line(trainer)}")
        trainer.accelerator.print(precision_line("train", trainer))
        if resolved is not None and trainer.accelerator.is_main_process:  # now: a run that crashes still has it
            run_model.write_record(resolved, args.output_dir)
        with tied_weights_restored(trainer):
            trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if eval_set is not None:
        trainer.accelerator.print(final_eval_line(trainer, eval_set))
    with quiet_saving(script_args.console):
        trainer.save_model(args.output_dir)
    trainer.accelerator.print(f"Model saved to {args.output_dir}")
    trl_compat.end_training(trainer)
    return 0


# -------------------------------------------------------------------------------------------------- recipes
#: What `trl-gspo recipes` copies out: recipes and configs, the modules beside them, example data (custom_task.jsonl).
COPIED = (".yaml", ".py", ".jsonl")


def recipes(argv: list[str]) -> int:
    """Copy the shipped recipes and accelerate configs to DEST/recipes and DEST/accelerate_configs for editing."""
    import argparse

    parser = argparse.ArgumentParser(prog="trl-gspo recipes", description=recipes.__doc__)
    parser.add_argument("dest", nargs="?", default=".", help="folder to copy into (default: the working directory)")
    parser.add_argument("--list", action="store_true", help="only list the shipped files and where they are")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist in DEST")
    options = parser.parse_args(argv)
    files = [path for folder in SHIPPED.values() for path in sorted(folder.iterdir()) if path.suffix in COPIED]
    if options.list:
        for kind, folder in SHIPPED.items():
            print(f"{kind}s ({folder}):  {', '.join(shipped_names(kind))}")
        return 0
    dest = Path(options.dest)
    targets = [dest / path.parent.name / path.name for path in files]
    existing = [str(target) for target in targets if target.exists()]
    if existing and not options.force:
        raise RecipeError(f"would overwrite {', '.join(existing)}; pass --force, or copy into another folder.")
    for path, target in zip(files, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    print(
        f"copied {len(files)} files to {dest / 'recipes'} and {dest / 'accelerate_configs'}; in {dest} (or in its "
        f"recipes/ folder) `--config NAME` now runs the copy, and from elsewhere `--config {dest / 'recipes'}/NAME.yaml`."
    )
    return 0


def check(argv: list[str]) -> int:
    return check_main(argv)


def models(argv: list[str]) -> int:
    return models_main(argv)


COMMANDS = {"demo": demo, "train": train, "check": check, "recipes": recipes, "models": models}
USAGE = """usage: trl-gspo {demo,train,check,recipes,models} [...]    (trl-gspo --version: versions in one line)

  demo     train SmolLM2-135M-Instruct on two-digit addition (CPU); prints held-out accuracy before/during/after;
           --config demo: a tiny model built in code on a digit-copy task (~2 min on 2 cores, no downloads)
  train    GSPO on any model/dataset/reward described by a recipe: --config NAME|PATH [--accelerate_config NAME|PATH]
  check    print the installed versions and compare our loss and gradients with the installed stock GRPOTrainer
  recipes  copy the shipped recipes and accelerate configs out for editing (--list to list them)
  models   prepare: make SmolLM2-135M-Instruct loadable offline (once); list: where each known model resolves

`trl-gspo COMMAND --help` lists every key. Shipped recipes: trl-gspo recipes --list. Multi-GPU / DeepSpeed:
  trl-gspo train --config qwen3_1p7b_math_zero2 --accelerate_config zero2
"""


def version_line() -> str:
    """`trl-gspo --version`: this package and the libraries that decide its behaviour, in one line."""
    from importlib import metadata

    others = ", ".join(f"{name} {metadata.version(name)}" for name in ("trl", "transformers", "torch"))
    return f"trl-gspo {__version__} ({others})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V"):
        print(version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"trl-gspo: unknown command {command!r}.{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    with warnings.catch_warnings(), library_bars_off_terminal():  # the caller's settings come back afterwards
        quiet_library_deprecations()
        quiet_deepspeed_collectives(os.environ)
        try:
            return COMMANDS[command](rest)
        except (RecipeError, ResumeError) as err:  # ResumeError: the demo's resume, checked by the trainer itself
            print(f"trl-gspo {command}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as err:  # Ctrl-C: where the checkpoint is, not a traceback (cli/failures.py)
            return failures.report_interrupt(command, err)
        except Exception as err:
            if (reward_error := failures.reward_failure(err)) is None:
                raise
            return failures.report_reward_failure(command, reward_error)
