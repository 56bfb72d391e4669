"""The offline demo: GSPO teaches a tiny randomly initialised Qwen3 to copy digits, on CPU, with no downloads.

Task: the prompt is `copy 3 7 5 :`, the right completion is `3 7 5`. The reward is verifiable and shaped: the
fraction of positions holding the right digit, over the longer of answer and target, so a partly right answer
earns partial credit and a short one (an early end-of-sequence) loses it. Completions are capped at three tokens.
The random model scores ~0.02 sampled and 0.0 greedy. Copying needs attention to the prompt, so a rising reward on
held-out prompts (digit strings never seen in training) means the policy learned the task, not a bias.

    from trl_gspo.cli.demo import run_demo
    run_demo("outputs/demo")          # or: trl-gspo demo

With `use_vllm=True` the demo generates with vLLM (colocate: the engine in this process, e.g. vLLM's CPU build): vLLM
loads the model from a folder, so the initial model and tokenizer are saved to `output_dir/initial-model` first, and the
model gets a head size vLLM's CPU attention runs (`VLLM_HEAD_DIM`; the plain demo's 16 is not one of them).
"""

from __future__ import annotations

import contextlib
import csv
import os
import random
import time

import torch
from datasets import Dataset

from ..config import GSPOConfig
from ..rollout.vllm_setup import check_vllm_setup
from ..testing import build_tiny_model, build_tokenizer
from ..trainer import GSPOTrainer
from .console import StartStep, generation_line, quiet_saving, tied_weights_restored, use_console
from .recipe_inputs import RecipeError
from .run_notes import precision_line, precision_refusal_as_recipe_error

NUM_DIGITS = 3
#: Head size of the demo's model when vLLM generates: one vLLM's CPU attention runs (it refuses 16, the plain demo's).
VLLM_HEAD_DIM = 64
#: KV cache of vLLM's CPU build for the demo, in GiB (`VLLM_CPU_KVCACHE_SPACE`, unless set): without it the CPU build
#: reserves a share of the machine's memory (`vllm_gpu_memory_utilization`), far more than a tiny model needs.
VLLM_CPU_KVCACHE_GIB = 1
#: Digit strings reserved for the held-out split: training never sees them.
NUM_HELD_OUT = 200

#: Settings of the demo run (the CLI uses them as defaults; a recipe or flags override them).
DEMO_ARGS = dict(
    use_cpu=True,
    bf16=False,
    learning_rate=3e-4,  # GRPO's 1e-6 would not move a random tiny model (see FINDINGS.md)
    lr_scheduler_type="constant",
    per_device_train_batch_size=16,
    num_generations=8,
    steps_per_generation=4,  # 4 mini-batch updates per rollout batch, as in the paper: ratios leave 1, clipping acts
    max_completion_length=NUM_DIGITS,  # room for the answer only: the model need not learn to stop
    temperature=1.0,
    max_steps=2000,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    seed=0,
    dataloader_num_workers=0,
)


def _digit_pool(split: str) -> list[tuple[str, ...]]:
    all_digits = [tuple(f"{i:0{NUM_DIGITS}d}") for i in range(10**NUM_DIGITS)]
    random.Random(1234).shuffle(all_digits)  # fixed split, independent of the sampling seed
    return all_digits[:NUM_HELD_OUT] if split == "test" else all_digits[NUM_HELD_OUT:]


def make_demo_dataset(num_prompts: int, seed: int = 0, split: str = "train") -> Dataset:
    """`num_prompts` copy prompts (columns `prompt`, `target`); `split="test"` draws from digits training never sees."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; allowed: 'train', 'test'.")
    pool, rng = _digit_pool(split), random.Random(seed)
    rows = [rng.choice(pool) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": [f"copy {' '.join(d)} :" for d in rows], "target": [" ".join(d) for d in rows]})


def copy_score(completion: str, target: str) -> float:
    """Fraction of target positions answered right, over the longer of completion and target (in [0, 1])."""
    got, want = completion.split(), target.split()
    hits = sum(g == w for g, w in zip(got, want))
    return hits / max(len(got), len(want), 1)


def demo_reward(completions, target, **kwargs) -> list[float]:
    """TRL reward function: `copy_score` per completion (plain-text or conversational completions)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [copy_score(text, t) for text, t in zip(texts, target)]


def demo_config(output_dir: str, **overrides) -> GSPOConfig:
    """CPU-friendly `GSPOConfig` for the demo; keyword arguments override `DEMO_ARGS`."""
    return GSPOConfig(output_dir=output_dir, **{**DEMO_ARGS, **overrides})


def build_demo_model(seed: int = 0, moe: bool = False, head_dim: int | None = None):
    """(model, tokenizer): a tiny randomly initialised Qwen3 (or Qwen3-MoE) and the word-level tokenizer; `head_dim`
    overrides the model's head size (default: hidden size / 4 = 16)."""
    tokenizer = build_tokenizer()
    overrides = {"head_dim": head_dim} if head_dim is not None else {}
    return build_tiny_model(tokenizer, moe=moe, seed=seed, **overrides), tokenizer


