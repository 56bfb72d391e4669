"""The `async` scenario: synchronous vs `async_generation=True` (staleness 1 and 2), ours only, with the floor
`max(gen, train) / (gen + train)` measured in the synchronous runs.
"""

from __future__ import annotations

import os
import time

from scenarios.driver import median_of, ratio_of, run_worker
from scenarios.workload import (
    ASYNC_VARIANTS,
    LOSS_SETTINGS,
    QWEN3_VOCAB,
    STEPS_PER_GENERATION,
    TokenCounter,
    make_dataset,
    make_model,
    make_tokenizer,
)


def run_async(variant: str, shape: dict, device: str, out_dir: str) -> dict:
    """One run of the `async` scenario: ours with `ASYNC_VARIANTS[variant]`; wall-clock seconds per optimizer step over
    the measured rollouts and, in synchronous runs, the seconds per step spent in the blocking generation call."""
    import torch
    from transformers import TrainerCallback

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = make_tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    model = make_model(tokenizer, shape, device)
    n_rollouts = shape["warmup_rollouts"] + shape["measured_rollouts"]
    args = GSPOConfig(
        output_dir=out_dir,
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        per_device_train_batch_size=shape["batch"],
        num_generations=shape["num_generations"],
        steps_per_generation=STEPS_PER_GENERATION,
        max_completion_length=shape["completion"],
        max_steps=n_rollouts * STEPS_PER_GENERATION,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        **LOSS_SETTINGS,
        **ASYNC_VARIANTS[variant],
    )
    counter = TokenCounter()
    trainer = GSPOTrainer(model, counter, args=args, train_dataset=make_dataset(shape), processing_class=tokenizer)
    generation = [0.0]
    single_turn = trainer._generate_single_turn

    def timed_single_turn(*args, **kwargs):  # the blocking call async generation moves off the main thread
        start = time.perf_counter()
        out = single_turn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        generation[0] += time.perf_counter() - start
        return out

    trainer._generate_single_turn = timed_single_turn
    marks, warmup = {}, shape["warmup_rollouts"] * STEPS_PER_GENERATION

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if state.global_step in (warmup, args.max_steps):
                marks[state.global_step] = (time.perf_counter(), time.process_time(), generation[0], counter.tokens)

    trainer.add_callback(Clock())
    trainer.train()
    steps = shape["measured_rollouts"] * STEPS_PER_GENERATION
    (t0, c0, g0, k0), (t1, c1, g1, k1) = marks[warmup], marks[args.max_steps]
    rows = [h for h in trainer.state.log_history if "async/trainer_wait_s" in h]
    result = {
        "seconds_per_step": (t1 - t0) / steps,
        "cpu_seconds_per_step": (c1 - c0) / steps,
        "completion_tokens": k1 - k0,
        # synchronous runs: the blocking generation call (0 when it runs in the generator thread)
        "generation_seconds_per_step": (g1 - g0) / steps,
        "host_load_1min": os.getloadavg()[0],  # other work on the host: two threads need two free cores to overlap
    }
    if rows:  # logged once, at the end: means over every rollout batch (first one included)
        for key in ("async/trainer_wait_s", "async/generation_s", "async/generator_idle_s", "async/training_s"):
            if key in rows[-1]:
                result[key.replace("async/", "mean_").replace("/", "_")] = rows[-1][key]
    trainer = model = None  # free both before the next run in this process
    return result


def async_scenario(shape: dict, device: str, reps: int, out_dir: str, log) -> dict:
    """sync vs async staleness 1 and 2 in fresh processes, order rotated each repetition; ratios of medians, and the
    floor max(gen, train) / (gen + train) from the synchronous runs of this invocation."""
    kinds = list(ASYNC_VARIANTS)
    runs = {k: [] for k in kinds}
    for rep in range(reps):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for kind in order:
            runs[kind].append(run_worker(dict(task="async", variant=kind, shape=shape, device=device, out_dir=out_dir)))
            r = runs[kind][-1]
            log(
                f"  async rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, generation in the step "
                f"{r['generation_seconds_per_step']:.4f} s, trainer waited {r.get('mean_trainer_wait_s', 0):.4f} s/rollout"
            )
    med = {k: {m: median_of(v, m) for m, x in v[0].items() if isinstance(x, (int, float))} for k, v in runs.items()}
    sync_step, gen = med["sync"]["seconds_per_step"], med["sync"]["generation_seconds_per_step"]
    train = sync_step - gen
    floor = max(gen, train) / (gen + train)
    result = {
        "variants": ASYNC_VARIANTS,
        "median": med,
        "runs": runs,
        "generation_share": gen / sync_step,
        "floor_ratio": floor,
        "sync_generation_seconds_per_step": gen,
        "sync_train_seconds_per_step": train,
    }
    for kind in kinds[1:]:
        ratio = ratio_of(med[kind]["seconds_per_step"], sync_step)
        result[kind] = {"ratio_seconds_per_step": ratio, "ratio_over_floor": ratio / floor}
    return result
