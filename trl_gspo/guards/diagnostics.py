"""`TrainingDiagnostics`: the trainer side of `common/metrics.py`, as a mixin placed before `trl.GRPOTrainer`.

    class GSPOTrainer(TrainingDiagnostics, GRPOTrainer): ...

The loss calls :meth:`TrainingDiagnostics._record_diagnostics` once per micro-batch. That only adds device tensors
to a per-mode :class:`metrics.MetricWindow`; ``log`` reduces the window across processes once per logging step and
hands the floats to TRL's ``_metrics``, so they reach every logger TRL feeds. Other mixins add their own
per-micro-batch statistics to the same window through :meth:`_diagnostics_window` (MoE routing: `moe/routing_replay.py`),
so everything is reduced in the same collectives. Every override here calls ``super()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common import metrics
from ..common.validation import check_bool


@dataclass
class DiagnosticsOptions:
    r"""
    `GSPOConfig` field of the diagnostics (this module).

    Parameters:
        diagnostics (`bool`, *optional*, defaults to `True`):
            Record the GSPO diagnostics (`seq_ratio/*`, `clip_fraction/*`, `ratio_dispersion/*`, `logratio_by_len/*`,
            `nonfinite/{logps,old_logps,advantages}`, and `moe/*` router recording on MoE models) on every
            micro-batch. They add no device sync (reduced at log time) but cost ~0.7 ms of tensor ops per micro-batch
            (see `benchmarks/run.py`); `False` turns them off. TRL's own metrics and the non-finite guard stay.
    """

    diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log GSPO's per-micro-batch diagnostics (sequence-ratio spread, clip fractions, ratio dispersion "
            "by length, non-finite counts, MoE routing shift): what shows whether GSPO behaves. They cost ~0.7 ms of "
            "tensor ops per micro-batch, so False turns them off for the last bit of speed; TRL's metrics remain."
        },
    )

    def _validate_options(self):
        check_bool("diagnostics", self.diagnostics)


class TrainingDiagnostics:
    """Mixin for a `trl.GRPOTrainer` subclass: GSPO diagnostics (`metrics.METRIC_NAMES`) in TRL's logs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._diagnostics = {"train": metrics.MetricWindow(), "eval": metrics.MetricWindow()}

    def _diagnostics_window(self) -> metrics.MetricWindow | None:
        """The logging window of the current mode, for statistics recorded outside the loss (None when
        `diagnostics=False`)."""
        return self._diagnostics["train" if self.model.training else "eval"] if self.args.diagnostics else None

    def _record_diagnostics(self, mode, inputs, logps, old_logps, low, high, advantages, mask):
        """Add this micro-batch's diagnostics to the logging window, without a host-device sync. `low`/`high`
        are the loss's clip indicators (`losses.Clip`). Nothing with `diagnostics=False`."""
        if not self.args.diagnostics:
            return
        window = self._diagnostics[mode]
        lr, valid = metrics.token_log_ratios(logps, old_logps, mask)
        window.add_values("seq_ratio", metrics.sequence_log_ratio(lr, valid), valid.sum(-1) > 0)
        window.add_means(metrics.clip_fraction_stats(low, high, mask))
        window.add_means(metrics.dispersion_stats(lr, valid, self.max_completion_length))
        for name, x in (("logps", logps), ("old_logps", old_logps), ("advantages", advantages)):
            window.add_sums(f"nonfinite/{name}", metrics.count_nonfinite(x, mask if x.shape == mask.shape else None))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        for name, value in self._diagnostics[mode].flush(self.accelerator, {"seq_ratio": torch.exp}).items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)
