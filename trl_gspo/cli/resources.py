"""What a `trl-gspo demo` / `train` run runs on, said in its first lines: how many processes, on which devices, and
on CPU how many threads each, with one warning when the processes' threads exceed the cores.

    trl-gspo demo: 1 process on cpu, 1 thread (the demo's choice for its tiny model; OMP_NUM_THREADS overrides), 2 cores
    trl-gspo train: 2 processes on cpu, 1 thread each (OMP_NUM_THREADS=1), 2 cores
    trl-gspo train: 8 processes on cuda (NVIDIA H100 80GB HBM3), one device each

torch runs as many intra-op threads as the machine has cores unless `OMP_NUM_THREADS` (or `MKL_NUM_THREADS`) says
otherwise. A tiny model gains nothing from them and loses a lot when another process shares the cores (measured:
docs/console.md), so the demo's copy task picks one thread (`cli/demo.py`, `TASKS`) unless the user chose a count:
one of the variables above, or, where `main` is called in-process, `torch.set_num_threads` after `trl_gspo.cli` was
imported (a count set before cannot be told from torch's own). `train`, and the demo on a real model, keep what torch
runs with and name it.
"""

from __future__ import annotations

import os

import torch

#: Environment variables through which a user sets torch's intra-op threads (torch reads them when it starts).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: torch's thread count when this module was first imported (before any command ran): a different count later means
#: `torch.set_num_threads` was called in this process, and the caller's count is kept.
STARTING_THREADS = torch.get_num_threads()


def cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def users_thread_choice() -> str | None:
    """How the user set the thread count (`OMP_NUM_THREADS=4`, `torch.set_num_threads(4)`), or None if they did not."""
    for name in THREAD_VARIABLES:
        if os.environ.get(name, "").strip():
            return f"{name}={os.environ[name].strip()}"
    if torch.get_num_threads() != STARTING_THREADS:
        return f"torch.set_num_threads({torch.get_num_threads()})"
    return None


def pick_threads(needed: int, why: str) -> str:
    """Run torch with `needed` intra-op threads unless the user chose a count; returns where the count comes from."""
    chosen = users_thread_choice()
    if chosen is not None:
        return chosen
    torch.set_num_threads(needed)
    return why


def threads_source() -> str:
    """Where the thread count `train` runs with comes from: the user's setting, or torch's default."""
    return users_thread_choice() or "torch's default"


def processes_per_machine(num_processes: int) -> int:
    """Processes sharing this machine's cores: torchrun's (accelerate's) `LOCAL_WORLD_SIZE`, else all of them."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else num_processes


def _count(number: int, word: str) -> str:
    return f"{number} {word}{'' if number == 1 else 'es' if word.endswith('s') else 's'}"


def resources_line(num_processes: int, device, threads_note: str) -> str:
    """The run's processes and devices, and on CPU its threads per process and the cores."""
    processes = _count(num_processes, "process")
    if device.type == "cpu":
        each = " each" if num_processes != 1 else ""
        threads = _count(torch.get_num_threads(), "thread")
        return f"{processes} on cpu, {threads}{each} ({threads_note}), {_count(cpu_cores(), 'core')}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{processes} on {device.type} ({name}), one device each"


def oversubscription(num_processes: int, device) -> str | None:
    """On CPU, a warning when this machine's processes run more threads than it has cores, else None."""
    if device.type != "cpu":
        return None
    local, threads, cores = processes_per_machine(num_processes), torch.get_num_threads(), cpu_cores()
    if local * threads <= cores:
        return None
    return (
        f"{_count(local, 'process')} x {_count(threads, 'thread')} = {local * threads} threads on "
        f"{_count(cores, 'core')}: they wait for each other, and a small model runs several times slower. Set "
        f"OMP_NUM_THREADS={max(cores // local, 1)} (processes x threads at most the cores)."
    )


def single_process_note(num_processes: int, command: str) -> str | None:
    """`accelerate launch --num_processes 2` without `--multi_gpu` (or a config that sets a distributed type) on a
    machine without GPUs starts one plain process: its environment has accelerate's variables and rendezvous address
    (set for more than one process only) but no `WORLD_SIZE`. Say how to start several."""
    launched = "ACCELERATE_DYNAMO_BACKEND" in os.environ and "MASTER_ADDR" in os.environ
    if num_processes != 1 or not launched or "WORLD_SIZE" in os.environ:
        return None
    return (
        "accelerate launch started a single process: on a machine without GPUs, --num_processes starts several only "
        "with --multi_gpu (or a config whose distributed_type is MULTI_CPU). Pass --multi_gpu, or run `trl-gspo "
        f"{command} --accelerate_config multi_gpu --num_processes N`."
    )


def deepspeed_cpu_problem(deepspeed: bool, use_cpu, cuda: bool) -> str | None:
    """DeepSpeed on a machine without a CUDA device, in a run that does not set `use_cpu: true`: transformers then
    sizes DeepSpeed's batch for one process and each process trains alone, silently. Say so before anything starts."""
    if not deepspeed or cuda or str(use_cpu).lower() == "true":
        return None
    return (
        "DeepSpeed without a CUDA device needs use_cpu: true, or each process trains alone (transformers sizes "
        "DeepSpeed's batch for one process): add --use_cpu true (or use_cpu: true in the recipe), or run on GPUs."
    )
