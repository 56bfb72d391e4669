"""Checkpoints that are either complete or ignored, exact resume mid-rollout, and a checkpoint on SIGTERM/SIGINT.

- Completion marker: the trainer's `_save_checkpoint` (`completion_marked`) deletes `checkpoint-N/gspo_checkpoint_complete.json` before HF
  writes the folder and writes it last (atomically: temp file, fsync, rename), listing every file and its size.
  `resolve_resume_checkpoint` only accepts a folder whose marker exists and whose files still match it, so a crash
  mid-save (or a truncated copy) is never resumed from: `resume_from_checkpoint=True` takes the newest complete one.
- Another model's checkpoint: `checkpoint_model_mismatch` compares the config.json a checkpoint holds with the model's
  config (the fields that fix the weights' shapes), and a LoRA adapter checkpoint's matrices with the layers they
  adapt, so resuming with another model fails naming what differs instead of a page of torch `size mismatch` lines
  once the weights load.
- Rollout state: TRL generates one rollout batch every `steps_per_generation` micro-steps and keeps it in memory, so
  a checkpoint taken mid-rollout would resume with a freshly generated (different) batch. Each process also saves its
  micro-step counter, the buffered rollout and the rollout source's state (`gspo_rollout_state_rank{i}.pt`, tensors
  and numbers only, loaded with `weights_only=True`); resume restores them (the trainer's `_save_checkpoint` and
  `train`). TRL itself saves the adaptive entropy controller (`entropy_ctrl_state.json`).
- Prompt order across epochs: TRL's `RepeatSampler` draws each epoch's permutation from one seeded generator, one
  draw per pass over the data, so a process that resumes in epoch `e` (HF fast-forwards to it without iterating the
  sampler through the epochs before) would replay epoch 1's order. `EpochRepeatSampler` makes epoch `e`'s order draw
  number `e` of that generator (both counted from 0) whatever ran before, and `SamplerEpoch` tells it the epoch HF is
  about to run. An
  uninterrupted run draws exactly the permutations stock TRL draws, in the same order.
  Together with HF's saved RNG states (sampling, dropout) this makes a resumed run reproduce the uninterrupted one at
  any step of any epoch.
- `SignalCheckpoint`: on SIGTERM/SIGINT, finish the current optimizer step, save a checkpoint, then exit with
  `SystemExit(143)` (SIGTERM) or `StoppedBySignal`, a `KeyboardInterrupt` (SIGINT). A second signal while waiting
  exits immediately.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import threading
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from trl.trainer.utils import RepeatSampler

from ..common.model_config import shape_differences
from ..common.validation import check_bool

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "gspo_checkpoint_complete.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class CheckpointOptions:
    r"""
    `GSPOConfig` field of the signal checkpoint (this module).

    Parameters:
        checkpoint_on_signal (`bool`, *optional*, defaults to `True`):
            On SIGTERM or SIGINT during `train()`, finish the current optimizer step, save a checkpoint, then exit
            (SIGTERM: `SystemExit(143)`; SIGINT: `KeyboardInterrupt`). Resume with `resume_from_checkpoint`.
    """

    checkpoint_on_signal: bool = field(
        default=True,
        metadata={
            "help": "Save a checkpoint when SIGTERM/SIGINT arrives (preemption, Ctrl-C) at the end of the current "
            "optimizer step, then exit, so a preempted run loses at most one step. Resume with "
            "resume_from_checkpoint."
        },
    )

    def _validate_options(self):
        check_bool("checkpoint_on_signal", self.checkpoint_on_signal)


def rollout_state_file(checkpoint: str, process_index: int) -> str:
    return os.path.join(checkpoint, f"gspo_rollout_state_rank{process_index}.pt")


# ------------------------------------------------------------------------------------------- completion marker
def mark_incomplete(checkpoint: str) -> None:
    """Called before (re)writing a checkpoint folder, so a crash while writing leaves it unmarked."""
    marker = os.path.join(checkpoint, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)


def mark_complete(checkpoint: str) -> None:
    """Record every file of the finished checkpoint with its size, atomically."""
    files = {}
    for root, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(root, name)
            if name != COMPLETE_MARKER and not name.endswith(".tmp"):
                files[os.path.relpath(path, checkpoint)] = os.path.getsize(path)
    tmp = os.path.join(checkpoint, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(checkpoint, COMPLETE_MARKER))


class ResumeError(ValueError):
    """`resume_from_checkpoint` names no checkpoint this run can resume from: none complete, or another model's. The
    message says why and what to do; the CLI prints it as its one error line."""


def checkpoint_problem(checkpoint: str) -> str | None:
    """Why `checkpoint` cannot be resumed from, or None if it is complete."""
    marker = os.path.join(checkpoint, COMPLETE_MARKER)
    if not os.path.isdir(checkpoint):
        return "it does not exist"
    if not os.path.exists(marker):
        return (
            f"it has no {COMPLETE_MARKER}: the run stopped while writing it, or another trainer wrote it (if you know "
            "it is complete, mark it with trl_gspo.guards.checkpointing.mark_complete(path))"
        )
    with open(marker) as f:
        files = json.load(f)["files"]
    for name, size in files.items():
        path = os.path.join(checkpoint, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
    return None


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder of `output_dir` that is complete (see `checkpoint_problem`)."""
    if not os.path.isdir(output_dir):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(name))]
    for _, name in sorted(found, reverse=True):
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("Skipping checkpoint %s for resume: %s.", path, problem)
    return None


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """Turn `train(resume_from_checkpoint=...)` into a complete checkpoint folder, or raise saying why not.

    `True` (or the strings "true"/"last", as a `--resume_from_checkpoint` flag or YAML key arrives) means the newest
    complete checkpoint of `output_dir`; any other string is a checkpoint path."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() in ("true", "last"):
        resume_from_checkpoint = True
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() in ("", "false", "none"):
        resume_from_checkpoint = None
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ResumeError(
                f"resume_from_checkpoint=True but {output_dir!r} holds no complete checkpoint-N folder "
                f"(complete = has {COMPLETE_MARKER} and every file it lists)."
            )
        return path
    problem = checkpoint_problem(str(resume_from_checkpoint))
    if problem is not None:
        latest = last_complete_checkpoint(os.path.dirname(os.path.abspath(str(resume_from_checkpoint))))
        hint = f" The newest complete checkpoint next to it is {latest}." if latest else ""
        raise ResumeError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r} cannot be resumed: {problem}.{hint}")
    return str(resume_from_checkpoint)


def checkpoint_model_mismatch(checkpoint: str, model_config, model: str) -> str | None:
    """Why `checkpoint` cannot be loaded into `model` (named so in the message; `model_config` its config): the
    fields fixing the weights' shapes that differ between the checkpoint's config.json and `model_config`, with both
    values, and what to do; a PEFT adapter checkpoint (no config.json) by its weights' shapes instead
    (`adapter_model_mismatch`). None when they agree, or when neither can be read."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        return adapter_model_mismatch(checkpoint, model_config, model)
    try:
        saved = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    except (OSError, ValueError) as error:  # e.g. a model type only its own remote code defines
        logger.debug("Reading the config of checkpoint %s failed: %s", checkpoint, error)
        return None
    differences = shape_differences(saved, model_config)
    if not differences:
        return None
    fields = "; ".join(
        f"{field} {theirs!r} in the checkpoint, {ours!r} in the model" for field, theirs, ours in differences
    )
    return (
        f"resume_from_checkpoint: {checkpoint} holds weights of another model than {model} ({fields}). Resume with "
        f"the model the checkpoint was trained from, or train {model} from the start in another output_dir."
    )


