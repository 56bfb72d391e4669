"""The clip band the loss uses: the configured one (the paper's, by default), or one that moves (opt-in, off by default).

The paper's band, `[1 - 3e-4, 1 + 4e-4]`, was tuned on Qwen3 models at lr 1e-6. How far a batch's sequence ratios
spread after one update depends on the model, the learning rate and the answer length: on SmolLM2-135M at lr 5e-6
the spread is ~1e-2, so most responses sit outside the paper's band and give no gradient. Two ways to move it:

`clip_spread_scale=k`: each update's own spread. Before each training micro-batch's loss, the band is set from the
root mean square of that micro-batch's log importance weights (log s_i per sequence at the sequence levels, log
w_i,t per valid token at the token level), pooled over every process (one all-reduce of two numbers):

    epsilon = max(configured epsilon, k * rms(log s)),   epsilon_high = epsilon * (configured epsilon_high / epsilon)

The root mean square, not the standard deviation: what a band around 1 clips is each ratio's distance from 1, which
is the standard deviation when the batch is centred on 1 and grows with it when the whole batch drifts one way. The
configured band is the floor. The band holds no memory across updates, so it cannot lag or swing, and a resumed run
computes the same bands as an uninterrupted one. It costs one host sync per training micro-batch.

`clip_target_fraction=f`: a controller across steps. After each optimizer step, `ClipBand` (a callback) reads the
step's clip fraction, pooled over every process, and scales both epsilons by one bounded factor:

    factor = clamp((fraction / target) ** GAIN, 1 / MAX_STEP_FACTOR, MAX_STEP_FACTOR)
    epsilon, epsilon_high = clamp(factor * epsilon, ...), clamp(factor * epsilon_high, ...)

A fraction above the target widens the band, one below narrows it. The fraction is TRL's `clip_ratio/region_mean`:
the share of sequences (sequence level) or of valid tokens (token levels) whose ratio is outside the band on the side
its advantage pushes toward. Bounds: each step moves the band by at most `MAX_STEP_FACTOR` either way, within
`[1 / MAX_SCALE, MAX_SCALE]` times the configured band. `GAIN` < 1 damps the loop: near a 15 % target the clip
fraction of a Gaussian-like spread of ratios changes ~2.7 times faster than the band (in log terms), so a gain of 0.5
overshoots by a shrinking third at worst. The band is saved in each checkpoint (`CHECKPOINT_FILE`) and restored on
resume. Measured on SmolLM2, a fraction tuned for one setting does not carry to another (docs/choosing.md).

Which updates are measured. Neither way measures a micro-batch whose ratios are all 1 by construction: there nothing
can clip and the spread is 0, so a count would read "band too wide" and narrow the controller's band every rollout
batch. That is decided by where pi_old came from (`ratios_one`, computed by the trainer): TRL skipped its pi_old pass
(pi_old is the current policy itself), or the pass ran at the weights of this very optimizer step (synchronous
rollouts' first update, the first update of an asynchronous batch whose pi_old is recomputed when training on it
starts, the first of `num_iterations`). pi_old from the sampler (`old_logprobs_source="sampler"`), or from the
weights of an earlier step, is measured. A step with no measured micro-batch keeps the controller's band; the spread
band uses the configured one there.

Bounds for both: the configured 4:3 shape is kept, neither epsilon goes above `MAX_EPSILON`, and with `delta` set the
upper bound stays below it (`1 + epsilon_high < delta`), so INTELLECT-2's cap never falls inside the band.

Logged: `clip_band/epsilon_low` and `clip_band/epsilon_high` (the band the loss used), and `clip_band/fraction` (the
controller's measured fraction) or `clip_band/spread` (the pooled root mean square), averaged over the logging window
like TRL's metrics; measurements only where something was measured.
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
from .losses import SEQUENCE_LEVELS, LossSettings

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
    `GSPOConfig` fields of the clip band that moves (this module); at most one of them.

    Parameters:
        clip_spread_scale (`float` or `None`, *optional*, defaults to `None`):
            Off (`None`): the clip band is `[1 - epsilon, 1 + epsilon_high]` throughout, as in the paper. A positive
            `k`, e.g. `1.0`: before each training micro-batch's loss, `epsilon` becomes `max(epsilon, k * rms)`,
            `rms` the root mean square of the micro-batch's log importance weights (log s_i per sequence at the
            sequence levels) pooled over processes, `epsilon_high` scaled with it. Logged as
            `clip_band/epsilon_low`, `clip_band/epsilon_high` and `clip_band/spread`.
        clip_target_fraction (`float` or `None`, *optional*, defaults to `None`):
            Off (`None`): the fixed band. A fraction in (0, 1), e.g. `0.15`: after each optimizer step both epsilons
            are scaled by a bounded factor toward the band that clips this fraction of TRL's
            `clip_ratio/region_mean` (sequences at the sequence level, tokens at the token levels), starting from
            `epsilon` / `epsilon_high`. Logged as `clip_band/epsilon_low`, `clip_band/epsilon_high` and
            `clip_band/fraction`; saved in checkpoints.
    """

    clip_spread_scale: float | None = field(
        default=None,
        metadata={
            "help": "Scale k of a clip band set from each update's own spread: epsilon = max(epsilon, k * rms of the "
            "micro-batch's log importance weights), epsilon_high scaled with it, because the paper's 3e-4 / 4e-4 "
            "fits Qwen3 at lr 1e-6, not every model, learning rate and answer length. None (default): the fixed band."
        },
    )
    clip_target_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Target clip fraction (e.g. 0.15): after each optimizer step the clip band (epsilon, "
            "epsilon_high) is scaled toward the band that clips this share of responses, because the paper's "
            "3e-4 / 4e-4 fits Qwen3 at lr 1e-6, not every model and learning rate. None (default): the fixed band."
        },
    )

    def _validate_options(self):
        target, scale = self.clip_target_fraction, self.clip_spread_scale
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target < 1.0
        ):
            raise ValueError(
                f"clip_target_fraction={target!r} is not allowed: it must be a fraction strictly between 0 and 1 "
                "(e.g. 0.15, the order the GSPO paper reports), or None for the fixed clip band."
            )
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
            or not 0.0 < scale <= MAX_SPREAD_SCALE
        ):
            raise ValueError(
                f"clip_spread_scale={scale!r} is not allowed: it must be a number in (0, {MAX_SPREAD_SCALE:g}] "
                "(e.g. 1.0: epsilon = max(epsilon, 1 x the rms of the log ratios)), or None for the fixed clip band."
            )
        if target is not None and scale is not None:
            raise ValueError(
                f"clip_target_fraction={target!r} and clip_spread_scale={scale!r} both move the clip band; set one."
            )
        moving = moving_band_field(self)
        if moving and getattr(self, "use_liger_kernel", False):
            raise ValueError(
                f"{moving} is not allowed with use_liger_kernel=True: TRL's Liger loss is built once with the fixed "
                "epsilons and never reads a band that moves; set use_liger_kernel=False or remove the field."
            )


