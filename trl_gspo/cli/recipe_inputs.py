"""What a recipe points at, resolved and checked before any model loads (the CLI calls these; `cli/commands.py` has the parser).

- Paths: `model_name_or_path`, `dataset_name`, `eval_dataset_name`, `reward_model_name_or_path` and a `datasets:`
  entry's `path` / `data_files`, like `trainer_class` and dotted reward modules, are looked up next to the recipe
  first, then in the working directory; a value found in neither stays as written (a Hub id, a dataset builder).
- The model: a local folder must hold a `config.json` (or a PEFT `adapter_config.json`); a value that is no existing
  folder and no valid Hub id, or a Hub id missing from the local cache while `HF_HUB_OFFLINE` is set, fails in one
  line instead of a traceback from inside `from_pretrained`.
- Chat prompts: a dataset whose prompts are lists of messages needs a tokenizer with a chat template; the tokenizer is
  loaded (it loads before the model) and checked when the first row's prompt is a conversation.
- Resume: `resume_from_checkpoint` resolved as the trainer will (a complete checkpoint), and the checkpoint's
  config.json compared with the model's, so another model's checkpoint fails in one line before either loads.
- The evaluation set: `eval_dataset_name` (a file, a folder or a Hub id, like `dataset_name`), else the training
  dataset's `dataset_test_split`; an eval strategy without one fails naming the splits found.
- Reward columns: with `remove_unused_columns=True` TRL keeps only `prompt` / `image` / `images`, so a reward that
  reads another column would fail at the first step.
- Mixed precision: `accelerate launch` exports its config's `mixed_precision` (or `--mixed_precision`) as
  `ACCELERATE_MIXED_PRECISION`, and TrainingArguments takes it whenever the recipe's `bf16`/`fp16` are off: a bf16
  accelerate config silently trains an fp32 recipe in bf16 under DDP, and fails after the model loads under DeepSpeed
  (its bf16 check). `reconcile_precision` decides: without CUDA (or with `use_cpu`) mixed precision is off (no
  autocast) and one line says what was turned off, the weights' dtype aside (the trainer's precision line says what
  runs: guards/precision.py); on GPUs an accelerate precision that is not the recipe's is an error naming both.
"""

from __future__ import annotations

from pathlib import Path

from ..guards import checkpointing


class RecipeError(ValueError):
    """A recipe or command line the CLI rejects before loading any model; the message names the key."""


