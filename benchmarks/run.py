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
  alone predicts (positions the model ran on / positions stock runs, from forward/padding.py's counters).
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

The scenarios live in `benchmarks/scenarios/` (workload.py: shapes, model, data, rollouts, memory probe; training.py:
the stock-vs-ours training runs and layout variants; asynchronous.py; loss.py: the loss path and log-prob memory;
driver.py: fresh-process workers and medians). This file parses the command line and writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
for folder in (REPO_ROOT, BENCHMARKS):  # trl_gspo, and scenarios/ beside this file (also when loaded by path)
    if folder not in sys.path:
        sys.path.insert(0, folder)

from scenarios import driver  # noqa: E402
from scenarios.asynchronous import async_scenario, run_async  # noqa: E402
from scenarios.loss import logprob_memory, loss_path, memory_scenario  # noqa: E402
from scenarios.training import LAYOUT_SHAPES, LAYOUT_VARIANTS, compare, layout_scenario, run_training  # noqa: E402
from scenarios.workload import (  # noqa: E402
    ASYNC_SHAPES,
    ASYNC_VARIANTS,
    LOSS_SETTINGS,
    SHAPES,
    STEPS_PER_GENERATION,
    cuda_attention,
)

#: Dense bf16 tensor-core peak (FLOP/s) by device-name substring, for MFU; the first substring found in
#: `torch.cuda.get_device_name()` wins, so form factors come before the bare name ("NVIDIA H100 NVL", "NVIDIA H100
#: PCIe", "NVIDIA H100 80GB HBM3" for SXM). NVIDIA's spec tables (nvidia.com/en-us/data-center/h100 and .../h200) give
#: bf16 tensor-core figures with 2:4 sparsity; dense is half: H100 SXM and H200 SXM 1,979 -> 989, H100 NVL and H200
#: NVL 1,671 -> 835, H100 PCIe 1,513 -> 756. A100 312, L40S 362 and A10G 70 are dense already. Override with
#: --peak-tflops.
BF16_PEAK_FLOPS = {
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def bf16_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of the device named `device_name` (`BF16_PEAK_FLOPS`), or None if it is not listed."""
    return next((flops for key, flops in BF16_PEAK_FLOPS.items() if key in device_name), None)


# ------------------------------------------------------------------------------------------------ driver
def _worker(spec: dict) -> dict:
    import torch

    torch.manual_seed(0)
    if spec["task"] == "train":
        return run_training(
            spec["kind"],
            spec["source"],
            spec["shape"],
            spec["device"],
            spec["out_dir"],
            spec["gradient_checkpointing"],
            spec.get("settings"),
            spec.get("long_tail", False),
        )
    if spec["task"] == "loss_path":
        return loss_path(spec["shape"], spec["device"], spec["iters"])
    if spec["task"] == "async":
        return run_async(spec["variant"], spec["shape"], spec["device"], spec["out_dir"])
    return logprob_memory(spec["kind"], spec["vocab"], spec["tokens"], spec["device"])


def _summary(sc: dict) -> dict:
    """Ratios of a scenario (layout scenarios: per shape and variant)."""
    if all(isinstance(v, dict) and "variants" in v for v in sc.values()):
        return {
            key: {
                v: {k: x for k, x in sub[v].items() if k.startswith("ratio") or k == "prompt_tokens_saved_per_step"}
                for v in sub["variants"]
                if v != "stock"
            }
            for key, sub in sc.items()
        }
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
    parser.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="train both trainers without activation checkpointing (TRL's default is on)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 dense peak for MFU (TFLOP/s)")
    parser.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/<device>.json)")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of the layout scenarios' variants to run (default: all)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return None

    import torch

    if args.tiny:
        driver.IN_PROCESS_WORKER = _worker
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

    import transformers
    import trl

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
        "versions": {
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
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
        report["scenarios"]["loss_path"] = driver.run_worker(spec)
        lp = report["scenarios"]["loss_path"]
        log(
            f"  ratio ours/stock: {lp['ratio_cpu_seconds']:.4f}, diagnostics off: "
            f"{lp['ratio_cpu_seconds_no_diagnostics']:.4f}, untrimmed: {lp['ratio_untrimmed_cpu_seconds']:.4f} (cpu time)"
        )
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
            "equal_settings_no_diagnostics",
            "recompute",
            shape,
            args.device,
            reps,
            work_dir,
            log,
            gradient_checkpointing,
            diagnostics=False,
        )
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
            log(f"{name} skipped: this TRL has no fused log-prob head, so padding removal is off (forward/padding.py)")
            continue
        report["scenarios"][name] = {}
        for key in LAYOUT_SHAPES[name]:
            sc_shape = {**shape, **shape["long_tail"], **shape[key]}  # long_tail's entry is every scenario's base
            log(
                f"{name} / {key} (identical rollouts: prompts of {sc_shape['prompt_range']} tokens, completions "
                f"lognormal up to {sc_shape['completion']}; {sc_shape['batch']} rows x {sc_shape['accumulation']} "
                f"micro-batches per optimizer step, {STEPS_PER_GENERATION} optimizer steps per rollout)"
            )
            report["scenarios"][name][key] = layout_scenario(
                key,
                sc_shape,
                args.device,
                args.reps or sc_shape["reps"],
                work_dir,
                log,
                gradient_checkpointing,
                {
                    k: v
                    for k, v in LAYOUT_VARIANTS[name].items()
                    if args.variants is None or k in args.variants.split(",")
                },
            )
            save()
    if "async" in wanted:
        a_shape = dict(ASYNC_SHAPES["tiny" if args.tiny else args.device])
        log(
            f"async (sync vs async_generation staleness 1 and 2, transformers generator; {a_shape['batch']} rows x "
            f"{STEPS_PER_GENERATION} mini-batches per rollout, {a_shape['completion']}-token completions)"
        )
        report["scenarios"]["async"] = async_scenario(a_shape, args.device, args.reps or a_shape["reps"], work_dir, log)
        save()
    if "logprob_memory" in wanted:
        log(f"logprob_memory (vocab {shape['mem_vocab']} x {shape['mem_tokens']} tokens)")
        # Peak memory is deterministic here (same shapes, same allocations): two repetitions confirm it.
        report["scenarios"]["logprob_memory"] = memory_scenario(shape, args.device, min(reps, 2), log)
    save()
    summary = {name: _summary(sc) for name, sc in report["scenarios"].items()}
    log(json.dumps(summary, indent=2))
    print(json.dumps({"out": out, "device_name": device_name, "ratios": summary}))  # last stdout line: machine-readable
    return report


if __name__ == "__main__":
    main()
