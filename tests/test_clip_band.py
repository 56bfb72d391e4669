"""The clip band that follows a target clip fraction (trl_gspo/clip_band.py): it reaches the target on synthetic
ratio spreads within a stated number of steps, never leaves its bounds, ignores on-policy micro-batches, is off by
default, holds one band on every rank, and resumes exactly."""

import math
import os
import shutil
import subprocess

import pytest
import torch
from helpers.fault_utils import make_trainer, weights
from helpers.ports import launch_env, two_processes
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_gspo import GSPOConfig
from trl_gspo.clip_band import CHECKPOINT_FILE, GAIN, MAX_EPSILON, MAX_SCALE, MAX_STEP_FACTOR, ClipBand, next_band
from trl_gspo.guards import checkpointing
from trl_gspo.losses import POLICY_LOSSES, LossSettings

PAPER = (3e-4, 4e-4)
#: Optimizer steps the controller gets to bring the fraction within TOLERANCE of the target, from the paper's band,
#: on spreads of 1e-4 .. 5e-2 (sigma / band up to ~170: log2(170) ~ 7.4 steps at the largest step factor).
STEPS_TO_TARGET = 15
#: |fraction - target| allowed afterwards: the sampling noise of a 4096-sequence batch at 0.15 is ~0.006 (1 sigma).
TOLERANCE = 0.03


class _Accelerator:
    """One process: `reduce` returns the local sums, as accelerate does without a process group."""

    device = torch.device("cpu")
    is_main_process = True

    def reduce(self, tensor, reduction="sum"):
        return tensor


class _Run:
    def __init__(self):
        self.metrics = {}

    def log_metric(self, name, value, mode=None):
        self.metrics.setdefault(name, []).append(value)


def _config(**kwargs):
    return GSPOConfig(output_dir="unused", use_cpu=True, report_to=[], per_device_train_batch_size=4, **kwargs)


def _band(target, start=PAPER):
    return ClipBand(LossSettings(*start), target, _Accelerator(), _Run())


def _synthetic_step(band, generator, sigma, heavy_tails, n=4096, at_sampler_weights=False):
    """One optimizer step on `n` sequences whose log-ratios spread by `sigma` (normal, or Laplace: heavier tails) with
    advantages of either sign; returns the clip fraction the step's band gave (TRL's region mean)."""
    noise = torch.randn(n, 1, generator=generator, dtype=torch.float64)
    if heavy_tails:
        uniform = torch.rand(n, 1, generator=generator, dtype=torch.float64) - 0.5
        noise = -torch.sign(uniform) * torch.log1p(-2 * uniform.abs()) / math.sqrt(2)  # Laplace, unit variance
    ratio = torch.exp(sigma * noise)
    advantages = torch.where(torch.rand(n, 1, generator=generator) < 0.5, -1.0, 1.0).double()
    low, high = POLICY_LOSSES["grpo"].clip.indicators(ratio, advantages, band.settings)
    band.record("train", low, high, torch.ones(n, 8), at_sampler_weights)
    fraction = torch.maximum(low, high).mean().item()
    band.on_step_end(None, None, None)
    return fraction


@pytest.mark.parametrize("heavy_tails", [False, True], ids=["normal", "laplace"])
@pytest.mark.parametrize("sigma", [1e-4, 1e-2, 5e-2])
def test_reaches_the_target_fraction_within_the_stated_steps(sigma, heavy_tails):
    generator = torch.Generator().manual_seed(0)
    fixed = _synthetic_step(_band(None), generator, sigma, heavy_tails)  # the paper's band, never moved
    band = _band(0.15)
    fractions = [_synthetic_step(band, generator, sigma, heavy_tails) for _ in range(STEPS_TO_TARGET + 10)]
    settled = fractions[STEPS_TO_TARGET:]
    assert all(abs(f - 0.15) < TOLERANCE for f in settled), (fixed, fractions)
    assert abs(fixed - 0.15) > 0.1  # the fixed band is far off at every spread tested: the controller did the work
    # logged every step: the band the step used, and the fraction it measured
    assert len(band.run.metrics["clip_band/epsilon_low"]) == len(band.run.metrics["clip_band/fraction"]) == 25
    assert band.run.metrics["clip_band/fraction"] == pytest.approx(fractions)


def test_micro_batches_at_the_sampling_weights_leave_the_band_alone():
    """On-policy micro-batches (every ratio 1) clip nothing; counted, they would narrow the band every first update."""
    generator = torch.Generator().manual_seed(0)
    band = _band(0.15)
    for _ in range(3):
        _synthetic_step(band, generator, 1e-2, False, at_sampler_weights=True)
    assert band.band == PAPER and "clip_band/fraction" not in band.run.metrics
    fraction = _synthetic_step(band, generator, 1e-2, False)
    assert fraction > 0.4  # the paper's band on a 1e-2 spread: widened by (fraction / target) ** GAIN
    assert band.band[0] == pytest.approx(PAPER[0] * (fraction / 0.15) ** GAIN, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60),
    target=st.floats(0.01, 0.99),
    start=st.sampled_from([(3e-4, 4e-4), (1e-3, 1.3e-3), (0.2, 0.28), (0.05, 0.3)]),
)
def test_never_leaves_its_bounds(fractions, target, start):
    band = start
    for fraction in fractions:
        new = next_band(band, fraction, target, start)
        factor = new[0] / band[0]
        assert 1 / MAX_STEP_FACTOR * (1 - 1e-12) <= factor <= MAX_STEP_FACTOR * (1 + 1e-12)
        assert new[1] / new[0] == pytest.approx(start[1] / start[0], rel=1e-12)  # the shape is kept
        scale = new[0] / start[0]
        assert 1 / MAX_SCALE * (1 - 1e-12) <= scale <= MAX_SCALE * (1 + 1e-12)
        assert max(new) <= MAX_EPSILON * (1 + 1e-12)
        if fraction > target:
            assert factor >= 1 - 1e-12  # too many clipped: never narrower
        elif fraction < target:
            assert factor <= 1 + 1e-12
        band = new


