"""A clip band that follows a target clip fraction (`clip_target_fraction`, opt-in; off by default).

The paper's band, `[1 - 3e-4, 1 + 4e-4]`, was tuned on Qwen3 models at lr 1e-6. How far a batch's sequence ratios
spread after one update depends on the model, the learning rate and the answer length: on SmolLM2-135M at lr 5e-6
the spread is ~1e-2, so most responses sit outside the paper's band and give no gradient. A clip fraction is what the
paper reports and what a user can reason about ("about 15 % of tokens clipped"), so this part takes that as the
setting and scales the band to it.

After each optimizer step, `ClipBand` (a callback) reads the step's clip fraction, pooled over every process (one
all-reduce of two numbers), and scales both epsilons by the same factor:

    factor = clamp((fraction / target) ** GAIN, 1 / MAX_STEP_FACTOR, MAX_STEP_FACTOR)
    epsilon, epsilon_high = clamp(factor * epsilon, ...), clamp(factor * epsilon_high, ...)

A fraction above the target widens the band, one below narrows it. The fraction is TRL's `clip_ratio/region_mean`:
the share of sequences (sequence level) or of valid tokens (token levels) whose ratio is outside the band on the side
its advantage pushes toward. The step's micro-batches computed at the weights that sampled their batch are left out:
there every ratio is 1 (the first update of each rollout batch with `num_iterations=1`), nothing can clip, and a 0
would read as "band too wide". A step with no other micro-batch keeps the band. Every process computes the same
factor from the same pooled counts, so every rank holds the same band.

Bounds: each step moves the band by at most `MAX_STEP_FACTOR` either way, and the band stays within
`[1 / MAX_SCALE, MAX_SCALE]` times the configured one, neither epsilon above `MAX_EPSILON`; the configured 4:3 shape of
the band is kept. `GAIN` < 1 damps the loop: near a 15 % target the clip fraction of a Gaussian-like spread of ratios
changes ~2.7 times faster than the band (in log terms), so a gain of 0.5 overshoots by a shrinking third at worst.

Logged every optimizer step (averaged over the logging window like TRL's metrics): `clip_band/epsilon_low` and
`clip_band/epsilon_high` (the band the step's loss used) and `clip_band/fraction` (its measured clip fraction; steps
that measured nothing add no value). The band is saved in each checkpoint (`CHECKPOINT_FILE`) and restored on resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from .common.metrics import masked_sum_and_count
from .losses import LossSettings

logger = logging.getLogger(__name__)

#: The band moves by at most this factor per optimizer step (either way).
MAX_STEP_FACTOR = 2.0
#: Exponent of the step's factor on (fraction / target): a damped step in log space.
GAIN = 0.5
#: The band stays within [1 / MAX_SCALE, MAX_SCALE] times the configured band.
MAX_SCALE = 1000.0
#: Neither epsilon goes above this: `1 - epsilon` stays well above 0.
MAX_EPSILON = 0.5
#: The band's state in a checkpoint folder (JSON: floats round-trip exactly).
CHECKPOINT_FILE = "gspo_clip_band.json"


@dataclass
class ClipBandOptions:
    r"""
    `GSPOConfig` field of the adaptive clip band (this module).

    Parameters:
        clip_target_fraction (`float` or `None`, *optional*, defaults to `None`):
            Off (`None`): the clip band is `[1 - epsilon, 1 + epsilon_high]` throughout, as in the paper. A fraction
            in (0, 1), e.g. `0.15`: after each optimizer step both epsilons are scaled by a bounded factor toward the
            band that clips this fraction of TRL's `clip_ratio/region_mean` (sequences at the sequence level, tokens
            at the token levels), starting from `epsilon` / `epsilon_high`. Logged as `clip_band/epsilon_low`,
            `clip_band/epsilon_high` and `clip_band/fraction`; saved in checkpoints.
    """

    clip_target_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Target clip fraction (e.g. 0.15): after each optimizer step the clip band (epsilon, "
            "epsilon_high) is scaled toward the band that clips this share of responses, because the paper's "
            "3e-4 / 4e-4 fits Qwen3 at lr 1e-6, not every model and learning rate. None (default): the fixed band."
        },
    )

    def _validate_options(self):
        target = self.clip_target_fraction
        if target is None:
            return
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target < 1.0:
            raise ValueError(
                f"clip_target_fraction={target!r} is not allowed: it must be a fraction strictly between 0 and 1 "
                "(e.g. 0.15, the order the GSPO paper reports), or None for the fixed clip band."
            )


def next_band(band: tuple[float, float], fraction: float, target: float, configured: tuple[float, float]):
    """The band after a step that clipped `fraction` with `band` (module docstring): both epsilons times one bounded
    factor, within `[1 / MAX_SCALE, MAX_SCALE]` x `configured` and at most `MAX_EPSILON`."""
    if fraction <= 0.0:
        factor = 1.0 / MAX_STEP_FACTOR
    else:
        factor = min(max((fraction / target) ** GAIN, 1.0 / MAX_STEP_FACTOR), MAX_STEP_FACTOR)
    # One scale for both, so the band keeps its shape when one epsilon reaches a bound.
    scale = band[0] / configured[0] * factor
    ceiling = min(MAX_SCALE, MAX_EPSILON / max(configured))
    scale = min(max(scale, 1.0 / MAX_SCALE), ceiling)
    return configured[0] * scale, configured[1] * scale


class ClipBand(TrainerCallback):
    """The clip band the loss uses (`settings`), fixed or following `target` (module docstring).

    The trainer calls `record` for each training micro-batch with its clip indicators; `on_step_end` (after the
    optimizer step) updates the band. `accelerator` pools the counts; `run` (common/trl_compat.RunView) receives the
    metrics."""

    def __init__(self, settings: LossSettings, target: float | None, accelerator, run):
        self.target, self.accelerator, self.run = target, accelerator, run
        self.configured = (settings.epsilon_low, settings.epsilon_high)
        self._settings = settings
        self._counts = None  # device tensor [clipped, counted] of this optimizer step's off-policy micro-batches
        if self.enabled and accelerator.is_main_process:
            logger.warning(self.start_line())  # once at start: the band is not the configured one for long

    @property
    def enabled(self) -> bool:
        return self.target is not None

    @property
    def settings(self) -> LossSettings:
        return self._settings

    @property
    def band(self) -> tuple[float, float]:
        return self._settings.epsilon_low, self._settings.epsilon_high

    def start_line(self) -> str:
        low, high = self.configured
        return (
            f"clip_target_fraction={self.target}: the clip band starts at [1 - {low:g}, 1 + {high:g}] and is scaled "
            f"after each optimizer step toward a clip fraction of {self.target:g} (at most x{MAX_STEP_FACTOR:g} per "
            f"step, within 1/{MAX_SCALE:g}..{MAX_SCALE:g} x the configured band, epsilons <= {MAX_EPSILON:g}); "
            "logged as clip_band/epsilon_low, clip_band/epsilon_high, clip_band/fraction."
        )

    def record(self, mode: str, low, high, mask, at_sampler_weights: bool) -> None:
        """Add one micro-batch's clip counts (TRL's `clip_ratio/region_mean` numerator and denominator), on the
        device: no sync per micro-batch. Evaluation and micro-batches at the sampling weights are not counted."""
        if not self.enabled or mode != "train" or at_sampler_weights:
            return
        region = torch.maximum(low, high).detach().float()
        counts = torch.stack(masked_sum_and_count(region, mask.float()))  # TRL's region mean, as loss_metrics logs it
        self._counts = counts if self._counts is None else self._counts + counts

    def on_step_end(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        low, high = self.band
        self.run.log_metric("clip_band/epsilon_low", low, "train")
        self.run.log_metric("clip_band/epsilon_high", high, "train")
        counts = self._counts if self._counts is not None else torch.zeros(2, device=self.accelerator.device)
        self._counts = None
        clipped, counted = self.accelerator.reduce(counts.float(), reduction="sum").tolist()  # every rank, every step
        if counted <= 0:
            return  # only on-policy micro-batches: nothing could clip, the band stays
        fraction = clipped / counted
        self.run.log_metric("clip_band/fraction", fraction, "train")
        self._set(next_band(self.band, fraction, self.target, self.configured))

    def _set(self, band: tuple[float, float]) -> None:
        self._settings = dataclasses.replace(self._settings, epsilon_low=band[0], epsilon_high=band[1])

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, checkpoint: str, should_save: bool) -> None:
        """Write the band into `checkpoint` (the main process: every rank holds the same band)."""
        if not self.enabled or not should_save:
            return
        low, high = self.band
        with open(os.path.join(checkpoint, CHECKPOINT_FILE), "w") as f:
            json.dump({"epsilon_low": low, "epsilon_high": high, "target": self.target}, f)

    def load(self, checkpoint: str) -> None:
        """Put back the band `save` wrote (each process reads the same file); a checkpoint without one (saved with the
        fixed band) restarts from the configured band, said once."""
        if not self.enabled:
            return
        path = os.path.join(checkpoint, CHECKPOINT_FILE)
        if not os.path.exists(path):
            logger.warning("%s has no %s: the clip band restarts from the configured one.", checkpoint, CHECKPOINT_FILE)
            return
        with open(path) as f:
            saved = json.load(f)
        band = (float(saved["epsilon_low"]), float(saved["epsilon_high"]))
        if not all(math.isfinite(x) and 0 < x < 1 for x in band):
            raise ValueError(f"{path}: clip band {band} is not a valid [1 - epsilon, 1 + epsilon_high] band.")
        self._set(band)