#: clip_spread_scale's upper bound: beyond it the band sits at MAX_EPSILON for any spread worth measuring.
MAX_SPREAD_SCALE = 100.0


def moving_band_field(options) -> str | None:
    """`"name=value"` of the field that moves the band, or None for the fixed band (the config's error messages)."""
    for name in ("clip_spread_scale", "clip_target_fraction"):
        if getattr(options, name, None) is not None:
            return f"{name}={getattr(options, name)!r}"
    return None


def ceiling_scale(configured: tuple[float, float], delta: float | None) -> float:
    """The widest band, as a multiple of the configured one: neither epsilon above `MAX_EPSILON`, and with `delta`
    set `1 + epsilon_high` below it (a millionth of `delta - 1` to spare, so the float sum stays below). Never under
    1: the configured band passed the config's own check against `delta`."""
    widest = MAX_EPSILON / max(configured)
    if delta is not None:
        widest = min(widest, (delta - 1.0) * (1.0 - 1e-6) / configured[1])
    return max(widest, 1.0)


def next_band(band, fraction: float, target: float, configured: tuple[float, float], delta: float | None = None):
    """The controller's band after a step that clipped `fraction` with `band` (module docstring): both epsilons times
    one bounded factor, within `[1 / MAX_SCALE, MAX_SCALE]` x `configured` and `ceiling_scale`."""
    if fraction <= 0.0:
        factor = 1.0 / MAX_STEP_FACTOR
    else:
        factor = min(max((fraction / target) ** GAIN, 1.0 / MAX_STEP_FACTOR), MAX_STEP_FACTOR)
    # One scale for both, so the band keeps its shape when one epsilon reaches a bound.
    scale = band[0] / configured[0] * factor
    scale = min(max(scale, 1.0 / MAX_SCALE), min(MAX_SCALE, ceiling_scale(configured, delta)))
    return configured[0] * scale, configured[1] * scale


