"""The reward of the `custom_task` recipe: replace `answer_reward` with your own (and name it in the recipe).

A TRL reward function gets the completions and, as keyword arguments, every dataset column of the same rows; it
returns one float per completion (or None to leave a completion out of that reward).
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first number in the completion equals the row's `answer`, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # chat or plain text
        found = NUMBER.search(text)
        rewards.append(float(found is not None and float(found.group()) == float(gold)))
    return rewards