@pytest.mark.parametrize("start", [PAPER, (0.05, 0.3)], ids=["scale-bound", "epsilon-bound"])
def test_bounds_are_reached_and_held(start):
    band = start
    for _ in range(40):
        band = next_band(band, 1.0, 0.15, start)
    widest = min(MAX_SCALE, MAX_EPSILON / start[1])  # the paper's band: 1000 x; (0.05, 0.3): epsilon_high at 0.5
    assert band == pytest.approx((start[0] * widest, start[1] * widest), rel=1e-12)
    for _ in range(80):
        band = next_band(band, 0.0, 0.15, start)
    assert band == pytest.approx((start[0] / MAX_SCALE, start[1] / MAX_SCALE), rel=1e-12)


@pytest.mark.parametrize(
    "value, fragment",
    [(0.0, "strictly between 0 and 1"), (1.0, "strictly between"), (1.5, "strictly between"), ("0.1", "fraction")],
)
def test_bad_target_names_the_field(value, fragment):
    with pytest.raises(ValueError, match=rf"clip_target_fraction={value!r}.*{fragment}"):
        _config(clip_target_fraction=value)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_loss_types_without_a_band_refuse_it(loss_type):
    with pytest.raises(ValueError, match=rf"clip_target_fraction=0.15 needs a clip band.*loss_type='{loss_type}'"):
        _config(
            clip_target_fraction=0.15,
            loss_type=loss_type,
            allow_token_sum_with_sequence_level=True,
            epsilon_high=5.0 if loss_type == "cispo" else 4e-4,
        )


def test_off_by_default(tmp_path):
    """The default run keeps the paper's band in every step and logs nothing of the controller (tests/test_parity.py
    checks the same default run against stock TRL, loss and gradients)."""
    assert _config().clip_target_fraction is None
    trainer = make_trainer(tmp_path, max_steps=4, save_strategy="no")
    trainer.train()
    assert not trainer.clip_band.enabled and trainer.clip_band.band == PAPER
    assert trainer.clip_band.settings == LossSettings(*PAPER)
    assert not any(key.startswith("clip_band/") for row in trainer.state.log_history for key in row)


def test_in_training_the_band_moves_only_after_off_policy_steps(tmp_path, caplog):
    """steps_per_generation=2: each rollout batch's first step is on-policy. The band measured and moved after the
    second steps only, and the start-up line said the controller is on."""
    with caplog.at_level("WARNING"):
        trainer = make_trainer(tmp_path, max_steps=6, save_strategy="no", clip_target_fraction=0.15)
    assert sum("clip_target_fraction=0.15: the clip band starts at" in r.message for r in caplog.records) == 1
    trainer.train()
    rows = [row for row in trainer.state.log_history if "clip_band/epsilon_low" in row]
    assert [row["step"] for row in rows if "clip_band/fraction" in row] == [2, 4, 6]
    for first, second in zip(rows[0::2], rows[1::2]):  # an on-policy step leaves the band to its off-policy sibling
        assert first["clip_band/epsilon_low"] == second["clip_band/epsilon_low"]
    bands = [row["clip_band/epsilon_low"] for row in rows] + [trainer.clip_band.band[0]]
    assert len(set(bands)) > 1


def test_resume_restores_the_band_exactly(tmp_path):
    """A checkpoint holds the band; a resumed run continues from it, bit for bit (band and weights). Control: the same
    checkpoint without the band's file restarts from the configured band and ends elsewhere."""
    settings = dict(max_steps=6, clip_target_fraction=0.15)
    straight = make_trainer(tmp_path / "straight", save_strategy="steps", save_steps=3, **settings)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    assert (checkpoint / CHECKPOINT_FILE).exists()
    resumed = make_trainer(tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.clip_band.band == straight.clip_band.band != PAPER
    final = weights(straight)
    assert all(torch.equal(final[k], v) for k, v in weights(resumed).items())

    bare = tmp_path / "bare" / "checkpoint-3"
    shutil.copytree(checkpoint, bare)
    os.remove(bare / CHECKPOINT_FILE)
    checkpointing.mark_complete(str(bare))  # a complete checkpoint of a run that had no band to save
    control = make_trainer(tmp_path / "control", **settings)
    control.train(resume_from_checkpoint=str(bare))
    assert control.clip_band.band != straight.clip_band.band


@pytest.mark.launch
def test_two_processes_hold_the_same_band_every_step(tmp_path):
    """2 processes (gloo), each training on its own micro-batches: the pooled fraction gives both one band after
    every optimizer step, and the band moves."""
    script = os.path.join(os.path.dirname(__file__), "helpers", "fault_utils.py")
    command = two_processes(script, "--output_dir", tmp_path / "run", "--max_steps", 8, "--clip_target_fraction", 0.15)
    result = subprocess.run(command, capture_output=True, text=True, env=launch_env(), timeout=300)
    log = result.stdout + result.stderr
    assert log.count("DONE") == 2, log[-4000:]
    bands = {}
    for rank in (0, 1):
        for line in (tmp_path / "run" / f"bands-rank{rank}.txt").read_text().splitlines():
            step, low, high = line.split()
            bands.setdefault(int(step), {})[rank] = (float(low), float(high))
    assert sorted(bands) == list(range(1, 9)), log[-4000:]
    assert all(per_rank[0] == per_rank[1] for per_rank in bands.values()), bands
    assert len({per_rank[0] for per_rank in bands.values()}) > 1, bands
