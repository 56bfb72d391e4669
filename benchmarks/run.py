"""Benchmark trl-gspo against stock TRL: same model, data, seeds and settings, interleaved, in one invocation.

    OMP_NUM_THREADS=1 python benchmarks/run.py                 # CPU, tiny Qwen3, writes benchmarks/results/cpu.json
    python benchmarks/run.py --device cuda                     # GPU: random-init Qwen3-0.6B shape in bf16, plus MFU
    python benchmarks/run.py --tiny --out /tmp/b.json          # seconds-long smoke run (used by the test suite)

Stock is `trl.GRPOTrainer(importance_sampling_level="sequence")` with the GSPO loss settings (loss_type="grpo",
epsilon=3e-4, epsilon_high=4e-4, beta=0, steps_per_generation=4); ours is `GSPOTrainer` with the same values.
Scenarios, each reported as ratios ours/stock of medians over repetitions (runs alternate stock/ours, ABBA):
- `equal_settings`: ours with `old_logprobs_source="recompute"` and its other defaults (overhead check; trimming
  and sorting are on but find little padding here: random-init completions mostly run to the 32-token limit).
- `equal_settings_no_diagnostics`: the same with `diagnostics=False` (GSPO's per-micro-batch diagnostics off).
- `sampler_logprobs`: ours with `old_logprobs_source="sampler"` (pi_old from generation, no extra forward).
- `loss_path`: `_compute_loss` + backward alone, stock vs ours alternating in one process (hook/metric overhead);
  ours with defaults trims the batch's padding (random completion lengths), `ours_no_diagnostics` is the same with
  diagnostics off, `ours_untrimmed` does stock's work.
- `logprob_memory`: peak memory of one loss forward+backward (the log-prob path) at vocab 151,936 (Qwen3) x 2,048
  completion tokens, each in a fresh process: stock `_compute_loss`, ours with defaults (TRL's own fused, chunked
  head), ours with `logprob_vocab_chunk_size=4096` (`ours_chunked`), and a naive full-fp32-logits reference.
- `long_tail`: the training phase on identical long-tailed rollouts handed to both trainers through TRL's
  `rollout_func` (`LongTailRollouts`: completions lognormal, median 0.3 x 256, ~10% truncated; 4 optimizer steps per
  rollout, so the pi_old pass runs), at two shapes: 4 rows x 16 micro-batches per optimizer step, and one micro-batch
  of 8 rows per optimizer step (`long_tail_one_micro_batch`, where sorting cannot narrow a micro-batch). Variants of
  ours, rotated ABC/CBA in fresh processes: `defaults` (every layout chosen by cost), `trim_sort` (no packing, no
  sharing: the previous defaults), `packed` (`padding_free=True`), `no_sharing` (`shared_prefix=False`).
  Generation costs nothing there, so the step time is the training phase. `ratio_positions` is what the token count
  alone predicts (positions the model ran on / positions stock runs, from padding.py's counters).
- `long_prompt`: the same on prompts of 896-1152 tokens (one per group of G = 8), completions lognormal with median
  128 (~10% truncated at 384), 8 rows x 2 micro-batches per optimizer step: `shared` (defaults,
  `shared_prefix="auto"`), `group_minibatches` (whole groups per optimizer step, so the loss forward shares too),
  `no_sharing`. `prompt_tokens_saved_per_step`: prompt positions not run again because a sibling's prefix stood
  for them.
- `async` (not in the default list; `--scenarios async`): asynchronous generation, ours only: the same workload
  synchronous vs `async_generation=True` with `max_staleness` 1 and 2, transformers generator, rotated in fresh
  processes (generator and trainer one thread each). Reports wall-clock s/step async / sync beside the floor
  `max(gen, train) / (gen + train)` measured in the synchronous runs of the same invocation (gen = the blocking
  generation call, train = the rest of the step), and the generation share `gen / (gen + train)`. Its workload (shape
  `async`, training without activation checkpointing) was fixed so that generation is >= 1/3 of a synchronous step.
Both trainers' log-prob method is wrapped by one timer that sums its no-grad calls (with beta=0: TRL's pi_old pass);
`stock_old_logprob_pass_share` = that time / step time in the stock runs, so 1 - share is what skipping the pass alone
would give. `--no-gradient-checkpointing` trains both without TRL's default activation checkpointing.
Seconds per optimizer step are averaged over whole rollout cycles (the step that generates and the 3 that reuse
the rollout), since the pass being saved lives in the generating step. Memory: CPU peak RSS above the pre-run
level (kernel high-water mark, reset through /proc/self/clear_refs; glibc is told to mmap blocks >= 64 KiB so
freed tensors leave RSS), CUDA `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

QWEN3_VOCAB = 151_936
#: Dense bf16 tensor-core peak (FLOP/s) by device-name substring, for MFU; the first substring found in
#: `torch.cuda.get_device_name()` wins, so form factors come before the bare name ("NVIDIA H100 NVL", "NVIDIA H100
#: PCIe", "NVIDIA H100 80GB HBM3" for SXM). NVIDIA's spec tables (nvidia.com/en-us/data-center/h100 and .../h200) give
#: bf16 tensor-core figures with 2:4 sparsity; dense is half: H100 SXM and H200 SXM 1,979 -> 989, H100 NVL and H200
#: NVL 1,671 -> 835, H100 PCIe 1,513 -> 756. A100 312, L40S 362 and A10G 70 are dense already. Override with
#: --peak-tflops.
BF16_PEAK_FLOPS = {"H200 NVL": 835e12, "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
                   "A100": 312e12, "L40S": 362e12, "A10G": 70e12}  # fmt: skip


def bf16_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of the device named `device_name` (`BF16_PEAK_FLOPS`), or None if it is not listed."""
    return next((flops for key, flops in BF16_PEAK_FLOPS.items() if key in device_name), None)
