"""Reward functions for the CLI and recipes, and the name -> function resolution the CLI uses.

A reward is any TRL reward function: `f(completions, **columns) -> list[float | None]`. Recipes name them in
`reward_funcs`, either by a registered name (TRL's built-ins and ours, see `REWARD_FUNCS`) or by a dotted import
path such as `my_pkg.rewards.my_reward` (imported with importlib, never evaluated as code).
"""

from __future__ import annotations

import difflib
import inspect
import re
import threading
from collections.abc import Callable

from ..common.imports import import_object
from .addition import addition_reward
from .demo import demo_reward

#: Arguments TRL passes to every reward function itself; any other parameter without a default is a dataset column.
TRAINER_SUPPLIED = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "environments"}

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _text(completion) -> str:
    """Plain-text completions are strings; conversational ones are a list of messages (the last is the answer)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _gold_text(row_solution: str) -> str:
    """GSM8K-style solutions end with `#### 42`; math-verify wants just the final answer there."""
    match = _GSM8K_ANSWER.search(row_solution)
    return match.group(1).replace(",", "") if match else row_solution


def math_accuracy_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion's final answer equal to the gold one, else 0.0.

    Unlike TRL's `accuracy_reward` it accepts plain-text and conversational completions, takes the gold answer
    from a `solution` or an `answer` column (GSM8K's `#### 42` suffix is understood), and parses an unboxed gold
    answer as a plain expression. Rows whose gold answer math-verify cannot parse get `None` (TRL skips them).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    golds = solution if solution is not None else answer
    if golds is None:
        raise ValueError("math_accuracy_reward needs a 'solution' or an 'answer' column in the dataset.")
    # math-verify's timeouts use signal.alarm, which only works in the main thread (TRL may call rewards elsewhere).
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]  # \boxed{} first
    rewards = []
    for completion, gold in zip(completions, golds, strict=True):
        gold_parsed = parse(_gold_text(str(gold)), extraction_config=configs, parsing_timeout=timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        predicted = parse(_text(completion), extraction_config=configs, parsing_timeout=timeout)
        rewards.append(float(verify(gold_parsed, predicted, timeout_seconds=timeout)))
    return rewards


math_accuracy_reward.needs_one_of = ("solution", "answer")


def _registry() -> dict[str, Callable]:
    from trl.rewards import accuracy_reward, reasoning_accuracy_reward, think_format_reward  # on first use only

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "math_accuracy_reward": math_accuracy_reward,
        "demo_reward": demo_reward,
        "addition_reward": addition_reward,
    }


def resolve_reward(name: str, search_dirs: tuple = ()) -> Callable:
    """A registered reward name or a dotted import path (`pkg.module.func`) -> the callable. Raises ValueError."""
    registry = _registry()
    if name in registry:
        return registry[name]
    if "." in name:
        try:
            func = import_object(name, search_dirs)
        except ValueError as err:
            raise ValueError(f"reward_funcs: reward {name!r}: {err}") from err
        if not callable(func):
            raise ValueError(f"reward_funcs: {name!r} is not callable.")
        return func
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"reward_funcs: unknown reward {name!r}.{hint} Use one of {', '.join(registry)} or a dotted import path "
        "such as 'my_package.rewards.my_reward'."
    )


def needed_columns(func: Callable) -> tuple[list[str], tuple[str, ...]]:
    """(dataset columns `func` requires, a group of columns of which it needs one): its parameters without a default
    that TRL does not supply, and its `needs_one_of` attribute such as ("solution", "answer")."""
    params = inspect.signature(func).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in TRAINER_SUPPLIED]
    return needed, tuple(getattr(func, "needs_one_of", ()))


def missing_columns(func: Callable, columns) -> list[str]:
    """Dataset columns `func` needs but `columns` lacks (see `needed_columns`); a missing `needs_one_of` group is
    reported as "solution|answer"."""
    needed, group = needed_columns(func)
    missing = [name for name in needed if name not in columns]
    if group and not set(group) & set(columns):
        missing.append("|".join(group))
    return missing