# ------------------------------------------------------------------------------------------------------ paths
def resolve_path(value, recipe_dir: Path | None):
    """`value` as a path next to the recipe if one exists there, else in the working directory if one exists there,
    else unchanged (absolute paths, `~`, Hub ids and builder names such as `json` included)."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    for base in ((recipe_dir,) if recipe_dir is not None else ()) + (Path.cwd(),):
        candidate = base / path
        if candidate.exists():
            return str(candidate.resolve())
    return value


def _resolve_files(value, recipe_dir):
    """`data_files` as datasets accepts it: a path, a list of paths, or a dict of split -> path(s)."""
    if isinstance(value, dict):
        return {split: _resolve_files(files, recipe_dir) for split, files in value.items()}
    if isinstance(value, list):
        return [resolve_path(item, recipe_dir) for item in value]
    return resolve_path(value, recipe_dir)


def resolve_recipe_paths(script_args, model_args, mixture, recipe_dir: Path | None) -> None:
    """Resolve every path-valued key of the parsed recipe in place (see the module docstring)."""
    model_args.model_name_or_path = resolve_path(model_args.model_name_or_path, recipe_dir)
    for key in ("dataset_name", "eval_dataset_name", "reward_model_name_or_path"):
        setattr(script_args, key, resolve_path(getattr(script_args, key), recipe_dir))
    for entry in getattr(mixture, "datasets", None) or []:
        entry.path = resolve_path(entry.path, recipe_dir)
        entry.data_files = _resolve_files(entry.data_files, recipe_dir)


# ------------------------------------------------------------------------------------------------------ model
def _looks_like_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1 or value.endswith("/")


def check_model_source(key: str, value: str, recipe_dir: Path | None) -> None:
    """Fail in one line when `value` (already through `resolve_path`) cannot be loaded: a folder without a model, a
    path that does not exist, an invalid Hub id, or a Hub id absent from the cache in offline mode."""
    path = Path(value).expanduser()
    where = f"next to the recipe ({recipe_dir}) or " if recipe_dir is not None else ""
    if path.is_dir():
        if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
            raise RecipeError(
                f"{key}={value!r} is a folder without config.json (not a saved model); give the folder "
                "save_pretrained wrote, or a Hub id."
            )
        return
    if path.exists():
        raise RecipeError(f"{key}={value!r} is a file; give the model's folder (with config.json) or a Hub id.")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problem = None
    if _looks_like_path(value):
        problem = "no such folder"
    else:
        try:
            validate_repo_id(value)
        except HFValidationError:
            problem = "no such folder, and not a valid Hub id (org/name)"
    if problem is not None:
        raise RecipeError(
            f"{key}={value!r}: {problem} {where}in the working directory ({Path.cwd()}); give an "
            "existing model folder (relative paths: next to the recipe, then the working directory) or a "
            "Hub id."
        )
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(value, "config.json"), str):
        raise RecipeError(
            f"{key}={value!r}: not a local folder ({where}in the working directory), and HF_HUB_OFFLINE is set but "
            "the Hugging Face cache holds no copy of it; download it first (`hf download ...`) or give a local folder."
        )


# ------------------------------------------------------------------------------------------- chat prompts
def first_row(dataset) -> dict | None:
    """The first row of a dataset (a streamed one included), or None when it is empty or absent."""
    if dataset is None:
        return None
    if hasattr(dataset, "__len__"):
        return dataset[0] if len(dataset) else None
    return next(iter(dataset), None)


def check_chat_template(dataset, split: str, model: str, revision=None, trust_remote_code=False) -> None:
    """Chat prompts (the first row's `prompt` is a list of messages) need a chat template in the model's tokenizer,
    which TRL applies at the first generation; check it once the tokenizer is loaded, as TRL loads it."""
    from trl.data_utils import is_conversational

    row = first_row(dataset)
    if row is None or not is_conversational(row):
        return
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # e.g. a PEFT adapter folder: TRL loads the tokenizer of its base model
        return
    tokenizer = getattr(processor, "tokenizer", processor)
    if getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None):
        return
    raise RecipeError(
        f"dataset split {split!r}: the prompts are chat messages (lists of role/content), but the tokenizer of "
        f"model_name_or_path={model!r} has no chat template to turn them into text. Give the model folder one (a "
        "chat_template.jinja file next to tokenizer_config.json, e.g. the template of the model's instruct version), "
        "or write each prompt as plain text (a string)."
    )


# ------------------------------------------------------------------------------------------------- resume
def check_resume(resume_from_checkpoint, output_dir: str, model: str, revision=None, trust_remote_code=False) -> None:
    """`resume_from_checkpoint` as the trainer will resolve it: a complete checkpoint, or a RecipeError saying why
    not; and, where the model's config can be read, a checkpoint of another model refused (which fields differ)."""
    from transformers import AutoConfig

    try:
        checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, output_dir)
    except checkpointing.ResumeError as err:
        raise RecipeError(str(err)) from err
    if checkpoint is None:
        return
    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # e.g. a PEFT adapter folder: the trainer compares once the model is built
        return
    if problem := checkpointing.checkpoint_model_mismatch(checkpoint, config, f"model_name_or_path={model!r}"):
        raise RecipeError(problem)