#: PEFT's names for a LoRA pair's matrices and which side of the base layer each matches: (r, in) and (out, r).
LORA_SIDES = {"lora_A.weight": (1, "in_features"), "lora_B.weight": (0, "out_features")}


def adapter_model_mismatch(checkpoint: str, model_config, model: str) -> str | None:
    """Why the LoRA adapter in `checkpoint` (adapter_model.safetensors) does not fit a model built from
    `model_config`: a layer it adapts that the model lacks, or a LoRA matrix whose side does not match the layer's
    (a base model of another size). Read from the file's header and a model on the meta device: no weights load.
    None when every matrix fits, or without an adapter file."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = os.path.join(checkpoint, "adapter_model.safetensors")
    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(model_config)
    except (OSError, ValueError) as error:  # a model type only remote code defines, an unreadable file
        logger.debug("Checking adapter %s against the model failed: %s", checkpoint, error)
        return None
    misfits = []
    for key, shape in shapes.items():
        side = next((suffix for suffix in LORA_SIDES if key.endswith("." + suffix)), None)
        if side is None:
            continue
        name = key.removeprefix("base_model.model.").removesuffix("." + side)
        try:
            layer = base.get_submodule(name)
        except AttributeError:
            misfits.append(f"{name} adapted in the checkpoint, absent from the model")
            continue
        axis, attribute = LORA_SIDES[side]
        expected = getattr(layer, attribute, None)
        if expected is not None and shape[axis] != expected:
            misfits.append(f"{name}.{side} {list(shape)} in the checkpoint, {attribute} {expected} in the model")
    if not misfits:
        return None
    more = f" and {len(misfits) - 1} more" if len(misfits) > 1 else ""
    return (
        f"resume_from_checkpoint: {checkpoint} holds a LoRA adapter trained on another base model than {model} "
        f"({misfits[0]}{more}). Resume with the base model the adapter was trained on (its adapter_config.json names "
        f"it), or train {model} from the start in another output_dir."
    )


# ---------------------------------------------------------------------------------------------- rollout state
@contextlib.contextmanager
def completion_marked(checkpoint: str, should_save: bool, accelerator):
    """Around the writing of `checkpoint` (HF's folder, then the rollout state): its marker is deleted first, and
    written last, once every process has written its part, only when the block completed."""
    if should_save:
        mark_incomplete(checkpoint)
    yield
    accelerator.wait_for_everyone()
    if should_save:
        mark_complete(checkpoint)


def save_rollout_state(checkpoint: str, process_index: int, state: dict) -> None:
    """This process's part of the training state HF's checkpoint lacks: TRL's micro-step counter, its buffered rollout
    batch and the rollout source's state (the trainer's `_save_checkpoint`)."""
    os.makedirs(checkpoint, exist_ok=True)
    torch.save(state, rollout_state_file(checkpoint, process_index))


def load_rollout_state(checkpoint: str, process_index: int, device) -> dict | None:
    """What `save_rollout_state` wrote for this process, tensors on `device`; None for a checkpoint without it."""
    path = rollout_state_file(checkpoint, process_index)
    if not os.path.exists(path):
        return None
    # Load on CPU, then move: a distributed CPU run tags storages "cpu:0", which map_location cannot restore.
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {
        **state,
        "buffered_inputs": _to_device(state["buffered_inputs"], device),
        "source": _to_device(state.get("source", {}), device),  # `source`: {} in checkpoints that predate it
    }


def rollout_state_matches(state: dict, steps_per_generation: int, checkpoint: str) -> bool:
    """Whether a saved rollout state can be put back: a buffered rollout saved with another `steps_per_generation` is
    dropped (logged; TRL then generates a new one, as stock TRL does on every resume)."""
    buffered = state["buffered_inputs"]
    if buffered is None or len(buffered) == steps_per_generation:
        return True
    logger.warning(
        "Rollout state of %s does not match steps_per_generation=%d; ignored.", checkpoint, steps_per_generation
    )
    return False


def optimizer_needs_cpu_map(args, distributed_engine: bool) -> bool:
    """A plain multi-process run on CPU (no DeepSpeed, no FSDP): there transformers < 5.18 loads the optimizer state
    onto the device the run names, the indexed `cpu:0`, which torch's `map_location` cannot restore, so the resume
    fails. Such a run loads it on `"cpu"` instead (`load_optimizer_and_scheduler`), as transformers >= 5.18 does."""
    device = args.device
    return not distributed_engine and args.world_size > 1 and device.type == "cpu" and device.index is not None


def load_optimizer_and_scheduler(checkpoint: str | None, optimizer, scheduler) -> bool:
    """Load the optimizer and scheduler states of `checkpoint` on the CPU; False (nothing loaded) when either file is
    missing."""
    files = [os.path.join(checkpoint or "", name) for name in (OPTIMIZER_NAME, SCHEDULER_NAME)]
    if not all(os.path.isfile(f) for f in files):
        return False
    optimizer_state, scheduler_state = (torch.load(f, map_location="cpu", weights_only=True) for f in files)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    return True


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {key: _to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(value, device) for value in obj)
    return obj


# ------------------------------------------------------------------------------------- prompt order per epoch
class EpochRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose epoch `e` always uses permutation number `e` of its seeded generator (from 0).

    Stock TRL draws the next permutation each time the sampler is iterated, i.e. once per epoch of an uninterrupted
    run. A resumed run starts iterating at the epoch it resumes in, with a freshly seeded generator, so it would get
    epoch 0's order again. Here, when the epoch to iterate (`set_epoch`) is not the next draw of the generator, the
    generator is re-seeded and advanced through the epochs before it (one `randperm` each, on CPU). When it is (every
    epoch of an uninterrupted run) nothing is re-drawn, so the order is exactly stock TRL's. Without `set_epoch` the
    epoch advances by one per pass, as stock does."""

    @classmethod
    def like(cls, sampler: RepeatSampler) -> EpochRepeatSampler:
        """The same sampler (data, repeats, batch size, shuffle, seed: whatever TRL chose) with epoch-exact order."""
        return cls(
            data_source=sampler.data_source,
            mini_repeat_count=sampler.mini_repeat_count,
            batch_size=sampler.batch_size,
            repeat_count=sampler.repeat_count,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
        )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch = 0  # the epoch the next pass yields
        self._draws = 0  # permutations drawn from the generator so far

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        if self.shuffle and self.seed is not None and self._draws != self.epoch:
            self.generator.manual_seed(self.seed)
            for _ in range(self.epoch):  # the permutations of the epochs before, discarded
                torch.randperm(self.num_samples, generator=self.generator)
            self._draws = self.epoch
        self._draws, self.epoch = self._draws + 1, self.epoch + 1
        yield from super().__iter__()  # draws this epoch's permutation


