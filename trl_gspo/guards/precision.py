"""Precision: full fine-tuning never loses its updates to bf16 rounding without a word, and the run says what runs.

An optimizer that updates bf16 (or fp16) weights in place adds each step to a number with 8 bits of mantissa: Adam's
step is about the learning rate (1e-6 in the shipped full fine-tuning recipes), and bf16 resolves about 1e-4 at a
weight of 0.02, so the step rounds away. DeepSpeed's ZeRO optimizers and its bf16 / fp16 modes keep fp32 master
weights, and so does accelerate's FSDP with a mixed precision (`common/engine.master_copy`); plain torch and DDP do
not. When the trainable weights of a full fine-tune (not PEFT: adapters train in fp32) are bf16 / fp16 and no engine
keeps fp32 master weights, `low_precision_weights` decides (docs/precision.md says why `"upcast"` is the default):

- `"upcast"` (default): the trainable weights become fp32 before the optimizer exists, so they are their own master
  weights; with `bf16: true` (GRPOConfig's default) the forward still computes in bf16 under autocast. Weights,
  gradients and Adam's states then take 16 bytes per parameter (as under DeepSpeed's ZeRO) instead of 8. Checkpoints
  keep the fp32 weights (a resume continues exactly); the final `save_model` writes the dtype they were loaded in.
- `"error"`: stop in one line before training, naming the fixes.
- `"allow"`: train the low-precision weights in place (stock TRL's behaviour), e.g. with an optimizer that rounds
  stochastically or keeps its own copy; `weights_changed` (guards/weight_updates.py) still watches the run.

`check_trainable_precision` runs in `GSPOTrainer.__init__` and returns the `Precision` of the run, whose `line()` the
command line prints: weight dtype, compute dtype, where the master weights live and the dtype the final save writes.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..common import engine
from ..common.validation import check_choice

logger = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)
LOW_PRECISION_CHOICES = ("upcast", "error", "allow")


@dataclass
class PrecisionOptions:
    r"""
    `GSPOConfig` field of the precision check (this module).

    Parameters:
        low_precision_weights (`str`, *optional*, defaults to `"upcast"`):
            What a full fine-tune does when its trainable weights are bf16/fp16 and no engine keeps fp32 master
            weights (DeepSpeed ZeRO or bf16/fp16, FSDP with mixed precision): `"upcast"` trains fp32 weights
            (computing in bf16 under autocast with `bf16=True`) and saves the final model in the dtype it was loaded
            in; `"error"` stops before training; `"allow"` updates the low-precision weights in place, where updates
            smaller than their resolution (learning rates near 1e-6) round away.
    """

    low_precision_weights: str = field(
        default="upcast",
        metadata={
            "help": "Full fine-tuning with bf16/fp16 weights and no engine keeping fp32 master weights (plain torch, "
            "DDP): Adam's ~learning-rate steps round away in bf16, so almost nothing trains. 'upcast' (default) trains "
            "fp32 weights (bf16 compute under autocast with bf16: true; 16 bytes/param with Adam, as under ZeRO) and "
            "saves in the loaded dtype; 'error' stops before training; 'allow' keeps stock TRL's behaviour.",
            "choices": list(LOW_PRECISION_CHOICES),
        },
    )

    def _validate_options(self):
        check_choice("low_precision_weights", self.low_precision_weights, LOW_PRECISION_CHOICES)


class LowPrecisionWeightsError(ValueError):
    """Full fine-tuning of bf16/fp16 weights without fp32 master weights, refused (`low_precision_weights="error"`)."""


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Precision:
    """What runs: the trainable weights' dtype while training (and as loaded), the compute dtype, where the master
    weights live, and the dtype the final save writes."""

    weights: str  # dtype of the trainable weights the optimizer sees
    loaded: str  # dtype they were loaded in
    compute: str  # e.g. "bfloat16 (autocast)"
    masters: str  # e.g. "DeepSpeed ZeRO-2's fp32 copy", "the fp32 weights", "none ..."
    saved: str  # dtype of the final save's weights
    upcast: bool = False  # the trainable weights were cast to fp32 here (the final save casts them back)
    peft: bool = False

    def line(self) -> str:
        """One line for the console."""
        what = "trainable (PEFT adapter) weights" if self.peft else "weights"
        weights = self.weights if self.weights == self.loaded else f"{self.weights} (loaded as {self.loaded})"
        return (
            f"precision: {what} {weights}, compute {self.compute}, master weights: {self.masters}; final save "
            f"writes {self.saved}"
        )


def trainable_dtype(model) -> torch.dtype | None:
    """The dtype of the trainable floating-point weights (the lowest-precision one if mixed), or None if none."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in dtypes:
            return dtype
    return next(iter(dtypes), None)


