"""Diagnostics that show what GSPO does, computed from tensors the loss already holds (no extra forward pass).

Two layers, in the style of `losses.py`:

- Pure functions turn one micro-batch into *partial statistics*: ``{name: (sum, count)}`` pairs (or a raw
  vector of values for quantiles). Partial statistics add up across micro-batches and processes, so a
  logging window's value is the pooled ``sum / count``, not a mean of per-batch means.
- :class:`MetricWindow` keeps those partials as device tensors while training runs (no ``.item()``, no
  boolean indexing, so no host-device sync per micro-batch) and turns them into floats once, at log time,
  with one all-reduce for every additive statistic and one gather per value distribution.

Shapes follow `losses.py`: ``B`` sequences, ``T`` completion positions, ``mask`` ``(B, T)``. Log-ratios are
``lr_t = log pi_theta(y_t) - log pi_old(y_t)``; the sequence log-ratio is GSPO's
``log s_i = (1/|y_i|) sum_t lr_t``. Metric names are listed in :data:`METRIC_NAMES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import losses

Partial = dict[str, torch.Tensor]  # name -> tensor([sum, count])

#: Quantiles reported for value distributions (p5 / p95).
QUANTILES = (0.05, 0.95)

#: What each metric means (also the table in docs/diagnostics.md). `{lo}-{hi}` is a response-length bucket.
METRIC_NAMES = {
    "seq_ratio/{mean,std,min,max,p5,p95}": "GSPO sequence ratio s_i = exp(mean_t lr_t) over the window's completions "
    "(computed for every level, so GRPO runs show what GSPO would have seen)",
    "clip_fraction/token/{low,high,total}": "fraction of completion tokens whose loss term is clipped (no gradient); "
    "the paper's Fig. 2 counts this",
    "clip_fraction/sequence/{low,high,total}": "per-sequence fraction of clipped tokens, averaged over sequences "
    "(for sequence-level ratios: the fraction of clipped completions)",
    "ratio_dispersion/token_logratio_std": "within-sequence std of token log-ratios lr_t, averaged over sequences",
    "ratio_dispersion/token_logratio_abs": "mean |lr_t| over tokens",
    "ratio_dispersion/seq_logratio_abs": "mean |log s_i| over sequences (GSPO's length-normalised log-ratio)",
    "ratio_dispersion/seq_logratio_sum_abs": "mean |sum_t lr_t| over sequences: log of the un-normalised sequence "
    "likelihood ratio, where token-level noise accumulates with length",
    "logratio_by_len/{lo}-{hi}/{token_std,token_abs,seq_abs,sum_abs}": "the four dispersion metrics for responses "
    "with lo <= |y_i| <= hi tokens (power-of-two buckets)",
    "nonfinite/{logps,old_logps,advantages}": "number of non-finite values seen in the window (summed, not averaged); "
    "they are left out of every other diagnostic",
    "moe/routing_shift": "MoE: fraction of (completion token, MoE layer) pairs whose top-k expert set picked by the "
    "current router differs from the routes pi_old's forward used (under routing replay: what replay corrected)",
    "moe/routing_shift_any_layer": "MoE: fraction of completion tokens routed differently in at least one layer",
    "moe/expert_change": "MoE: fraction of activated experts replaced, 1 - |old & new| / k, per token and layer",
    "moe/expert_load_cv": "MoE: coefficient of variation (std / mean) of completion tokens per expert, per layer, "
    "averaged over layers; 0 is perfectly balanced",
    "moe/replay/coverage": "routing replay: fraction of completion tokens whose recorded route was replayed in the "
    "loss forward (the rest had none, e.g. the last sampled token, and routed natively)",
    "moe/replay/route_mb": "routing replay: MiB of expert routes held for the current rollout batch, per process",
    "moe/r3/sampler_mismatch{,_any_layer}": "R3: routing_shift on mini-batches still at the sampler's weights, i.e. "
    "the (token, layer) pairs (tokens) where the trainer's router picks other experts than the sampler did",
}


# ----------------------------------------------------------------------------------------------- pure functions
def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total.to(torch.float64), count.to(torch.float64)])


def finalize(partial: Partial) -> dict[str, float]:
    """``sum / count`` for each partial statistic with a non-zero count (for tests and single-batch use)."""
    return {k: (v[0] / v[1]).item() for k, v in partial.items() if v[1] > 0}


def token_log_ratios(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor):
    """``(lr, valid)``: token log-ratios ``(B, T)`` and the mask of valid tokens whose log-ratio is finite."""
    lr = (logps - old_logps).detach().float()
    valid = mask.bool() & torch.isfinite(lr)
    return torch.where(valid, lr, torch.zeros_like(lr)), valid.float()


def sequence_log_ratio(lr: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """GSPO's ``log s_i``, ``(B,)``: mean of the valid token log-ratios (0 for an empty completion)."""
    return losses.masked_sequence_mean(lr, valid)