#: GSPO paper loss settings, given explicitly to both trainers (GRPOConfig defaults differ).
LOSS_SETTINGS = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0)

# Workload shapes. `cpu`: compute-bound enough on one thread that step time is not all Python overhead.
SHAPES = {
    "tiny": dict(hidden=32, layers=1, batch=8, num_generations=4, prompt_words=6, completion=8, warmup_rollouts=1,
                 measured_rollouts=1, reps=1, mem_vocab=4096, mem_tokens=64,
                 long_tail=dict(batch=2, accumulation=4, completion=32, prompt_range=(3, 8)),
                 long_tail_one_micro_batch=dict(batch=4, accumulation=1),
                 long_prompt=dict(batch=4, accumulation=2, completion=12, prompt_range=(24, 32), median_fraction=0.5)),  # fmt: skip
    "cpu": dict(hidden=256, layers=4, batch=16, num_generations=8, prompt_words=48, completion=32,
                warmup_rollouts=1, measured_rollouts=3, reps=7, mem_vocab=QWEN3_VOCAB, mem_tokens=2048,
                long_tail=dict(layers=2, batch=4, accumulation=16, completion=256, prompt_range=(8, 32),
                               measured_rollouts=1, reps=3),
                # issue 19's shape: one micro-batch of 8 rows per optimizer step, sorting cannot narrow it
                long_tail_one_micro_batch=dict(batch=8, accumulation=1),
                # ~1024-token prompts, completions lognormal with median 128 (~10% truncated at 384), G = 8
                long_prompt=dict(layers=2, batch=8, accumulation=2, completion=384, median_fraction=1 / 3,
                                 prompt_range=(896, 1152), measured_rollouts=1, reps=3)),  # fmt: skip
    "cuda": dict(hidden=None, layers=None, batch=16, num_generations=8, prompt_words=128, completion=512,
                 warmup_rollouts=1, measured_rollouts=2, reps=3, mem_vocab=QWEN3_VOCAB, mem_tokens=2048,
                 long_tail=dict(batch=4, accumulation=16, completion=2048, prompt_range=(64, 256), measured_rollouts=1,
                                reps=3),
                 long_tail_one_micro_batch=dict(batch=8, accumulation=1),
                 long_prompt=dict(batch=8, accumulation=2, completion=384, median_fraction=1 / 3,
                                  prompt_range=(896, 1152), measured_rollouts=1, reps=3)),  # fmt: skip
}
STEPS_PER_GENERATION = 4
#: Workload of the `async` scenario per device (`tiny`: the smoke run): short prompts and longer completions so that
#: generation is >= 1/3 of a synchronous step, no activation checkpointing.
ASYNC_SHAPES = {
    "tiny": dict(hidden=32, layers=1, batch=8, num_generations=4, prompt_words=4, completion=8, warmup_rollouts=1,
                 measured_rollouts=1, reps=1),  # fmt: skip
    "cpu": dict(hidden=256, layers=4, batch=16, num_generations=8, prompt_words=8, completion=128, warmup_rollouts=1,
                measured_rollouts=3, reps=3),  # fmt: skip
    "cuda": dict(hidden=None, layers=None, batch=16, num_generations=8, prompt_words=64, completion=512,
                 warmup_rollouts=1, measured_rollouts=2, reps=3),  # fmt: skip
}
#: The async scenario's variants: GSPOConfig settings on top of the workload.
ASYNC_VARIANTS = {
    "sync": {},
    "async_staleness1": dict(async_generation=True, max_staleness=1),
    "async_staleness2": dict(async_generation=True, max_staleness=2),
}


# ------------------------------------------------------------------------------------------------ memory
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator stats, or the kernel's RSS high-water mark on CPU."""

    def __init__(self, device: str):
        self.device, self.peak_bytes = device, None

    def __enter__(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            # The kernel syncs per-thread RSS counters lazily (every 64 page faults), so both readings are good to
            # a few hundred KiB: small regions can read slightly negative, which means "nothing measurable".
            self.peak_bytes = max(0, max(_status_kb("VmHWM"), _status_kb("VmRSS")) * 1024 - self.base)
        return False


# ------------------------------------------------------------------------------------------------ workload
def _tokenizer(vocab_size: int | None = None):
    from trl_gspo.cli.tiny import WORDS, SPECIAL_TOKENS, build_tokenizer

    extra = None
    if vocab_size is not None:  # pad the word-level vocabulary to the model's, so every sampled id decodes
        extra = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(WORDS))]
    return build_tokenizer(extra)


def _model(tokenizer, shape: dict, device: str, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from trl_gspo.cli.tiny import build_tiny_model

    if device == "cuda":
        # Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), randomly initialised: no download needed.
        config = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rope_theta=1_000_000, tie_word_embeddings=True, rms_norm_eps=1e-6,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        )  # fmt: skip
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=cuda_attention())
    return build_tiny_model(tokenizer, seed=seed, hidden_size=shape["hidden"], num_layers=shape["layers"])