def epoch_about_to_run(state) -> int:
    """The 0-based epoch HF's loop starts when `on_epoch_begin` fires: `state.epoch` is the fraction of epochs done
    (`epoch + micro_steps / steps_in_epoch`, restored from `trainer_state.json` on resume), so its floor is the epoch
    in progress, or the next one at an epoch boundary. Exact: the boundary value is a whole number."""
    return math.floor(state.epoch or 0.0)


class SamplerEpoch(TrainerCallback):
    """Tell the training sampler which epoch HF runs next. HF's own `set_epoch` call goes through accelerate's
    wrappers, which do not reach the sampler on every path (several processes, or the fast-forwarded epoch of a
    resume); this callback does, on every process, before the epoch's first batch is drawn."""

    def __init__(self):
        self.sampler: EpochRepeatSampler | None = None

    def follow(self, sampler: EpochRepeatSampler) -> None:
        """The sampler HF's training dataloader draws from (the trainer's `_get_train_sampler` made it)."""
        self.sampler = sampler

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.sampler is not None:
            self.sampler.set_epoch(epoch_about_to_run(state))


# ----------------------------------------------------------------------------------------- signal checkpoint
class StoppedBySignal(KeyboardInterrupt):
    """Training stopped on SIGINT (Ctrl-C) after saving a checkpoint: `step` is the last step trained, `checkpoint`
    the folder saved. A `KeyboardInterrupt`, so that code catching Ctrl-C catches it."""

    def __init__(self, message: str, step: int = 0, checkpoint: str = ""):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


