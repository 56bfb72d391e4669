"""A console a person can read: the progress bar plus one short line per logging step.

transformers prints the whole log dict on every logging step (`ProgressCallback.on_log`, or `PrinterCallback` with
`disable_tqdm`): with TRL's and GSPO's metrics that is 40+ numbers, ~2 KB a line. `CompactProgressCallback` and
`CompactPrinterCallback` are those two callbacks with `on_log` replaced by :func:`format_line`, which keeps the
numbers people watch while a run goes:

    step 40/2000 | reward 0.412 ± 0.213 | clip seq 0.106 tok 0.104 | entropy 3.846 | len 2.9 | grad 0.86 | 0.021 s/step

Only the printing changes. The log dict itself is untouched, so every `report_to` logger, `trainer.state.log_history`
(and the demo's `metrics.csv`) still get every metric. `trl-gspo demo` and `trl-gspo train` use this console;
`--console stock` keeps transformers' callbacks. In a script: `use_console(trainer, "compact")` after building the
trainer.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import sys
import warnings
from dataclasses import dataclass, field

from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.utils import logging as hf_logging

from ..common.validation import check_choice

CONSOLE_MODES = ("compact", "stock")

#: The line's groups, in order: (label, ((part label, log key, format), ...)). A part whose key is absent from a log
#: is left out, and so is a group with no part present (e.g. `kl` only appears with `beta > 0`). Of several groups
#: with one label the first present is shown: GSPO's clip fractions (guards/diagnostics.py, per sequence and per token at
#: every level), else TRL's `clip_ratio/region_mean` (diagnostics off).
GROUPS = (
    ("reward", (("", "reward", "{:.3f}"), ("±", "reward_std", "{:.3f}"))),
    ("clip", (("seq", "clip_fraction/sequence/total", "{:.3f}"), ("tok", "clip_fraction/token/total", "{:.3f}"))),
    ("clip", (("", "clip_ratio/region_mean", "{:.3f}"),)),
    ("entropy", (("", "entropy", "{:.3f}"),)),
    ("kl", (("", "kl", "{:.3g}"),)),
    ("len", (("", "completions/mean_length", "{:.1f}"),)),
    ("grad", (("", "grad_norm", "{:.3g}"),)),
)
#: TRL's mean seconds per optimizer step over the logging window (generation included).
STEP_TIME = "step_time"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _groups(logs: dict, prefix: str = "") -> dict[str, str]:
    groups = {}
    for label, parts in GROUPS:
        values = [(name, fmt.format(logs[prefix + key])) for name, key, fmt in parts if _number(logs.get(prefix + key))]
        if values and label not in groups:
            groups[label] = " ".join([label, *(f"{name} {text}".strip() for name, text in values)])
    if _number(logs.get(prefix + STEP_TIME)):
        seconds = logs[prefix + STEP_TIME]
        groups[STEP_TIME] = f"{seconds:.3f} s/step" if seconds < 10 else f"{seconds:.1f} s/step"
    return groups


def format_line(logs: dict, step: int, max_steps: int, first_step: int = 0) -> str:
    """One line for one log dict: a training log, an evaluation log (`eval_*` keys), or the end-of-training summary.

    `first_step`: the step this `train()` call started from (a resumed run's checkpoint), so that the summary counts
    the steps this run trained. A log with none of the known fields (e.g. a custom `trainer.log({...})`) is printed
    whole, as transformers does.
    """
    if "train_runtime" in logs:  # Trainer's summary after the last step
        steps, seconds = step - first_step, logs["train_runtime"]
        resumed = f", resumed at step {first_step}" if first_step else ""
        rate = f" ({steps / seconds:.3g} steps/s{resumed})" if seconds > 0 and steps > 0 else ""
        return f"done: {steps} steps in {seconds:.1f} s{rate}"
    prefix = "eval_" if any(key.startswith("eval_") for key in logs) else ""
    groups = _groups(logs, prefix)
    if not groups:
        return str({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"})
    counter = f"{step:>{len(str(max_steps))}}/{max_steps}" if max_steps and max_steps > 0 else str(step)
    return " | ".join([f"{'eval ' if prefix else ''}step {counter}", *groups.values()])


class _CompactLines:
    """What both compact callbacks share: the step a run started from, and transformers' per-file progress bars (e.g.
    "Writing model shards" at every checkpoint) kept off while training, so only the compact lines are printed."""

    first_step, _bars = 0, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step, self._bars = state.global_step, hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        return super().on_train_begin(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self._bars:
            hf_logging.enable_progress_bar()
        return super().on_train_end(args, state, control, **kwargs)

    def line(self, logs, state) -> str:
        return format_line(logs, state.global_step, state.max_steps, self.first_step)


class CompactProgressCallback(_CompactLines, ProgressCallback):
    """transformers' progress bar, with one :func:`format_line` line per log written above it."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(self.line(logs, state))


