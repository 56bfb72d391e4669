"""Tiny deterministic GSPO training runs for the fault tests (also run as a script by the resume test)."""

import argparse
import os
import sys

import torch
from transformers import TrainerCallback  # after TRL: with peft 0.17 (oldest set) TRL's import-time patch is needed

from trl_gspo import GSPOTrainer

if __package__:  # imported by the tests (helpers.fault_utils)
    from .trainers import build_trainer
else:  # run as a script by the resume and async tests
    from trainers import build_trainer

PROMPTS = [f"add {a} {b} =" for a in range(1, 5) for b in range(1, 5)]


def length_reward(completions, **kwargs):
    """Deterministic, varied reward: shorter completions score higher."""
    return [1.0 / (1 + len(c.split())) for c in completions]


#: The config fields of the fault and resume runs.
SETTINGS = dict(
    seed=0,
    learning_rate=1e-3,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    steps_per_generation=2,
    max_steps=4,
    logging_steps=1,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def make_trainer(output_dir, reward_funcs=length_reward, trainer_cls=GSPOTrainer, prompts=PROMPTS, **overrides):
    """A fault or resume run's trainer (tests/helpers/trainers.py), also from the scripts the tests launch."""
    trainer_kwargs = {k: overrides.pop(k) for k in ("rollout_func", "peft_config", "eval_dataset") if k in overrides}
    return build_trainer(
        output_dir, reward_funcs, prompts, cls=trainer_cls, trainer_kwargs=trainer_kwargs, **{**SETTINGS, **overrides}
    )


class SaveAt(TrainerCallback):
    """Save a checkpoint after each of the given optimizer steps (HF's save_steps only saves at multiples)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            control.should_save = True
        return control


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def straight_then_resumed(output_dir, max_steps, save_at, **overrides):
    """Train `max_steps` without interruption, saving after each step in `save_at`; then, in the same process, a new
    trainer per saved checkpoint resumes from it and trains to `max_steps`. Returns (straight weights, {step: resumed
    weights}). Each resumed trainer starts from scratch like a restarted job (new model, sampler, generator); HF
    restores the RNG states from the checkpoint."""
    trainer = make_trainer(os.path.join(output_dir, "straight"), max_steps=max_steps, **overrides)
    trainer.add_callback(SaveAt(save_at))
    trainer.train()
    straight, resumed = weights(trainer), {}
    for step in save_at:
        again = make_trainer(os.path.join(output_dir, f"resumed-{step}"), max_steps=max_steps, **overrides)
        again.train(resume_from_checkpoint=os.path.join(output_dir, "straight", f"checkpoint-{step}"))
        assert again.state.global_step == max_steps
        resumed[step] = weights(again)
    return straight, resumed


def main():
    """Train to --max_steps, optionally resuming; write a marker line per optimizer step and the final weights.
    With --resume_each, run `straight_then_resumed` instead and save its weights."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step_delay", type=float, default=0.0)
    parser.add_argument("--weights_out")
    parser.add_argument("--num_prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--resume_each", type=int, nargs="*", help="steps to save at, then resume from")
    parser.add_argument("--async_generation", action="store_true")
    parser.add_argument("--generation_delay", type=float, default=0.0, help="seconds added to each async generation")
    parser.add_argument("--clip_target_fraction", type=float, default=None, help="prints each step's clip band")
    parser.add_argument("--clip_spread_scale", type=float, default=None, help="prints each step's last clip band")
    cli = parser.parse_args()
    prompts = PROMPTS[: cli.num_prompts]
    if cli.generation_delay:
        from trl_gspo.rollout.async_backends import TransformersGenerator

        generate = TransformersGenerator._generate_batch

        def slow(self, *args, **kwargs):
            import time

            time.sleep(cli.generation_delay)
            return generate(self, *args, **kwargs)

        TransformersGenerator._generate_batch = slow

    if cli.resume_each:
        straight, resumed = straight_then_resumed(cli.output_dir, cli.max_steps, cli.resume_each, prompts=prompts)
        from accelerate import PartialState

        if PartialState().is_main_process:
            torch.save({"straight": straight, "resumed": resumed}, cli.weights_out)
        print("DONE", flush=True)
        return

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"STEP {state.global_step} RANK {trainer.accelerator.process_index} PID {os.getpid()}", flush=True)
            if trainer.clip_band.enabled:  # the band this rank will use next (exact: repr of the floats)
                # In a file per rank: the ranks share one stdout pipe, where another rank's partial line can join it.
                low, high = trainer.clip_band.band
                rank = trainer.accelerator.process_index
                os.makedirs(cli.output_dir, exist_ok=True)
                with open(os.path.join(cli.output_dir, f"bands-rank{rank}.txt"), "a") as record:
                    record.write(f"{state.global_step} {low!r} {high!r}\n")
            if cli.step_delay:
                import time

                time.sleep(cli.step_delay)

    trainer = make_trainer(
        cli.output_dir,
        max_steps=cli.max_steps,
        save_strategy="no",
        prompts=prompts,
        **({"async_generation": True} if cli.async_generation else {}),
        **({"clip_target_fraction": cli.clip_target_fraction} if cli.clip_target_fraction else {}),
        **({"clip_spread_scale": cli.clip_spread_scale} if cli.clip_spread_scale else {}),
    )
    trainer.add_callback(Progress())
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    if cli.weights_out and trainer.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, cli.weights_out)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
    main()
