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

import warnings
from dataclasses import dataclass, field

from transformers.trainer_callback import PrinterCallback, ProgressCallback

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


def format_line(logs: dict, step: int, max_steps: int) -> str:
    """One line for one log dict: a training log, an evaluation log (`eval_*` keys), or the end-of-training summary.

    A log with none of the known fields (e.g. a custom `trainer.log({...})`) is printed whole, as transformers does.
    """
    if "train_runtime" in logs:  # Trainer's summary after the last step
        rate = logs.get("train_steps_per_second")
        return f"done: {step} steps in {logs['train_runtime']:.1f} s" + (f" ({rate:.3g} steps/s)" if rate else "")
    prefix = "eval_" if any(key.startswith("eval_") for key in logs) else ""
    groups = {}
    for label, parts in GROUPS:
        values = [(name, fmt.format(logs[prefix + key])) for name, key, fmt in parts if _number(logs.get(prefix + key))]
        if values and label not in groups:
            groups[label] = " ".join([label, *(f"{name} {text}".strip() for name, text in values)])
    if _number(logs.get(prefix + STEP_TIME)):
        seconds = logs[prefix + STEP_TIME]
        groups[STEP_TIME] = f"{seconds:.3f} s/step" if seconds < 10 else f"{seconds:.1f} s/step"
    if not groups:
        return str({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"})
    counter = f"{step:>{len(str(max_steps))}}/{max_steps}" if max_steps and max_steps > 0 else str(step)
    return " | ".join([f"{'eval ' if prefix else ''}step {counter}", *groups.values()])


class CompactProgressCallback(ProgressCallback):
    """transformers' progress bar, with one :func:`format_line` line per log written above it."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(format_line(logs, state.global_step, state.max_steps))


class CompactPrinterCallback(PrinterCallback):
    """transformers' `PrinterCallback` (used with `disable_tqdm=True`), printing :func:`format_line` lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(format_line(logs, state.global_step, state.max_steps), flush=True)


def use_console(trainer, mode: str = "compact") -> None:
    """Swap the trainer's printing callbacks for the compact ones (`mode="compact"`), or keep transformers' own
    (`"stock"`). Loggers and `log_history` are not affected either way."""
    check_choice("console", mode, CONSOLE_MODES)
    if mode == "stock":
        return
    for stock, compact in ((ProgressCallback, CompactProgressCallback), (PrinterCallback, CompactPrinterCallback)):
        if trainer.pop_callback(stock) is not None:
            trainer.add_callback(compact)


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