@torch.no_grad()
def evaluate(model, tokenizer, dataset, batch_size: int = 100) -> float:
    """Mean `demo_reward` over `dataset` with greedy decoding (the held-out score the demo reports)."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    scores = []
    for start in range(0, len(dataset), batch_size):
        batch = dataset[start : start + batch_size]
        enc = tokenizer(batch["prompt"], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(  # ids and mask only: older tokenizers also return token_type_ids, which Qwen3 refuses
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            do_sample=False,
            max_new_tokens=NUM_DIGITS,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
        scores += demo_reward(texts, batch["target"])
    model.train(was_training)
    return sum(scores) / len(scores)


def write_metrics(log_history: list[dict], csv_path: str, png_path: str, held_out: tuple | None = None) -> None:
    """Every metric TRL logged, one row per logging step (blank where a metric was not logged that step), and a PNG
    of the training reward curve (with the held-out `(before, after)` rewards as two markers, if given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in log_history if "loss" in row]  # per-step logs (not the end-of-training summary)
    keys = ["step"] + sorted({k for row in rows for k in row} - {"step"})
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Rewards are logged once per rollout batch (every steps_per_generation steps), the loss every logging step.
    rewarded = [r for r in rows if "reward" in r]
    ax.plot([r["step"] for r in rewarded], [r["reward"] for r in rewarded], label="train reward (rollout mean)")
    if held_out is not None and rows:
        ax.plot([0, rows[-1]["step"]], list(held_out), "o", color="C3", label="held-out reward (greedy)")
    ax.set(xlabel="optimizer step", ylabel="copy reward", ylim=(-0.03, 1.05), title="GSPO on the offline copy task")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def save_initial_model(model, folder: str, tokenizer=None) -> None:
    """TRL loads the KL reference model (`beta > 0`, no adapter) and vLLM its engine from the policy's path, and the
    demo's model is built in code: the main process saves it (whole, also when ZeRO-3 has partitioned it) with the
    tokenizer, and the model's path becomes that folder, on every process."""
    from accelerate import PartialState
    from transformers.integrations import is_deepspeed_zero3_enabled

    gathered = contextlib.nullcontext()
    if is_deepspeed_zero3_enabled():
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gathered:
        model.save_pretrained(folder)  # writes on the main process only
    if tokenizer is not None and PartialState().is_main_process:
        tokenizer.save_pretrained(folder)
    PartialState().wait_for_everyone()
    model.config._name_or_path = model.name_or_path = folder  # TRL reads the config's, vLLM's engine the model's


def run_demo(
    output_dir: str = "outputs/demo",
    num_train_prompts: int = 2000,
    num_eval_prompts: int = 200,
    moe: bool = False,
    args: GSPOConfig | None = None,
    peft_config=None,
    console: str = "compact",
    **overrides,
) -> dict:
    """Train the demo end to end; writes the model, `metrics.csv` and `reward_curve.png` to `output_dir`.

    `args` replaces the whole config (the CLI passes its parsed one); otherwise `overrides` go to `demo_config`.
    `args.resume_from_checkpoint` resumes from a checkpoint of an earlier run, as `trl-gspo train` does.
    `console`: "compact" (one line per logging step) or "stock" (transformers' log dicts), see cli/console.py.
    It runs with the process's torch threads; `trl-gspo demo` picks one for this tiny model (cli/resources.py).
    Returns the held-out reward before and after training, the wall time and the steps this call trained.
    """
    from trl.models.utils import unwrap_model_for_generation

    args = args if args is not None else demo_config(output_dir, **overrides)
    model, tokenizer = build_demo_model(seed=args.seed, moe=moe, head_dim=VLLM_HEAD_DIM if args.use_vllm else None)
    train_set = make_demo_dataset(num_train_prompts, seed=args.seed)
    eval_set = make_demo_dataset(num_eval_prompts, seed=args.seed, split="test")

    if args.use_vllm or (args.beta != 0.0 and peft_config is None):
        with quiet_saving(console):
            save_initial_model(model, os.path.join(args.output_dir, "initial-model"), tokenizer)
    if args.use_vllm:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_CPU_KVCACHE_GIB))  # read by vLLM's CPU build only
        try:
            check_vllm_setup(args, model)  # the trainer checks too; here the CLI gets its one line
        except ValueError as err:
            raise RecipeError(str(err)) from err
    with precision_refusal_as_recipe_error():
        trainer = GSPOTrainer(
            model, demo_reward, args=args, train_dataset=train_set, processing_class=tokenizer, peft_config=peft_config
        )
    use_console(trainer, console)
    started = StartStep()
    trainer.add_callback(started)
    if trainer.accelerator.is_main_process:
        print(f"trl-gspo demo: {generation_line(trainer)}", flush=True)
        print(precision_line("demo", trainer), flush=True)

    def held_out_reward():  # under ZeRO-3 the weights are sharded from creation on: gather them to generate
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            return evaluate(unwrapped, tokenizer, eval_set)

    before = held_out_reward()
    start = time.perf_counter()
    with tied_weights_restored(trainer):
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    wall = time.perf_counter() - start
    steps = trainer.state.global_step - started.step
    after = held_out_reward()
    with quiet_saving(console):
        trainer.save_model(args.output_dir)  # weights + tokenizer (processing_class)
    if trainer.accelerator.is_main_process:
        paths = (os.path.join(args.output_dir, name) for name in ("metrics.csv", "reward_curve.png"))
        write_metrics(trainer.state.log_history, *paths, held_out=(before, after))
        print(f"held-out reward (greedy, {len(eval_set)} unseen prompts): before {before:.3f} -> after {after:.3f}")
        resumed = f" (resumed at step {started.step})" if started.step else ""
        print(
            f"trained {steps} steps{resumed} in {wall:.0f} s; model, metrics.csv and reward_curve.png in "
            f"{args.output_dir}"
        )
    return {"before": before, "after": after, "train_seconds": wall, "steps": steps, "trainer": trainer}
