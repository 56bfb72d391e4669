"""Bad configuration fails at GSPOConfig construction (before any model is loaded) with a message naming the field,
the value and what is allowed."""

import pytest
import torch

from trl_gspo import GSPOConfig
from trl_gspo.token_advantages import checked_advantages


def _config(**kwargs):
    return GSPOConfig(output_dir="unused", use_cpu=True, report_to=[], per_device_train_batch_size=4, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"importance_sampling_level": "seq"},
            r"importance_sampling_level='seq' is not supported; allowed: token, sequence, sequence_token",
        ),
        ({"loss_type": "ppo"}, r"loss_type='ppo' is not supported; allowed: grpo, bnpo, dr_grpo, dapo, luspo, cispo"),
        ({"epsilon": -0.1}, r"epsilon=-0.1 is out of range: .*needs 0 < epsilon < 1"),
        ({"epsilon_high": 1.5}, r"epsilon_high=1.5 is out of range: .*needs 0 < epsilon_high < 1"),
        ({"epsilon": float("nan")}, r"epsilon=nan is out of range"),
        (
            {"loss_type": "cispo", "epsilon_high": float("nan"), "allow_token_sum_with_sequence_level": True},
            r"epsilon_high=nan is CISPO's ratio cap and must be > 0",
        ),
        (
            {"loss_type": "dapo"},
            r"loss_type='dapo' sums token losses, so with importance_sampling_level='sequence'.*"
            r"Use loss_type='grpo'.*allow_token_sum_with_sequence_level=True",
        ),
        (
            {"loss_type": "bnpo", "importance_sampling_level": "sequence_token"},
            r"loss_type='bnpo' sums token losses, so with importance_sampling_level='sequence_token'",
        ),
        ({"num_generations": 1}, r"num_generations=1 is not allowed: it must be an integer >= 2"),
        ({"num_generations": 0}, r"num_generations=0 is not allowed: it must be an integer >= 2"),
        ({"num_generations": None}, r"num_generations=None is not allowed"),
        ({"num_generations": 2.5}, r"num_generations=2.5 is not allowed"),
        ({"num_iterations": 0}, r"num_iterations=0 is not allowed: it must be an integer >= 1"),
        ({"steps_per_generation": 0}, r"steps_per_generation=0 is not allowed: it must be an integer >= 1"),
        ({"max_log_ratio": 0.0}, r"max_log_ratio=0.0 is out of range: it must satisfy 0 < max_log_ratio <= 88.0"),
        ({"max_log_ratio": float("nan")}, r"max_log_ratio=nan is out of range"),
        ({"max_log_ratio": float("inf")}, r"max_log_ratio=inf is out of range.*or be None to disable the clamp"),
        ({"max_log_ratio": 100.0}, r"max_log_ratio=100.0 is out of range.*exp overflows"),
        ({"max_consecutive_nonfinite": 0}, r"max_consecutive_nonfinite=0 must be an integer >= 1"),
        ({"nonfinite_reward": "ignore"}, r"nonfinite_reward='ignore' is not supported; allowed: error, none"),
        ({"temperature": 0.0}, r"temperature=0.0 must be > 0"),
        ({"beta": -0.1}, r"beta=-0.1 must be >= 0"),
        ({"delta": 1.0001, "epsilon_high": 0.2}, r"delta=1.0001 must be greater than 1 \+ epsilon_high"),
        ({"epsilon": 0.0}, r"epsilon=0.0 is out of range: .*needs 0 < epsilon < 1"),
        ({"loss_type": "dr_grpo"}, r"loss_type='dr_grpo' sums token losses"),
        ({"loss_type": "cispo", "epsilon_high": 5.0}, r"loss_type='cispo' sums token losses"),
        (
            {"loss_type": "luspo", "importance_sampling_level": "token"},
            r"luspo.*needs importance_sampling_level='sequence'",
        ),
        ({"loss_type": "vespo"}, r"vespo.*set importance_sampling_level='token' \(got 'sequence'\)"),
        ({"routing_replay": "R1"}, r"routing_replay='R1' is not supported; allowed: none, R2, R3"),
        (
            {"routing_replay": "R2", "steps_per_generation": 2, "gradient_accumulation_steps": 2, "num_generations": 4},
            r"routing_replay='R2' records routes in TRL's pi_old forward, which does not run here: with "
            r"steps_per_generation=2 <= gradient_accumulation_steps=2.*replay would change nothing",
        ),
        (
            {"routing_replay": "R2", "old_logprobs_source": "sampler"},
            r"routing_replay='R2' records routes in TRL's pi_old forward, which old_logprobs_source='sampler' skips",
        ),
        (
            {"routing_replay": "R2", "use_liger_kernel": True},
            r"routing_replay='R2' replays routes in TRL's log-prob "
            r"forward, which use_liger_kernel=True replaces",
        ),
        (
            {"routing_replay": "R3", "use_transformers_continuous_batching": True},
            r"old_logprobs_source|routing_replay='R3' needs the sampler's expert routes",
        ),
        ({"trim_padding": "yes"}, r"trim_padding='yes' must be True or False"),
        ({"padding_free": 1}, r"padding_free=1 is not supported; allowed: 'auto', True, False"),
        ({"shared_prefix": "yes"}, r"shared_prefix='yes' is not supported; allowed: 'auto', True, False"),
        ({"group_minibatches": "no"}, r"group_minibatches='no' must be True or False"),
        ({"shared_prefill": "yes"}, r"shared_prefill='yes' must be True or False"),
        ({"sort_by_length": "sometimes"}, r"sort_by_length='sometimes' is not supported; allowed: auto, always, never"),
        ({"sort_by_length": True}, r"sort_by_length=True is not supported; allowed: auto, always, never"),
        ({"dynamic_sampling": "yes"}, r"dynamic_sampling='yes' must be True or False"),
        (
            {"max_sampling_rounds": 0},
            r"max_sampling_rounds=0 must be an integer >= 1 \(generation rounds per rollout batch",
        ),
        (
            {"dynamic_sampling_underfill": "drop"},
            r"dynamic_sampling_underfill='drop' is not supported; allowed: shrink, pad",
        ),
        (
            {"dynamic_sampling_filter": "std"},
            r"dynamic_sampling_filter='std' is not supported; allowed: 'reward_std', or a "
            r"dotted import path",
        ),
        (
            {"padding_free": True, "trim_padding": False},
            r"padding_free=True removes all padding, but trim_padding=False",
        ),
    ],
)
def test_bad_config_is_rejected_with_field_value_and_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_good_configs_still_build():
    assert _config().importance_sampling_level == "sequence"
    assert _config(max_log_ratio=None, nonfinite_reward="none", max_consecutive_nonfinite=1).max_log_ratio is None
    assert _config(loss_type="dapo", allow_token_sum_with_sequence_level=True).loss_type == "dapo"
    assert _config(routing_replay="R2").routing_replay == "R2"  # 4 mini-batches per rollout: pi_old forward runs
    assert _config(routing_replay="R3", steps_per_generation=2, num_generations=8).routing_replay == "R3"  # on-policy
    assert _config(trim_padding=False, sort_by_length="never").sort_by_length == "never"
    assert _config(padding_free=True, sort_by_length="always").padding_free is True


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from helpers.fault_utils import make_trainer

    return make_trainer(tmp_path_factory.mktemp("adv"))


