"""The clip band that moves (trl_gspo/clip_band.py). The controller (`clip_target_fraction`): it reaches the target on
synthetic ratio spreads within a stated number of steps, never leaves its bounds, ignores on-policy micro-batches, is
off by default, holds one band on every rank, and resumes exactly. The band from each update's spread
(`clip_spread_scale`): k x the rms of the log ratios on synthetic batches (the floor where that is smaller), the same
bounds, the same on every rank, exact on resume. Which updates either measures follows where pi_old came from
(synchronous, asynchronous, sampler log-probs, one update per rollout batch); a band that moves is refused beside
Liger's loss, and `delta` stays above it."""

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
from trl_gspo.clip_band import (
    CHECKPOINT_FILE,
    GAIN,
    MAX_EPSILON,
    MAX_SCALE,
    MAX_SPREAD_SCALE,
    MAX_STEP_FACTOR,
    ClipBand,
    next_band,
    spread_band,
)
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


def _band(target, start=PAPER, delta=None):
    return ClipBand(LossSettings(*start, delta=delta), _Accelerator(), _Run(), target=target)


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


def _bands_of_two_processes(tmp_path, steps: int, *option) -> dict[int, dict[int, tuple[float, float]]]:
    """{step: {rank: the band that rank holds after the step}} of a 2-process (gloo) run of `steps` steps with
    `option` (the band's flag and value), each rank on its own micro-batches (tests/helpers/fault_utils.py)."""
    script = os.path.join(os.path.dirname(__file__), "helpers", "fault_utils.py")
    command = two_processes(script, "--output_dir", tmp_path / "run", "--max_steps", steps, *option)
    result = subprocess.run(command, capture_output=True, text=True, env=launch_env(), timeout=300)
    log = result.stdout + result.stderr
    assert log.count("DONE") == 2, log[-4000:]
    bands = {}
    for rank in (0, 1):
        for line in (tmp_path / "run" / f"bands-rank{rank}.txt").read_text().splitlines():
            step, low, high = line.split()
            bands.setdefault(int(step), {})[rank] = (float(low), float(high))
    assert sorted(bands) == list(range(1, steps + 1)), log[-4000:]
    return bands


@pytest.mark.launch
def test_two_processes_hold_the_same_band_every_step(tmp_path):
    """2 processes (gloo), each training on its own micro-batches: the pooled fraction gives both one band after
    every optimizer step, and the band moves."""
    bands = _bands_of_two_processes(tmp_path, 8, "--clip_target_fraction", 0.15)
    assert all(per_rank[0] == per_rank[1] for per_rank in bands.values()), bands
    assert len({per_rank[0] for per_rank in bands.values()}) > 1, bands


# --------------------------------------------------------------------------- which updates are measured (pi_old)
def _measured_steps(trainer, key="clip_band/fraction"):
    return [row["step"] for row in trainer.state.log_history if key in row]


def test_asynchronous_rollouts_leave_out_the_update_at_pi_olds_weights(tmp_path):
    """async_generation at its defaults (max_staleness=1, pi_old recomputed when training on a batch starts): each
    batch was sampled a step earlier than its pi_old pass, so its first update has ratios of exactly 1 and must not
    count (counted, it reads 0 and halves the band once per rollout batch)."""
    trainer = make_trainer(tmp_path, max_steps=6, save_strategy="no", async_generation=True, clip_target_fraction=0.15)
    trainer.train()
    assert _measured_steps(trainer) == [2, 4, 6]
    fractions = [row["clip_band/fraction"] for row in trainer.state.log_history if "clip_band/fraction" in row]
    assert all(f > 0 for f in fractions), fractions  # lr 1e-3 on the tiny model: the second updates clip


def test_one_update_per_asynchronous_batch_never_measures(tmp_path):
    """steps_per_generation == gradient_accumulation_steps with async generation: every update is at pi_old's weights;
    the band must stay where it was configured (counted, it sank to its floor, 1/1000 of the band)."""
    trainer = make_trainer(
        tmp_path,
        max_steps=4,
        save_strategy="no",
        async_generation=True,
        steps_per_generation=1,
        clip_target_fraction=0.15,
    )
    trainer.train()
    assert _measured_steps(trainer) == [] and trainer.clip_band.band == PAPER


def test_sampler_log_probs_measure_every_update(tmp_path):
    """old_logprobs_source="sampler": pi_old is the sampler's, not the trainer's at this step, so the first update of
    each batch is off-policy too and counts."""
    trainer = make_trainer(
        tmp_path, max_steps=4, save_strategy="no", old_logprobs_source="sampler", clip_target_fraction=0.15
    )
    trainer.train()
    assert _measured_steps(trainer) == [1, 2, 3, 4]


def test_liger_loss_refuses_a_band_that_moves():
    for field_name, value in (("clip_target_fraction", 0.15), ("clip_spread_scale", 1.0)):
        with pytest.raises(ValueError, match=rf"{field_name}={value!r} is not allowed with use_liger_kernel=True"):
            _config(**{field_name: value}, use_liger_kernel=True)


