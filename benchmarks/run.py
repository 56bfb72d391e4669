"""Benchmark trl-gspo against stock TRL, and time what a user runs: every scenario of `scenarios/registry.py`, each
written to its own file, `benchmarks/results/<scenario>.json` (overwritten by each run: the history is git's).

    OMP_NUM_THREADS=1 python benchmarks/run.py                                 # every scenario (CPU, tiny models)
    OMP_NUM_THREADS=1 python benchmarks/run.py --scenarios equal_settings,async # some of them
    python benchmarks/run.py --list                                            # the scenarios and what each measures
    python benchmarks/run.py --device cuda                                     # GPU: Qwen3-0.6B shape in bf16, + MFU
    python benchmarks/run.py --tiny --results-dir /tmp/b                       # seconds-long smoke run (tests)

Each file holds the date, the commit, the machine (CPU or GPU, cores, load average before and after), the versions,
the settings, and the result with every repetition. `--out FILE` writes one file holding every scenario run instead
(what `make gpu-check` reads). benchmarks/README.md says what each scenario measures and how to read it.

Stock is `trl.GRPOTrainer(importance_sampling_level="sequence")` with the GSPO loss settings (loss_type="grpo",
epsilon=3e-4, epsilon_high=4e-4, beta=0, steps_per_generation=4); ours is `GSPOTrainer` with the same values. Each
training run is a fresh process (`run.py --worker SPEC`); stock and ours alternate (ABBA), or variants rotate, and
ratios are ours / stock of medians over repetitions. The scenarios' code: `scenarios/` (workload.py: shapes, model,
data, rollouts, memory probe; training.py; loss.py; asynchronous.py; demo.py; vllm_generation.py; driver.py: fresh
processes and medians).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
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
from scenarios.asynchronous import run_async  # noqa: E402
from scenarios.loss import logprob_memory, loss_path  # noqa: E402
from scenarios.registry import SCENARIOS, Context  # noqa: E402
from scenarios.training import run_training  # noqa: E402
from scenarios.workload import LOSS_SETTINGS, SHAPES, STEPS_PER_GENERATION, cuda_attention  # noqa: E402

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


# ------------------------------------------------------------------------------------------------ worker
#: What a fresh `run.py --worker SPEC` process runs, by the spec's `task`.
TASKS = {
    "train": lambda spec: run_training(
        spec["kind"],
        spec["source"],
        spec["shape"],
        spec["device"],
        spec["out_dir"],
        spec["gradient_checkpointing"],
        spec.get("settings"),
        spec.get("long_tail", False),
    ),
    "loss_path": lambda spec: loss_path(spec["shape"], spec["device"], spec["iters"]),
    "async": lambda spec: run_async(spec["variant"], spec["shape"], spec["device"], spec["out_dir"]),
    "memory": lambda spec: logprob_memory(spec["kind"], spec["vocab"], spec["tokens"], spec["device"]),
}


def _worker(spec: dict) -> dict:
    import torch

    torch.manual_seed(0)
    return TASKS[spec["task"]](spec)


# ------------------------------------------------------------------------------------------------ records
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict:
    """The commit measured, and whether tracked files outside benchmarks/results differed from it."""
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(changed) if changed is not None else None}


def machine(device: str) -> dict:
    """What the numbers were measured on (no host name, no paths)."""
    import torch

    info = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["attention"] = cuda_attention()
    return info


def versions() -> dict:
    import torch
    import transformers
    import trl

    found = {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__}
    with contextlib.suppress(ImportError):
        import vllm

        found["vllm"] = vllm.__version__
    return {**found, "python": platform.python_version()}


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run with toy shapes (test suite)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per scenario (default: per shape)")
    parser.add_argument("--scenarios", default="all", help=f"comma-separated, or all (default): {', '.join(SCENARIOS)}")
    parser.add_argument("--list", action="store_true", help="list the scenarios and what each measures")
    parser.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="train both trainers without activation checkpointing (TRL's default is on)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 dense peak for MFU (TFLOP/s)")
    parser.add_argument(
        "--results-dir",
        default=None,
        help="one <scenario>.json per scenario (default: benchmarks/results, /cuda for --device cuda)",
    )
    parser.add_argument("--out", default=None, help="instead: one JSON file holding every scenario run")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the layout scenarios' variants")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return None
    if args.list:
        for scenario in SCENARIOS.values():
            print(f"{scenario.name:31s} {scenario.what}")
        return None
    wanted = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [name for name in wanted if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)} (or all)")

    import torch

    if args.tiny:
        driver.IN_PROCESS_WORKER = _worker
    shape = dict(SHAPES["tiny" if args.tiny else args.device])
    if args.tiny and args.device == "cuda":
        shape["mem_vocab"], shape["mem_tokens"] = 4096, 64
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible")
        peak = args.peak_tflops * 1e12 if args.peak_tflops else bf16_peak_flops(torch.cuda.get_device_name())
        shape["peak_flops"] = peak
    # CPU results are the ones the docs quote; a GPU run goes beside them, never over them
    default_dir = os.path.join(REPO_ROOT, "benchmarks", "results", *(("cuda",) if args.device == "cuda" else ()))
    results_dir = args.results_dir or default_dir

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    ctx = Context(
        device=args.device,
        tiny=args.tiny,
        shape=shape,
        reps=args.reps,
        work_dir=tempfile.mkdtemp(prefix="trl-gspo-bench-"),
        log=log,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        variants=args.variants.split(",") if args.variants else None,
    )
    header = {
        **commit(),
        "machine": machine(args.device),
        "versions": versions(),
        "settings": {
            "device": args.device,
            "tiny": args.tiny,
            "reps": args.reps,
            "shape": shape,
            "steps_per_generation": STEPS_PER_GENERATION,
            "gradient_checkpointing": ctx.gradient_checkpointing,
            "loss_settings": LOSS_SETTINGS,
        },
    }
    combined = {**header, "device": args.device, "scenarios": {}, "skipped": {}}
    written = []
    for name in wanted:
        scenario = SCENARIOS[name]
        reason = scenario.unavailable(ctx)
        if reason is not None:
            log(f"{name} skipped: {reason}")
            combined["skipped"][name] = reason
            continue
        log(f"{name}: {scenario.what}")
        start, load_before = time.perf_counter(), load_average()
        record = {
            "scenario": name,
            "what": scenario.what,
            "command": " ".join(["python benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **header,
        }
        record["result"] = scenario.run(ctx)
        record["wall_seconds"] = time.perf_counter() - start
        record["machine"] = {
            **record["machine"],
            "load_average_before": load_before,
            "load_average_after": load_average(),
        }
        combined["scenarios"][name] = record["result"]
        if args.out is None:  # each scenario as soon as it is done: a run stopped later keeps what it finished
            os.makedirs(results_dir, exist_ok=True)
            path = os.path.join(results_dir, f"{name}.json")
            with open(path, "w") as f:
                json.dump(record, f, indent=1)
            written.append(path)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(combined, f, indent=1)
    print(json.dumps({"out": args.out, "written": written, "skipped": combined["skipped"]}))  # machine-readable
    return combined


if __name__ == "__main__":
    main()