def _checked_advantages(trainer, inputs, mask):
    """What the loss makes of `token_advantages(inputs)` (trl_gspo.token_advantages.checked_advantages)."""
    return checked_advantages(trainer.token_advantages(inputs), mask, trainer.importance_sampling_level)


def test_per_token_advantages_with_sequence_level_raise(trainer):
    mask = torch.ones(2, 5)
    with pytest.raises(
        ValueError,
        match=r"Per-token advantages of shape \(B, T\) need "
        r"importance_sampling_level='sequence_token'.*or 'token'",
    ):
        _checked_advantages(trainer, {"advantages": torch.zeros(2, 5)}, mask)
    with pytest.raises(ValueError, match=r"must return shape \(B,\) or \(B, T\) = \(2, 5\), got \(2, 4\)"):
        _checked_advantages(trainer, {"advantages": torch.zeros(2, 4)}, mask)
    trainer.importance_sampling_level = "sequence_token"
    try:
        assert _checked_advantages(trainer, {"advantages": torch.zeros(2, 5)}, mask).shape == (2, 5)
    finally:
        trainer.importance_sampling_level = "sequence"


def test_trainer_rejects_plain_grpo_config(tiny_model_dir):
    from trl import GRPOConfig

    from trl_gspo import GSPOTrainer

    with pytest.raises(TypeError, match=r"GSPOTrainer needs args=GSPOConfig\(...\), got GRPOConfig"):
        GSPOTrainer(tiny_model_dir, lambda **kw: None, args=GRPOConfig("unused", use_cpu=True, report_to=[]))
