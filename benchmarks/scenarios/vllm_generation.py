"""The `vllm_generation` scenario: GSPO steps generating with vLLM's CPU build, colocated in the trainer's process
and as a real vLLM server process, beside transformers `generate` in the trainer: same tiny model, data, batch and
seed, runs alternating between the backends (ABC CBA ...). Needs vLLM (`make .venv-vllm/.installed`, then
`.venv-vllm/bin/python benchmarks/run.py --scenarios vllm_generation`).

Both engines run in fp32, like the trainer (TRL builds the colocated engine with vLLM's automatic dtype, bf16 for an
fp32 checkpoint; `dtype="float32"` is added to that call here). Colocate pays its real weight sync before each rollout
(vLLM's layer-wise reload on the CPU build, trl_gspo/rollout/colocate_cpu_sync.py) and shares the trainer's one
thread. In server mode TRL's weight push runs on NCCL (CUDA only) and is replaced by a no-op here, so the server
samples with the initial weights and the push costs nothing; on a GPU it adds a broadcast per generation. The server
runs with one thread beside the trainer's one thread. GSPOConfig's defaults generate one rollout per 4 optimizer
steps (the paper's 4 mini-batches). Per run: seconds per optimizer step and seconds of generation per optimizer step
(TRL's `_generate`, the call the step waits on), means over the rollouts after the first (warm-up, discarded);
`generation_share` is their ratio. The summary gives medians over runs at each shape:
- `short`: prompts of 3-9 words, 8 completions of up to 32 tokens per optimizer step, one micro-batch;
- `long`: prompts of 200-260 words, 4 micro-batches of 8 completions (groups of 8) of up to 128 tokens per step.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the real-vLLM set's model and server helpers

SHAPES = {
    "short": dict(
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=32,
        prompt_words=(3, 9),
    ),
    "long": dict(
        per_device_train_batch_size=8,
        num_generations=8,
        gradient_accumulation_steps=4,
        max_completion_length=128,
        prompt_words=(200, 260),
    ),
}


def prompts(words: tuple[int, int], count: int = 64) -> list[str]:
    import random

    vocab = ["add", "copy", "count", "the", "sum", "of", "and", "a", "b", "c", "d", *map(str, range(10))]
    rng = random.Random(0)
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(*words))) for _ in range(count)]


def one_run(model_dir: str, url: str | None, shape: str, rollouts: int, out: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from trl_gspo import GSPOConfig, GSPOTrainer

    settings = dict(SHAPES[shape])
    words = settings.pop("prompt_words")
    if url == "colocate":
        vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512)
    elif url:
        vllm = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
    else:
        vllm = dict(use_vllm=False)
    args = GSPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        learning_rate=1e-5,
        max_steps=4 * (1 + rollouts),
        logging_steps=1,
        disable_tqdm=True,
        **settings,
        **vllm,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GSPOTrainer(
        model_dir,
        lambda completions, **k: [float(len(c.split()) % 4) for c in completions],
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts(words)}),
    )
    generation, step_times, generate = [], [], trainer._generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generation.append(time.perf_counter() - start)

    trainer._generate = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.generated = time.perf_counter(), len(generation)

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append((time.perf_counter() - self.start, sum(generation[self.generated :])))

    trainer.add_callback(Steps())
    trainer.train()
    # TRL generates inside the step's first training_step (after on_step_begin): generation is part of the step time.
    per_rollout = args.steps_per_generation // args.gradient_accumulation_steps
    rest = step_times[per_rollout:]  # the first rollout's steps: warm-up
    step_s = sum(s for s, _ in rest) / len(rest)
    gen_s = sum(g for _, g in rest) / len(rest)
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    if url == "colocate":  # the engine lives in this process: take down its process groups before the next run's
        from real_vllm.conftest import release_colocated_engine

        del trainer, generate
        release_colocated_engine()
    return {
        "step_s": step_s,
        "generation_s": gen_s,
        "generation_share": gen_s / step_s,
        "completion_mean_length": statistics.mean(lengths),
        "steps_s_and_generation_s": [list(t) for t in step_times],
    }


def vllm_generation_scenario(repeats: int, rollouts: int, log) -> dict:
    """Every backend `repeats` times per shape, `rollouts` measured rollouts per run after a warm-up rollout."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from trl.generation.vllm_client import VLLMClient

    VLLMClient.init_communicator = lambda self, *a, **k: None  # NCCL weight transfer: CUDA only (module docstring)
    VLLMClient.update_named_params = lambda self, *a, **k: None
    import vllm
    from real_vllm.conftest import colocated_engine_dtype, running_server, save_served_model

    colocated_engine_dtype("float32")  # the colocated engine in fp32, like the server and the trainer (module doc)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    work = tempfile.mkdtemp(prefix="gspo-vllm-cpu-")
    model_dir = save_served_model(os.path.join(work, "model"))  # the tiny Qwen3 of tests/real_vllm
    results = {"vllm": vllm.__version__, "shapes": {k: dict(v) for k, v in SHAPES.items()}, "runs": []}
    backends = ["transformers", "vllm_server", "vllm_colocate"]
    with running_server(model_dir, max_model_len=512) as (server_url, _):
        for shape in SHAPES:
            order = [b for r in range(repeats) for b in (backends if r % 2 == 0 else backends[::-1])]
            for index, backend in enumerate(order):
                url = {"vllm_server": server_url, "vllm_colocate": "colocate"}.get(backend)
                run = one_run(model_dir, url, shape, rollouts, os.path.join(work, f"{shape}-{index}"))
                results["runs"].append({"shape": shape, "backend": backend, **run})
                log(
                    f"  {shape:6s} {backend:14s} step {run['step_s']:.3f} s  generation {run['generation_s']:.3f} s "
                    f"({100 * run['generation_share']:.0f}%)  mean length {run['completion_mean_length']:.1f}"
                )
    for shape in SHAPES:
        summary = {}
        for backend in backends:
            runs = [r for r in results["runs"] if r["shape"] == shape and r["backend"] == backend]
            summary[f"{backend}_step_s"] = statistics.median(r["step_s"] for r in runs)
            summary[f"{backend}_generation_s"] = statistics.median(r["generation_s"] for r in runs)
            summary[f"{backend}_generation_share"] = statistics.median(r["generation_share"] for r in runs)
        for backend in backends[1:]:
            summary[f"step_ratio_{backend}_over_transformers"] = (
                summary[f"{backend}_step_s"] / summary["transformers_step_s"]
            )
        results[shape] = summary
    return results