def distribution_summary(values: torch.Tensor, prefix: str) -> dict[str, float]:
    """mean / std (population) / min / max / p5 / p95 of a 1-D tensor, in float64; ``{}`` when empty."""
    v = values.detach().to(torch.float64).flatten()
    if v.numel() == 0:
        return {}
    q = torch.quantile(v, torch.tensor(QUANTILES, dtype=torch.float64, device=v.device)).tolist()
    stats = {"mean": v.mean().item(), "std": v.std(correction=0).item(), "min": v.min().item(), "max": v.max().item()}
    stats.update({f"p{round(100 * p)}": x for p, x in zip(QUANTILES, q)})
    return {f"{prefix}/{k}": x for k, x in stats.items()}


def clip_fraction_stats(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> Partial:
    """Clip fractions from the loss's clip indicators (`losses.clip_indicators`), at token and sequence level.

    ``low`` / ``high`` are ``(B, 1)`` (one decision per sequence) or ``(B, T)``. Token level: clipped valid tokens /
    valid tokens (a clipped sequence clips all its tokens). Sequence level: each non-empty sequence's fraction of
    clipped tokens, averaged over sequences, so a sequence-level clip counts as 1 whatever the length.
    """
    mask = mask.float()
    n = mask.sum(-1)
    nonempty = (n > 0).float()
    # low, high, total stacked on a leading axis: a handful of ops per micro-batch instead of a loop of them
    clipped = torch.stack([x.float().expand_as(mask) for x in (low, high, torch.maximum(low, high))]) * mask
    token = torch.stack([clipped.sum((1, 2)), mask.sum().expand(3)], -1)  # (3, 2)
    per_seq = clipped.sum(-1) / n.clamp(min=1.0)  # (3, B)
    sequence = torch.stack([(per_seq * nonempty).sum(-1), nonempty.sum().expand(3)], -1)
    names = [f"clip_fraction/{level}/{kind}" for level in ("token", "sequence") for kind in ("low", "high", "total")]
    return dict(zip(names, torch.cat([token, sequence]).to(torch.float64).unbind(0)))


def length_buckets(max_length: int) -> list[tuple[int, int]]:
    """Power-of-two response-length buckets ``[(1, 1), (2, 3), (4, 7), ...]`` covering ``1..max_length``."""
    buckets, lo = [], 1
    while lo <= max_length:
        buckets.append((lo, min(2 * lo - 1, max_length)))
        lo *= 2
    return buckets


def dispersion_stats(lr: torch.Tensor, valid: torch.Tensor, max_length: int) -> Partial:
    """The paper's variance argument, measured: token log-ratio spread inside each sequence vs the sequence
    log-ratio, overall and per response-length bucket (see :data:`METRIC_NAMES`).

    ``lr`` / ``valid`` come from :func:`token_log_ratios`; ``max_length`` (the max completion length) fixes the
    bucket set, so every process and micro-batch reports the same names, empty buckets with count 0.
    """
    n = valid.sum(-1)
    nonempty = (n > 0).float()
    seq = sequence_log_ratio(lr, valid)
    token_std = (losses.masked_sequence_mean((lr - seq[:, None]) ** 2, valid)).sqrt()
    overall = {
        "token_std": "token_logratio_std",
        "token_abs": "token_logratio_abs",
        "seq_abs": "seq_logratio_abs",
        "sum_abs": "seq_logratio_sum_abs",
    }
    per_seq = (
        torch.stack(
            [
                token_std,
                (lr.abs() * valid).sum(-1),  # summed per sequence; divided by tokens, not sequences
                seq.abs(),
                (lr * valid).sum(-1).abs(),
            ]
        ).double()
        * nonempty.double()
    )  # (4, B), rows in `overall`'s order; empty sequences contribute nothing

    buckets = length_buckets(max_length)
    # bucket index floor(log2 n), computed without a sync; empty sequences and lengths past the last bucket drop out
    index = torch.floor(torch.log2(n.clamp(min=1.0))).long().clamp(max=len(buckets) - 1)
    in_range = nonempty * (n <= buckets[-1][1]).float()
    one_hot = (index[:, None] == torch.arange(len(buckets), device=index.device)).double() * in_range[:, None].double()
    # column 0: every sequence (the overall metrics), then one column per bucket
    groups = torch.cat([nonempty.double()[:, None], one_hot], 1)  # (B, 1 + buckets)
    sums = per_seq @ groups  # (4, 1 + buckets)
    seq_counts, tok_counts = groups.sum(0), n.double() @ groups
    counts = torch.stack([seq_counts, tok_counts, seq_counts, seq_counts])  # token_abs is a mean over tokens
    pairs = torch.stack([sums, counts], -1).unbind(0)  # 4 x (1 + buckets, 2)
    out = {}
    for (key, name), rows in zip(overall.items(), pairs):
        rows = rows.unbind(0)
        out[f"ratio_dispersion/{name}"] = rows[0]
        for (lo, hi), row in zip(buckets, rows[1:]):
            out[f"logratio_by_len/{lo:04d}-{hi:04d}/{key}"] = row
    return out


def count_nonfinite(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Number of NaN / inf entries of ``x`` (where ``mask`` is set), as a 0-dim device tensor (no sync)."""
    bad = ~torch.isfinite(x.detach())
    if mask is not None:
        bad = bad & mask.bool().expand_as(bad)
    return bad.sum()


def routing_shift_stats(old_topk: torch.Tensor, new_topk: torch.Tensor, mask: torch.Tensor) -> Partial:
    """How far MoE routing moved between the old and the current policy on the same completion tokens.

    ``old_topk`` / ``new_topk``: ``(B, T, L, k)`` expert ids chosen by each of ``L`` MoE layers for every completion
    token (top-k of the router logits). The order inside the top-k does not matter: sets are compared.
    """
    k = new_topk.size(-1)
    # |old & new| per (token, layer): for each new expert, is it among the old ones
    overlap = (new_topk.unsqueeze(-1) == old_topk.unsqueeze(-2)).any(-1).sum(-1).double()  # (B, T, L)
    changed = (overlap < k).double()
    m = mask.double()
    layers = new_topk.size(2)
    return {
        "moe/routing_shift": _pair((changed * m[..., None]).sum(), m.sum() * layers),
        "moe/routing_shift_any_layer": _pair((changed.amax(-1) * m).sum(), m.sum()),
        "moe/expert_change": _pair(((1 - overlap / k) * m[..., None]).sum(), m.sum() * layers),
    }


def replay_coverage_stats(replayed: torch.Tensor, mask: torch.Tensor) -> Partial:
    """Share of valid completion tokens whose expert route was replayed (``replayed``, ``(B, T)`` bool)."""
    m = mask.bool()
    return {"moe/replay/coverage": _pair((replayed.bool() & m).sum(), m.sum())}


def expert_load(topk: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, ``(L, E)``, counting each valid completion token once per chosen expert."""
    layers, k = topk.size(2), topk.size(3)
    # flat (layer, expert) bin per choice; a scatter, not a one-hot, keeps memory at O(B T L k) on large MoEs
    bins = topk.long() + torch.arange(layers, device=topk.device).view(1, 1, layers, 1) * num_experts
    weights = mask.to(torch.float64)[..., None, None].expand(-1, -1, layers, k)
    load = torch.zeros(layers * num_experts, dtype=torch.float64, device=topk.device)
    return load.scatter_add_(0, bins.flatten(), weights.flatten()).view(layers, num_experts)


def expert_load_cv(load: torch.Tensor) -> float:
    """Coefficient of variation (population std / mean) of tokens per expert, per layer, averaged over layers."""
    mean = load.mean(-1)
    cv = load.std(-1, correction=0) / mean.clamp(min=1e-12)
    return cv[mean > 0].mean().item() if bool((mean > 0).any()) else math.nan


# ------------------------------------------------------------------------------------------ logging window
def masked_sum_and_count(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of `x` and what a mean of it divides by, as TRL averages its metrics: a per-sequence `(B, 1)` tensor
    counts sequences, a per-token one the valid tokens of `mask` (a float mask)."""
    if x.size(1) == 1:
        return x.sum(), torch.tensor(float(x.size(0)), device=x.device)
    return (x.expand_as(mask) * mask).sum(), mask.sum()


def loss_metrics(clip, low, high, mask, entropies, per_token_kl, accelerator) -> dict[str, float]:
    """TRL's loss metrics of one micro-batch (same names and values: `entropy`, `kl`, the clip metrics `clip` names,
    a `losses.Clip`), from one gather and one device-to-host copy; stock TRL issues a reduce or gather, each followed
    by a sync, per metric (six for the clipped losses). `low` / `high` are the clip indicators, `(B, 1)` per sequence
    or `(B, T)` per token."""
    mask = mask.float()

    def per_sequence(x):  # (B,) mean over each completion's tokens, for the min/max over sequences
        return losses.masked_sequence_mean(x.expand_as(mask), mask) if x.size(1) > 1 else x[:, 0]

    def indicator(which):
        return {"low": low, "high": high}[which] if which != "region" else torch.maximum(low, high)

    names, stats = ["entropy"], [*masked_sum_and_count(entropies, mask)]
    if per_token_kl is not None:
        names.append("kl")
        stats += masked_sum_and_count(per_token_kl, mask)
    for name, which in clip.means:
        names.append(name)
        stats += masked_sum_and_count(indicator(which), mask)
    local = torch.stack(stats)
    if clip.extremes:
        local = torch.cat([local, *(per_sequence(indicator(which)) for _, which, _ in clip.extremes)])
    gathered = accelerator.gather(local.detach().float()).view(accelerator.num_processes, -1).cpu()
    totals = gathered[:, : len(stats)].sum(0).tolist()
    values = {name: totals[2 * i] / max(totals[2 * i + 1], 1.0) for i, name in enumerate(names)}
    if clip.extremes:
        per_seq = gathered[:, len(stats) :].view(gathered.size(0), len(clip.extremes), -1)  # (processes, extreme, B)
        for i, (name, _, reduction) in enumerate(clip.extremes):
            values[name] = getattr(per_seq[:, i], reduction)().item()
    return values


class MetricWindow:
    """Device-side partial statistics of one logging window (one per mode: train / eval).

    ``add_means`` / ``add_sums`` / ``add_counts`` accumulate running tensors (one add per name per micro-batch, no
    sync); ``add_values`` keeps raw values for quantiles. :meth:`flush` reduces everything across processes, returns
    ``{name: float}`` and empties the window. Every process must call ``flush`` at the same points (TRL's ``log``
    runs on all ranks); names a process never saw are filled with zeros, so uneven names cannot hang a collective.
    """

    def __init__(self):
        self._additive: dict[str, tuple[str, torch.Tensor]] = {}  # name -> (kind, running tensor)
        self._mean_groups: dict[tuple[str, ...], torch.Tensor] = {}  # names -> running (K, 2) [sum, count] rows
        self._values: dict[str, list[torch.Tensor]] = {}
        self._finalizers: dict[str, Callable[[torch.Tensor], dict[str, float]]] = {}

    def _add(self, kind: str, name: str, value: torch.Tensor):
        value = value.detach().to(torch.float64)
        if name in self._additive:
            value = self._additive[name][1] + value
        self._additive[name] = (kind, value)

    def add_means(self, partial: Partial):
        """Pooled means: each value is ``tensor([sum, count])``; the window reports ``sum / count``.

        The partial is kept as one stacked ``(K, 2)`` tensor per set of names (one add per call, not one per
        name: this runs every micro-batch) and split into names at flush."""
        if not partial:
            return
        names = tuple(partial)
        rows = torch.stack([pair.detach().to(torch.float64) for pair in partial.values()])
        running = self._mean_groups.get(names)
        self._mean_groups[names] = rows if running is None else running + rows

    def add_sums(self, name: str, total: torch.Tensor):
        """A count or total reported as the window's sum (e.g. ``nonfinite/...``)."""
        self._add("sum", name, total.reshape(1))

    def add_counts(self, name: str, counts: torch.Tensor, finalizer: Callable[[torch.Tensor], dict[str, float]]):
        """A tensor of counts (any shape) summed over the window; ``finalizer(total)`` turns it into metrics."""
        self._add("counts", name, counts)
        self._finalizers[name] = finalizer

    def add_values(self, name: str, values: torch.Tensor, valid: torch.Tensor | None = None):
        """Raw values (gathered at flush) for :func:`distribution_summary`; ``valid`` marks which to keep."""
        values = values.detach().to(torch.float64).flatten()
        if valid is not None:  # NaN marks "no value" so filtering can wait until flush (no boolean index here)
            values = torch.where(valid.flatten().bool(), values, torch.full_like(values, math.nan))
        self._values.setdefault(name, []).append(values)

    def __bool__(self):
        return bool(self._additive or self._mean_groups or self._values)

    def flush(self, accelerator=None, transforms: dict[str, Callable] | None = None) -> dict[str, float]:
        """Reduce across processes and return the window's metrics; ``transforms[name]`` maps gathered values
        before summarising (e.g. ``exp`` to report ratios from stored log-ratios)."""
        for names, rows in self._mean_groups.items():
            for name, pair in zip(names, rows.unbind(0)):
                self._add("mean", name, pair)
        additive = self._additive
        values = {name: torch.cat(parts) for name, parts in self._values.items()}
        finalizers = dict(self._finalizers)
        self._additive, self._mean_groups, self._values, self._finalizers = {}, {}, {}, {}
        distributed = accelerator is not None and accelerator.num_processes > 1
        signature = sorted((name, kind, tuple(t.shape)) for name, (kind, t) in additive.items())
        value_names = sorted(values)
        if distributed:  # union of names over ranks, so every rank takes part in the same collectives
            from accelerate.utils import gather_object

            signature = sorted(set(sum(gather_object([signature]), [])))
            value_names = sorted(set(sum(gather_object([value_names]), [])))
        device = accelerator.device if accelerator is not None else torch.device("cpu")
        out = {}
        if signature:
            flat = torch.cat(
                [
                    additive[name][1].flatten().to(device)
                    if name in additive
                    else torch.zeros(math.prod(shape), dtype=torch.float64, device=device)
                    for name, _, shape in signature
                ]
            )
            if distributed:
                flat = accelerator.reduce(flat, reduction="sum")
            flat, offset = flat.cpu(), 0
            for name, kind, shape in signature:
                size = math.prod(shape)
                total = flat[offset : offset + size].reshape(shape)
                offset += size
                if kind == "mean":
                    if total[1] > 0:
                        out[name] = (total[0] / total[1]).item()
                elif kind == "sum":
                    out[name] = total[0].item()
                elif name in finalizers:
                    out.update(finalizers[name](total))
        for name in value_names:
            v = values.get(name, torch.empty(0, dtype=torch.float64)).to(device)
            if distributed:
                v = accelerator.gather(accelerator.pad_across_processes(v, dim=0, pad_index=math.nan))
            v = v.cpu()
            v = v[~torch.isnan(v)]
            if transforms and name in transforms:
                v = transforms[name](v)
            out.update(distribution_summary(v, name))
        return out