def spread_band(rms: float, k: float, configured: tuple[float, float], delta: float | None = None):
    """The band `clip_spread_scale=k` gives a micro-batch whose pooled log-ratio rms is `rms` (module docstring):
    `epsilon = k * rms`, the configured band its floor, the shape kept, within `ceiling_scale`."""
    scale = min(max(k * rms / configured[0], 1.0), ceiling_scale(configured, delta))
    return configured[0] * scale, configured[1] * scale


def log_ratio_squares(log_weights: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """`[sum of squares, count]` of a micro-batch's log importance weights, on the device. `per_sequence` (the
    sequence levels): one value per sequence with a valid token, log s_i (a `(B, 1)` weight as it is; sequence_token's
    `(B, T)`, which repeats log s_i on every token, through its masked mean); else (token) one per valid token."""
    mask, values = mask.float(), log_weights.detach().float()
    if not per_sequence:
        return torch.stack([(values.square() * mask).sum(), mask.sum()])
    tokens = mask.sum(-1)
    if values.size(-1) != 1:
        values = (values * mask).sum(-1, keepdim=True) / tokens.clamp(min=1.0).unsqueeze(-1)
    valid = (tokens > 0).float()
    return torch.stack([(values.squeeze(-1).square() * valid).sum(), valid.sum()])


class ClipBand(TrainerCallback):
    """The clip band the loss uses (`settings`): fixed, set from each micro-batch's spread, or following a target
    clip fraction (module docstring).

    The trainer calls `fit` before each micro-batch's policy loss (the spread band is set there) and `record` after it
    with the clip indicators (the controller's counts); `on_step_end` (after the optimizer step) moves the
    controller's band. `accelerator` pools over processes; `run` (common/trl_compat.RunView) receives the metrics."""

    def __init__(self, settings: LossSettings, accelerator, run, *, target=None, spread_scale=None, per_sequence=True):
        self.target, self.spread_scale, self.accelerator, self.run = target, spread_scale, accelerator, run
        self.per_sequence = per_sequence  # sequence levels: log s_i once per sequence (sequence_token repeats it)
        self.configured = (settings.epsilon_low, settings.epsilon_high)
        self._configured_settings = self._settings = settings
        self._counts = None  # device tensor [clipped, counted] of this optimizer step's measured micro-batches
        if self.enabled and accelerator.is_main_process:
            logger.warning(self.start_line())  # once at start: the band is not the configured one

    @classmethod
    def for_config(cls, args, epsilons: tuple[float, float], accelerator, run) -> ClipBand:
        """The band a `GSPOConfig` asks for, around TRL's resolved (`epsilon_low`, `epsilon_high`)."""
        settings = LossSettings(*epsilons, args.delta, args.sapo_temperature_pos, args.sapo_temperature_neg)
        per_sequence = args.importance_sampling_level in SEQUENCE_LEVELS
        target, scale = args.clip_target_fraction, args.clip_spread_scale
        return cls(settings, accelerator, run, target=target, spread_scale=scale, per_sequence=per_sequence)

    @property
    def enabled(self) -> bool:
        return self.target is not None or self.spread_scale is not None

    @property
    def settings(self) -> LossSettings:
        return self._settings

    @property
    def band(self) -> tuple[float, float]:
        return self._settings.epsilon_low, self._settings.epsilon_high

    def start_line(self) -> str:
        low, high = self.configured
        widest = ceiling_scale(self.configured, self._settings.delta)
        if self.spread_scale is not None:
            return (
                f"clip_spread_scale={self.spread_scale:g}: each training micro-batch's clip band is [1 - epsilon, 1 + "
                f"epsilon_high] with epsilon = max({low:g}, {self.spread_scale:g} x the rms of its log importance "
                f"weights, pooled over processes), epsilon_high = {high / low:g} x epsilon, at most {widest:g} x the "
                "configured band; logged as clip_band/epsilon_low, clip_band/epsilon_high, clip_band/spread."
            )
        return (
            f"clip_target_fraction={self.target}: the clip band starts at [1 - {low:g}, 1 + {high:g}] and is scaled "
            f"after each optimizer step toward a clip fraction of {self.target:g} (at most x{MAX_STEP_FACTOR:g} per "
            f"step, within 1/{MAX_SCALE:g}..{min(widest, MAX_SCALE):g} x the configured band, epsilons <= {MAX_EPSILON:g}); "
            "logged as clip_band/epsilon_low, clip_band/epsilon_high, clip_band/fraction."
        )

    def fit(self, mode: str, log_weights, mask, ratios_one: bool) -> None:
        """Before a micro-batch's policy loss: the spread band for it (the configured band in evaluation and where
        every ratio is 1 by construction). Every process calls it for every micro-batch, in the same order, and takes
        the same branch (`ratios_one` depends on the step and the config only), so the all-reduce pairs up."""
        if self.spread_scale is None:
            return
        if mode != "train" or ratios_one:
            self._settings = self._configured_settings
        else:
            total, count = self.accelerator.reduce(
                log_ratio_squares(log_weights, mask, self.per_sequence), reduction="sum"
            ).tolist()
            rms = math.sqrt(total / count) if count > 0 else 0.0
            self.run.log_metric("clip_band/spread", rms, "train")
            self._set(spread_band(rms, self.spread_scale, self.configured, self._settings.delta))
        if mode == "train":
            low, high = self.band
            self.run.log_metric("clip_band/epsilon_low", low, "train")
            self.run.log_metric("clip_band/epsilon_high", high, "train")

    def record(self, mode: str, low, high, mask, ratios_one: bool) -> None:
        """Add one micro-batch's clip counts (TRL's `clip_ratio/region_mean` numerator and denominator) for the
        controller, on the device: no sync per micro-batch. Evaluation and micro-batches whose ratios are all 1 by
        construction are not counted."""
        if self.target is None or mode != "train" or ratios_one:
            return
        region = torch.maximum(low, high).detach().float()
        counts = torch.stack(masked_sum_and_count(region, mask.float()))  # TRL's region mean, as loss_metrics logs it
        self._counts = counts if self._counts is None else self._counts + counts

    def on_step_end(self, args, state, control, **kwargs):
        if self.target is None:
            return
        low, high = self.band
        self.run.log_metric("clip_band/epsilon_low", low, "train")
        self.run.log_metric("clip_band/epsilon_high", high, "train")
        counts = self._counts if self._counts is not None else torch.zeros(2, device=self.accelerator.device)
        self._counts = None
        clipped, counted = self.accelerator.reduce(counts.float(), reduction="sum").tolist()  # every rank, every step
        if counted <= 0:
            return  # no measured micro-batch: nothing could clip, the band stays
        fraction = clipped / counted
        self.run.log_metric("clip_band/fraction", fraction, "train")
        self._set(next_band(self.band, fraction, self.target, self.configured, self._settings.delta))

    def _set(self, band: tuple[float, float]) -> None:
        self._settings = dataclasses.replace(self._settings, epsilon_low=band[0], epsilon_high=band[1])

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, checkpoint: str, should_save: bool) -> None:
        """Write the controller's band into `checkpoint` (the main process: every rank holds the same band). The
        spread band has no state to save."""
        if self.target is None or not should_save:
            return
        low, high = self.band
        with open(os.path.join(checkpoint, CHECKPOINT_FILE), "w") as f:
            json.dump({"epsilon_low": low, "epsilon_high": high, "target": self.target}, f)

    def load(self, checkpoint: str) -> None:
        """Put back the band `save` wrote (each process reads the same file); a checkpoint without one (saved with the
        fixed band) restarts from the configured band, said once."""
        if self.target is None:
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
