"""GSPOConfig: the paper's defaults, and a clear ValueError for each bad combination."""

import pytest

from trl_gspo import GSPOConfig


def make(tmp_path, **kwargs):
    return GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kwargs)


def test_paper_defaults(tmp_path):
    args = make(tmp_path, gradient_accumulation_steps=2)
    assert args.importance_sampling_level == "sequence"
    assert (args.epsilon, args.epsilon_high) == (3e-4, 4e-4)
    assert args.loss_type == "grpo" and args.beta == 0.0
    assert args.steps_per_generation == 8  # 4 mini-batch updates per rollout batch
    assert make(tmp_path, steps_per_generation=2).steps_per_generation == 2  # an explicit value wins


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(importance_sampling_level="seq"), ["importance_sampling_level='seq'", "sequence_token"]),
        (dict(epsilon=0.0), ["epsilon=0.0", "0 < epsilon < 1"]),
        (dict(epsilon=-3e-4), ["epsilon=-0.0003", "out of range"]),
        (dict(epsilon_high=1.5), ["epsilon_high=1.5", "0 < epsilon_high < 1"]),
        (dict(loss_type="dapo"), ["loss_type='dapo'", "length", "allow_token_sum_with_sequence_level"]),
        (dict(loss_type="bnpo", importance_sampling_level="sequence_token"), ["loss_type='bnpo'"]),
        (dict(loss_type="dr_grpo"), ["loss_type='dr_grpo'"]),
        (dict(loss_type="cispo", epsilon_high=5.0), ["loss_type='cispo'"]),
        (dict(loss_type="ppo"), ["loss_type='ppo'", "grpo"]),
        (dict(loss_type="luspo", importance_sampling_level="token"), ["luspo", "'sequence'"]),
        (dict(loss_type="vespo"), ["vespo", "importance_sampling_level='token'"]),
        (dict(loss_type="sapo", importance_sampling_level="sequence_token"), ["sapo", "sequence_token"]),
        (dict(delta=1.0001), ["delta=1.0001", "1 + epsilon_high"]),
        (dict(max_log_ratio=0.0), ["max_log_ratio=0.0", "0 < max_log_ratio"]),
        (dict(token_advantages_fn="x.y"), ["token_advantages_fn='x.y'", "sequence_token"]),
        (dict(num_generations=1), ["num_generations=1", ">= 2"]),
    ],
)
def test_bad_config_raises_a_clear_error(tmp_path, kwargs, fragments):
    with pytest.raises(ValueError) as err:
        make(tmp_path, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_token_sum_loss_with_sequence_level_is_allowed_on_opt_in(tmp_path):
    args = make(tmp_path, loss_type="dapo", allow_token_sum_with_sequence_level=True)
    assert args.loss_type == "dapo"


def test_cispo_cap_above_one_is_valid(tmp_path):
    assert make(tmp_path, loss_type="cispo", importance_sampling_level="token", epsilon_high=5.0).epsilon_high == 5.0


def test_on_policy_setting_warns_that_gspo_reduces_to_grpo(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        make(tmp_path, steps_per_generation=1)
    assert "reduces to GRPO" in caplog.text


def test_trainer_rejects_a_plain_grpo_config(tmp_path, tokenizer):
    from trl import GRPOConfig

    from trl_gspo import GSPOTrainer
    from trl_gspo.tiny import build_tiny_model

    with pytest.raises(TypeError, match="GSPOConfig"):
        GSPOTrainer(build_tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions),
                    args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))


def test_unresolvable_token_advantages_fn_names_the_field(tmp_path, tokenizer):
    from datasets import Dataset

    from trl_gspo import GSPOTrainer
    from trl_gspo.tiny import build_tiny_model

    args = make(tmp_path, importance_sampling_level="sequence_token", token_advantages_fn="trl_gspo.nope.fn",
                per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match=r"token_advantages_fn='trl_gspo.nope.fn' could not be imported"):
        GSPOTrainer(build_tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=tokenizer)
