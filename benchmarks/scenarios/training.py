"""Training-step scenarios, stock `GRPOTrainer` vs `GSPOTrainer` on the same workload: `equal_settings`,
`equal_settings_no_diagnostics`, `sampler_logprobs` (ABBA pairs, `compare`) and the layout scenarios `long_tail` /
`long_prompt` on identical rollouts (`layout_scenario`).
"""

from __future__ import annotations

import os
import time

from scenarios import real_model
from scenarios.driver import median_of, ratio_of, run_worker
from scenarios.workload import (
    LOSS_SETTINGS,
    QWEN3_VOCAB,
    LongTailRollouts,
    PeakMemory,
    PhaseClock,
    TokenCounter,
    forward_positions,
    make_dataset,
    make_model,
    make_tokenizer,
    param_flops_per_token,
    rollout_steps,
)


def build_workload(shape: dict, device: str):
    """(tokenizer, model, train dataset, reward with its token counter, prompt encoder for `LongTailRollouts` or
    None) of `shape`: the tiny or Qwen3-shaped model on word prompts, or (`shape["model"] == "smollm2"`) the real
    model on chat prompts with its own template (real_model.py)."""
    if shape.get("model") == "smollm2":
        from trl_gspo.cli.addition import addition_reward

        tokenizer = real_model.make_tokenizer()
        model = real_model.make_model(shape)
        encode = real_model.prompt_encoder(tokenizer)
        return tokenizer, model, real_model.make_dataset(shape), TokenCounter(addition_reward), encode
    tokenizer = make_tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    return tokenizer, make_model(tokenizer, shape, device), make_dataset(shape), TokenCounter(), None