# ---------------------------------------------------------------------------------------------- eval split
def eval_split_problem(eval_strategy: str, split: str, splits: list[str], default_split: str) -> str | None:
    """Why the training dataset cannot supply the evaluation set, or None (see `pick_eval_split` for eval files)."""
    if split in splits:
        return None
    if eval_strategy != "no":
        return (
            f"eval_strategy={eval_strategy!r} needs an evaluation set, but the dataset has no {split!r} split "
            f"(dataset_test_split; splits found: {splits}). Give an eval file or dataset with eval_dataset_name, set "
            f"dataset_test_split to one of {splits}, or set eval_strategy: 'no'."
        )
    if split != default_split:  # set on purpose, yet missing: say so even though nothing evaluates
        return f"dataset_test_split={split!r} not found; the dataset has splits {splits}."
    return None


def pick_eval_split(name: str, split: str, splits: list[str]) -> str:
    """The split of an `eval_dataset_name` dataset to evaluate on: `dataset_test_split` if it has it, else its only
    split (a single file loads as `train`)."""
    if split in splits:
        return split
    if len(splits) == 1:
        return splits[0]
    raise RecipeError(
        f"eval_dataset_name={name!r} has splits {splits} and none is dataset_test_split={split!r}; set "
        "dataset_test_split to the one to evaluate on."
    )


# ---------------------------------------------------------------------------------------- reward columns
#: Columns GRPOTrainer keeps when `remove_unused_columns=True` (its `_set_signature_columns_if_needed`).
KEPT_COLUMNS = ("prompt", "image", "images")


def removed_columns_problem(reward_names: dict[str, list[str]], columns: list[str]) -> str | None:
    """`reward_names` maps each reward to the columns it needs (present in the dataset): with
    `remove_unused_columns=True` those outside `KEPT_COLUMNS` never reach it."""
    for name, needed in reward_names.items():
        dropped = [column for column in needed if column in columns and column not in KEPT_COLUMNS]
        if dropped:
            return (
                f"remove_unused_columns=True removes the dataset column(s) {dropped} that reward {name!r} reads "
                f"(GRPOTrainer keeps only {list(KEPT_COLUMNS)}); set remove_unused_columns: false (GSPOConfig's default)."
            )
    return None


# ------------------------------------------------------------------------------------------ mixed precision
def recipe_precision(bf16, fp16) -> tuple[str, str]:
    """(precision, how the recipe says it): TRL's GRPOConfig turns bf16 on when neither bf16 nor fp16 is set."""
    if fp16:
        return "fp16", "fp16: true"
    if bf16 is None:
        return "bf16", "bf16 (GRPOConfig's default when neither bf16 nor fp16 is set)"
    return ("bf16", "bf16: true") if bf16 else ("no", "bf16: false, fp16: false (fp32)")


def reconcile_precision(accelerate: str | None, bf16, fp16, use_cpu, cuda: bool) -> str | None:
    """Decide the run's precision from accelerate's (`ACCELERATE_MIXED_PRECISION`, None when not launched by it) and
    the recipe's. Returns None (nothing to change), or a note: mixed precision off (the caller turns both off and
    prints it). Raises RecipeError on GPUs when accelerate asks for a mixed precision the recipe does not use."""
    wanted, said = recipe_precision(bf16, fp16)
    accelerate = (accelerate or "no").lower()
    if not cuda or use_cpu:
        ignored = [f"mixed_precision={accelerate!r} from accelerate launch"] if accelerate != "no" else []
        if wanted != "no":
            ignored.append(f"the recipe's {said}")
        if not ignored:
            return None
        return (
            f"{'no CUDA device' if not cuda else 'use_cpu is set'}: mixed precision off (no autocast), ignoring "
            f"{' and '.join(ignored)}."
        )
    if accelerate != "no" and accelerate != wanted:
        flag = {"no": "bf16: false", "bf16": "bf16: true", "fp16": "fp16: true"}[accelerate]
        raise RecipeError(
            f"mixed precision: accelerate launch asks for mixed_precision={accelerate!r} (the accelerate config or "
            f"--mixed_precision) but the recipe trains in {wanted} ({said}). Make them agree: set {flag} in the "
            f"recipe, or pass --mixed_precision {wanted} (or edit mixed_precision in the accelerate config)."
        )
    return None