def _compute(accelerator, weights: str) -> str:
    deepspeed = engine.engine_compute_dtype(accelerator)
    if deepspeed is not None:
        return f"{deepspeed} (DeepSpeed)"
    if engine.deepspeed_config(accelerator) is None and accelerator.mixed_precision in ("bf16", "fp16"):
        return f"{'bfloat16' if accelerator.mixed_precision == 'bf16' else 'float16'} (autocast)"
    return f"{weights} (no autocast)"


def refusal(loaded: str) -> str:
    return (
        f"low_precision_weights='error': full fine-tuning with {loaded} weights and no fp32 master weights (plain "
        "torch / DDP): Adam's steps near the learning rate round away in "
        f"{loaded}. Set low_precision_weights='upcast' (fp32 weights, bf16 compute; 16 bytes/param), or train under "
        "a DeepSpeed ZeRO config (--accelerate_config zero2 / zero3 keep fp32 master weights), or train a PEFT adapter."
    )


def check_trainable_precision(model, accelerator, mode: str, peft: bool, requested=None) -> Precision:
    """The run's `Precision`, after the decision of `low_precision_weights` (`mode`, module docstring): upcasts the
    trainable weights in place (`"upcast"`), raises `LowPrecisionWeightsError` (`"error"`), or leaves them (`"allow"`).
    Call after the model is built and before the optimizer exists. `requested`: the `dtype` the model was loaded with
    by name (`model_init_kwargs`), which ZeRO-3's partitioning replaces by its own."""
    dtype = trainable_dtype(model)
    loaded = _name(dtype) if dtype is not None else "none"
    if engine.zero_stage(accelerator) == 3 and requested not in (None, "auto"):
        loaded = _name(requested)
    masters = engine.master_copy(accelerator)
    deepspeed = engine.engine_compute_dtype(accelerator)
    weights = deepspeed or loaded  # DeepSpeed's bf16 / fp16 mode casts the weights when it prepares the model
    saved = deepspeed or loaded
    if engine.zero_stage(accelerator) == 3 and deepspeed is None and dtype is not None:
        weights = saved = "float32"  # ZeRO-3 partitions the weights in its own dtype: fp32 without bf16 / fp16
    compute = _compute(accelerator, weights)
    if masters is not None or dtype not in LOW_PRECISION:
        where = masters or (f"the {loaded} weights themselves" if dtype is not None else "none (nothing trains)")
        return Precision(weights, loaded, compute, where, saved, peft=peft)
    if mode == "error":
        raise LowPrecisionWeightsError(refusal(loaded))
    if mode == "allow":
        precision = Precision(weights, loaded, compute, f"none (the {loaded} weights, updated in place)", saved)
        if accelerator.is_main_process:
            logger.warning(
                "low_precision_weights='allow': the optimizer updates the %s weights in place; steps below their "
                "resolution round away (watch weights_changed).",
                loaded,
            )
        return precision
    upcast_trainable(model)
    precision = Precision("float32", loaded, _compute(accelerator, "float32"), "the fp32 weights", loaded, upcast=True)
    if accelerator.is_main_process:
        logger.warning(
            "low_precision_weights='upcast': full fine-tuning keeps fp32 master weights, so the %s trainable weights "
            "train in fp32 (16 bytes/param with Adam); the final save writes %s.",
            loaded,
            loaded,
        )
    return precision


def upcast_trainable(model) -> None:
    """The trainable bf16 / fp16 weights cast to fp32 in place (the same `Parameter` objects, new data)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype in LOW_PRECISION:
            param.data = param.data.float()


@contextlib.contextmanager
def saved_as_loaded(model, precision: Precision | None, final: bool):
    """Around a save: the final save of an upcast run writes the dtype the weights were loaded in (each trainable
    weight cast for the write and its fp32 data put back after); checkpoints keep fp32, so a resume continues from
    the exact master weights."""
    if precision is None or not precision.upcast or not final:
        yield
        return
    dtype = getattr(torch, precision.loaded)
    kept = [(param, param.data) for param in model.parameters() if param.requires_grad and param.dtype == torch.float32]
    for param, data in kept:
        param.data = data.to(dtype)
    try:
        yield
    finally:
        for param, data in kept:
            param.data = data