def cuda_attention() -> str:
    """flash-attention when installed (varlen kernels for padding_free), else sdpa; the same for stock and ours."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"


def _dataset(shape: dict, n: int = 512):
    import random

    from datasets import Dataset

    rng = random.Random(0)
    words = ["copy", "add", "the", "sum", "of", "a", "b", "c", "and"] + [str(d) for d in range(10)]
    prompts = [" ".join(rng.choice(words) for _ in range(shape["prompt_words"])) + " :" for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


class _TokenCounter:
    """Reward with spread (so advantages are non-zero) that also counts the completion tokens generated."""

    __name__ = "digit_fraction"

    def __init__(self):
        self.tokens = 0

    def __call__(self, completions, completion_ids=None, **kwargs):
        self.tokens += sum(len(ids) for ids in completion_ids)
        return [sum(w.isdigit() for w in c.split()) / (1 + len(c.split())) for c in completions]


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _param_flops_per_token(model) -> float:
    """2 * (weights multiplied per token): all parameters, less an untied input embedding (a lookup, not a matmul).

    With tied embeddings the one matrix is counted once, for its use as the LM head."""
    n_params = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        n_params -= model.get_input_embeddings().weight.numel()
    return 2.0 * n_params


def _positions(trainer):
    """padding.py's running counts (real tokens, positions run, positions TRL would run), or None for stock."""
    counts = getattr(trainer, "_throughput", None)
    return None if counts is None else counts.tolist()


