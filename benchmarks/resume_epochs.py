"""Resume across epochs: max weight difference between an uninterrupted run and one stopped and resumed, with trl-gspo's
sampler (`EpochRepeatSampler`) and with TRL's own `RepeatSampler`, on the tiny Qwen3 of the fault tests (CPU).

    python benchmarks/resume_epochs.py --prompts 8 --max-steps 24 --stop 15

With 8 prompts, 4 completions per prompt, 4 completions per micro-batch and 4 mini-batches per rollout, a rollout uses
4 prompts over 4 optimizer steps and an epoch is 8 steps; step 15 is mid-rollout in epoch 2. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--stop", type=int, default=15, help="step after which the interrupted run saved and stopped")
    args = parser.parse_args(argv)

    from helpers.fault_utils import PROMPTS, make_trainer, weights
    from trl import GRPOTrainer

    from trl_gspo import GSPOTrainer

    class StockSampler(GSPOTrainer):  # TRL's RepeatSampler: each epoch's order from one generator, restarted on resume
        def _get_train_sampler(self, *a, **k):
            return GRPOTrainer._get_train_sampler(self, *a, **k)

    settings = dict(
        prompts=PROMPTS[: args.prompts],
        max_steps=args.max_steps,
        num_generations=4,
        per_device_train_batch_size=4,
        steps_per_generation=4,
    )
    result = {"prompts": args.prompts, "max_steps": args.max_steps, "stop": args.stop}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in (("trl_gspo", GSPOTrainer), ("stock_sampler", StockSampler)):
            straight = make_trainer(
                os.path.join(tmp, name), trainer_cls=cls, save_strategy="steps", save_steps=args.stop, **settings
            )
            straight.train()
            resumed = make_trainer(os.path.join(tmp, name + "-resumed"), trainer_cls=cls, **settings)
            resumed.train(resume_from_checkpoint=os.path.join(tmp, name, f"checkpoint-{args.stop}"))
            a, b = weights(straight), weights(resumed)
            result[f"{name}_max_abs_weight_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
