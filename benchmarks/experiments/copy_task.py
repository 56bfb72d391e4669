"""The demo's copy task with more digits (`CopyTask`): the task the comparison's experiments train on when the
demo's three digits are too short (`compare.py --task`, the routing-replay and dynamic-sampling experiments).
"""

from __future__ import annotations


class CopyTask:
    """The demo's copy task with `num_digits` digits per prompt (longer completions) and MoE config overrides, in the
    task interface `run` expects. Held-out prompts are digit strings whose digit sum is a multiple of 7; training
    never draws them."""

    def __init__(self, num_digits: int, moe_overrides: dict | None = None):
        self.num_digits, self.moe_overrides = num_digits, moe_overrides or {}
        from trl_gspo.cli import demo

        self.demo = demo
        self.demo_reward, self.demo_config = demo.demo_reward, demo.demo_config

    def make_demo_dataset(self, num_prompts: int, seed: int = 0, split: str = "train"):
        import random

        from datasets import Dataset

        rng, rows = random.Random(f"{split}-{seed}"), []
        while len(rows) < num_prompts:
            digits = [str(rng.randrange(10)) for _ in range(self.num_digits)]
            if (sum(map(int, digits)) % 7 == 0) == (split == "test"):
                rows.append(digits)
        return Dataset.from_dict(
            {"prompt": [f"copy {' '.join(d)} :" for d in rows], "target": [" ".join(d) for d in rows]}
        )

    def build_demo_model(self, seed: int = 0, moe: bool = False):
        from trl_gspo.testing import build_tiny_model, build_tokenizer

        tokenizer = build_tokenizer()
        return build_tiny_model(tokenizer, moe=moe, seed=seed, **(self.moe_overrides if moe else {})), tokenizer

    def evaluate(self, model, tokenizer, dataset, batch_size: int = 100) -> float:
        import torch

        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        scores = []
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                batch = dataset[start : start + batch_size]
                enc = tokenizer(batch["prompt"], return_tensors="pt", padding=True).to(model.device)
                out = model.generate(
                    **enc, do_sample=False, max_new_tokens=self.num_digits, pad_token_id=tokenizer.pad_token_id
                )
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
                scores += self.demo_reward(texts, batch["target"])
        model.train(was_training)
        return sum(scores) / len(scores)