class SignalCheckpoint(TrainerCallback):
    """Save a checkpoint at the end of the optimizer step during which SIGTERM/SIGINT arrived, then exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.received: int | None = None
        self._stopping = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.received is not None:  # second signal: stop waiting for the checkpoint
            self.restore_handlers()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning(
            "Received %s: saving a checkpoint at the end of the current optimizer step, then exiting. "
            "Send it again to exit immediately.",
            signal.Signals(signum).name,
        )

    def restore_handlers(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self._stopping = None, False
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        stop = self.received is not None
        accelerator = self.accelerator
        if accelerator.num_processes > 1:  # every rank must stop at the same step to save together
            stop = accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), reduction="sum").item() > 0
        if stop:
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if not self._stopping:
            return
        self.restore_handlers()
        signum = self.received or signal.SIGTERM  # another rank got the signal
        checkpoint = f"{args.output_dir}/checkpoint-{state.global_step}"
        message = (
            f"Stopped by {signal.Signals(signum).name} after step {state.global_step}; checkpoint saved to "
            f"{checkpoint}. Resume with resume_from_checkpoint=True."
        )
        if signum == signal.SIGINT:  # the exception carries the message (logged too, it would be printed twice)
            raise StoppedBySignal(message, state.global_step, checkpoint)
        logger.warning(message)
        raise SystemExit(128 + signum)

    def on_train_end(self, args, state, control, **kwargs):
        self.restore_handlers()
