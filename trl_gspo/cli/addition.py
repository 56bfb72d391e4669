"""The real-model demo's task: two-digit addition, asked in chat form, checked exactly.

    What is 27 + 82? Reply with only the number.        ->  reward 1 when the reply's last integer is 109, else 0

SmolLM2-135M-Instruct answers these in the form "27 + 82 = 109", right about one time in six (greedy), so the reward
is read from the reply's last integer rather than the whole reply: the policy may keep the equation, it must get the
sum right. Operands run from 10 to 99 (8,100 problems); a fixed draw of them (`NUM_HELD_OUT`, independent of the
training seed) is held out, and training never sees those pairs, so a rising held-out accuracy is arithmetic learned,
not problems memorised. The answer is an integer, so an exact integer comparison is the whole verifier (math-verify
would accept the same replies and cost a parse per completion).
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

PROMPT = "What is {a} + {b}? Reply with only the number."
#: The long-answer form (the clip-band experiments' `--study long`): SmolLM2-135M-Instruct writes ~100 tokens of
#: working before the sum; the reward still reads the reply's last integer.
WORKING_PROMPT = "What is {a} + {b}? Work it out step by step, then give the answer on the last line."
#: Problems held out of training, drawn once with a fixed seed (the demo's and the first studies' evaluation).
NUM_HELD_OUT = 200
#: The larger held-out set the experiments may reserve instead (`held_out=`): its first `NUM_HELD_OUT` problems are the
#: same, in the same order; training then draws from the rest, so the two settings train on different draws.
MAX_HELD_OUT = 1000
OPERANDS = range(10, 100)
_INTEGER = re.compile(r"-?\d+")


def _problems(split: str, held_out: int = NUM_HELD_OUT) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(4321).shuffle(pairs)  # fixed split, independent of the sampling seed
    return pairs[:held_out] if split == "test" else pairs[held_out:]


def make_addition_dataset(
    num_prompts: int, seed: int = 0, split: str = "train", prompt: str = PROMPT, held_out: int = NUM_HELD_OUT
) -> Dataset:
    """`num_prompts` chat prompts (columns `prompt`, a one-message conversation, and `answer`, the sum). `split="test"`
    gives the held-out problems in a fixed order (at most `held_out`); `"train"` draws from the rest. `prompt`:
    the question's form, with `{a}` and `{b}` (`PROMPT`, or `WORKING_PROMPT` for answers with their working).
    `held_out`: how many problems are reserved, `NUM_HELD_OUT` (200) or `MAX_HELD_OUT` (1000); a run must pass the
    same value for both splits, which keeps them disjoint."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; allowed: 'train', 'test'.")
    if held_out not in (NUM_HELD_OUT, MAX_HELD_OUT):
        raise ValueError(f"held_out={held_out!r}; allowed: {NUM_HELD_OUT} or {MAX_HELD_OUT}.")
    pool = _problems(split, held_out)
    if split == "test":
        if num_prompts > len(pool):
            raise ValueError(f"num_eval_prompts={num_prompts}: the addition task holds out {len(pool)} problems.")
        rows = pool[:num_prompts]
    else:
        rng = random.Random(seed)
        rows = [rng.choice(pool) for _ in range(num_prompts)]
    prompts = [[{"role": "user", "content": prompt.format(a=a, b=b)}] for a, b in rows]
    return Dataset.from_dict({"prompt": prompts, "answer": [a + b for a, b in rows]})


def last_integer(text: str) -> int | None:
    """The last integer written in `text`, or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def addition_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's last integer equals `answer`, else 0.0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(last_integer(text) == int(gold)) for text, gold in zip(texts, answer, strict=True)]
