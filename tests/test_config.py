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


def test_what_gspo_config_changes_against_grpo_config_is_computed_and_said_once(tmp_path, caplog, trainer_factory):
    """Switching the import changes steps_per_generation (4 x accumulation) and the loss settings: the differences
    come from building both config classes with the same arguments, each with its reason, logged once per trainer."""
    from trl import GRPOConfig

    from trl_gspo.config import WHY_NOT_GRPO, differences_from_grpo

    same = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2)
    found = differences_from_grpo(make(tmp_path, **same))
    grpo = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **same)  # stock, built here
    assert found["steps_per_generation"] == (8, grpo.steps_per_generation) == (8, 2)
    assert found["importance_sampling_level"] == ("sequence", "token") and found["epsilon"] == (3e-4, 0.2)
    assert all(theirs == getattr(grpo, name) for name, (_, theirs) in found.items())
    assert set(found) <= set(WHY_NOT_GRPO)  # every difference has its reason
    grpo_values = dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=None, loss_type="dapo")
    assert differences_from_grpo(make(tmp_path, **same, **grpo_values, steps_per_generation=2)) == {}

    with caplog.at_level("WARNING", logger="trl_gspo"):
        trainer_factory(
            dict(reward=lambda completions, **kw: [0.0] * len(completions), prompts=["a b"] * 4),
            output_dir=tmp_path,
            **same,
        )
    said = [r.getMessage() for r in caplog.records if "GSPOConfig's defaults differ" in r.getMessage()]
    assert len(said) == 1 and "steps_per_generation=8 (GRPOConfig: 2; the paper's 4 mini-batch" in said[0], said
