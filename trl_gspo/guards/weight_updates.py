"""`weights_changed`: the fraction of a fixed sample of trainable elements that the last optimizer step changed.

Loss, rewards and gradient norms look the same whether an optimizer step moves the weights or rounds away in bf16
(guards/precision.py); this metric tells them apart. `WeightUpdates` is a callback: at `on_step_begin` (before the
first micro-batch of an optimizer step, so before DeepSpeed's step, which runs inside the last backward) it copies a
fixed random sample of the elements the optimizer updates, and at `on_step_end` (after the step) it counts how many
differ. The elements are those of the tensors the optimizer holds (`update_tensors`): the model's parameters for
torch optimizers (the local shard of a DTensor under FSDP), and DeepSpeed's fp32 partitions under ZeRO, so each
process samples its own shard and a step that moves the master weights counts even when the bf16 copy does not move.

The sample is `SAMPLE_SIZE` elements in all, spread over the tensors by size (at least one each), drawn once from a
fixed seed: two small gathers per tensor and optimizer step, and one all-reduce of two numbers when the trainer logs
(`flush`, called from `GSPOTrainer.log`). The logged value is the last optimizer step's fraction, pooled over
processes. When it is below `WARN_BELOW` at a non-zero learning rate and a finite, non-zero gradient norm (a step whose
gradient is zero, e.g. every reward of the batch equal on the first step, moves nothing by design), one warning says
so, once per run.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

#: Elements sampled per process, over all tensors the optimizer updates.
SAMPLE_SIZE = 4096
#: Below this fraction of changed elements at a non-zero learning rate, the run warns once. An fp32 master weight
#: moves under any non-zero Adam step; elements whose gradient was always zero (embedding rows of tokens never seen,
#: experts never routed to) do not, which stays well below 90 % of a model's elements.
WARN_BELOW = 0.1
#: The sample's seed: the same elements every step.
SEED = 0
#: Where DeepSpeed's ZeRO optimizers keep the fp32 partitions they update (their inner torch optimizer holds them only
#: while it steps under ZeRO-3): stage 3, stages 1-2, the bf16 optimizer.
DEEPSPEED_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def update_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors `optimizer` (accelerate's wrapper, DeepSpeed's ZeRO optimizer or a torch optimizer) updates: an
    engine's fp32 partitions where it keeps them, else the innermost optimizer's parameters (local shards)."""
    current = optimizer
    while current is not None:
        for name in DEEPSPEED_PARTITIONS:
            found = [t for t in getattr(current, name, None) or [] if isinstance(t, torch.Tensor) and t.numel() > 0]
            if found:
                return found
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    tensors = []
    for group in getattr(current, "param_groups", []):
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel() > 0:
                tensors.append(local)
    return tensors


def learning_rate(optimizer) -> float:
    """The largest learning rate of the innermost optimizer's parameter groups (the one the next step uses)."""
    current = optimizer
    while getattr(current, "optimizer", None) is not None and current.optimizer is not current:
        current = current.optimizer
    return max((float(group.get("lr", 0.0)) for group in getattr(current, "param_groups", [])), default=0.0)


def sample_indices(sizes: list[int], total: int = SAMPLE_SIZE, seed: int = SEED) -> list[torch.Tensor]:
    """For tensors of `sizes` elements, fixed uniform random flat indices: about `total` in all, spread by size, at
    least one per tensor. Drawn with replacement (an unbiased estimate of the fraction, without materialising a
    permutation of a ZeRO partition of hundreds of millions of elements)."""
    generator = torch.Generator().manual_seed(seed)
    whole = max(sum(sizes), 1)
    return [torch.randint(size, (max(1, round(total * size / whole)),), generator=generator) for size in sizes]


def _joined(picked: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sampled elements as one tensor per device and dtype, in order of first appearance, so that counting what
    changed is one comparison and one sum per tensor of the result (a model has hundreds of parameter tensors,
    mostly on one device in one dtype) instead of per parameter. Same count: concatenation moves no value."""
    groups: dict = {}
    for x in picked:
        groups.setdefault((x.device, x.dtype), []).append(x)
    return [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in groups.values()]


class WeightUpdates(TrainerCallback):
    """The `weights_changed` metric and its warning (module docstring). `describe()` names the run's precision in
    the warning (the trainer passes `Precision.line`)."""

    def __init__(self, describe=None, sample_size: int = SAMPLE_SIZE, warn_below: float = WARN_BELOW):
        self.describe, self.sample_size, self.warn_below = describe, sample_size, warn_below
        self.warned = False
        self._indices, self._sizes = None, None
        self._before, self._lr = None, 0.0
        self._last = None  # (changed, sampled) of the last measured step, device tensors; None once flushed

    def _sample(self, optimizer):
        tensors = update_tensors(optimizer)
        sizes = [t.numel() for t in tensors]
        if sizes != self._sizes:
            self._sizes, self._indices = sizes, sample_indices(sizes, self.sample_size)
            self._indices = [i.to(t.device) for i, t in zip(self._indices, tensors)]
        with torch.no_grad():  # `take` indexes the flat view, as `t.reshape(-1)[i]` does, in one op and no copy
            return _joined([torch.take(t, i) for t, i in zip(tensors, self._indices)])

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:
            return
        self._before, self._lr = self._sample(optimizer), learning_rate(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None or self._before is None:
            return
        after = self._sample(optimizer)
        if [a.numel() for a in after] == [b.numel() for b in self._before]:
            changed = sum((a != b).sum() for a, b in zip(after, self._before))
            self._last = (torch.as_tensor(changed), sum(a.numel() for a in after))
        self._before = None

    def sampled(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The flat indices sampled per tensor and the tensors' sizes (for tests and curious users)."""
        return None if self._indices is None else (self._indices, self._sizes)

    def flush(self, accelerator, grad_norm=None, step: int | None = None) -> dict[str, float]:
        """`{"weights_changed": fraction}` of the last optimizer step, pooled over processes (one all-reduce; every
        process calls it), or `{}` when no step was measured since the last call. Warns once (module docstring)."""
        if self._last is None:
            return {}
        changed, sampled = self._last
        self._last = None
        stats = torch.stack([changed.float().cpu(), torch.tensor(float(sampled))]).to(accelerator.device)
        if accelerator.num_processes > 1:
            stats = accelerator.reduce(stats, reduction="sum")
        changed, sampled = stats.tolist()
        fraction = changed / max(sampled, 1.0)
        self._maybe_warn(fraction, grad_norm, step, accelerator.is_main_process)
        return {"weights_changed": fraction}

    def _maybe_warn(self, fraction: float, grad_norm, step, main: bool) -> None:
        moving = grad_norm is None or (math.isfinite(float(grad_norm)) and float(grad_norm) > 0)
        if self.warned or fraction >= self.warn_below or self._lr <= 0 or not moving:
            return
        self.warned = True
        if main:
            precision = f" ({self.describe()})" if self.describe is not None else ""
            logger.warning(
                "weights_changed=%.4f at step %s: the optimizer step at learning rate %.3g changed %.2f%% of the "
                "sampled trainable weights%s. Steps below the weights' resolution round away (bf16/fp16 weights "
                "without fp32 master weights): set low_precision_weights='upcast' or train under a DeepSpeed ZeRO "
                "config. Said once.",
                fraction,
                step,
                self._lr,
                100 * fraction,
                precision,
            )
