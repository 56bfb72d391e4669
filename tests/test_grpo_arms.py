"""The regime studies' GRPO arms run on GSPOTrainer at TRL's GRPO settings (benchmarks/experiments/
real_model_compare.py `ARMS["GRPO dapo"]`, `ARMS["GRPO grpo"]`): at those settings GSPOTrainer draws stock
trl.GRPOTrainer's rollouts one for one, the same completion ids at every rollout of a run that updates the weights in
between, so the arm stands for stock GRPO at about half its CPU cost."""

import importlib

import pytest
import torch
from helpers.trainers import SAMPLING_RUN
from trl import GRPOConfig, GRPOTrainer

EXPERIMENTS = __import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks" / "experiments"
#: The sampling path's run (tests/helpers/trainers.py) at GRPO's settings, long enough for three rollout batches.
RUN = {**SAMPLING_RUN, "max_steps": 12}


def rollouts(trainer) -> list[torch.Tensor]:
    """Every rollout batch's completion ids, in the order the trainer sampled them."""
    drawn, generate = [], trainer._generate_and_score_completions

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        drawn.append(out["completion_ids"].clone())
        return out

    trainer._generate_and_score_completions = recorded
    trainer.train()
    return drawn


@pytest.mark.parametrize("arm, loss_type", [("GRPO dapo", "dapo"), ("GRPO grpo", "grpo")])
def test_grpo_arm_draws_stock_trl_rollouts_one_for_one(arm, loss_type, tmp_path, monkeypatch, trainer_factory):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    family, settings = importlib.import_module("real_model_compare").ARMS[arm]
    assert family == "ours" and settings["importance_sampling_level"] == "token" and settings["epsilon"] == 0.2
    stock_settings = {**RUN, "importance_sampling_level": "token", "loss_type": loss_type}
    for name in ("epsilon", "epsilon_high"):  # TRL's defaults, unset: the arm must write out the same
        stock_settings.pop(name)
    stock = trainer_factory(stock_settings, output_dir=tmp_path / "stock", cls=GRPOTrainer, config_cls=GRPOConfig)
    assert (stock.epsilon_low, stock.epsilon_high, stock.loss_type) == (  # epsilon_high None: TRL takes epsilon
        settings["epsilon"],
        settings["epsilon_high"],
        settings["loss_type"],
    )
    expected = rollouts(stock)  # trained before the other is built: building a model seeds torch's sampling RNG
    got = rollouts(trainer_factory({**RUN, **settings}, output_dir=tmp_path / "ours"))
    assert len(expected) == len(got) == 3  # 12 steps, 4 per rollout batch
    for index, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"rollout {index} differs"
    # the weights moved between rollouts, so equal later rollouts mean equal updates, not an idle policy
    assert not torch.equal(expected[0], expected[-1])
