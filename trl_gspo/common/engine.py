"""What the distributed engine of a run does with the weights, read from the accelerator: DeepSpeed's ZeRO stage and
its fp32 master copy, FSDP's mixed precision, and the engine's start-up kept quiet and agreeing with the Trainer.

- Master weights. DeepSpeed's ZeRO optimizers (stages 1-3) keep an fp32 copy of the partition each process updates
  whatever the dtype of the model's weights, and its bf16 / fp16 modes keep one without ZeRO too. accelerate's FSDP
  with a mixed precision upcasts the sharded parameters to fp32 before sharding. Without one of those the optimizer
  updates the model's own weights, in their own dtype (`master_copy`).
- Gradient accumulation. transformers builds its `Accelerator` with one accumulation step (the Trainer counts them),
  while the DeepSpeed config holds the run's; accelerate then warns "GradientAccumulationPlugin has 1, DeepSpeed config
  has N" and takes DeepSpeed's value. `agree_gradient_accumulation` gives accelerate that value first (the same
  number it would take, without the warning).
- DeepSpeed's collectives call `torch.distributed` functions torch has deprecated, and torch warns on every call
  (`quiet_deepspeed_collectives` filters exactly those FutureWarnings, in DeepSpeed runs only).
- DeepSpeed compiles C++ ops on first use, 30-60 s each on 2 cores and silent: the shared-memory collective of a CPU
  run and the CPU Adam of ZeRO-Offload. `deepspeed_build_notes` says so before they start (the command line prints
  them), unless the op is prebuilt or was compiled by an earlier run.
"""

from __future__ import annotations

import warnings
from pathlib import Path


def deepspeed_config(accelerator) -> dict | None:
    """The DeepSpeed config of the run (None without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else plugin.deepspeed_config


def zero_stage(accelerator) -> int | None:
    """DeepSpeed's ZeRO stage (0 to 3), or None without DeepSpeed."""
    config = deepspeed_config(accelerator)
    if config is None:
        return None
    return int((config.get("zero_optimization") or {}).get("stage", 0) or 0)


def _enabled(config: dict, key: str) -> bool:
    return str((config.get(key) or {}).get("enabled", False)).lower() == "true"


def master_copy(accelerator) -> str | None:
    """Where the engine keeps fp32 master weights of the trainable weights, in words, or None when it keeps none
    (plain torch, DDP, DeepSpeed stage 0 without bf16/fp16, FSDP without mixed precision)."""
    config = deepspeed_config(accelerator)
    if config is not None:
        stage = zero_stage(accelerator)
        if stage >= 1:
            return f"DeepSpeed ZeRO-{stage}'s fp32 copy"
        if _enabled(config, "bf16") or _enabled(config, "fp16"):
            return "DeepSpeed's fp32 copy (its bf16/fp16 optimizer)"
        return None
    if getattr(accelerator.state, "fsdp_plugin", None) is not None and accelerator.mixed_precision != "no":
        return "FSDP's fp32 sharded parameters (accelerate upcasts them for mixed precision)"
    return None


def engine_compute_dtype(accelerator) -> str | None:
    """The dtype DeepSpeed casts the model's weights to and computes in ("bfloat16" / "float16"), or None when it
    keeps the weights as loaded (no DeepSpeed, or DeepSpeed without bf16/fp16: the CPU runs)."""
    config = deepspeed_config(accelerator)
    if config is None:
        return None
    if _enabled(config, "bf16"):
        return "bfloat16"
    if _enabled(config, "fp16"):
        return "float16"
    return None


def agree_gradient_accumulation(accelerator, steps: int) -> None:
    """Under DeepSpeed, accelerate's gradient accumulation set to the run's (the DeepSpeed config's) before
    `prepare`, which otherwise warns about the mismatch and then takes that value itself (module docstring). The
    Trainer counts accumulation itself either way; elsewhere nothing changes."""
    if deepspeed_config(accelerator) is not None and accelerator.gradient_accumulation_steps != steps:
        accelerator.gradient_accumulation_steps = steps


#: torch's deprecation messages of the `torch.distributed` collectives DeepSpeed's ZeRO calls (all_gather_into_tensor,
#: reduce_scatter_tensor, their private forms, the coalesced ones, _get_global_rank). torch raises them from its own
#: wrapper module, so the caller cannot be told apart: the filter is installed for DeepSpeed runs only.
DEEPSPEED_COLLECTIVE_DEPRECATIONS = (
    r"`torch\.distributed\.[\w.]+` (is deprecated|is a private function|will be deprecated)"
)


def uses_deepspeed(env) -> bool:
    """Whether `accelerate launch` started this process for DeepSpeed (`env`: what it exported)."""
    return str(env.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() == "true"


def quiet_deepspeed_collectives(env) -> None:
    """In a DeepSpeed run (`env`: what `accelerate launch` exported), hide torch's FutureWarnings about the deprecated
    `torch.distributed` collectives DeepSpeed calls, 20-30 per run; every other warning still shows."""
    if not uses_deepspeed(env):
        return
    warnings.filterwarnings(
        "ignore",
        message=DEEPSPEED_COLLECTIVE_DEPRECATIONS,
        category=FutureWarning,
        module=r"torch\.distributed\.",
    )


#: DeepSpeed's C++ ops compiled on first use in a CPU or ZeRO-Offload run: (op name, when, what it is).
DEEPSPEED_BUILDS = (
    ("deepspeed_shm_comm", "cpu", "its shared-memory collective for CPU processes"),
    ("cpu_adam", "offload", "its CPU Adam for ZeRO-Offload"),
)


def _op_built(name: str) -> bool:
    """Whether DeepSpeed's op `name` came prebuilt or was compiled by an earlier run (torch's extension cache)."""
    try:
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import get_default_build_root
    except ImportError:
        return True  # no DeepSpeed: nothing to build
    return bool(installed_ops.get(name, False)) or any(Path(get_default_build_root()).glob(f"*/{name}/{name}*.so"))


def deepspeed_build_notes(env, cuda: bool) -> list[str]:
    """Lines to print before DeepSpeed compiles an op in silence (30-60 s on 2 cores, first run on a machine only):
    the shared-memory collective of a CPU run, the CPU Adam of ZeRO-Offload. `env`: what `accelerate launch` exported
    (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE`)."""
    if str(env.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() != "true":
        return []
    offload = str(env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")).lower() not in ("none", "")
    wanted = {"cpu": not cuda or env.get("DS_ACCELERATOR") == "cpu", "offload": offload}
    notes = []
    for name, when, what in DEEPSPEED_BUILDS:
        if wanted[when] and not _op_built(name):
            notes.append(
                f"DeepSpeed compiles {what} ({name}) now: first run on this machine only, about 30-60 s, then cached."
            )
    return notes
