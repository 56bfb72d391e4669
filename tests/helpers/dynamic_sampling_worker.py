"""Launched on 2 processes by tests/test_dynamic_sampling.py: dynamic sampling with a reward that differs by rank.

Rank 0's reward is constant, rank 1's differs within each group. 2 generations per prompt, 2 prompts per process
per round (4 per round in all), 2 micro-batches per rollout batch. Each rank writes `report_rank{rank}.json` to the
output folder: per filled batch, the groups kept (`[round, group]` -> a flat index), the gathered rewards it decided on, and the prompts
of the rows it trains on.
"""

import argparse
import json
import os
import sys

import torch
from datasets import Dataset

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.testing import build_tiny_model, build_tokenizer

GROUPS_PER_ROUND = 4


def rank_dependent_reward(completions, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        return [1.0] * len(completions)
    return [float(i % 2) for i in range(len(completions))]  # rows 2k, 2k+1 are one group


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    tokenizer = build_tokenizer()
    args = GSPOConfig(
        output_dir=cli.output_dir,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=2,
        num_generations=2,
        steps_per_generation=2,
        max_completion_length=4,
        learning_rate=1e-3,
        max_steps=4,
        logging_steps=1,
        disable_tqdm=True,
        dynamic_sampling=True,
        max_sampling_rounds=3,
    )
    prompts = [f"copy {a} {b} :" for a in range(4) for b in range(4)]
    trainer = GSPOTrainer(
        build_tiny_model(tokenizer, seed=0),
        rank_dependent_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    source = trainer.rollout_source
    report = {"rank": trainer.accelerator.process_index, "kept": [], "rewards": [], "rows": [], "finished": []}
    fill = source.fill

    def recording_fill(sample=None):
        filled = fill(sample)
        report["kept"].append([r * GROUPS_PER_ROUND + k for r, k in filled.plan.groups])
        report["rewards"].append([v for round_ in filled.rounds for v in round_.rewards[:, 0].tolist()])
        groups = {}  # prompt -> flat group index, for the rows this rank trains on
        for r, round_ in enumerate(filled.rounds):
            for k, index in enumerate(source.stream.prompt_indices(round_.rollout)):
                groups[source.stream.dataset[index]["prompt"]] = r * GROUPS_PER_ROUND + k
        report["rows"].append([groups[x["prompt"]] for x in filled.inputs])
        return filled

    source.fill = recording_fill
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    report["finished"] = [int(all(torch.isfinite(torch.tensor(losses))))]
    with open(os.path.join(cli.output_dir, f"report_rank{report['rank']}.json"), "w") as f:  # ranks share stdout
        json.dump(report, f)
    print(f"DS_REPORT rank {report['rank']} written", flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/helpers/cpu_launch.py)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
    main()
