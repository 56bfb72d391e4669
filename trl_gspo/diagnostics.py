"""`TrainingDiagnostics`: the trainer side of `metrics.py`, as a mixin placed before `trl.GRPOTrainer`.

    class GSPOTrainer(TrainingDiagnostics, GRPOTrainer): ...

The loss calls :meth:`TrainingDiagnostics._record_diagnostics` once per micro-batch. That only adds device tensors
to a per-mode :class:`metrics.MetricWindow`; ``log`` reduces the window across processes once per logging step and
hands the floats to TRL's ``_metrics``, so they reach every logger TRL feeds.

For MoE models, router hooks (`routing.py`) record the completion tokens' top-k experts during two forwards TRL
already runs: the old-policy log-prob forward at rollout time and the loss forward. The old ids ride along in the
rollout batch as ``old_router_topk``; no routing replay, no extra forward. When `padding.py` trims, sorts or packs
a forward, the recorder maps what the routers saw back to the batch through each call's `ForwardLayout`. Every override here calls ``super()``,
so other overrides of the same TRL methods in the trainer compose with these through the MRO.
"""

from __future__ import annotations

import torch

from . import metrics
from .routing import RouterRecorder


class TrainingDiagnostics:
    """Mixin for a `trl.GRPOTrainer` subclass: GSPO diagnostics (`metrics.METRIC_NAMES`) in TRL's logs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._diagnostics = {"train": metrics.MetricWindow(), "eval": metrics.MetricWindow()}
        self._router_recorder = RouterRecorder.for_model(self.model)  # None for dense models
        # While a list, every log-prob forward appends (its log-probs, the completion tokens' top-k experts). The
        # log-probs tensor identifies the forward: the one whose output became pi_old's log-probs (not a reference
        # forward of the same modules with a PEFT adapter off, nor a forward that was skipped), or the loss's own.
        self._routing_records = None

    def _record_diagnostics(self, mode, inputs, logps, old_logps, low, high, advantages, mask):
        """Add this micro-batch's diagnostics to the logging window, without a host-device sync. `low`/`high`
        are the loss's clip indicators (`GSPOTrainer._clip_indicators`)."""
        window = self._diagnostics[mode]
        lr, valid = metrics.token_log_ratios(logps, old_logps, mask)
        window.add_values("seq_ratio", metrics.sequence_log_ratio(lr, valid), valid.sum(-1) > 0)
        window.add_means(metrics.clip_fraction_stats(low, high, mask))
        window.add_means(metrics.dispersion_stats(lr, valid, self.max_completion_length))
        for name, x in (("logps", logps), ("old_logps", old_logps), ("advantages", advantages)):
            window.add_sums(f"nonfinite/{name}", metrics.count_nonfinite(x, mask if x.shape == mask.shape else None))
        current = _routing_of(self._routing_records, logps)
        if current is not None:
            window.add_counts(
                "moe/expert_load",
                metrics.expert_load(current, mask, self._router_recorder.num_experts),
                lambda load: {"moe/expert_load_cv": metrics.expert_load_cv(load)},
            )
            old = inputs.get("old_router_topk")
            if old is not None:
                window.add_means(metrics.routing_shift_stats(old, current, mask))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        for name, value in self._diagnostics[mode].flush(self.accelerator, {"seq_ratio": torch.exp}).items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._routing_records = [] if self._router_recorder is not None else None
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._routing_records = None

    def _generate_and_score_completions(self, inputs):
        self._routing_records = [] if self._router_recorder is not None else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            records, self._routing_records = self._routing_records, None
        topk = _routing_of(records, output.get("old_per_token_logps"))
        if topk is not None:
            output["old_router_topk"] = topk  # split and shuffled with the rollout batch, like every tensor in it
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        forward = super()._get_per_token_logps_and_entropies
        if self._routing_records is None:
            return forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        with self._router_recorder.recording():
            out = forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        self._routing_records.append((out[0], self._router_recorder.completion_topk(input_ids, logits_to_keep)))
        return out

    def _call_model(self, model, layout, **model_inputs):
        # padding.py's one model call: the routers see its trimmed / sorted / packed layout, so note it for the
        # mapping back to the batch's [B, S] positions.
        if self._router_recorder is not None:
            self._router_recorder.note_layout(layout)
        return super()._call_model(model, layout, **model_inputs)


def _routing_of(records, logps):
    """Top-k experts recorded by the forward that returned exactly this `logps` tensor, else None."""
    return next((topk for out, topk in records or () if logps is not None and out is logps), None)