class LongTailRollouts:
    """TRL `rollout_func` that hands every trainer the same rollouts: completion lengths lognormal with median
    0.3 x max and ~10% truncated at max (no EOS), as in reasoning RL; random tokens, one prompt per group.

    Seeded by call count, so stock and ours, called once per rollout batch, see identical batches. Generation then
    costs ~nothing and the step time is the training phase (pi_old pass, loss forward and backward)."""

    MEDIAN_FRACTION, TRUNCATED_FRACTION = 0.3, 0.10

    def __init__(self, tokenizer, max_completion: int, prompt_range: tuple[int, int], num_generations: int, seed=0,
                 median_fraction: float | None = None):  # fmt: skip
        import math
        from statistics import NormalDist

        self.vocab, self.eos = len(tokenizer), tokenizer.eos_token_id
        self.max_completion, self.prompt_range, self.num_generations = max_completion, prompt_range, num_generations
        median_fraction = median_fraction or self.MEDIAN_FRACTION
        self.mu = math.log(median_fraction * max_completion)
        # P(length >= max) = 10%: ln(max) - mu = z_0.9 * sigma
        self.sigma = math.log(1 / median_fraction) / NormalDist().inv_cdf(1 - self.TRUNCATED_FRACTION)
        self.seed, self.calls, self.tokens = seed, 0, 0

    def __call__(self, prompts, trainer):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * trainer.accelerator.process_index + self.calls)
        self.calls += 1
        n = len(prompts)
        lengths = torch.exp(self.mu + self.sigma * torch.randn(n, generator=g)).round().clamp(1, self.max_completion)
        prompt_ids, completion_ids = [], []
        for i in range(n):
            if i % self.num_generations == 0:  # TRL repeats each prompt num_generations times, consecutively
                p_len = int(torch.randint(self.prompt_range[0], self.prompt_range[1] + 1, (1,), generator=g))
                prompt = torch.randint(4, self.vocab, (p_len,), generator=g).tolist()
            length = int(lengths[i])
            ids = torch.randint(4, self.vocab, (length,), generator=g).tolist()
            if length < self.max_completion:
                ids[-1] = self.eos  # finished; at max length it is truncated, as a sampler cut off there would be
            prompt_ids.append(prompt), completion_ids.append(ids)
            self.tokens += len(prompt) + length
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def run_training(kind: str, source: str, shape: dict, device: str, out_dir: str, gradient_checkpointing: bool = True,
                 settings: dict | None = None, long_tail: bool = False) -> dict:  # fmt: skip
    """Train one trainer for warmup + measured rollouts; returns seconds/step, tokens/s, peak memory, FLOPs, and
    the time spent in the no-grad pi_old pass (`old_logprob_pass_seconds_per_step`, ~0 when it is skipped).
    `settings`: extra `GSPOConfig` fields for ours. `long_tail`: rollouts from `LongTailRollouts` instead of
    sampling, `gradient_accumulation_steps` from the shape, 4 optimizer steps (mini-batches) per rollout."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = _tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    model = _model(tokenizer, shape, device)
    counter = _TokenCounter()
    n_rollouts = shape["warmup_rollouts"] + shape["measured_rollouts"]
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
        steps_per_generation=STEPS_PER_GENERATION * accumulation,
        max_completion_length=shape["completion"],
        max_steps=n_rollouts * STEPS_PER_GENERATION,
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
        rollout_func = LongTailRollouts(tokenizer, shape["completion"], shape["prompt_range"], shape["num_generations"],
                                        median_fraction=shape.get("median_fraction"))  # fmt: skip
    trainer = trainer_cls(model, counter, args=args, train_dataset=_dataset(shape), processing_class=tokenizer,
                          rollout_func=rollout_func)  # fmt: skip

    marks, pass_seconds = {}, [0.0]
    warmup_steps = shape["warmup_rollouts"] * STEPS_PER_GENERATION

    # TRL's pi_old pass is its only no-grad call of this method here (beta=0: no reference pass); timing it in both
    # trainers shows the share of a stock step that sampler reuse can remove. Same wrapper on both sides.
    logprob_fn = trainer._get_per_token_logps_and_entropies

    def timed_logprobs(*args, **kwargs):
        if torch.is_grad_enabled():
            return logprob_fn(*args, **kwargs)
        start = time.perf_counter()
        out = logprob_fn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        pass_seconds[0] += time.perf_counter() - start
        return out

    trainer._get_per_token_logps_and_entropies = timed_logprobs

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if state.global_step == warmup_steps:
                marks["start"], marks["cpu_start"] = time.perf_counter(), time.process_time()
                marks["tokens"], marks["pass_start"] = counter.tokens, pass_seconds[0]
                marks["positions_start"] = _positions(trainer)
                marks["rollout_tokens"] = getattr(rollout_func, "tokens", 0)
                marks["peak"] = PeakMemory(device).__enter__()
            elif state.global_step == args.max_steps:
                marks["end"], marks["cpu_end"] = time.perf_counter(), time.process_time()
                marks["pass_end"] = pass_seconds[0]
                marks["peak"].__exit__(None, None, None)
                marks["positions_end"] = _positions(trainer)

    trainer.add_callback(Clock())
    trainer.train()
    seconds = marks["end"] - marks["start"]
    measured_steps = shape["measured_rollouts"] * STEPS_PER_GENERATION
    tokens = counter.tokens - marks["tokens"]
    result = {
        "seconds_per_step": seconds / measured_steps,
        "cpu_seconds_per_step": (marks["cpu_end"] - marks["cpu_start"]) / measured_steps,
        "completion_tokens_per_s": tokens / seconds,
        "completion_tokens_per_cpu_s": tokens / (marks["cpu_end"] - marks["cpu_start"]),
        "peak_memory_bytes": marks["peak"].peak_bytes,
        "completion_tokens": tokens,
        "old_logprob_pass_seconds_per_step": (marks["pass_end"] - marks["pass_start"]) / measured_steps,
    }
    if marks["positions_end"] is not None:  # ours: tokens the model ran on vs what TRL's padded forwards would run
        real, run, padded, saved = (b - a for a, b in zip(marks["positions_start"], marks["positions_end"]))
        result["positions"] = {"real_tokens": real, "run": run, "stock_would_run": padded, "prompt_tokens_saved": saved}
    if long_tail:  # real (prompt + completion) tokens of the rollouts trained in the measured window
        result["train_tokens"] = rollout_func.tokens - marks["rollout_tokens"]
        result["train_tokens_per_s"] = result["train_tokens"] / seconds
    if device == "cuda":
        # Useful model FLOPs per rollout, same definition for both trainers (a recomputed pi_old is overhead, not
        # work): generation forward over prompt + completion, then forward + backward (3x) of every mini-batch.
        # Attention's sequence-quadratic term is left out (small at these lengths next to the weight matmuls).
        per_token = _param_flops_per_token(trainer.model)
        if long_tail:  # rollouts come from LongTailRollouts: no generation forward, training only
            flops = per_token * result["train_tokens"] * 3
        else:
            prompt_tokens = shape["measured_rollouts"] * shape["batch"] * STEPS_PER_GENERATION * (shape["prompt_words"] + 1)
            flops = per_token * (prompt_tokens + tokens) * (1 + 3)
        result["model_flops_per_s"] = flops / seconds
    del trainer, model
    return result


def run_async(variant: str, shape: dict, device: str, out_dir: str) -> dict:
    """One run of the `async` scenario: ours with `ASYNC_VARIANTS[variant]`; wall-clock seconds per optimizer step over
    the measured rollouts and, in synchronous runs, the seconds per step spent in the blocking generation call."""
    import torch
    from transformers import TrainerCallback

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = _tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    model = _model(tokenizer, shape, device)
    n_rollouts = shape["warmup_rollouts"] + shape["measured_rollouts"]
    args = GSPOConfig(
        output_dir=out_dir, use_cpu=device == "cpu", bf16=device == "cuda", report_to=[], save_strategy="no",
        logging_steps=10_000, disable_tqdm=True, learning_rate=1e-5, lr_scheduler_type="constant",
        per_device_train_batch_size=shape["batch"], num_generations=shape["num_generations"],
        steps_per_generation=STEPS_PER_GENERATION, max_completion_length=shape["completion"],
        max_steps=n_rollouts * STEPS_PER_GENERATION, seed=0, dataloader_num_workers=0, gradient_checkpointing=False,
        **LOSS_SETTINGS, **ASYNC_VARIANTS[variant],
    )  # fmt: skip
    counter = _TokenCounter()
    trainer = GSPOTrainer(model, counter, args=args, train_dataset=_dataset(shape), processing_class=tokenizer)
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
    del trainer, model
    return result


def async_scenario(shape: dict, device: str, reps: int, out_dir: str, log) -> dict:
    """sync vs async staleness 1 and 2 in fresh processes, order rotated each repetition; ratios of medians, and the
    floor max(gen, train) / (gen + train) from the synchronous runs of this invocation."""
    kinds = list(ASYNC_VARIANTS)
    runs = {k: [] for k in kinds}
    for rep in range(reps):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for kind in order:
            runs[kind].append(_run_worker(dict(task="async", variant=kind, shape=shape, device=device, out_dir=out_dir)))
            r = runs[kind][-1]
            log(f"  async rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, generation in the step "
                f"{r['generation_seconds_per_step']:.4f} s, trainer waited {r.get('mean_trainer_wait_s', 0):.4f} s/rollout")
    med = {k: {m: _median(v, m) for m, x in v[0].items() if isinstance(x, (int, float))} for k, v in runs.items()}
    sync_step, gen = med["sync"]["seconds_per_step"], med["sync"]["generation_seconds_per_step"]
    train = sync_step - gen
    floor = max(gen, train) / (gen + train)
    result = {"variants": ASYNC_VARIANTS, "median": med, "runs": runs, "generation_share": gen / sync_step,
              "floor_ratio": floor, "sync_generation_seconds_per_step": gen, "sync_train_seconds_per_step": train}  # fmt: skip
    for kind in kinds[1:]:
        ratio = _ratio(med[kind]["seconds_per_step"], sync_step)
        result[kind] = {"ratio_seconds_per_step": ratio, "ratio_over_floor": ratio / floor,
                        "meets_target": gen / sync_step >= 1 / 3 and ratio <= 0.75 and ratio <= 1.10 * floor}  # fmt: skip
    return result


#: `logprob_vocab_chunk_size` of the `ours_chunked` memory variant.
MEMORY_CHUNK = 4096


def logprob_memory(kind: str, vocab: int, tokens: int, device: str) -> dict:
    """Peak memory of one policy-loss forward + backward on 1 completion of `tokens` tokens at `vocab` words."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli.tiny import tiny_config

    torch.manual_seed(0)
    tokenizer = _tokenizer()
    hidden = 1024 if device == "cuda" else 64  # the logits' size depends on vocab x tokens, not on the backbone
    config = tiny_config(vocab, hidden_size=hidden, num_layers=1, max_position_embeddings=tokens + 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    prompt_len = 16
    g = torch.Generator().manual_seed(0)
    inputs = {
        "prompt_ids": torch.randint(4, vocab, (1, prompt_len), generator=g),
        "prompt_mask": torch.ones(1, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (1, tokens), generator=g),
        "completion_mask": torch.ones(1, tokens, dtype=torch.long),
        "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(tokens),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if kind == "naive":  # the textbook path: full (tokens, vocab) fp32 logits -> log_softmax -> gather + entropy
        model.train()

        def step():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
            logp_all = torch.log_softmax(logits, -1)
            logps = logp_all.gather(-1, inputs["completion_ids"][..., None])[..., 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # TRL also returns the entropy for its metrics
            loss = -(torch.exp(logps - logps.detach()) * inputs["advantages"][:, None]).mean()
            loss.backward()
            return entropy
    else:
        common = dict(output_dir="/tmp/trl-gspo-bench-mem", use_cpu=device == "cpu", bf16=device == "cuda",
                      report_to=[], per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=tokens, steps_per_generation=4, **LOSS_SETTINGS)  # fmt: skip
        if kind == "stock":
            trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
        else:
            chunk = MEMORY_CHUNK if kind == "ours_chunked" else None
            trainer_cls, args = GSPOTrainer, GSPOConfig(**common, logprob_vocab_chunk_size=chunk)
        dataset = Dataset.from_dict({"prompt": ["a"] * 4})
        trainer = trainer_cls(model, _zero_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1

        def step():
            trainer._compute_loss(trainer.model, inputs).backward()

    step()  # warm-up: allocates the parameter gradients and any lazily created state
    model.zero_grad(set_to_none=False)  # keep grad buffers: the measured step then counts only transient memory
    start, cpu_start = time.perf_counter(), time.process_time()
    with PeakMemory(device) as peak:
        step()
    return {
        "peak_memory_bytes": peak.peak_bytes,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def loss_path(shape: dict, device: str, iters: int) -> dict:
    """`_compute_loss` + backward on one mini-batch, stock vs ours in one process, alternating, `iters` times each.

    Isolates what our loss pipeline (hooks, metrics) costs on top of TRL's, without generation and its noise."""
    import copy

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = _tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    model = _model(tokenizer, shape, device).to(device)
    B, P, T = shape["batch"], shape["prompt_words"] + 1, shape["completion"]
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    inputs = {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (B, T), generator=g),
        "completion_mask": (torch.arange(T)[None] < lengths[:, None]).long(),
        "advantages": torch.randn(B, generator=g),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainers = {}
    # ours_untrimmed: padding.py's forward with trimming off, the same work as stock (its overhead alone)
    variants = (("stock", GRPOTrainer, GRPOConfig, {}), ("ours", GSPOTrainer, GSPOConfig, {}),
                ("ours_no_diagnostics", GSPOTrainer, GSPOConfig, {"diagnostics": False}),
                ("ours_untrimmed", GSPOTrainer, GSPOConfig, dict(trim_padding=False, sort_by_length="never")))  # fmt: skip
    for kind, trainer_cls, config_cls, extra in variants:
        args = config_cls(
            output_dir="/tmp/trl-gspo-bench-loss", use_cpu=device == "cpu", bf16=device == "cuda", report_to=[],
            per_device_train_batch_size=B, num_generations=shape["num_generations"], max_completion_length=T,
            steps_per_generation=STEPS_PER_GENERATION, **LOSS_SETTINGS, **extra,
        )  # fmt: skip
        dataset = Dataset.from_dict({"prompt": ["a"] * 4})
        trainers[kind] = trainer_cls(
            copy.deepcopy(model), _zero_reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        trainers[kind].model.train()
        trainers[kind].current_gradient_accumulation_steps = 1
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():  # pi_old near pi_theta, so some sequence ratios clip as in training
        logps, _, _ = trainers["stock"]._get_per_token_logps_and_entropies(
            trainers["stock"].model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), T,
        )  # fmt: skip
    inputs["old_per_token_logps"] = logps + 1e-3 * torch.randn(logps.shape, generator=g).to(device)
    times = {kind: [] for kind in trainers}
    for i in range(iters + 2):  # the first two rounds warm up allocator and kernels, then alternate
        for kind in list(trainers) if i % 2 == 0 else list(trainers)[::-1]:
            trainer = trainers[kind]
            if device == "cuda":
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer._compute_loss(trainer.model, inputs).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times[kind].append((time.perf_counter() - start, time.process_time() - cpu_start))
            trainer.model.zero_grad(set_to_none=True)
    med = {k: {"seconds": statistics.median(t[0] for t in v), "cpu_seconds": statistics.median(t[1] for t in v)}
           for k, v in times.items()}  # fmt: skip
    return {
        "iters": iters,
        "stock": med["stock"],
        "ours": med["ours"],
        "ours_no_diagnostics": med["ours_no_diagnostics"],
        "ours_untrimmed": med["ours_untrimmed"],
        "ratio_seconds": _ratio(med["ours"]["seconds"], med["stock"]["seconds"]),
        "ratio_cpu_seconds": _ratio(med["ours"]["cpu_seconds"], med["stock"]["cpu_seconds"]),
        "ratio_seconds_no_diagnostics": _ratio(med["ours_no_diagnostics"]["seconds"], med["stock"]["seconds"]),
        "ratio_cpu_seconds_no_diagnostics": _ratio(
            med["ours_no_diagnostics"]["cpu_seconds"], med["stock"]["cpu_seconds"]
        ),
        "ratio_untrimmed_cpu_seconds": _ratio(med["ours_untrimmed"]["cpu_seconds"], med["stock"]["cpu_seconds"]),
    }


# ------------------------------------------------------------------------------------------------ driver
def _worker(spec: dict) -> dict:
    import torch

    torch.manual_seed(0)
    if spec["task"] == "train":
        return run_training(
            spec["kind"], spec["source"], spec["shape"], spec["device"], spec["out_dir"], spec["gradient_checkpointing"],
            spec.get("settings"), spec.get("long_tail", False),
        )  # fmt: skip
    if spec["task"] == "loss_path":
        return loss_path(spec["shape"], spec["device"], spec["iters"])
    if spec["task"] == "async":
        return run_async(spec["variant"], spec["shape"], spec["device"], spec["out_dir"])
    return logprob_memory(spec["kind"], spec["vocab"], spec["tokens"], spec["device"])


IN_PROCESS = False  # --tiny: run workers in this process (import once; numbers are not meant to be read)


def _run_worker(spec: dict) -> dict:
    """Each run in a fresh process: no allocator or autotuning state carried from one trainer to the other."""
    if IN_PROCESS:
        return json.loads(json.dumps(_worker(spec)))
    pythonpath = os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=pythonpath)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed ({spec}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def compare(name: str, source: str, shape: dict, device: str, reps: int, out_dir: str, log, gradient_checkpointing: bool,
            diagnostics: bool = True) -> dict:  # fmt: skip
    settings = None if diagnostics else {"diagnostics": False}
    runs = {"stock": [], "ours": []}
    for rep in range(reps):
        order = ("stock", "ours") if rep % 2 == 0 else ("ours", "stock")  # ABBA: drift hits both sides alike
        for kind in order:
            spec = dict(task="train", kind=kind, source=source, shape=shape, device=device, out_dir=out_dir,
                        gradient_checkpointing=gradient_checkpointing, settings=settings)  # fmt: skip
            runs[kind].append(_run_worker(spec))
            r = runs[kind][-1]
            log(f"  {name} rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, "
                f"{r['cpu_seconds_per_step']:.4f} CPU s/step, pi_old pass {r['old_logprob_pass_seconds_per_step']:.4f} s/step")
    # numeric fields only ("positions", ours' padding counts, is a dict and the same in every run)
    med = {k: {m: _median(v, m) for m, x in v[0].items() if isinstance(x, (int, float))} for k, v in runs.items()}
    result = {
        "old_logprobs_source": source,
        "diagnostics": diagnostics,
        "stock": med["stock"],
        "ours": med["ours"],
        "ratio_seconds_per_step": _ratio(med["ours"]["seconds_per_step"], med["stock"]["seconds_per_step"]),
        "ratio_cpu_seconds_per_step": _ratio(med["ours"]["cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]),
        "ratio_completion_tokens_per_s": _ratio(
            med["ours"]["completion_tokens_per_s"], med["stock"]["completion_tokens_per_s"]
        ),
        "ratio_completion_tokens_per_cpu_s": _ratio(
            med["ours"]["completion_tokens_per_cpu_s"], med["stock"]["completion_tokens_per_cpu_s"]
        ),
        "ratio_peak_memory": _ratio(med["ours"]["peak_memory_bytes"], med["stock"]["peak_memory_bytes"]),
        # Share of a stock step spent in TRL's no-grad pi_old pass: skipping that pass and nothing else would give
        # ours/stock = 1 - share, the reference the sampler_logprobs ratio is read against.
        "stock_old_logprob_pass_share": _ratio(
            med["stock"]["old_logprob_pass_seconds_per_step"], med["stock"]["seconds_per_step"]
        ),
        "runs": runs,
    }
    if "model_flops_per_s" in med["ours"]:
        peak = shape["peak_flops"]
        result["mfu"] = {k: (med[k]["model_flops_per_s"] / peak if peak else None) for k in ("stock", "ours")}
    return result


#: Layout scenarios on identical rollouts (`LongTailRollouts`): GSPOConfig settings of each variant of ours (stock is
#: plain GRPOTrainer). `defaults`: every layout choice left to the trainer (trim, sort, pack and share by cost);
#: `trim_sort`: the layouts of the previous release's defaults (no packing, no sharing).
LAYOUT_VARIANTS = {
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
LAYOUT_SHAPES = {"long_tail": ("long_tail", "long_tail_one_micro_batch"), "long_prompt": ("long_prompt",)}


def layout_scenario(name: str, shape: dict, device: str, reps: int, out_dir: str, log, gradient_checkpointing: bool,
                    variants: dict) -> dict:  # fmt: skip
    """Stock vs each variant on identical rollouts (`LongTailRollouts`), fresh processes, order rotated every
    repetition (ABCD, DCBA, ...). Ratios: median ours / median stock."""
    kinds = ["stock", *variants]
    runs = {k: [] for k in kinds}
    for rep in range(reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            spec = dict(task="train", kind="stock" if kind == "stock" else "ours", source="recompute", shape=shape,
                        device=device, out_dir=out_dir, gradient_checkpointing=gradient_checkpointing,
                        settings=variants.get(kind), long_tail=True)  # fmt: skip
            runs[kind].append(_run_worker(spec))
            r = runs[kind][-1]
            saved = r.get("positions", {}).get("prompt_tokens_saved", 0)
            log(f"  {name} rep {rep} {kind}: {r['seconds_per_step']:.4f} s/step, {r['cpu_seconds_per_step']:.4f} "
                f"CPU s/step, pi_old pass {r['old_logprob_pass_seconds_per_step']:.4f} s/step, "
                f"peak {r['peak_memory_bytes'] / 2**20:.1f} MiB, prompt tokens saved {saved:.0f}")
    numeric = ("seconds_per_step", "cpu_seconds_per_step", "peak_memory_bytes", "old_logprob_pass_seconds_per_step",
               "train_tokens_per_s") + (("model_flops_per_s",) if device == "cuda" else ())
    med = {k: {m: _median(v, m) for m in numeric} for k, v in runs.items()}
    result = {"variants": {"stock": "trl.GRPOTrainer", **variants}, "median": med, "runs": runs,
              "shape": {k: shape[k] for k in ("batch", "accumulation", "completion", "prompt_range", "num_generations")}}
    for kind in variants:
        positions = runs[kind][0]["positions"]  # identical rollouts: the same counts in every repetition
        result[kind] = {
            "ratio_seconds_per_step": _ratio(med[kind]["seconds_per_step"], med["stock"]["seconds_per_step"]),
            "ratio_cpu_seconds_per_step": _ratio(med[kind]["cpu_seconds_per_step"], med["stock"]["cpu_seconds_per_step"]),
            "ratio_peak_memory": _ratio(med[kind]["peak_memory_bytes"], med["stock"]["peak_memory_bytes"]),
            # What the token count alone predicts: positions the model ran on / positions stock TRL runs
            "ratio_positions": _ratio(positions["run"], positions["stock_would_run"]),
            "stock_padding_fraction": 1 - positions["real_tokens"] / positions["stock_would_run"],
            "prompt_tokens_saved_per_step": positions["prompt_tokens_saved"] / (shape["measured_rollouts"] * STEPS_PER_GENERATION),
        }
    if device == "cuda" and shape.get("peak_flops"):
        result["mfu"] = {k: med[k]["model_flops_per_s"] / shape["peak_flops"] for k in kinds}
    return result


def memory_scenario(shape: dict, device: str, reps: int, log) -> dict:
    from trl_gspo.forward import fused_head

    runs = {"stock": [], "ours": [], "ours_chunked": [], "naive": []}
    if not fused_head.available():  # TRL < 1.15 has no fused head, so no tile size to set
        del runs["ours_chunked"]
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        for kind in order:
            spec = dict(task="memory", kind=kind, vocab=shape["mem_vocab"], tokens=shape["mem_tokens"], device=device)
            runs[kind].append(_run_worker(spec))
            log(f"  logprob_memory rep {rep} {kind}: {runs[kind][-1]['peak_memory_bytes'] / 2**20:.1f} MiB")
    med = {k: _median(v, "peak_memory_bytes") for k, v in runs.items()}
    cpu_seconds = {k: _median(v, "cpu_seconds") for k, v in runs.items()}
    return {
        "cpu_seconds": cpu_seconds,  # one loss forward + backward; includes the measurement's page faults
        "vocab": shape["mem_vocab"],
        "completion_tokens": shape["mem_tokens"],
        "peak_memory_bytes": med,
        "ratio_ours_over_stock": _ratio(med["ours"], med["stock"]),
        "ours_chunked_logprob_vocab_chunk_size": MEMORY_CHUNK,
        "ratio_ours_chunked_over_stock": _ratio(med["ours_chunked"], med["stock"]) if "ours_chunked" in med else None,
        "ratio_stock_over_naive_full_logits": _ratio(med["stock"], med["naive"]),
        "full_fp32_logits_bytes": shape["mem_vocab"] * shape["mem_tokens"] * 4,
        "runs": runs,
    }


def _summary(sc: dict) -> dict:
    """Ratios of a scenario (layout scenarios: per shape and variant)."""
    if all(isinstance(v, dict) and "variants" in v for v in sc.values()):
        return {key: {v: {k: x for k, x in sub[v].items() if k.startswith("ratio") or k == "prompt_tokens_saved_per_step"}
                      for v in sub["variants"] if v != "stock"} for key, sub in sc.items()}  # fmt: skip
    keep = (*ASYNC_VARIANTS, "floor_ratio", "generation_share")
    return {k: v for k, v in sc.items() if k.startswith(("ratio", "stock_old")) or k == "mfu" or k in keep}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run with toy shapes (test suite)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per scenario (default: per shape)")
    parser.add_argument(
        "--scenarios",
        default="loss_path,equal_settings,equal_settings_no_diagnostics,sampler_logprobs,logprob_memory,long_tail,"
        "long_prompt",
    )
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="train both trainers without activation checkpointing (TRL's default is on)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 dense peak for MFU (TFLOP/s)")
    parser.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/<device>.json)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of the layout scenarios' variants to run (default: all)")  # fmt: skip
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return None

    import torch

    global IN_PROCESS
    IN_PROCESS = args.tiny
    shape = dict(SHAPES["tiny" if args.tiny else args.device])
    if args.tiny and args.device == "cuda":
        shape["mem_vocab"], shape["mem_tokens"] = 4096, 64
    reps = args.reps or shape["reps"]
    gradient_checkpointing = not args.no_gradient_checkpointing
    device_name = "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible")
        device_name = torch.cuda.get_device_name()
        peak = args.peak_tflops * 1e12 if args.peak_tflops else None
        if peak is None:
            peak = bf16_peak_flops(device_name)
        shape["peak_flops"] = peak
    default_name = f"{args.device}{'-tiny' if args.tiny else ''}.json"
    out = args.out or os.path.join(REPO_ROOT, "benchmarks", "results", default_name)
    work_dir = "/tmp/trl-gspo-bench"

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import trl
    import transformers

    report = {
        "device": args.device,
        "device_name": device_name,
        "tiny": args.tiny,
        "reps": reps,
        "shape": shape,
        "steps_per_generation": STEPS_PER_GENERATION,
        "gradient_checkpointing": gradient_checkpointing,
        "loss_settings": LOSS_SETTINGS,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},  # fmt: skip
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scenarios": {},
    }
    if args.device == "cuda":
        report["attention"] = cuda_attention()
    wanted = args.scenarios.split(",")
    started = time.perf_counter()

    def save():  # after every scenario, so a run stopped by a time limit keeps what it finished
        report["wall_seconds"] = time.perf_counter() - started
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)

    if "loss_path" in wanted:
        log("loss_path (_compute_loss + backward, stock vs ours, alternating in one process)")
        iters = 5 if args.tiny else 200
        spec = dict(task="loss_path", shape=shape, device=args.device, iters=iters)
        report["scenarios"]["loss_path"] = _run_worker(spec)
        lp = report["scenarios"]["loss_path"]
        log(f"  ratio ours/stock: {lp['ratio_cpu_seconds']:.4f}, diagnostics off: "
            f"{lp['ratio_cpu_seconds_no_diagnostics']:.4f}, untrimmed: {lp['ratio_untrimmed_cpu_seconds']:.4f} (cpu time)")
        save()
    if "equal_settings" in wanted:
        log("equal_settings (old_logprobs_source='recompute')")
        report["scenarios"]["equal_settings"] = compare(
            "equal_settings", "recompute", shape, args.device, reps, work_dir, log, gradient_checkpointing
        )
        save()
    if "equal_settings_no_diagnostics" in wanted:
        log("equal_settings_no_diagnostics (old_logprobs_source='recompute', diagnostics=False)")
        report["scenarios"]["equal_settings_no_diagnostics"] = compare(
            "equal_settings_no_diagnostics", "recompute", shape, args.device, reps, work_dir, log,
            gradient_checkpointing, diagnostics=False,
        )  # fmt: skip
        save()
    if "sampler_logprobs" in wanted:
        log("sampler_logprobs (old_logprobs_source='sampler')")
        report["scenarios"]["sampler_logprobs"] = compare(
            "sampler_logprobs", "sampler", shape, args.device, reps, work_dir, log, gradient_checkpointing
        )
        save()
    from trl_gspo.forward import fused_head

    for name in ("long_prompt", "long_tail"):
        if name not in wanted:
            continue
        if not fused_head.available():  # padding removal needs TRL's fused head (>= 1.15)
            log(f"{name} skipped: this TRL has no fused log-prob head, so padding removal is off (padding.py)")
            continue
        report["scenarios"][name] = {}
        for key in LAYOUT_SHAPES[name]:
            sc_shape = {**shape, **shape["long_tail"], **shape[key]}  # long_tail's entry is every scenario's base
            log(f"{name} / {key} (identical rollouts: prompts of {sc_shape['prompt_range']} tokens, completions "
                f"lognormal up to {sc_shape['completion']}; {sc_shape['batch']} rows x {sc_shape['accumulation']} "
                f"micro-batches per optimizer step, {STEPS_PER_GENERATION} optimizer steps per rollout)")
            report["scenarios"][name][key] = layout_scenario(
                key, sc_shape, args.device, args.reps or sc_shape["reps"], work_dir, log, gradient_checkpointing,
                {k: v for k, v in LAYOUT_VARIANTS[name].items() if args.variants is None or k in args.variants.split(",")},
            )  # fmt: skip
            save()
    if "async" in wanted:
        a_shape = dict(ASYNC_SHAPES["tiny" if args.tiny else args.device])
        log(f"async (sync vs async_generation staleness 1 and 2, transformers generator; {a_shape['batch']} rows x "
            f"{STEPS_PER_GENERATION} mini-batches per rollout, {a_shape['completion']}-token completions)")
        report["scenarios"]["async"] = async_scenario(a_shape, args.device, args.reps or a_shape["reps"], work_dir, log)
        save()
    if "logprob_memory" in wanted:
        log(f"logprob_memory (vocab {shape['mem_vocab']} x {shape['mem_tokens']} tokens)")
        # Peak memory is deterministic here (same shapes, same allocations): two repetitions confirm it.
        report["scenarios"]["logprob_memory"] = memory_scenario(shape, args.device, min(reps, 2), log)
    save()
    summary = {
        name: _summary(sc) for name, sc in report["scenarios"].items()
    }
    log(json.dumps(summary, indent=2))
    print(json.dumps({"out": out, "device_name": device_name, "ratios": summary}))  # last stdout line: machine-readable
    return report


if __name__ == "__main__":
    main()
