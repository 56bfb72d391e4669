"""The benchmark's workload: shapes per device, the tiny or Qwen3-shaped model, prompts, the token counter, the
identical long-tailed rollouts (`LongTailRollouts`) and the peak-memory probe, shared by every scenario.
"""

from __future__ import annotations

import importlib.util
import time

QWEN3_VOCAB = 151_936


LOSS_SETTINGS = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0)

# Workload shapes. `cpu`: compute-bound enough on one thread that step time is not all Python overhead.
SHAPES = {
    "tiny": dict(
        hidden=32,
        layers=1,
        batch=8,
        num_generations=4,
        prompt_words=6,
        completion=8,
        warmup_rollouts=1,
        measured_rollouts=1,
        reps=1,
        mem_vocab=4096,
        mem_tokens=64,
        long_tail=dict(batch=2, accumulation=4, completion=32, prompt_range=(3, 8)),
        long_tail_one_micro_batch=dict(batch=4, accumulation=1),
        long_prompt=dict(batch=4, accumulation=2, completion=12, prompt_range=(24, 32), median_fraction=0.5),
    ),
    "cpu": dict(
        hidden=256,
        layers=4,
        batch=16,
        num_generations=8,
        prompt_words=48,
        completion=32,
        warmup_rollouts=1,
        measured_rollouts=3,
        reps=7,
        mem_vocab=QWEN3_VOCAB,
        mem_tokens=2048,
        long_tail=dict(
            layers=2, batch=4, accumulation=16, completion=256, prompt_range=(8, 32), measured_rollouts=1, reps=3
        ),
        # issue 19's shape: one micro-batch of 8 rows per optimizer step, sorting cannot narrow it
        long_tail_one_micro_batch=dict(batch=8, accumulation=1),
        # ~1024-token prompts, completions lognormal with median 128 (~10% truncated at 384), G = 8
        long_prompt=dict(
            layers=2,
            batch=8,
            accumulation=2,
            completion=384,
            median_fraction=1 / 3,
            prompt_range=(896, 1152),
            measured_rollouts=1,
            reps=3,
        ),
    ),
    "cuda": dict(
        hidden=None,
        layers=None,
        batch=16,
        num_generations=8,
        prompt_words=128,
        completion=512,
        warmup_rollouts=1,
        measured_rollouts=2,
        reps=3,
        mem_vocab=QWEN3_VOCAB,
        mem_tokens=2048,
        long_tail=dict(batch=4, accumulation=16, completion=2048, prompt_range=(64, 256), measured_rollouts=1, reps=3),
        long_tail_one_micro_batch=dict(batch=8, accumulation=1),
        long_prompt=dict(
            batch=8,
            accumulation=2,
            completion=384,
            median_fraction=1 / 3,
            prompt_range=(896, 1152),
            measured_rollouts=1,
            reps=3,
        ),
    ),
}
STEPS_PER_GENERATION = 4


def rollout_steps(shape: dict) -> int:
    """Optimizer steps per rollout of a shape: its `steps_per_generation`, else `STEPS_PER_GENERATION`."""
    return shape.get("steps_per_generation", STEPS_PER_GENERATION)


#: Workload of the `async` scenario per device (`tiny`: the smoke run): short prompts and longer completions so that
#: generation is >= 1/3 of a synchronous step, no activation checkpointing.
ASYNC_SHAPES = {
    "tiny": dict(
        hidden=32,
        layers=1,
        batch=8,
        num_generations=4,
        prompt_words=4,
        completion=8,
        warmup_rollouts=1,
        measured_rollouts=1,
        reps=1,
    ),
    "cpu": dict(
        hidden=256,
        layers=4,
        batch=16,
        num_generations=8,
        prompt_words=8,
        completion=128,
        warmup_rollouts=1,
        measured_rollouts=3,
        reps=3,
    ),
    "cuda": dict(
        hidden=None,
        layers=None,
        batch=16,
        num_generations=8,
        prompt_words=64,
        completion=512,
        warmup_rollouts=1,
        measured_rollouts=2,
        reps=3,
    ),
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


class PhaseClock:
    """Wall and CPU seconds spent inside `with clock:` blocks, summed over every entry (CUDA work synchronised)."""

    def __init__(self, device: str):
        self.device, self.seconds, self.cpu_seconds = device, 0.0, 0.0

    def __enter__(self):
        self.started = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        wall, cpu = self.started
        self.seconds += time.perf_counter() - wall
        self.cpu_seconds += time.process_time() - cpu
        return False

    def totals(self) -> tuple[float, float]:
        return self.seconds, self.cpu_seconds


# ------------------------------------------------------------------------------------------------ workload
def make_tokenizer(vocab_size: int | None = None):
    from trl_gspo.testing import SPECIAL_TOKENS, WORDS, build_tokenizer

    extra = None
    if vocab_size is not None:  # pad the word-level vocabulary to the model's, so every sampled id decodes
        extra = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(WORDS))]
    return build_tokenizer(extra)


