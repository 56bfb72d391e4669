"""The `demo`, `demo_copy` and `demo_vllm` scenarios: `trl-gspo demo` end to end as a user types it, one fresh process
per seed: the held-out score before and after training (the real model's accuracy, the copy task's reward), the
training seconds (the console's `done:` line), the seconds end to end (the whole command: imports, model, evaluation,
saving; with vLLM the engine's start too) and the threads it ran with. `demo` is `make demo` (SmolLM2-135M-Instruct on
two-digit addition, from the model `trl-gspo models prepare` made available), `demo_copy` the tiny model's copy task
(`--config demo`), `demo_vllm` the copy task with colocated vLLM.

As typed means no thread variables: the harness's `OMP_NUM_THREADS` / `MKL_NUM_THREADS` (the other scenarios run
with one thread) are removed from the demo's environment, so the demo picks its own thread count, as `make demo` does.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

from scenarios.driver import REPO_ROOT

SEEDS = (0, 1, 2)
#: --tiny: a few steps, only to run the path.
TINY = ("--max_steps", "4", "--num_train_prompts", "32", "--num_eval_prompts", "8")
#: --tiny on the real model: one small rollout batch.
TINY_REAL = (
    *("--max_steps", "2", "--num_train_prompts", "16", "--num_eval_prompts", "4", "--eval_every", "0"),
    *("--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "2"),
)
HELD_OUT = re.compile(
    r"held-out (?:reward|accuracy) \(greedy, (\d+) unseen prompts\): before ([\d.]+) -> after ([\d.]+)"
)
DONE = re.compile(r"^done: (\d+) steps in ([\d.]+) s", re.MULTILINE)
#: The demo's line on what it runs on: `trl-gspo demo: 1 process on cpu, 1 thread (...), 2 cores`.
RESOURCES = re.compile(r"^trl-gspo demo: \d+ process(?:es)? on cpu, (\d+) threads? \(([^)]*)\)", re.MULTILINE)
#: Variables a user sets to choose torch's threads; the demo runs without them, as typed.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def run_demo(seed: int, copy: bool, use_vllm: bool, tiny: bool, out_dir: str) -> dict:
    """`python -m trl_gspo demo --seed SEED` (`copy`: with `--config demo`; with `--use_vllm true --vllm_mode
    colocate`), its numbers from its console."""
    command = [sys.executable, "-m", "trl_gspo", "demo", *(("--config", "demo") if copy else ())]
    command += ["--seed", str(seed), "--output_dir", out_dir]
    command += [*(("--use_vllm", "true", "--vllm_mode", "colocate") if use_vllm else ())]
    command += [*((TINY if copy else TINY_REAL) if tiny else ())]
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
    end_to_end = time.perf_counter() - start
    held_out, done, resources = HELD_OUT.search(proc.stdout), DONE.search(proc.stdout), RESOURCES.search(proc.stdout)
    if proc.returncode != 0 or held_out is None or done is None:
        raise RuntimeError(
            f"{' '.join(command[2:])} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return {
        "seed": seed,
        "eval_prompts": int(held_out.group(1)),
        "before": float(held_out.group(2)),
        "after": float(held_out.group(3)),
        "steps": int(done.group(1)),
        "train_seconds": float(done.group(2)),
        "end_to_end_seconds": end_to_end,
        "threads": int(resources.group(1)) if resources else None,
        "threads_from": resources.group(2) if resources else None,
    }


def demo_scenario(copy: bool, use_vllm: bool, tiny: bool, work_dir: str, log, seeds=SEEDS) -> dict:
    runs, name = [], "demo" + ("-copy" if copy else "") + ("-vllm" if use_vllm else "")
    for seed in seeds[:1] if tiny else seeds:
        runs.append(run_demo(seed, copy, use_vllm, tiny, os.path.join(work_dir, f"{name}-{seed}")))
        r = runs[-1]
        log(
            f"  demo seed {seed}: held-out {r['before']:.3f} -> {r['after']:.3f}, training {r['train_seconds']:.1f} s, "
            f"end to end {r['end_to_end_seconds']:.1f} s"
        )
    return {
        "command": "python -m trl_gspo demo"
        + (" --config demo" if copy else "")
        + " --seed SEED"
        + (" --use_vllm true --vllm_mode colocate" if use_vllm else "")
        + " (no OMP_NUM_THREADS / MKL_NUM_THREADS)",
        "seeds": [r["seed"] for r in runs],
        "before_max": max(r["before"] for r in runs),
        "after_min": min(r["after"] for r in runs),
        "after_max": max(r["after"] for r in runs),
        "median_train_seconds": statistics.median(r["train_seconds"] for r in runs),
        "median_end_to_end_seconds": statistics.median(r["end_to_end_seconds"] for r in runs),
        "runs": runs,
    }
