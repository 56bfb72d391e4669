"""Prefill each distinct prompt once when transformers generates (`GSPOConfig.shared_prefill`).

TRL samples `num_generations` completions of a prompt by repeating the prompt that many times in the batch it hands
`model.generate`, so generation's first forward (the prefill, which runs every prompt token to fill the KV cache)
runs each prompt G times. On a CPU, where a forward costs its token count, that prefill is most of a short answer's
generation. With `shared_prefill`, the prefill runs on the distinct rows only; their KV cache and last-position
logits are then copied to every row that repeats them (transformers' `Cache.batch_select_indices`), and decoding goes
on for every row as before.

Exact up to float rounding: each distinct row's prefill is the computation it was (the same tokens, attention mask
and positions), only in a smaller batch, whose matmuls may round differently in the last bit; a row that repeats
another gets that row's cache and logits, which its own prefill would have computed. The sampler draws the same
random numbers in the same order, so with greedy decoding, or sampling from the same seed, the completions are the
ones the full prefill gives (up to a tie that a rounding difference breaks), and their log-probs agree to fp32
rounding (tests/test_shared_prefill.py).

How it reaches the model: a forward pre-hook and a forward hook (PyTorch's public hooks; nothing of transformers is
patched) on the module `generate` runs, for the duration of TRL's generation call (rollout/pipeline.py). The pre-hook
recognises the prefill (an empty `DynamicCache`, more than one position) of a batch whose rows repeat and hands the
model its distinct rows; the hook copies the cache rows and the logits back to the whole batch before `generate`
sees them (and before the sampler's log-prob recorder, registered after it). A call it cannot share is left as it is:
another cache class, model inputs other than ids, mask, positions or embeddings, no repeated row.

Where it applies: TRL's transformers `generate` path (not vLLM, continuous batching or a `rollout_func`), and not
under R3 routing replay, whose router log of the prefill must hold every row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..common.validation import check_bool

#: Per-row inputs of a prefill call that are shared: rows are the same prompt when all of these are equal.
ROW_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
#: Tensor inputs that are not per row (the same for every row); any other tensor input leaves the call unshared.
SHARED_INPUTS = ("cache_position",)


@dataclass
class SharedPrefillOptions:
    r"""
    `GSPOConfig` field of shared prefill in generation (rollout/shared_prefill.py).

    Parameters:
        shared_prefill (`bool`, *optional*, defaults to `False`):
            When transformers generates (TRL's default path, not vLLM), run each distinct prompt's prefill once and
            copy its KV cache to the prompt's `num_generations` rows, instead of running the prompt once per
            completion. It saves `(G - 1) / G` of the prefill. Exact up to float rounding: the smaller prefill batch
            may round differently in the last bit, which can break a near-tie between two tokens, so the rollouts
            are no longer stock TRL's token for token; off by default so that a run matches stock TRL's rollouts.
    """

    shared_prefill: bool = field(
        default=False,
        metadata={
            "help": "With transformers generation, prefill each distinct prompt once and copy its KV cache to its "
            "num_generations rows (exact up to float rounding, so rollouts may differ from stock TRL's by a broken "
            "near-tie). False (default): TRL's generation unchanged."
        },
    )

    def _validate_options(self):
        check_bool("shared_prefill", self.shared_prefill)


def distinct_rows(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(keep, expand)` for the per-row `inputs` (each `[B, ...]`): the rows to run (one per distinct row) and, for
    every row, which of those holds it (`[B]`, into `keep`); None when no row repeats another."""
    rows = next(iter(inputs.values())).size(0)
    key = torch.cat([inputs[name].reshape(rows, -1).to(torch.float64) for name in sorted(inputs)], dim=1)
    _, expand = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(expand.max()) + 1
    if distinct == rows:
        return None
    order = torch.arange(rows, device=expand.device)
    keep = torch.full((distinct,), rows, dtype=torch.long, device=expand.device).scatter_reduce(
        0, expand, order, reduce="amin"
    )  # each distinct row's first occurrence
    return keep, expand


def _fresh_dynamic_cache(cache) -> bool:
    """A `DynamicCache` holding nothing yet, whose layers copy rows with `batch_select_indices` (full attention or a
    sliding window; a linear-attention state is left alone)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or cache.get_seq_length() != 0:
        return False
    return all(isinstance(layer, DynamicLayer) for layer in cache.layers)


class PrefillSharing:
    """The two hooks of one generation call (module docstring); `positions_saved` counts prompt positions not run."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.handles = module, []
        self.pending: torch.Tensor | None = None  # the `expand` index of the prefill being run, between the hooks
        self.positions_saved = 0

    def __enter__(self):
        self.handles = [
            self.module.register_forward_pre_hook(self._before, with_kwargs=True),
            self.module.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.pending = None
        return False

    def _before(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if args or ids is None or ids.size(1) < 2 or not _fresh_dynamic_cache(cache):
            return None  # not a prefill this can share
        tensors = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if tensors - set(ROW_INPUTS) - set(SHARED_INPUTS):
            return None  # a per-row input it does not know how to share (pixel values, token types, ...)
        rows = {k: kwargs[k] for k in ROW_INPUTS if kwargs.get(k) is not None}
        found = distinct_rows(rows)
        if found is None:
            return None
        keep, self.pending = found
        self.positions_saved += (ids.size(0) - keep.numel()) * ids.size(1)
        return args, {**kwargs, **{k: v.index_select(0, keep) for k, v in rows.items()}}

    def _after(self, module, args, kwargs, output):
        if self.pending is None:
            return None
        expand, self.pending = self.pending, None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache.batch_select_indices(expand)  # in place: the cache generate goes on with
        distinct = int(expand.max()) + 1

        def per_row(x):
            return isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == distinct

        for name, value in list(output.items()):  # logits, and hidden states or attentions if asked for
            if per_row(value):
                output[name] = value.index_select(0, expand)
            elif isinstance(value, tuple) and value and all(per_row(v) for v in value):
                output[name] = tuple(v.index_select(0, expand) for v in value)
        return output


class SharedPrefill:
    """Shared prefill for TRL's `generate` path (module docstring). The rollout pipeline wraps each generation call in
    `sharing(model)`.

    Collaborators: `run` (trainer.RunView: what generates), `accelerator` (to find the module `generate` runs) and
    `routes` (moe/routing_replay.py: whether R3 records the sampler's routes, which needs every row's prefill)."""

    def __init__(self, run, accelerator, routes, enabled: bool = False):
        self.run, self.accelerator, self.routes, self.enabled = run, accelerator, routes, enabled

    @contextlib.contextmanager
    def sharing(self, model):
        """Context for one generation call: the hooks on the module `generate` runs, when shared prefill applies;
        logs the prompt positions the prefill did not run (`throughput/prefill_tokens_saved`, per call)."""
        if not (self.enabled and self.run.sampling_path == "generate") or self.routes.records_sampler_routes:
            yield None
            return
        module = self.accelerator.unwrap_model(model)  # the module generate() calls
        module = module.get_base_model() if hasattr(module, "get_base_model") else module  # PEFT: the HF model
        with PrefillSharing(module) as hooks:
            yield hooks
        self.run.log_metric("throughput/prefill_tokens_saved", hooks.positions_saved)
