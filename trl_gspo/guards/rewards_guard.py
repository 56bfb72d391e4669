"""Checks on what reward functions return, so a buggy reward fails loudly instead of training on garbage.

TRL calls every reward function on the whole generation batch and turns `None` into NaN, which it reads as "this
function does not apply to this sample" (the sample's other reward functions still count; a sample no function
scores gets advantage 0). That convention is kept. What TRL does not catch, and this module does:

- the function raises: re-raised as `RewardFunctionError` naming the function and the first sample that fails on
  its own (found by calling the function again on single samples, only on this error path);
- it returns something that is not a sequence of numbers, or the wrong number of values: `RewardFunctionError`;
- it returns NaN or +-inf: TRL would read NaN as `None` and let inf poison the group's mean and std (every
  advantage of the group turns NaN, then silently 0). With `nonfinite_reward="error"` (default) this raises;
  with `"none"` the value is treated as `None`, a warning is logged and `rewards/<name>/nonfinite` counts it;
- a reward *model* (an `nn.Module`) outputs NaN or inf: `RewardFunctionError` (checked on TRL's reward matrix).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common.trl_compat import is_async_callable
from ..common.validation import check_choice

logger = logging.getLogger(__name__)

#: What a NaN/inf reward means.
NONFINITE_REWARD_POLICIES = ("error", "none")


@dataclass
class RewardGuardOptions:
    r"""
    `GSPOConfig` field of the reward checks (this module).

    Parameters:
        nonfinite_reward (`str`, *optional*, defaults to `"error"`):
            What to do when a reward function returns NaN or +-inf for a sample. `"error"`: raise, naming the reward
            function, the sample and the value. `"none"`: treat the value like `None` ("not applicable", TRL's
            convention), log a warning and count it in the metric `rewards/<name>/nonfinite`.
    """

    nonfinite_reward: str = field(
        default="error",
        metadata={
            "help": "A NaN/inf reward is a bug in the reward function, so it is an error by default ('error'). 'none' "
            "treats it like None (not applicable, TRL's convention: no reward signal from that function for that "
            "sample), with a warning and the metric rewards/<name>/nonfinite.",
            "choices": list(NONFINITE_REWARD_POLICIES),
        },
    )

    def _validate_options(self):
        check_choice("nonfinite_reward", self.nonfinite_reward, NONFINITE_REWARD_POLICIES)


_PREVIEW_CHARS = 200
_TRAINER_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something that cannot be used as a reward."""


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "...'"


def _describe_sample(kwargs: dict, index: int) -> str:
    prompts, completions = kwargs.get("prompts"), kwargs.get("completions")
    prompt = _preview(prompts[index]) if prompts is not None else "?"
    completion = _preview(completions[index]) if completions is not None else "?"
    return f"sample {index} (prompt={prompt}, completion={completion})"


def _single_sample_kwargs(kwargs: dict, index: int, batch_size: int) -> dict:
    """The reward call's kwargs restricted to one sample: per-sample lists are sliced, the rest passed as is, and
    the logging callbacks replaced by no-ops so the diagnostic calls leave no trace in the logs."""
    out = {}
    for key, value in kwargs.items():
        if key in ("log_extra", "log_metric"):
            out[key] = lambda *args, **kw: None
        elif isinstance(value, (list, tuple)) and len(value) == batch_size and key != "trainer_state":
            out[key] = [value[index]]
        else:
            out[key] = value
    return out


def _first_failing_sample(func, kwargs: dict, batch_size: int) -> tuple[int, BaseException] | None:
    for index in range(batch_size):
        try:
            func(**_single_sample_kwargs(kwargs, index, batch_size))
        except Exception as error:  # noqa: BLE001 - whatever the user's function raises is reported
            return index, error
    return None


def _as_number(value):
    if value is None or isinstance(value, bool):
        return value if value is None else float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):  # int, float, numpy scalars
        return float(value)
    raise TypeError(type(value).__name__)


