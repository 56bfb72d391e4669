"""GSPOConfig: the paper's defaults, opt-ins and warnings (bad values: test_bad_config.py)."""

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


def test_token_sum_loss_with_sequence_level_is_allowed_on_opt_in(tmp_path):
    args = make(tmp_path, loss_type="dapo", allow_token_sum_with_sequence_level=True)
    assert args.loss_type == "dapo"


def test_cispo_cap_above_one_is_valid(tmp_path):
    assert make(tmp_path, loss_type="cispo", importance_sampling_level="token", epsilon_high=5.0).epsilon_high == 5.0


def test_on_policy_setting_warns_that_gspo_reduces_to_grpo(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        make(tmp_path, steps_per_generation=1)
    assert "reduces to GRPO" in caplog.text
