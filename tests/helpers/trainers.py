"""The one factory of the tests' trainers: a `GSPOTrainer` (or stock `GRPOTrainer`) on a tiny model built in code,
on CPU in fp32, saving nothing. `tests/conftest.py` hands it to tests as the `trainer_factory` fixture; scripts the
tests launch in other processes call it directly."""

from __future__ import annotations

from datasets import Dataset

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.testing import build_tiny_model, build_tokenizer

#: What every test run shares: CPU, fp32, no reporting, no checkpoints unless a test asks.
CPU_RUN = dict(use_cpu=True, bf16=False, report_to=[], save_strategy="no")


def digit_fraction(completions, **kwargs) -> list[float]:
    """A reward with spread over the tiny vocabulary's words, so advantages (and gradients) are non-zero."""
    return [sum(w.isdigit() for w in c.split()) / (1 + len(c.split())) for c in completions]


#: The generation path's tests' run (`build_trainer` arguments; `cls=GRPOTrainer, config_cls=GRPOConfig` for stock
#: TRL): GSPO at the paper's clip, 8 prompts x 4 completions per rollout sampled at temperature 0.9, 4 optimizer
#: steps of 8 rows, every step logged.
SAMPLING_RUN = dict(
    reward=digit_fraction,
    prompts=[f"copy {a} {b} :" for a in range(8) for b in range(8)],
    importance_sampling_level="sequence",
    loss_type="grpo",
    epsilon=3e-4,
    epsilon_high=4e-4,
    beta=0.0,
    per_device_train_batch_size=8,
    num_generations=4,
    steps_per_generation=4,
    max_completion_length=8,
    temperature=0.9,
    learning_rate=1e-3,
    seed=0,
    logging_steps=1,
    max_steps=4,
    disable_tqdm=True,
)


def build_trainer(
    output_dir,
    reward,
    prompts,
    *,
    tokenizer=None,
    model=None,
    moe=False,
    model_seed=0,
    cls=GSPOTrainer,
    config_cls=GSPOConfig,
    train=False,
    accumulation=None,
    trainer_kwargs=None,
    **settings,
):
    """`cls(model, reward, args=config_cls(output_dir, **CPU_RUN, **settings), train_dataset=prompts)`. `model`: the
    tiny Qwen3 (`moe`: Qwen3-MoE) of `model_seed` when None. `train`: put the model in training mode, as the trainer's
    step does, for tests that call the loss or the rollout path directly; `accumulation`: TRL's
    `current_gradient_accumulation_steps` for such calls. `trainer_kwargs`: further `cls` arguments (`rollout_func`,
    `peft_config`, `eval_dataset`)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    model = model if model is not None else build_tiny_model(tokenizer, moe=moe, seed=model_seed)
    args = config_cls(output_dir=str(output_dir), **{**CPU_RUN, **settings})
    dataset = Dataset.from_dict({"prompt": list(prompts)})
    trainer = cls(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer, **(trainer_kwargs or {}))
    if train:
        trainer.model.train()
    if accumulation is not None:
        trainer.current_gradient_accumulation_steps = accumulation
    return trainer