@pytest.mark.parametrize("delta", [1.0005, 1.01, 1.2])
def test_delta_stays_above_the_band(delta):
    """A band that widens never reaches INTELLECT-2's cap: 1 + epsilon_high < delta at every step, whatever it
    measured (the config only checks the configured band)."""
    band = PAPER
    for _ in range(40):
        band = next_band(band, 1.0, 0.15, PAPER, delta)
        assert 1 + band[1] < delta and band[1] / band[0] == pytest.approx(PAPER[1] / PAPER[0], rel=1e-12)
    for rms in (1e-3, 1e-2, 0.1, 10.0):
        low, high = spread_band(rms, 2.0, PAPER, delta)
        assert 1 + high < delta and low >= PAPER[0]
    assert spread_band(10.0, 2.0, PAPER, None) == pytest.approx((MAX_EPSILON * 0.75, MAX_EPSILON), rel=1e-12)


def test_a_trainer_with_delta_keeps_the_controllers_band_below_it(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6, save_strategy="no", clip_target_fraction=0.15, delta=1.001)
    trainer.train()
    assert trainer.clip_band.band != PAPER and 1 + trainer.clip_band.band[1] < 1.001


# ------------------------------------------------------------------------------- the band from each update's spread
def _spread_band(k, start=PAPER, per_sequence=True, delta=None):
    return ClipBand(
        LossSettings(*start, delta=delta), _Accelerator(), _Run(), spread_scale=k, per_sequence=per_sequence
    )


@pytest.mark.parametrize("k", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("sigma, drift", [(1e-5, 0.0), (1e-2, 0.0), (3e-2, 0.0), (0.0, 5e-3), (1e-2, -2e-2)])
def test_spread_band_is_k_times_the_rms_or_the_configured_floor(k, sigma, drift):
    """Sequence level: `epsilon = max(3e-4, k * rms(log s_i))` over the sequences that have a valid token, computed
    here in float64 from the same numbers; the 4:3 shape kept. rms, not std: a batch drifting one way (drift with no
    spread) widens the band too. float32 sums of 4096 squares: relative error well under 1e-5."""
    generator = torch.Generator().manual_seed(1)
    n, width = 4096, 8
    log_s = drift + sigma * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    mask = torch.ones(n, width)
    mask[::7] = 0  # sequences with no valid token carry no ratio
    valid = mask.sum(-1) > 0
    rms = log_s[valid].square().mean().sqrt().item()
    expected_low = max(PAPER[0], k * rms)
    band = _spread_band(k)
    band.fit("train", log_s.float(), mask, ratios_one=False)
    assert band.band == pytest.approx((expected_low, expected_low * PAPER[1] / PAPER[0]), rel=1e-5)
    assert band.run.metrics["clip_band/spread"] == [pytest.approx(rms, rel=1e-5)]
    # GSPO-token's (B, T) weights repeat log s_i on every valid token: the same band (per sequence, not per token)
    token_copy = _spread_band(k)
    token_copy.fit("train", (log_s * mask).float(), mask, ratios_one=False)
    assert token_copy.band == pytest.approx(band.band, rel=1e-5)


def test_spread_band_at_the_token_level_pools_valid_tokens():
    generator = torch.Generator().manual_seed(2)
    log_w = 0.05 * torch.randn(64, 12, generator=generator, dtype=torch.float64)
    mask = (torch.rand(64, 12, generator=generator) < 0.6).float()
    rms = log_w[mask.bool()].square().mean().sqrt().item()
    band = _spread_band(1.0, start=(0.2, 0.28), per_sequence=False)
    band.fit("train", log_w.float(), mask, ratios_one=False)
    assert band.band == pytest.approx((max(0.2, rms), max(0.2, rms) * 1.4), rel=1e-5)
    wide = _spread_band(5.0, start=(0.02, 0.028), per_sequence=False)
    wide.fit("train", log_w.float(), mask, ratios_one=False)
    assert wide.band == pytest.approx((5 * rms, 7 * rms), rel=1e-5)
    capped = _spread_band(10.0, start=(0.02, 0.028), per_sequence=False)  # 14 x rms > 0.5: the shape kept at the cap
    capped.fit("train", log_w.float(), mask, ratios_one=False)
    assert capped.band == pytest.approx((MAX_EPSILON / 1.4, MAX_EPSILON), rel=1e-12)


def test_spread_band_leaves_ratios_of_one_and_evaluation_at_the_configured_band():
    band = _spread_band(1.0)
    log_s = torch.full((16, 1), 0.1)
    band.fit("train", log_s, torch.ones(16, 4), ratios_one=False)
    assert band.band[0] == pytest.approx(0.1)
    band.fit("train", log_s, torch.ones(16, 4), ratios_one=True)
    assert band.band == PAPER
    band.fit("train", log_s, torch.ones(16, 4), ratios_one=False)
    band.fit("eval", log_s, torch.ones(16, 4), ratios_one=False)
    assert band.band == PAPER and len(band.run.metrics["clip_band/spread"]) == 2  # measured twice, in training


@settings(max_examples=200, deadline=None)
@given(
    rms=st.floats(0.0, 1e3),
    k=st.floats(1e-3, MAX_SPREAD_SCALE),
    start=st.sampled_from([(3e-4, 4e-4), (1e-3, 1.3e-3), (0.2, 0.28), (0.05, 0.3)]),
    delta=st.sampled_from([None, 1.001, 1.5, 3.0]),
)
def test_spread_band_never_leaves_its_bounds(rms, k, start, delta):
    if delta is not None and delta <= 1 + start[1]:
        return  # the config refuses it
    low, high = spread_band(rms, k, start, delta)
    assert low >= start[0] * (1 - 1e-12) and high / low == pytest.approx(start[1] / start[0], rel=1e-12)
    assert high <= MAX_EPSILON * (1 + 1e-12)
    assert delta is None or 1 + high < delta
    if k * rms <= start[0]:
        assert (low, high) == start


@pytest.mark.parametrize(
    "value, fragment",
    [
        (0.0, "in \\(0, 100\\]"),
        (-1.0, "in \\(0"),
        (float("inf"), "in \\(0"),
        (1e3, "in \\(0"),
        ("1", "number"),
        (True, ""),
    ],
)
def test_bad_spread_scale_names_the_field(value, fragment):
    with pytest.raises(ValueError, match=rf"clip_spread_scale={value!r} is not allowed.*{fragment}"):
        _config(clip_spread_scale=value)


def test_one_band_that_moves_at_a_time():
    with pytest.raises(ValueError, match="clip_target_fraction=0.15 and clip_spread_scale=1.0 both move the clip band"):
        _config(clip_target_fraction=0.15, clip_spread_scale=1.0)
    with pytest.raises(ValueError, match=r"clip_spread_scale=1.0 needs a clip band.*loss_type='sapo'"):
        _config(clip_spread_scale=1.0, loss_type="sapo")


def test_spread_band_off_by_default(tmp_path):
    """Off: no all-reduce, no metric, the configured settings object itself in every step (test_off_by_default and
    tests/test_parity.py check the default run against stock TRL)."""
    assert _config().clip_spread_scale is None
    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="no")
    configured = trainer.clip_band.settings
    trainer.train()
    assert trainer.clip_band.settings is configured