def run_training(
    kind: str,
    source: str,
    shape: dict,
    device: str,
    out_dir: str,
    gradient_checkpointing: bool = True,
    settings: dict | None = None,
    long_tail: bool = False,
) -> dict:
    """Train one trainer for warmup + measured rollouts; returns seconds/step, tokens/s, peak memory, FLOPs, and
    the time spent in the no-grad pi_old pass (`old_logprob_pass_*seconds_per_step`, ~0 when it is skipped) and in
    TRL's generation call (`generation_*seconds_per_step`, 0 with `LongTailRollouts`), wall and CPU.
    `settings`: extra `GSPOConfig` fields for ours. `long_tail`: rollouts from `LongTailRollouts` instead of
    sampling, `gradient_accumulation_steps` from the shape, 4 optimizer steps (mini-batches) per rollout."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer, model, dataset, counter, encode = build_workload(shape, device)
    n_rollouts = shape["warmup_rollouts"] + shape["measured_rollouts"]
    steps_per_rollout = rollout_steps(shape)
    accumulation = shape.get("accumulation", 1) if long_tail else 1
    common = dict(
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
        gradient_accumulation_steps=accumulation,
        num_generations=shape["num_generations"],
        steps_per_generation=steps_per_rollout * accumulation,
        max_completion_length=shape["completion"],
        max_steps=n_rollouts * steps_per_rollout,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=gradient_checkpointing,  # TRL's GRPOConfig default is True
        **LOSS_SETTINGS,
    )
    if kind == "stock":
        args, trainer_cls = GRPOConfig(**common), GRPOTrainer
    else:
        args, trainer_cls = GSPOConfig(**common, old_logprobs_source=source, **(settings or {})), GSPOTrainer
    rollout_func = None
    if long_tail:
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func's "experimental" notice
        rollout_func = LongTailRollouts(
            tokenizer,
            shape["completion"],
            shape["prompt_range"],
            shape["num_generations"],
            median_fraction=shape.get("median_fraction"),
            encode=encode,
        )
    trainer = trainer_cls(
        model, counter, args=args, train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout_func
    )

    marks = {}
    warmup_steps = shape["warmup_rollouts"] * steps_per_rollout

    # TRL's pi_old pass is its only no-grad call of this method here (beta=0: no reference pass); timing it in both
    # trainers shows the share of a stock step that sampler reuse can remove. TRL's generation call: the share no
    # forward layout can remove (none with a rollout_func). Same wrappers on both sides.
    old_logprob_pass = PhaseClock(device)
    generation = PhaseClock(device)
    logprob_fn = trainer._get_per_token_logps_and_entropies
    single_turn = trainer._generate_single_turn

    def timed_logprobs(*args, **kwargs):
        if torch.is_grad_enabled():
            return logprob_fn(*args, **kwargs)
        with old_logprob_pass:
            return logprob_fn(*args, **kwargs)

    def timed_single_turn(*args, **kwargs):
        with generation:
            return single_turn(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = timed_logprobs
    trainer._generate_single_turn = timed_single_turn

    class Clock(TrainerCallback):
        # The window opens as step `warmup_steps + 1` begins (before its rollout is generated) and closes as the
        # last step ends.
        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if state.global_step == warmup_steps and "start" not in marks:
                marks["start"], marks["cpu_start"] = time.perf_counter(), time.process_time()
                marks["tokens"] = counter.tokens
                marks["phases_start"] = old_logprob_pass.totals() + generation.totals()
                marks["positions_start"] = forward_positions(trainer)
                marks["rollout_tokens"] = getattr(rollout_func, "tokens", 0)
                marks["peak"] = PeakMemory(device).__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if state.global_step == args.max_steps:
                marks["end"], marks["cpu_end"] = time.perf_counter(), time.process_time()
                marks["phases_end"] = old_logprob_pass.totals() + generation.totals()
                marks["peak"].__exit__(None, None, None)
                marks["positions_end"] = forward_positions(trainer)

    trainer.add_callback(Clock())
    trainer.train()
    seconds = marks["end"] - marks["start"]
    measured_steps = shape["measured_rollouts"] * steps_per_rollout
    tokens = counter.tokens - marks["tokens"]
    pass_s, pass_cpu, gen_s, gen_cpu = (
        (b - a) / measured_steps for a, b in zip(marks["phases_start"], marks["phases_end"])
    )
    result = {
        "seconds_per_step": seconds / measured_steps,
        "cpu_seconds_per_step": (marks["cpu_end"] - marks["cpu_start"]) / measured_steps,
        "completion_tokens_per_s": tokens / seconds,
        "completion_tokens_per_cpu_s": tokens / (marks["cpu_end"] - marks["cpu_start"]),
        "peak_memory_bytes": marks["peak"].peak_bytes,
        "completion_tokens": tokens,
        "old_logprob_pass_seconds_per_step": pass_s,
        "old_logprob_pass_cpu_seconds_per_step": pass_cpu,
        "generation_seconds_per_step": gen_s,
        "generation_cpu_seconds_per_step": gen_cpu,
    }
    if marks["positions_end"] is not None:  # ours: tokens the model ran on vs what TRL's padded forwards would run
        real, run, padded, saved = (b - a for a, b in zip(marks["positions_start"], marks["positions_end"]))
        result["positions"] = {"real_tokens": real, "run": run, "stock_would_run": padded, "prompt_tokens_saved": saved}
    if long_tail:  # real (prompt + completion) tokens of the rollouts trained in the measured window
        result["train_tokens"] = rollout_func.tokens - marks["rollout_tokens"]
        result["train_tokens_per_s"] = result["train_tokens"] / seconds
        result["mean_prompt_tokens"] = rollout_func.prompt_tokens / rollout_func.rows
    if device == "cuda":
        # Useful model FLOPs per rollout, same definition for both trainers (a recomputed pi_old is overhead, not
        # work): generation forward over prompt + completion, then forward + backward (3x) of every mini-batch.
        # Attention's sequence-quadratic term is left out (small at these lengths next to the weight matmuls).
        per_token = param_flops_per_token(trainer.model)
        if long_tail:  # rollouts come from LongTailRollouts: no generation forward, training only
            flops = per_token * result["train_tokens"] * 3
        else:
            prompt_tokens = (
                shape["measured_rollouts"] * shape["batch"] * steps_per_rollout * (shape["prompt_words"] + 1)
            )
            flops = per_token * (prompt_tokens + tokens) * (1 + 3)
        result["model_flops_per_s"] = flops / seconds
    trainer = model = None  # free both before the next run in this process
    return result


def compare(
    name: str,
    source: str,
    shape: dict,
    device: str,
    reps: int,
    out_dir: str,
    log,
    gradient_checkpointing: bool,
    diagnostics: bool = True,
    extra: dict[str, dict] | None = None,
    settings: dict | None = None,
) -> dict:
    """Stock TRL against ours at its defaults, or with the GSPOConfig `settings` (and each `extra` arm: ours with
    those settings too), every arm once per repetition, in an order that reverses every other repetition so that
    drift hits every arm alike."""
    base = {**(settings or {}), **({} if diagnostics else {"diagnostics": False})}
    arms = {"stock": None, "ours": base or None, **{k: {**base, **v} for k, v in (extra or {}).items()}}
    runs = {kind: [] for kind in arms}
    for rep in range(reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))  # ABBA over every arm
        for kind in order:
            spec = dict(
                task="train",
                kind="stock" if kind == "stock" else "ours",
                source=source,
                shape=shape,
                device=device,
                out_dir=out_dir,
                gradient_checkpointing=gradient_checkpointing,
                settings=arms[kind],
            )
            runs[kind].append(run_worker(spec))
            r = runs[kind][-1]
            log(
                f"  {name} rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, {r['cpu_seconds_per_step']:.4f} "
                f"CPU s/step, pi_old pass {r['old_logprob_pass_cpu_seconds_per_step']:.4f} CPU s/step, generation "
                f"{r['generation_cpu_seconds_per_step']:.4f} CPU s/step"
            )
    # numeric fields only ("positions", ours' padding counts, is a dict and the same in every run)
    med = {k: {m: median_of(v, m) for m, x in v[0].items() if isinstance(x, (int, float))} for k, v in runs.items()}
    result = {
        "old_logprobs_source": source,
        "diagnostics": diagnostics,
        "ours_settings": settings or {},
        "stock": med["stock"],
        "ours": med["ours"],
        "ratio_seconds_per_step": ratio_of(med["ours"]["seconds_per_step"], med["stock"]["seconds_per_step"]),
        "ratio_cpu_seconds_per_step": ratio_of(
            med["ours"]["cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
        ),
        "ratio_completion_tokens_per_s": ratio_of(
            med["ours"]["completion_tokens_per_s"], med["stock"]["completion_tokens_per_s"]
        ),
        "ratio_completion_tokens_per_cpu_s": ratio_of(
            med["ours"]["completion_tokens_per_cpu_s"], med["stock"]["completion_tokens_per_cpu_s"]
        ),
        "ratio_peak_memory": ratio_of(med["ours"]["peak_memory_bytes"], med["stock"]["peak_memory_bytes"]),
        # Share of a stock step spent in TRL's no-grad pi_old pass: skipping that pass and nothing else would give
        # ours/stock = 1 - share, the reference the sampler_logprobs ratio is read against.
        "stock_old_logprob_pass_share": ratio_of(
            med["stock"]["old_logprob_pass_seconds_per_step"], med["stock"]["seconds_per_step"]
        ),
        # CPU seconds in TRL's generation call over the step's. Ours' generation over stock's whole step is the
        # generation floor: the ours/stock ratio if everything but generating cost nothing (no forward layout or
        # skipped pass can go under it).
        "stock_generation_share": ratio_of(
            med["stock"]["generation_cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
        ),
        "generation_floor": ratio_of(
            med["ours"]["generation_cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
        ),
        "runs": runs,
    }
    for kind in extra or {}:  # each extra arm's ratios to stock, and its own generation floor
        result[kind] = med[kind]
        result[f"ratio_cpu_seconds_per_step_{kind}"] = ratio_of(
            med[kind]["cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
        )
        result[f"generation_floor_{kind}"] = ratio_of(
            med[kind]["generation_cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
        )
    if "model_flops_per_s" in med["ours"]:
        peak = shape["peak_flops"]
        result["mfu"] = {k: (med[k]["model_flops_per_s"] / peak if peak else None) for k in ("stock", "ours")}
    return result


#: Layout scenarios on identical rollouts (`LongTailRollouts`): GSPOConfig settings of each variant of ours (stock is
#: plain GRPOTrainer). `defaults`: every layout choice left to the trainer (trim, sort, pack and share by cost);
#: `trim_sort`: the layouts of the previous release's defaults (no packing, no sharing).
LAYOUT_VARIANTS = {
    # the real model: one variant each, ours' defaults (a stock run there costs minutes)
    "real_long_tail": {"defaults": {}},
    "real_long_prompt": {"shared": {}},
    "long_tail": {
        "defaults": {},
        "trim_sort": dict(padding_free=False, shared_prefix=False),
        "packed": dict(padding_free=True, shared_prefix=False),
        "no_sharing": dict(shared_prefix=False),
    },
    "long_prompt": {
        "shared": {},  # the defaults: shared_prefix="auto"
        "group_minibatches": dict(group_minibatches=True),
        "no_sharing": dict(shared_prefix=False),
    },
}
#: Shapes of each layout scenario: overrides of the device shape's scenario entry (SHAPES).
LAYOUT_SHAPES = {
    "long_tail": ("long_tail", "long_tail_one_micro_batch"),
    "long_prompt": ("long_prompt",),
    "real_long_tail": ("long_tail",),
    "real_long_prompt": ("long_prompt",),
}


def layout_scenario(
    name: str, shape: dict, device: str, reps: int, out_dir: str, log, gradient_checkpointing: bool, variants: dict
) -> dict:
    """Stock vs each variant on identical rollouts (`LongTailRollouts`), fresh processes, order rotated every
    repetition (ABCD, DCBA, ...). Ratios: median ours / median stock."""
    kinds = ["stock", *variants]
    runs = {k: [] for k in kinds}
    for rep in range(reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            spec = dict(
                task="train",
                kind="stock" if kind == "stock" else "ours",
                source="recompute",
                shape=shape,
                device=device,
                out_dir=out_dir,
                gradient_checkpointing=gradient_checkpointing,
                settings=variants.get(kind),
                long_tail=True,
            )
            runs[kind].append(run_worker(spec))
            r = runs[kind][-1]
            saved = r.get("positions", {}).get("prompt_tokens_saved", 0)
            log(
                f"  {name} rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, {r['cpu_seconds_per_step']:.4f} "
                f"CPU s/step, pi_old pass {r['old_logprob_pass_seconds_per_step']:.4f} s/step, "
                f"peak {r['peak_memory_bytes'] / 2**20:.1f} MiB, prompt tokens saved {saved:.0f}"
            )
    numeric = (
        "seconds_per_step",
        "cpu_seconds_per_step",
        "peak_memory_bytes",
        "old_logprob_pass_seconds_per_step",
        "generation_cpu_seconds_per_step",
        "train_tokens_per_s",
    ) + (("model_flops_per_s",) if device == "cuda" else ())
    med = {k: {m: median_of(v, m) for m in numeric} for k, v in runs.items()}
    result = {
        "variants": {"stock": "trl.GRPOTrainer", **variants},
        "median": med,
        "runs": runs,
        "shape": {
            k: shape[k]
            for k in ("batch", "accumulation", "completion", "prompt_range", "prompt", "shots", "num_generations")
            if k in shape
        },
    }
    for kind in variants:
        positions = runs[kind][0]["positions"]  # identical rollouts: the same counts in every repetition
        result[kind] = {
            "ratio_seconds_per_step": ratio_of(med[kind]["seconds_per_step"], med["stock"]["seconds_per_step"]),
            "ratio_cpu_seconds_per_step": ratio_of(
                med[kind]["cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
            ),
            "ratio_peak_memory": ratio_of(med[kind]["peak_memory_bytes"], med["stock"]["peak_memory_bytes"]),
            # What the token count alone predicts: positions the model ran on / positions stock TRL runs
            "ratio_positions": ratio_of(positions["run"], positions["stock_would_run"]),
            "stock_padding_fraction": 1 - positions["real_tokens"] / positions["stock_would_run"],
            "prompt_tokens_saved_per_step": positions["prompt_tokens_saved"]
            / (shape["measured_rollouts"] * rollout_steps(shape)),
            # 0: the rollouts come from a rollout_func, nothing is generated (compare's generation floor)
            "generation_floor": ratio_of(
                med[kind]["generation_cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]
            ),
        }
    if device == "cuda" and shape.get("peak_flops"):
        result["mfu"] = {k: med[k]["model_flops_per_s"] / shape["peak_flops"] for k in kinds}
    return result