def check_reward_values(output, name: str, kwargs: dict, batch_size: int, policy: str, on_nonfinite=None) -> list:
    """Validate one reward function's output for a batch; returns a list of floats / `None` of length `batch_size`.

    `policy` is `GSPOConfig.nonfinite_reward`; under `policy="none"`, `on_nonfinite(count)` (if given) is told how many
    NaN/inf values were turned into `None` in this batch.
    """
    if isinstance(output, torch.Tensor):
        output = output.reshape(-1).tolist() if output.dim() <= 1 else output
    elif hasattr(output, "tolist") and not isinstance(output, (list, tuple)):  # numpy arrays
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise RewardFunctionError(
            f"Reward function {name!r} returned {type(output).__name__} ({_preview(output)}); it must return a list of "
            f"{batch_size} floats (or None for samples it does not apply to), one per completion."
        )
    if len(output) != batch_size:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(output)} values for {batch_size} completions; it must return "
            "exactly one value (a float, or None when it does not apply) per completion, in order."
        )
    values, nonfinite = [], 0
    for index, raw in enumerate(output):
        try:
            value = _as_number(raw)
        except TypeError:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {_preview(raw)} of type {type(raw).__name__} for "
                f"{_describe_sample(kwargs, index)}; allowed: a real number, or None when it does not apply."
            ) from None
        if value is not None and not math.isfinite(value):
            if policy == "error":
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {value} for {_describe_sample(kwargs, index)}. NaN/inf "
                    "rewards are not allowed: return None for samples the function does not apply to, or set "
                    "nonfinite_reward='none' to treat non-finite values as None."
                )
            value, nonfinite = None, nonfinite + 1
        values.append(value)
    if nonfinite:
        logger.warning(
            "Reward function %r returned NaN/inf for %d of %d completions; treated as None (nonfinite_reward='none').",
            name,
            nonfinite,
            batch_size,
        )
    if on_nonfinite is not None and policy == "none":
        on_nonfinite(nonfinite)
    return values


def _reraise(func, name: str, kwargs: dict, error: Exception):
    batch_size = len(kwargs.get("completions") or kwargs.get("prompts") or [])
    found = _first_failing_sample(func, kwargs, batch_size) if not is_async_callable(func) else None
    if found is not None:
        index, sample_error = found
        where = f"on {_describe_sample(kwargs, index)}: {type(sample_error).__name__}: {sample_error}"
    else:
        where = f"on a batch of {batch_size} completions: {type(error).__name__}: {error}"
    raise RewardFunctionError(f"Reward function {name!r} raised {where}") from error


def guard_reward_function(func, name: str, policy: str, on_nonfinite=None):
    """Wrap a TRL reward callable so errors and bad outputs are reported as above; keeps it sync or async."""
    if is_async_callable(func):

        @functools.wraps(func)
        async def guarded_async(**kwargs):
            try:
                output = await func(**kwargs)
            except Exception as error:  # noqa: BLE001
                _reraise(func, name, kwargs, error)
            return check_reward_values(output, name, kwargs, len(kwargs["prompts"]), policy, on_nonfinite)

        guarded_async.__gspo_guarded__ = True
        return guarded_async

    @functools.wraps(func)
    def guarded(**kwargs):
        try:
            output = func(**kwargs)
        except Exception as error:  # noqa: BLE001
            _reraise(func, name, kwargs, error)
        return check_reward_values(output, name, kwargs, len(kwargs["prompts"]), policy, on_nonfinite)

    guarded.__gspo_guarded__ = True
    return guarded


def check_reward_matrix(rewards_per_func: torch.Tensor, reward_funcs: list, names: list[str]) -> None:
    """Final check on TRL's `(N, num_funcs)` reward matrix: no inf anywhere (guarded callables already turned theirs
    into errors or None), and no NaN from a reward model, which has no "not applicable" convention."""
    bad = torch.isinf(rewards_per_func)
    for column, func in enumerate(reward_funcs):
        if isinstance(func, nn.Module):
            bad[:, column] |= torch.isnan(rewards_per_func[:, column])
    if bad.any():
        row, column = (int(i) for i in bad.nonzero()[0])
        raise RewardFunctionError(
            f"Reward {names[column]!r} produced {rewards_per_func[row, column].item()} for completion {row} of the "
            "batch; rewards must be finite (a reward model's NaN/inf output usually means overflow or a broken head)."
        )


def guard_reward_funcs(reward_funcs: list, names: list[str], policy: str, on_nonfinite=None) -> None:
    """Wrap the reward callables of TRL's `reward_funcs` list in place (reward models are left alone; they are
    checked on the reward matrix, `check_reward_matrix`). `on_nonfinite(name, count)` is told, under `policy="none"`,
    how many NaN/inf values of the function `name` were turned into `None` in a batch."""
    for i, (func, name) in enumerate(zip(reward_funcs, names)):
        if not isinstance(func, nn.Module) and not getattr(func, "__gspo_guarded__", False):
            count = functools.partial(on_nonfinite, name) if policy == "none" and on_nonfinite else None
            reward_funcs[i] = guard_reward_function(func, name, policy, count)
