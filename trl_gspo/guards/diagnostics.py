"""`Diagnostics`: the trainer side of `common/metrics.py`.

The loss calls `Diagnostics.record` once per micro-batch. That only adds device tensors to a per-mode
`metrics.MetricWindow`; the trainer's `log` reduces the window across processes once per logging step (`flush`) and
hands the floats to TRL's metrics, so they reach every logger TRL feeds. Other parts add their own per-micro-batch
statistics to the same window (`Diagnostics.window`: MoE routing in `moe/routing_replay.py`, the asynchronous
behaviour weight in `rollout/async_rollouts.py`), so everything is reduced in the same collectives.
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


class Diagnostics:
    """GSPO's diagnostics (`metrics.METRIC_NAMES`) of a run: one logging window per mode.

    The loss records each micro-batch (`record`); other parts add their own per-micro-batch statistics to the same
    window (`window`: MoE routing, the async behaviour weight), so everything is reduced in the same collectives when
    the trainer logs (`flush`)."""

    def __init__(self, enabled: bool, max_completion_length: int):
        self.enabled = enabled
        self.max_completion_length = max_completion_length
        self.windows = {"train": metrics.MetricWindow(), "eval": metrics.MetricWindow()}

    def window(self, mode: str) -> metrics.MetricWindow | None:
        """The logging window of `mode` for optional statistics: None when `diagnostics=False`."""
        return self.windows[mode] if self.enabled else None

    def record(self, mode, logps, old_logps, low, high, advantages, mask) -> None:
        """Add this micro-batch's diagnostics to the logging window, without a host-device sync. `low`/`high` are the
        loss's clip indicators (losses.Clip). Nothing with `diagnostics=False`."""
        window = self.window(mode)
        if window is None:
            return
        lr, valid = metrics.token_log_ratios(logps, old_logps, mask)
        window.add_values("seq_ratio", metrics.sequence_log_ratio(lr, valid), valid.sum(-1) > 0)
        window.add_means(metrics.clip_fraction_stats(low, high, mask))
        window.add_means(metrics.dispersion_stats(lr, valid, self.max_completion_length))
        for name, x in (("logps", logps), ("old_logps", old_logps), ("advantages", advantages)):
            window.add_sums(f"nonfinite/{name}", metrics.count_nonfinite(x, mask if x.shape == mask.shape else None))

    def flush(self, mode: str, accelerator) -> dict[str, float]:
        """The window of `mode`, reduced across processes (one all-reduce and one gather), and emptied."""
        return self.windows[mode].flush(accelerator, {"seq_ratio": torch.exp})