def test_in_training_the_spread_band_is_set_on_off_policy_updates(tmp_path, caplog):
    """steps_per_generation=2: each rollout batch's first update is at pi_old's weights (the configured band, no
    spread logged), the second has its own band, k x the spread it logged."""
    with caplog.at_level("WARNING"):
        trainer = make_trainer(tmp_path, max_steps=6, save_strategy="no", clip_spread_scale=1.0)
    assert sum("clip_spread_scale=1: each training micro-batch's clip band" in r.message for r in caplog.records) == 1
    trainer.train()
    rows = [row for row in trainer.state.log_history if "clip_band/epsilon_low" in row]
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert _measured_steps(trainer, "clip_band/spread") == [2, 4, 6]
    for row in rows:
        if "clip_band/spread" in row:
            assert row["clip_band/epsilon_low"] == pytest.approx(max(PAPER[0], row["clip_band/spread"]), rel=1e-6)
        else:
            assert row["clip_band/epsilon_low"] == PAPER[0]
    assert any(row["clip_band/epsilon_low"] > PAPER[0] for row in rows)  # lr 1e-3: spreads well above the floor


def test_spread_band_resumes_exactly(tmp_path):
    """Nothing to save: a run resumed mid-batch (checkpoint-3, steps_per_generation=2) computes the same bands and ends
    at the same weights, bit for bit."""
    settings = dict(max_steps=6, clip_spread_scale=1.0)
    straight = make_trainer(tmp_path / "straight", save_strategy="steps", save_steps=3, **settings)
    straight.train()
    resumed = make_trainer(tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))

    def bands(trainer):  # the steps after the checkpoint (the resumed run's history starts with the checkpoint's)
        rows = trainer.state.log_history
        return {r["step"]: r["clip_band/epsilon_low"] for r in rows if "clip_band/spread" in r and r["step"] > 3}

    assert bands(resumed) == bands(straight) and len(bands(straight)) == 2
    final = weights(straight)
    assert all(torch.equal(final[k], v) for k, v in weights(resumed).items())


@pytest.mark.launch
def test_two_processes_hold_the_same_spread_band(tmp_path):
    """2 processes (gloo), each on its own micro-batches: the pooled spread gives both one band at every update."""
    bands = _bands_of_two_processes(tmp_path, 6, "--clip_spread_scale", 1.0)
    assert all(per_rank[0] == per_rank[1] for per_rank in bands.values()), bands
    assert any(per_rank[0][0] > PAPER[0] for per_rank in bands.values()), bands
