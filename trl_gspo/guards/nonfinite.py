"""Non-finite guard: a NaN/inf never reaches the weights, and a run that keeps producing them stops with a checkpoint.

Two layers, both free of host-device syncs on the per-micro-batch path:

1. Micro-batch (`guard_loss`, called at the end of `GSPOTrainer._compute_loss`, in training and evaluation, for
   every loss type; VESPO, which runs TRL's own loss code, is guarded on its loss alone): `ok = isfinite(loss) &
   all(isfinite(ratio))` stays on the device. The loss returned for backward is `where(ok, loss, 0)` and a hook on
   the per-token log-probs replaces their gradient by `where(ok, grad, 0)`, so a bad micro-batch sends exactly zero
   into the model (a NaN inside the loss graph would otherwise survive `0 * NaN` in the backward). For a finite
   micro-batch both `where`s are the identity: value and gradient are bit-for-bit unchanged.
2. Optimizer step (`on_pre_optimizer_step`): one sync per optimizer step reads the number of dropped micro-batches
   and whether the accumulated gradient norm is finite. A non-finite gradient (e.g. from a NaN in the forward pass,
   which layer 1 cannot cut off) or a step whose every micro-batch was dropped skips the optimizer step: gradients are
   set to `None`, which torch optimizers treat as "no update" (no moment update, no weight decay). The learning-rate
   scheduler still advances, as HF does for steps the AMP scaler skips.

Metrics (averaged over the logging window like TRL's): `nonfinite/microbatches` (micro-batches dropped per optimizer
step, summed over processes) and `nonfinite/skipped_steps` (fraction of optimizer steps skipped). After
`max_consecutive_nonfinite` consecutive optimizer steps with any such event, the trainer saves a checkpoint (of the
last good weights) and raises `NonFiniteTrainingError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from ..common.validation import check_int


@dataclass
class NonFiniteOptions:
    r"""
    `GSPOConfig` field of the non-finite guard (this module).

    Parameters:
        max_consecutive_nonfinite (`int`, *optional*, defaults to `10`):
            A micro-batch whose importance ratio or loss is NaN/inf contributes no gradient, and an optimizer step
            whose gradient is NaN/inf (or whose every micro-batch was dropped) is skipped. After this many
            consecutive optimizer steps with such an event, training saves a checkpoint and raises
            `NonFiniteTrainingError`. Counted in the logged metrics `nonfinite/microbatches` and
            `nonfinite/skipped_steps`.
    """

    max_consecutive_nonfinite: int = field(
        default=10,
        metadata={
            "help": "Micro-batches with a NaN/inf ratio or loss contribute nothing and optimizer steps with a NaN/inf "
            "gradient are skipped, so weights never receive a NaN; after this many consecutive affected optimizer "
            "steps the run is broken, not unlucky: save a checkpoint and stop with an error."
        },
    )

    def _validate_options(self):
        check_int(
            "max_consecutive_nonfinite",
            self.max_consecutive_nonfinite,
            1,
            "consecutive optimizer steps with a NaN/inf before training stops",
        )


class NonFiniteTrainingError(RuntimeError):
    """Training produced NaN/inf in too many consecutive optimizer steps."""


class NonFiniteGuard(TrainerCallback):
    """Drops non-finite micro-batches, skips non-finite optimizer steps, counts both, stops a run that keeps failing."""

    def __init__(self, run, accelerator, max_consecutive: int):
        self.run, self.accelerator = run, accelerator  # run: the trainer's state (trainer.RunView)
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total_dropped_microbatches = 0
        self.total_skipped_steps = 0
        self.grad_norm = None  # HF's pre-clip gradient norm of the step (`observe_grad_norm`)
        self._dropped = None  # device tensor: micro-batches dropped since the last optimizer step
        self._seen = 0  # micro-batches since the last optimizer step
        self._abort_message = None

    def observe_grad_norm(self, norm) -> None:
        """HF's pre-clip gradient norm of the optimizer step about to run (the trainer's `_get_grad_norm`): a NaN/inf
        anywhere in the gradients makes it non-finite, so the step check reuses it instead of a pass over them."""
        self.grad_norm = norm

    # --------------------------------------------------------------------------------------- micro-batch layer
    def guard_loss(self, loss: torch.Tensor, mode: str, ratio=None, logps=None) -> torch.Tensor:
        """The loss to use: unchanged when finite, a zero-gradient 0 when the loss or the ratio is not.

        Training: counted for the optimizer-step layer below. With `logps` (the rebuilt loss), a gradient hook zeroes
        what flows back into the model too; without (VESPO, TRL's own code) a NaN reaching the gradients is left to
        the optimizer-step check. Evaluation: the micro-batch adds 0 to `eval_loss` and is counted in
        `eval_nonfinite/microbatches` (one reduce per evaluation batch; evaluation is off the hot path).
        """
        ok = torch.isfinite(loss)
        if ratio is not None:
            ok = ok & torch.isfinite(ratio).all()
        if mode == "train":
            if logps is not None and logps.requires_grad:
                # Registered after the forward, when `ok` is known; it gates every loss path through the log-probs.
                logps.register_hook(lambda grad: torch.where(ok, grad, torch.zeros_like(grad)))
            dropped = (~ok).to(torch.int64)
            self._dropped = dropped if self._dropped is None else self._dropped + dropped
            self._seen += 1
        else:
            dropped = self.accelerator.reduce((~ok).float().reshape(1), reduction="sum")
            self.run.log_metric("nonfinite/microbatches", dropped.item(), mode)
        return torch.where(ok, loss, torch.zeros_like(loss))

    # ---------------------------------------------------------------------------------- optimizer-step layer
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        device, norm = self.accelerator.device, self.grad_norm
        if norm is None:
            # DeepSpeed keeps gradients in its own buffers (p.grad is None) and runs its own overflow check.
            grads = [p.grad for p in self.run.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        grad_bad = (~torch.isfinite(torch.as_tensor(norm, dtype=torch.float32))).float()
        dropped = self._dropped if self._dropped is not None else torch.zeros((), dtype=torch.int64)
        seen = torch.tensor(float(self._seen), device=device)
        stats = torch.stack([dropped.float().to(device), grad_bad.to(device), seen])
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")
        dropped, grad_bad, seen = stats.tolist()  # the one sync per optimizer step
        self._dropped, self._seen = None, 0

        skip = grad_bad > 0 or (seen > 0 and dropped >= seen)
        if skip:
            for p in self.run.model.parameters():
                p.grad = None
        self.run.log_metric("nonfinite/microbatches", dropped, "train")
        self.run.log_metric("nonfinite/skipped_steps", float(skip), "train")
        self.total_dropped_microbatches += int(dropped)
        self.total_skipped_steps += int(skip)

        self.consecutive = self.consecutive + 1 if (dropped > 0 or grad_bad > 0) else 0
        if self.consecutive >= self.max_consecutive and self._abort_message is None:
            self._abort_message = (
                f"Non-finite values (NaN/inf) in {self.consecutive} consecutive optimizer steps (up to step "
                f"{state.global_step + 1}; max_consecutive_nonfinite={self.max_consecutive}): "
                f"{self.total_dropped_microbatches} micro-batches dropped and {self.total_skipped_steps} optimizer "
                "steps skipped so far. The weights were never updated with a NaN. Likely causes: a learning rate "
                "too high, fp16 overflow, or corrupted inputs/log-probs."
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self._abort_message is not None:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if self._abort_message is not None:
            checkpoint = f"{args.output_dir}/checkpoint-{state.global_step}"
            raise NonFiniteTrainingError(f"{self._abort_message} Checkpoint of the last good weights: {checkpoint}.")
