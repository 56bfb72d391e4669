"""`trl-gspo demo`: GSPO trains a model on a verifiable task, on CPU, and reports a held-out score before and after.

Two tasks (`task`):

- `addition` (the default recipe, `smollm2_addition`): SmolLM2-135M-Instruct, a real pretrained model (from the Hub,
  or prepared offline by `trl-gspo models prepare`), learns two-digit addition; greedy accuracy on 200 held-out
  problems before, during and after training (cli/addition.py).
- `copy` (recipe `demo`, the fast smoke test): a tiny randomly initialised Qwen3 built in code learns to copy digits.
  The prompt is `copy 3 7 5 :`, the right completion is `3 7 5`. The reward is verifiable and shaped: the fraction of
  positions holding the right digit, over the longer of answer and target, so a partly right answer earns partial
  credit and a short one (an early end-of-sequence) loses it. Completions are capped at three tokens. The random
  model scores ~0.02 sampled and 0.0 greedy. Copying needs attention to the prompt, so a rising reward on held-out
  prompts (digit strings never seen in training) means the policy learned the task, not a bias. No downloads.

    from trl_gspo.cli.demo import run_demo
    run_demo("outputs/demo")          # the copy task; or: trl-gspo demo --config demo

With `use_vllm=True` the demo generates with vLLM (colocate: the engine in this process, e.g. vLLM's CPU build): vLLM
loads the model from a folder, so the copy task's initial model and tokenizer are saved to `output_dir/initial-model`
first, and the model gets a head size vLLM's CPU attention runs (`VLLM_HEAD_DIM`; the plain demo's 16 is not one of
them).
"""

from __future__ import annotations

import contextlib
import csv
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from datasets import Dataset
from transformers import TrainerCallback

from ..common.model_store import SMOLLM2
from ..config import GSPOConfig
from ..rollout.vllm_setup import check_vllm_setup
from ..testing import build_tiny_model, build_tokenizer
from ..trainer import GSPOTrainer
from .addition import NUM_HELD_OUT as ADDITION_HELD_OUT
from .addition import addition_reward, make_addition_dataset
from .console import StartStep, generation_line, quiet_saving, tied_weights_restored, use_console
from .recipe_inputs import RecipeError
from .run_model import resolve_for_run, write_record
from .run_notes import precision_line, precision_refusal_as_recipe_error

NUM_DIGITS = 3
#: Head size of the demo's model when vLLM generates: one vLLM's CPU attention runs (it refuses 16, the plain demo's).
VLLM_HEAD_DIM = 64
#: KV cache of vLLM's CPU build for the demo, in GiB (`VLLM_CPU_KVCACHE_SPACE`, unless set): without it the CPU build
#: reserves a share of the machine's memory (`vllm_gpu_memory_utilization`), far more than a tiny model needs.
VLLM_CPU_KVCACHE_GIB = 1
#: Digit strings reserved for the held-out split: training never sees them.
NUM_HELD_OUT = 200

#: Settings of the copy task's run (the CLI uses them as defaults; a recipe or flags override them).
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

