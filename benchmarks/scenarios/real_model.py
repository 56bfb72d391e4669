"""The real-model scenarios' workload: SmolLM2-135M-Instruct (`trl_gspo.common.model_store.SMOLLM2`, Llama, 30
layers, a 49,152-token vocabulary) in fp32 with its own tokenizer and chat template, on the demo's two-digit addition
task (`trl_gspo.cli.addition`). The template puts its default system prompt (~20 tokens) in front of every prompt, as a
user's run would, so every prompt of a batch starts with the same tokens.

`REAL_SHAPES["cpu"]` loads the real weights (`hidden=None`); `REAL_SHAPES["tiny"]` (`run.py --tiny`) builds SmolLM2's
config shrunk to a hidden size of 64 and one layer, randomly initialised, with the real tokenizer, template and
vocabulary: the same code path in seconds. A real-model step on one thread costs tens of CPU seconds, so the shapes
are small: the demo's batch for the generating scenarios, one group of 8 per optimizer step for the layout ones.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

#: Shapes of the real-model scenarios, read as `workload.SHAPES` entries are (`long_tail`, `long_prompt`: overrides of
#: the base for those scenarios). `prompt`: which prompts (`dataset`); `prompt_range` is unused here (the prompts'
#: own token counts). `warmup_rollouts=0`: the measured window starts at the first step (a rollout costs minutes
#: there, one-time costs under a second).
REAL_SHAPES = {
    "tiny": dict(
        model="smollm2",
        hidden=64,
        layers=1,
        batch=4,
        num_generations=2,
        completion=4,
        prompt="addition",
        warmup_rollouts=0,
        measured_rollouts=1,
        reps=1,
        long_tail=dict(batch=2, accumulation=2, completion=16, prompt_range=None),
        long_prompt=dict(batch=2, accumulation=1, completion=8, median_fraction=0.5, prompt="few_shot", shots=(2, 4)),
    ),
    "cpu": dict(
        model="smollm2",
        hidden=None,  # the real weights
        layers=None,
        # the demo's rollout batch (cli/demo.py ADDITION_ARGS): 8 prompts x 8 completions of <= 16 tokens
        batch=16,
        num_generations=8,
        completion=16,
        prompt="addition",
        warmup_rollouts=0,
        measured_rollouts=1,
        reps=3,
        # addition prompts (47 tokens), completions lognormal with median 0.3 x 128, ~10 % truncated at 128
        long_tail=dict(batch=4, accumulation=2, completion=128, prompt_range=None),
        # ~1,000-token few-shot prompts (80-100 worked sums), completions lognormal with median 64 / 3; one optimizer
        # step per rollout (a stock step costs ~7 CPU minutes; each step is the same work, 8 rows of one prompt)
        long_prompt=dict(
            batch=8,
            accumulation=1,
            steps_per_generation=1,
            completion=64,
            median_fraction=1 / 3,
            prompt="few_shot",
            shots=(80, 100),
        ),
    ),
}
#: The hidden size and layers of `--tiny`'s SmolLM2-shaped model: heads of 32, one key-value head.
TINY_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def unavailable() -> str | None:
    """Why the real model cannot be loaded here (None: it can)."""
    from trl_gspo.common.model_store import SMOLLM2, ModelSourceError, resolve_model

    try:
        resolve_model(SMOLLM2)
    except ModelSourceError as err:
        return str(err)
    return None


def model_path() -> str:
    from trl_gspo.common.model_store import SMOLLM2, resolve_model

    return resolve_model(SMOLLM2).path


def model_source() -> str:
    """Which copy of the model was measured, without a path: the Hub's, or the prepared one's source."""
    from trl_gspo.common.model_store import SMOLLM2, describe, is_prepared

    path = Path(model_path())
    return f"{SMOLLM2} ({describe(path) if path.is_dir() and is_prepared(path) else 'from the Hub'})"


def make_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


def make_model(shape: dict, seed: int = 0):
    """The real weights in fp32 (`shape["hidden"]` None), else SmolLM2's config at `hidden` / `layers`, random."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape["hidden"] is None:
        return AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_path())
    config.hidden_size, config.num_hidden_layers = shape["hidden"], shape["layers"]
    config.intermediate_size = 2 * shape["hidden"]
    for key, value in TINY_HEADS.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def few_shot_content(a: int, b: int, shots: int, rng: random.Random) -> str:
    """The addition question after `shots` worked sums (~11 tokens each): a long prompt a user could send."""
    examples = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(shots)]
    worked = "\n".join(f"{x} + {y} = {x + y}" for x, y in examples)
    return f"Here are some sums:\n{worked}\n\nWhat is {a} + {b}? Reply with only the number."


def make_dataset(shape: dict, n: int = 256):
    """`n` chat prompts with their `answer`: the demo's addition prompts, or (`prompt="few_shot"`) the same questions
    after worked sums, how many drawn per prompt from the range `shots`."""
    from datasets import Dataset

    from trl_gspo.cli.addition import make_addition_dataset

    data = make_addition_dataset(n, seed=0)
    if shape["prompt"] == "addition":
        return data
    rng, shots = random.Random(0), shape["shots"]
    prompts = []
    for messages in data["prompt"]:
        a, b = (int(x) for x in re.findall(r"\d+", messages[0]["content"]))  # "What is 27 + 82? ..."
        prompts.append([{"role": "user", "content": few_shot_content(a, b, rng.randint(*shots), rng)}])
    return Dataset.from_dict({"prompt": prompts, "answer": data["answer"]})


def prompt_encoder(tokenizer):
    """How TRL tokenizes a chat prompt (`_tokenize_prompts`): the template with the generation prompt, as ids."""

    def encode(messages) -> list[int]:
        out = tokenizer.apply_chat_template(
            conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"][0])

    return encode