def make_model(tokenizer, shape: dict, device: str, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from trl_gspo.testing import build_tiny_model

    if device == "cuda":
        # Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), randomly initialised: no download needed.
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=cuda_attention())
    return build_tiny_model(tokenizer, seed=seed, hidden_size=shape["hidden"], num_layers=shape["layers"])


def cuda_attention() -> str:
    """flash-attention when installed (varlen kernels for padding_free), else sdpa; the same for stock and ours."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"


def make_dataset(shape: dict, n: int = 512):
    import random

    from datasets import Dataset

    rng = random.Random(0)
    words = ["copy", "add", "the", "sum", "of", "a", "b", "c", "and"] + [str(d) for d in range(10)]
    prompts = [" ".join(rng.choice(words) for _ in range(shape["prompt_words"])) + " :" for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def digit_fraction(completions, **kwargs) -> list[float]:
    """The tiny models' reward: with spread over their word vocabulary, so advantages are non-zero."""
    return [sum(w.isdigit() for w in c.split()) / (1 + len(c.split())) for c in completions]


class TokenCounter:
    """TRL reward function `reward` (by default `digit_fraction`) that also counts the completion tokens generated."""

    def __init__(self, reward=digit_fraction):
        self.reward, self.tokens = reward, 0
        self.__name__ = reward.__name__  # TRL names the reward's metrics by it

    def __call__(self, completions, completion_ids=None, **kwargs):
        self.tokens += sum(len(ids) for ids in completion_ids)
        return self.reward(completions, **kwargs)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def param_flops_per_token(model) -> float:
    """2 * (weights multiplied per token): all parameters, less an untied input embedding (a lookup, not a matmul).

    With tied embeddings the one matrix is counted once, for its use as the LM head."""
    n_params = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        n_params -= model.get_input_embeddings().weight.numel()
    return 2.0 * n_params


def forward_positions(trainer):
    """forward/padding.py's running counts (real tokens, positions run, positions TRL would run), or None for stock."""
    padding = getattr(trainer, "padding", None)  # GSPOTrainer's part (stock TRL has none)
    return None if padding is None else padding.throughput.tolist()


class LongTailRollouts:
    """TRL `rollout_func` that hands every trainer the same rollouts: completion lengths lognormal with median
    0.3 x max and ~10% truncated at max (no EOS), as in reasoning RL; random tokens, one prompt per group: random
    tokens in `prompt_range`, or (`encode`) the group's prompt as the trainer would tokenize it.

    Seeded by call count, so stock and ours, called once per rollout batch, see identical batches. Generation then
    costs ~nothing and the step time is the training phase (pi_old pass, loss forward and backward)."""

    MEDIAN_FRACTION, TRUNCATED_FRACTION = 0.3, 0.10

    def __init__(
        self,
        tokenizer,
        max_completion: int,
        prompt_range: tuple[int, int],
        num_generations: int,
        seed=0,
        median_fraction: float | None = None,
        encode=None,
    ):
        import math
        from statistics import NormalDist

        self.vocab, self.eos = len(tokenizer), tokenizer.eos_token_id
        self.max_completion, self.prompt_range, self.num_generations = max_completion, prompt_range, num_generations
        median_fraction = median_fraction or self.MEDIAN_FRACTION
        self.mu = math.log(median_fraction * max_completion)
        # P(length >= max) = 10%: ln(max) - mu = z_0.9 * sigma
        self.sigma = math.log(1 / median_fraction) / NormalDist().inv_cdf(1 - self.TRUNCATED_FRACTION)
        self.seed, self.calls, self.encode = seed, 0, encode
        self.tokens, self.prompt_tokens, self.rows = 0, 0, 0  # handed out so far: all, prompts', rows

    def __call__(self, prompts, trainer):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * trainer.accelerator.process_index + self.calls)
        self.calls += 1
        n = len(prompts)
        lengths = torch.exp(self.mu + self.sigma * torch.randn(n, generator=g)).round().clamp(1, self.max_completion)
        prompt_ids, completion_ids = [], []
        for i in range(n):
            if i % self.num_generations == 0 and self.encode is not None:
                prompt = self.encode(prompts[i])
            elif i % self.num_generations == 0:  # TRL repeats each prompt num_generations times, consecutively
                p_len = int(torch.randint(self.prompt_range[0], self.prompt_range[1] + 1, (1,), generator=g))
                prompt = torch.randint(4, self.vocab, (p_len,), generator=g).tolist()
            length = int(lengths[i])
            ids = torch.randint(4, self.vocab, (length,), generator=g).tolist()
            if length < self.max_completion:
                ids[-1] = self.eos  # finished; at max length it is truncated, as a sampler cut off there would be
            prompt_ids.append(prompt), completion_ids.append(ids)
            self.tokens += len(prompt) + length
            self.prompt_tokens, self.rows = self.prompt_tokens + len(prompt), self.rows + 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