#: Settings of the addition task's run on SmolLM2-135M-Instruct (recipes/smollm2_addition.yaml sets the same; a recipe
#: or flags override them). 8 prompts x 8 completions per rollout batch, 4 updates per batch.
ADDITION_ARGS = dict(
    use_cpu=True,
    bf16=False,
    learning_rate=5e-6,
    lr_scheduler_type="constant",
    per_device_train_batch_size=16,
    num_generations=8,
    steps_per_generation=4,
    max_completion_length=16,  # "27 + 82 = 109" and the end-of-turn token fit in 9; room to spare
    temperature=1.0,
    gradient_checkpointing=False,  # GRPOConfig turns it on; this model's activations fit, recomputing costs CPU time
    max_steps=32,
    logging_steps=4,
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
    """CPU-friendly `GSPOConfig` for the copy task; keyword arguments override `DEMO_ARGS`."""
    return GSPOConfig(output_dir=output_dir, **{**DEMO_ARGS, **overrides})


def build_demo_model(seed: int = 0, moe: bool = False, head_dim: int | None = None):
    """(model, tokenizer): a tiny randomly initialised Qwen3 (or Qwen3-MoE) and the word-level tokenizer; `head_dim`
    overrides the model's head size (default: hidden size / 4 = 16)."""
    tokenizer = build_tokenizer()
    overrides = {"head_dim": head_dim} if head_dim is not None else {}
    return build_tiny_model(tokenizer, moe=moe, seed=seed, **overrides), tokenizer


def greedy_score(model, tokenizer, dataset, reward, max_new_tokens: int, batch_size: int = 100) -> float:
    """Mean `reward` over `dataset` with greedy decoding (`greedy_scores`, averaged)."""
    scores = greedy_scores(model, tokenizer, dataset, reward, max_new_tokens, batch_size)
    return sum(scores) / len(scores)


@torch.no_grad()
def greedy_scores(model, tokenizer, dataset, reward, max_new_tokens: int, batch_size: int = 100) -> list[float]:
    """`reward` of each row of `dataset` with greedy decoding, in order; chat prompts (lists of messages) go through
    the tokenizer's chat template with the generation prompt, as TRL renders them for training. A batch stops
    generating once every row has ended (transformers' `generate`). torch's random state is put back afterwards, so
    evaluating inside a run leaves its sampling unchanged."""
    was_training, rng = model.training, torch.random.get_rng_state()
    model.eval()
    tokenizer.padding_side = "left"
    scores = []
    for start in range(0, len(dataset), batch_size):
        batch = dataset[start : start + batch_size]
        prompts = batch.pop("prompt")
        if isinstance(prompts[0], list):
            enc = tokenizer.apply_chat_template(
                prompts, add_generation_prompt=True, tokenize=True, return_dict=True, padding=True, return_tensors="pt"
            )
        else:
            enc = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(  # ids and mask only: older tokenizers also return token_type_ids, which Qwen3 refuses
            input_ids=enc["input_ids"].to(model.device),
            attention_mask=enc["attention_mask"].to(model.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,  # the Trainer turns the config's off under gradient checkpointing; decoding wants the cache
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
        scores += reward(texts, **batch)
    model.train(was_training)
    torch.random.set_rng_state(rng)
    return scores


def evaluate(model, tokenizer, dataset, batch_size: int = 100) -> float:
    """Mean `demo_reward` over the copy task's `dataset` with greedy decoding (the held-out score the demo reports)."""
    return greedy_score(model, tokenizer, dataset, demo_reward, NUM_DIGITS, batch_size)


@dataclass(frozen=True)
class DemoTask:
    """What `run_demo` needs of a task: its data, its reward, what its held-out score is called, its settings, and
    where its model comes from (built in code, or a Hub id resolved by `common/model_store.py`)."""

    name: str
    make_dataset: Callable  # (num_prompts, seed, split) -> Dataset
    reward: Callable
    score_name: str
    settings: dict
    default_model: str | None  # None: the tiny model built in code
    threads: int | None  # intra-op threads the demo picks (None: torch's default, every core)
    max_eval_prompts: int | None = None
    plot_title: str = field(default="")


TASKS = {
    "copy": DemoTask(
        "copy", make_demo_dataset, demo_reward, "held-out reward", DEMO_ARGS, None, 1, None, "GSPO on the copy task"
    ),
    "addition": DemoTask(
        "addition",
        make_addition_dataset,
        addition_reward,
        "held-out accuracy",
        ADDITION_ARGS,
        SMOLLM2,
        None,
        ADDITION_HELD_OUT,
        "GSPO, SmolLM2-135M-Instruct, two-digit addition",
    ),
}


class HeldOutCurve(TrainerCallback):
    """The held-out score every `every` optimizer steps (and at the last), with the seconds it took, kept apart from
    the training time. `score()` evaluates the current weights."""

    def __init__(self, score: Callable[[], float], every: int, name: str, printer=print):
        self.score, self.every, self.name, self.printer = score, every, name, printer
        self.points: list[tuple[int, float]] = []
        self.seconds = 0.0

    def measure(self, step: int) -> float:
        start = time.perf_counter()
        value = self.score()
        self.seconds += time.perf_counter() - start
        self.points.append((step, value))
        return value

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            value = self.measure(state.global_step)
            self.printer(f"{self.name} at step {state.global_step}: {value:.3f}")


def write_metrics(
    log_history: list[dict],
    csv_path: str,
    png_path: str,
    held_out: tuple | None = None,
    curve: list[tuple[int, float]] | None = None,
    score_name: str = "held-out reward",
    title: str = "GSPO on the offline copy task",
) -> None:
    """Every metric TRL logged, one row per logging step (blank where a metric was not logged that step), and a PNG
    of the training reward curve with the held-out score: the `curve` of (step, score) points if given, else the
    `(before, after)` pair as two markers."""
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
    if curve:
        steps, values = zip(*curve)
        ax.plot(steps, values, "o-", color="C3", label=f"{score_name} (greedy)")
    elif held_out is not None and rows:
        ax.plot([0, rows[-1]["step"]], list(held_out), "o", color="C3", label=f"{score_name} (greedy)")
    ax.set(xlabel="optimizer step", ylabel="reward", ylim=(-0.03, 1.05), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def write_curve(curve: list[tuple[int, float]], path: str, score_name: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", score_name.replace("-", "_").replace(" ", "_")])
        writer.writerows(curve)


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


def load_task_model(task: DemoTask, args: GSPOConfig, model_name_or_path: str | None, moe: bool, printer=print):
    """(model or model path for the trainer, tokenizer or None): the copy task's tiny model built in code, or the
    task's model (`model_name_or_path`, default the task's) resolved to the Hub or the prepared offline copy, said in
    one line. A model for the copy task, or MoE for a real one, is a RecipeError."""
    if task.default_model is None:
        if model_name_or_path is not None:
            raise RecipeError(
                f"model_name_or_path={model_name_or_path!r}: the {task.name} task builds its tiny model in code; "
                "`--config smollm2_addition` runs a real model, `trl-gspo train` any model."
            )
        head_dim = VLLM_HEAD_DIM if args.use_vllm else None
        return build_demo_model(seed=args.seed, moe=moe, head_dim=head_dim)
    if moe:
        raise RecipeError(f"moe=true applies to the copy task's tiny model; the {task.name} task loads a real model.")
    resolved = resolve_for_run(model_name_or_path or task.default_model, args)  # once a node, the same on its ranks
    printer(f"trl-gspo demo: {resolved.note}")
    if resolved.revision:  # the Hub snapshot the record names, not whatever the Hub's main is when the model loads
        args.model_init_kwargs = {**(args.model_init_kwargs or {}), "revision": resolved.revision}
    if resolved.source != "as named" and args.process_index == 0:  # which copy this run trains, in its output
        os.makedirs(args.output_dir, exist_ok=True)
        write_record(resolved, args.output_dir)
    return resolved.path, None


def run_demo(
    output_dir: str = "outputs/demo",
    num_train_prompts: int = 2000,
    num_eval_prompts: int = 200,
    moe: bool = False,
    args: GSPOConfig | None = None,
    peft_config=None,
    console: str = "compact",
    task: str = "copy",
    model_name_or_path: str | None = None,
    eval_every: int = 0,
    **overrides,
) -> dict:
    """Train the demo end to end; writes the model, `metrics.csv`, `held_out.csv` and `reward_curve.png` to
    `output_dir`.

    `task`: "copy" (the tiny model) or "addition" (SmolLM2-135M-Instruct, or `model_name_or_path`). `args` replaces
    the whole config (the CLI passes its parsed one); otherwise `overrides` go over the task's settings.
    `eval_every` > 0 also scores the held-out set every that many optimizer steps (the curve).
    `args.resume_from_checkpoint` resumes from a checkpoint of an earlier run, as `trl-gspo train` does.
    `console`: "compact" (one line per logging step) or "stock" (transformers' log dicts), see cli/console.py.
    It runs with the process's torch threads; `trl-gspo demo` picks them per task (cli/resources.py).
    Returns the held-out score before and after training, the curve, the training seconds (evaluation excluded) and
    the steps this call trained.
    """
    from trl.models.utils import unwrap_model_for_generation

    if task not in TASKS:
        raise RecipeError(f"task={task!r}; allowed: {', '.join(TASKS)}.")
    spec = TASKS[task]
    if spec.max_eval_prompts is not None and num_eval_prompts > spec.max_eval_prompts:
        raise RecipeError(
            f"num_eval_prompts={num_eval_prompts}: the {task} task holds out {spec.max_eval_prompts} problems."
        )
    args = args if args is not None else GSPOConfig(output_dir=output_dir, **{**spec.settings, **overrides})
    main_process = args.process_index == 0
    printer = print if main_process else (lambda *a, **k: None)
    model, tokenizer = load_task_model(spec, args, model_name_or_path, moe, printer)
    train_set = spec.make_dataset(num_train_prompts, seed=args.seed)
    eval_set = spec.make_dataset(num_eval_prompts, seed=args.seed, split="test")

    if spec.default_model is None and (args.use_vllm or (args.beta != 0.0 and peft_config is None)):
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
            model, spec.reward, args=args, train_dataset=train_set, processing_class=tokenizer, peft_config=peft_config
        )
    tokenizer = trainer.processing_class
    use_console(trainer, console)
    started = StartStep()
    trainer.add_callback(started)
    printer(f"trl-gspo demo: {generation_line(trainer)}", flush=True)
    printer(precision_line("demo", trainer), flush=True)

    def held_out_score():  # under ZeRO-3 the weights are sharded from creation on: gather them to generate
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            max_new_tokens = args.max_completion_length
            return greedy_score(unwrapped, tokenizer, eval_set, spec.reward, max_new_tokens)

    curve = HeldOutCurve(held_out_score, eval_every, spec.score_name, printer)
    before = curve.measure(trainer.state.global_step)
    printer(f"{spec.score_name} before training (greedy, {len(eval_set)} unseen prompts): {before:.3f}", flush=True)
    trainer.add_callback(curve)
    start, evaluated_before = time.perf_counter(), curve.seconds
    with tied_weights_restored(trainer):
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    wall = time.perf_counter() - start - (curve.seconds - evaluated_before)  # training only
    after = curve.measure(trainer.state.global_step)
    steps = trainer.state.global_step - started.step
    with quiet_saving(console):
        trainer.save_model(args.output_dir)  # weights + tokenizer (processing_class)
    if main_process:
        out = {
            name: os.path.join(args.output_dir, name) for name in ("metrics.csv", "reward_curve.png", "held_out.csv")
        }
        points = curve.points if eval_every else None
        write_metrics(
            trainer.state.log_history,
            out["metrics.csv"],
            out["reward_curve.png"],
            (before, after),
            points,
            spec.score_name,
            spec.plot_title,
        )
        write_curve(curve.points, out["held_out.csv"], spec.score_name)
        print(f"{spec.score_name} (greedy, {len(eval_set)} unseen prompts): before {before:.3f} -> after {after:.3f}")
        resumed = f" (resumed at step {started.step})" if started.step else ""
        evaluated = f", plus {curve.seconds:.0f} s of held-out evaluation"
        print(
            f"trained {steps} steps{resumed} in {wall:.0f} s{evaluated}; model, metrics.csv, held_out.csv and "
            f"reward_curve.png in {args.output_dir}"
        )
    return {
        "before": before,
        "after": after,
        "curve": curve.points,
        "train_seconds": wall,
        "eval_seconds": curve.seconds,
        "steps": steps,
        "trainer": trainer,
    }
