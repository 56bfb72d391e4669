"""Tiny deterministic GSPO training runs for the fault tests (also run as a script by the resume test)."""

import argparse
import os
import sys

import torch
from datasets import Dataset

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.tiny import build_tiny_model, build_tokenizer

PROMPTS = [f"add {a} {b} =" for a in range(1, 5) for b in range(1, 5)]


def length_reward(completions, **kwargs):
    """Deterministic, varied reward: shorter completions score higher."""
    return [1.0 / (1 + len(c.split())) for c in completions]


def make_trainer(output_dir, reward_funcs=length_reward, trainer_cls=GSPOTrainer, **overrides):
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to=[],
        seed=0,
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        steps_per_generation=2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer_kwargs = {k: overrides.pop(k) for k in ("rollout_func", "peft_config", "eval_dataset") if k in overrides}
    settings.update(overrides)
    args = GSPOConfig(**settings)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    return trainer_cls(model, reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer,
                       **trainer_kwargs)  # fmt: skip


def main():
    """Train to --max_steps, optionally resuming; write a marker line per optimizer step and the final weights."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step_delay", type=float, default=0.0)
    parser.add_argument("--weights_out")
    parser.add_argument("--async_generation", action="store_true")
    parser.add_argument("--generation_delay", type=float, default=0.0, help="seconds added to each async generation")
    cli = parser.parse_args()
    if cli.generation_delay:
        from trl_gspo.async_rollouts import TransformersGenerator

        generate = TransformersGenerator._generate

        def slow(self, *args, **kwargs):
            import time

            time.sleep(cli.generation_delay)
            return generate(self, *args, **kwargs)

        TransformersGenerator._generate = slow

    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"STEP {state.global_step} RANK {trainer.accelerator.process_index} PID {os.getpid()}", flush=True)
            if cli.step_delay:
                import time

                time.sleep(cli.step_delay)

    trainer = make_trainer(cli.output_dir, max_steps=cli.max_steps, save_strategy="no",
                           **({"async_generation": True} if cli.async_generation else {}))  # fmt: skip
    trainer.add_callback(Progress())
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    if cli.weights_out and trainer.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, cli.weights_out)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
