"""`TrainingDiagnostics`: the trainer side of `metrics.py`, as a mixin placed before `trl.GRPOTrainer`.

    class GSPOTrainer(TrainingDiagnostics, GRPOTrainer): ...

The loss calls :meth:`TrainingDiagnostics._record_diagnostics` once per micro-batch. That only adds device tensors
to a per-mode :class:`metrics.MetricWindow`; ``log`` reduces the window across processes once per logging step and
hands the floats to TRL's ``_metrics``, so they reach every logger TRL feeds. Other mixins add their own
per-micro-batch statistics to the same window through :meth:`_diagnostics_window` (MoE routing: `routing_replay.py`),
so everything is reduced in the same collectives. Every override here calls ``super()``.
"""

from __future__ import annotations

import torch

from . import metrics


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
        are the loss's clip indicators (`GSPOTrainer._clip_indicators`). Nothing with `diagnostics=False`."""
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
