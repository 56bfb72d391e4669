"""The loss-side scenarios: `loss_path` (`_compute_loss` + backward alone, stock vs ours alternating in one process)
and `logprob_memory` (peak memory of one loss forward+backward at Qwen3's vocabulary, each kind in a fresh process).
"""

from __future__ import annotations

import statistics
import time

from scenarios.driver import median_of, ratio_of, run_worker
from scenarios.workload import (
    LOSS_SETTINGS,
    QWEN3_VOCAB,
    STEPS_PER_GENERATION,
    PeakMemory,
    make_model,
    make_tokenizer,
    zero_reward,
)

MEMORY_CHUNK = 4096


def logprob_memory(kind: str, vocab: int, tokens: int, device: str) -> dict:
    """Peak memory of one policy-loss forward + backward on 1 completion of `tokens` tokens at `vocab` words."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.testing import tiny_config

    torch.manual_seed(0)
    tokenizer = make_tokenizer()
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
        common = dict(
            output_dir="/tmp/trl-gspo-bench-mem",
            use_cpu=device == "cpu",
            bf16=device == "cuda",
            report_to=[],
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=tokens,
            steps_per_generation=4,
            **LOSS_SETTINGS,
        )
        if kind == "stock":
            trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
        else:
            chunk = MEMORY_CHUNK if kind == "ours_chunked" else None
            trainer_cls, args = GSPOTrainer, GSPOConfig(**common, logprob_vocab_chunk_size=chunk)
        dataset = Dataset.from_dict({"prompt": ["a"] * 4})
        trainer = trainer_cls(model, zero_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
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

    tokenizer = make_tokenizer(QWEN3_VOCAB if device == "cuda" else None)
    model = make_model(tokenizer, shape, device).to(device)
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
    # ours_untrimmed: forward/padding.py's forward with trimming off, the same work as stock (its overhead alone)
    variants = (
        ("stock", GRPOTrainer, GRPOConfig, {}),
        ("ours", GSPOTrainer, GSPOConfig, {}),
        ("ours_no_diagnostics", GSPOTrainer, GSPOConfig, {"diagnostics": False}),
        ("ours_untrimmed", GSPOTrainer, GSPOConfig, dict(trim_padding=False, sort_by_length="never")),
    )
    for kind, trainer_cls, config_cls, extra in variants:
        args = config_cls(
            output_dir="/tmp/trl-gspo-bench-loss",
            use_cpu=device == "cpu",
            bf16=device == "cuda",
            report_to=[],
            per_device_train_batch_size=B,
            num_generations=shape["num_generations"],
            max_completion_length=T,
            steps_per_generation=STEPS_PER_GENERATION,
            **LOSS_SETTINGS,
            **extra,
        )
        dataset = Dataset.from_dict({"prompt": ["a"] * 4})
        trainers[kind] = trainer_cls(
            copy.deepcopy(model), zero_reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        trainers[kind].model.train()
        trainers[kind].current_gradient_accumulation_steps = 1
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():  # pi_old near pi_theta, so some sequence ratios clip as in training
        logps, _, _ = trainers["stock"]._get_per_token_logps_and_entropies(
            trainers["stock"].model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            T,
        )
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
    med = {
        k: {"seconds": statistics.median(t[0] for t in v), "cpu_seconds": statistics.median(t[1] for t in v)}
        for k, v in times.items()
    }
    return {
        "iters": iters,
        "stock": med["stock"],
        "ours": med["ours"],
        "ours_no_diagnostics": med["ours_no_diagnostics"],
        "ours_untrimmed": med["ours_untrimmed"],
        "ratio_seconds": ratio_of(med["ours"]["seconds"], med["stock"]["seconds"]),
        "ratio_cpu_seconds": ratio_of(med["ours"]["cpu_seconds"], med["stock"]["cpu_seconds"]),
        "ratio_seconds_no_diagnostics": ratio_of(med["ours_no_diagnostics"]["seconds"], med["stock"]["seconds"]),
        "ratio_cpu_seconds_no_diagnostics": ratio_of(
            med["ours_no_diagnostics"]["cpu_seconds"], med["stock"]["cpu_seconds"]
        ),
        "ratio_untrimmed_cpu_seconds": ratio_of(med["ours_untrimmed"]["cpu_seconds"], med["stock"]["cpu_seconds"]),
        # every repetition: [wall seconds, CPU seconds] of one _compute_loss + backward, in the order they ran
        "runs": {kind: [[round(wall, 6), round(cpu, 6)] for wall, cpu in t] for kind, t in times.items()},
    }


def memory_scenario(shape: dict, device: str, reps: int, log) -> dict:
    from trl_gspo.forward import fused_head

    runs = {"stock": [], "ours": [], "ours_chunked": [], "naive": []}
    if not fused_head.available():  # TRL < 1.15 has no fused head, so no tile size to set
        del runs["ours_chunked"]
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        for kind in order:
            spec = dict(task="memory", kind=kind, vocab=shape["mem_vocab"], tokens=shape["mem_tokens"], device=device)
            runs[kind].append(run_worker(spec))
            log(f"  logprob_memory rep {rep} {kind}: {runs[kind][-1]['peak_memory_bytes'] / 2**20:.1f} MiB")
    med = {k: median_of(v, "peak_memory_bytes") for k, v in runs.items()}
    cpu_seconds = {k: median_of(v, "cpu_seconds") for k, v in runs.items()}
    return {
        "cpu_seconds": cpu_seconds,  # one loss forward + backward; includes the measurement's page faults
        "vocab": shape["mem_vocab"],
        "completion_tokens": shape["mem_tokens"],
        "peak_memory_bytes": med,
        "ratio_ours_over_stock": ratio_of(med["ours"], med["stock"]),
        "ours_chunked_logprob_vocab_chunk_size": MEMORY_CHUNK,
        "ratio_ours_chunked_over_stock": ratio_of(med["ours_chunked"], med["stock"]) if "ours_chunked" in med else None,
        "ratio_stock_over_naive_full_logits": ratio_of(med["stock"], med["naive"]),
        "full_fp32_logits_bytes": shape["mem_vocab"] * shape["mem_tokens"] * 4,
        "runs": runs,
    }
