"""Misbehaving reward functions: each fails with a message naming the function and the sample, or follows TRL's
documented None convention; a NaN/inf never reaches the advantages silently."""

import asyncio
import math

import pytest
import torch
from helpers.fault_utils import make_trainer
from torch import nn

from trl_gspo.guards.rewards_guard import RewardFunctionError, check_reward_matrix, guard_reward_function

PROMPTS = ["add 1 2 =", "add 3 4 =", "add 5 6 ="]
COMPLETIONS = ["3", "seven", "11"]


def _call(func, policy="error", on_nonfinite=None, completions=COMPLETIONS):
    guarded = guard_reward_function(func, func.__name__, policy, on_nonfinite)
    return guarded(
        prompts=PROMPTS,
        completions=completions,
        completion_ids=[[1]] * 3,
        trainer_state=None,
        log_extra=None,
        log_metric=None,
        answer=["3", "7", "11"],
    )


def fails_on_words(completions, answer, **kwargs):
    return [float(int(c) == int(a)) for c, a in zip(completions, answer)]


def test_raising_reward_names_function_and_failing_sample():
    with pytest.raises(
        RewardFunctionError,
        match=r"'fails_on_words' raised on sample 1 \(prompt='add 3 4 =', "
        r"completion='seven'\): ValueError: invalid literal",
    ) as info:
        _call(fails_on_words)
    assert isinstance(info.value.__cause__, ValueError)  # the original traceback is kept


def test_wrong_number_of_values():
    def short(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    with pytest.raises(RewardFunctionError, match=r"'short' returned 2 values for 3 completions"):
        _call(short)


@pytest.mark.parametrize(
    "output,match",
    [
        (0.5, r"'bad' returned float \(0.5\); it must return a list of 3 floats"),
        (["1", 0.0, 1.0], r"'bad' returned '1' of type str for sample 0 \(prompt='add 1 2 ='.*allowed: a real number"),
        ([[1.0], 0.0, 1.0], r"'bad' returned \[1.0\] of type list for sample 0"),
    ],
)
def test_values_that_are_not_numbers(output, match):
    def bad(completions, **kwargs):
        return output

    with pytest.raises(RewardFunctionError, match=match):
        _call(bad)


def test_numpy_and_tensor_outputs_are_accepted():
    import numpy as np

    def as_array(completions, **kwargs):
        return np.array([1.0, 0.0, 0.5])

    def as_tensor(completions, **kwargs):
        return [torch.tensor(1.0), None, np.float32(0.5)]

    assert _call(as_array) == [1.0, 0.0, 0.5]
    assert _call(as_tensor) == [1.0, None, 0.5]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_reward_is_an_error_by_default(value):
    def nonfinite(completions, **kwargs):
        return [1.0, value, 0.0]

    with pytest.raises(
        RewardFunctionError,
        match=rf"'nonfinite' returned {value} for sample 1 \(prompt='add 3 4 =', "
        r"completion='seven'\).*nonfinite_reward='none'",
    ):
        _call(nonfinite)


def test_nonfinite_reward_as_none_is_counted():
    counts = []

    def nonfinite(completions, **kwargs):
        return [float("nan"), 1.0, float("inf")]

    assert _call(nonfinite, policy="none", on_nonfinite=counts.append) == [None, 1.0, None]
    assert counts == [2]


def test_async_reward_function_is_guarded():
    async def async_reward(completions, **kwargs):
        return [1.0, float("nan"), 0.0]

    guarded = guard_reward_function(async_reward, "async_reward", "error")
    assert asyncio.iscoroutinefunction(guarded)
    with pytest.raises(RewardFunctionError, match="'async_reward' returned nan for sample 1"):
        asyncio.run(guarded(prompts=PROMPTS, completions=COMPLETIONS))


def test_reward_model_nan_or_inf_is_an_error():
    rewards = torch.tensor([[0.1, 1.0], [float("nan"), float("nan")], [0.3, 0.0]])
    funcs = [nn.Linear(1, 1), lambda **kw: None]
    with pytest.raises(RewardFunctionError, match=r"Reward 'rm' produced nan for completion 1"):
        check_reward_matrix(rewards, funcs, ["rm", "fn"])
    check_reward_matrix(rewards[:, 1:], funcs[1:], ["fn"])  # NaN from a function is TRL's "None": allowed
    with pytest.raises(RewardFunctionError, match=r"Reward 'fn' produced inf for completion 2"):
        check_reward_matrix(torch.tensor([[0.0], [1.0], [math.inf]]), funcs[1:], ["fn"])


# ----------------------------------------------------------------------------------- wired into GSPOTrainer
def test_trainer_reports_raising_reward(tmp_path):
    def broken(completions, **kwargs):
        raise KeyError("answer")

    trainer = make_trainer(tmp_path, reward_funcs=broken, max_steps=1)
    with pytest.raises(RewardFunctionError, match=r"'broken' raised on sample 0 \(prompt='add .*KeyError: 'answer'"):
        trainer.train()


def test_trainer_rejects_nan_reward_and_wrong_count(tmp_path):
    def sometimes_nan(completions, **kwargs):
        return [float("nan")] + [1.0] * (len(completions) - 1)

    with pytest.raises(RewardFunctionError, match=r"'sometimes_nan' returned nan for sample 0"):
        make_trainer(tmp_path / "a", reward_funcs=sometimes_nan, max_steps=1).train()

    def one_value(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"'one_value' returned 1 values for 8 completions"):
        make_trainer(tmp_path / "b", reward_funcs=one_value, max_steps=1).train()


def test_trainer_none_rewards_follow_trl_convention(tmp_path):
    """None for some samples: those samples are unscored by that function; None for all (from every function):
    advantage 0. Either way the step is finite. NaN under nonfinite_reward='none' behaves the same and is counted."""

    def half_none(completions, **kwargs):
        return [None if i % 2 else float(len(c)) for i, c in enumerate(completions)]

    def all_none(completions, **kwargs):
        return [None] * len(completions)

    def all_nan(completions, **kwargs):
        return [float("nan")] * len(completions)

    for name, funcs, extra in [
        ("half", half_none, {}),
        ("all", all_none, {}),
        ("nan", all_nan, {"nonfinite_reward": "none"}),
    ]:
        trainer = make_trainer(tmp_path / name, reward_funcs=funcs, max_steps=2, **extra)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "nonfinite/microbatches" in h]
        assert all(math.isfinite(h["loss"]) and h["nonfinite/microbatches"] == 0 for h in logs), name
        if name != "half":  # nothing scored: zero advantages, so no gradient at all
            assert all(h["grad_norm"] == 0.0 for h in logs), name
        if name == "nan":
            assert logs[0]["rewards/all_nan/nonfinite"] == 8