class CompactPrinterCallback(_CompactLines, PrinterCallback):
    """transformers' `PrinterCallback` (used with `disable_tqdm=True`), printing :func:`format_line` lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(self.line(logs, state), flush=True)


@contextlib.contextmanager
def quiet_saving(mode: str = "compact"):
    """In the compact console, no per-file progress bar while the final model is written (as during training)."""
    if mode != "compact" or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def use_console(trainer, mode: str = "compact") -> None:
    """Swap the trainer's printing callbacks for the compact ones (`mode="compact"`), or keep transformers' own
    (`"stock"`). Loggers and `log_history` are not affected either way."""
    check_choice("console", mode, CONSOLE_MODES)
    if mode == "stock":
        return
    for stock, compact in ((ProgressCallback, CompactProgressCallback), (PrinterCallback, CompactPrinterCallback)):
        if trainer.pop_callback(stock) is not None:
            trainer.add_callback(compact)


def progress_bar_default() -> dict:
    """A default for the command's parser: no progress bar when stdout is not a terminal. In a file or a pipe the
    bar's carriage-return redraws land between the one-line step records; the recipe's or a flag's `disable_tqdm`
    still wins."""
    return {} if sys.stdout.isatty() else {"disable_tqdm": True}


@contextlib.contextmanager
def library_bars_off_terminal():
    """While a command runs with stdout off a terminal: none of transformers' and datasets' progress bars either
    (loading weights, generating a split), restored afterwards (`main` is also called in-process)."""
    import datasets

    if sys.stdout.isatty():
        yield
        return
    bars = hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars[0]:
            hf_logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()


def quiet_library_deprecations() -> None:
    """Hide transformers' FutureWarnings about its `gradient_checkpointing` -> `activation_checkpointing` rename.

    They fire on every run because TRL's `GRPOConfig` sets `gradient_checkpointing=True` and TRL calls the old
    method names while generating; nothing in a recipe causes or can fix them. The command line installs this
    filter; library use keeps every warning."""
    warnings.filterwarnings(
        "ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning
    )


@dataclass
class ConsoleArguments:
    """Script argument of `trl-gspo demo` and `trl-gspo train`: how training progress is printed."""

    console: str = field(
        default="compact",
        metadata={
            "help": "'compact' (default): the progress bar and one line per logging step (step, reward ± std, clip "
            "fraction per sequence and per token, entropy, KL when beta > 0, completion length, grad norm, step "
            "time). 'stock': transformers' printing of the whole log dict. Every metric reaches the report_to "
            "loggers (and the demo's metrics.csv) either way.",
            "choices": list(CONSOLE_MODES),
        },
    )


# ----------------------------------------------------------------------------------- around the training loop
class StartStep(TrainerCallback):
    """The step a `train()` call started from: 0, or a resumed checkpoint's step."""

    step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def generation_line(trainer) -> str:
    """Which engine generates the completions, said once before training: transformers in this process, vLLM
    colocated (with the engine's dtype, which vLLM picks itself: an fp32 checkpoint gets a bf16 engine), or a vLLM
    server (its URL)."""
    args = trainer.args
    if not args.use_vllm:
        text = "transformers generate, in the trainer's process"
    elif args.vllm_mode == "colocate":
        engine = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        dtype = getattr(getattr(getattr(engine, "llm_engine", None), "model_config", None), "dtype", None)
        text = f"vLLM, colocated in the trainer's process (engine dtype {str(dtype).replace('torch.', '')})"
    else:
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        text = f"vLLM server at {url}"
    if getattr(args, "async_generation", False):
        text += f", asynchronous (max_staleness {args.max_staleness})"
    return f"generation: {text}"


#: transformers' warning after a checkpoint's weights are loaded into a model with keys the checkpoint lacks.
MISSING_KEYS = "There were missing keys in the checkpoint model loaded: "


def tied_names(model) -> set[str]:
    """Names of parameters that are one tensor with another named parameter (a head tied to the embedding): a
    checkpoint stores such a tensor once, under one of its names."""
    by_tensor = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {name for names in by_tensor.values() if len(names) > 1 for name in names}


class _TiedKeysFilter(logging.Filter):
    def __init__(self, model):
        super().__init__()
        self.tied = tied_names(model)

    def filter(self, record) -> bool:
        message = record.getMessage()
        if not message.startswith(MISSING_KEYS):
            return True
        try:
            missing = set(ast.literal_eval(message[len(MISSING_KEYS) :].rstrip(".")))
        except (ValueError, SyntaxError):
            return True
        return not missing <= self.tied  # every "missing" key is the same tensor as a key that was loaded


@contextlib.contextmanager
def tied_weights_restored(trainer):
    """While training: drop transformers' "missing keys ['lm_head.weight']" warning on resuming a model whose output
    head is tied to its input embeddings. The checkpoint stores the shared tensor once, under the embedding's name,
    and loading it restores the head with it; any other missing key is still reported."""
    log = logging.getLogger("transformers.trainer")
    quiet = _TiedKeysFilter(trainer.accelerator.unwrap_model(trainer.model))
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def final_eval_line(trainer, eval_set) -> str:
    """The eval score of the trained model, in one line: the last evaluation if it ran at the last step, else a new
    one (an `eval_strategy` of `epoch`, or `steps` off the last step, leaves the end unevaluated)."""

    def last_eval():
        return next((log for log in reversed(trainer.state.log_history) if "eval_reward" in log), None)

    logs = last_eval()
    if logs is None or logs.get("step") != trainer.state.global_step:
        trainer.evaluate()
        logs = last_eval() or {}
    scores = " | ".join(_groups(logs, "eval_").values()) or "no reward logged"
    return f"eval ({len(eval_set)} prompts) after step {trainer.state.global_step}: {scores}"
