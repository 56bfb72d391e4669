"""Compute each group's prompt once: prompt groups, shared-prefix options, and whole-group micro-batches.

GSPO samples G completions per prompt; TRL lays each out as its own row `[prompt | completion]`, so every forward
runs the prompt G times. A shared-prefix call runs it once: the prompt (but its last token) followed by one segment
per completion, each segment attending to the prompt and causally to itself, never to a sibling, every token at the
position TRL's padded forward gives it (forward/padding.py `segment_layout`, attention in forward/segment_attention.py). Log-probs,
entropies and gradients are the unshared forward's up to float rounding.

Where it applies: the no-grad passes (pi_old, reference) see the whole rollout batch, so they share every group.
The loss forward shares what its micro-batch holds; TRL shuffles rows before cutting micro-batches, so siblings
rarely meet there unless `group_minibatches=True` keeps each group in one optimizer step (and its rows in the same
micro-batches), as verl's mini-batches do. forward/pipeline.py decides per model call, from token counts, whether sharing
(and packing) costs less than the trimmed padded call (`shared_prefix="auto"`).

This module holds the pure parts: `SharedPrefixOptions` (the `GSPOConfig` fields), `prompt_groups` (rows with the
same prompt), `group_order` (rows of a batch with each group's rows together), and `group_rows` (the rollout buffer
re-cut so whole groups stay in one optimizer step, for `group_minibatches`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.validation import check_bool

TRISTATE = ("auto", True, False)


def tristate(name: str, value):
    """`"auto"`, True or False; the strings "true"/"false" (any case, as a command line gives them) too."""
    if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
        value = {"true": True, "false": False, "auto": "auto"}[value.lower()]
    if value not in TRISTATE or (value != "auto" and not isinstance(value, bool)):
        raise ValueError(f"{name}={value!r} is not supported; allowed: 'auto', True, False.")
    return value


@dataclass
class SharedPrefixOptions:
    r"""
    `GSPOConfig` fields of shared-prefix forwards (this module).

    Parameters:
        shared_prefix (`str` or `bool`, *optional*, defaults to `"auto"`):
            Run a prompt once for all of its completions that are in the same model call: the completions follow
            the prompt in one row, each attending to the prompt and causally to itself (never to a sibling), at the
            positions TRL's padded forward uses. Exact up to float rounding. `"auto"`: per model call, where the
            token counts say it costs less than the trimmed padded call (long prompts; the no-grad passes see the
            whole rollout batch); `True`: wherever a call holds two rows of one prompt; `False`: never. Not used in
            a forward that computes the MoE load-balancing loss (sharing would count prompt tokens once).
        group_minibatches (`bool`, *optional*, defaults to `False`):
            Keep each prompt's completions in the same optimizer step and micro-batches (verl's mini-batches), so
            the loss forward can share the prompt too. Off by default: TRL shuffles rows across mini-batches, and
            this changes which rows share an optimizer step (whole groups move together; the group order is still
            random). Without it rows never move across optimizer steps.
    """

    shared_prefix: str = field(
        default="auto",
        metadata={
            "help": "Run each prompt once for its completions in the same forward (exact). 'auto' (where the token "
            "counts say it pays: long prompts), true, or false."
        },
    )
    group_minibatches: bool = field(
        default=False,
        metadata={
            "help": "Keep each prompt's completions in one optimizer step and micro-batch so the loss forward shares "
            "the prompt too. Changes which rows share a mini-batch (TRL shuffles rows), so off by default."
        },
    )

    def _validate_options(self):
        self.shared_prefix = tristate("shared_prefix", self.shared_prefix)
        check_bool("group_minibatches", self.group_minibatches)


# ---------------------------------------------------------------------------------------------- prompt groups
def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Rows whose prompts (left-padded `[B, P]`) are identical but for the last token, i.e. that can share the
    prefix, as lists of row indices in increasing order; groups of one row are left out. One device-to-host copy."""
    if prompt_ids.size(1) < 2:
        return []
    key = torch.where(prompt_mask[:, :-1].bool(), prompt_ids[:, :-1], -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.cpu().tolist()):
        groups.setdefault(g, []).append(row)
    return [rows for rows in groups.values() if len(rows) > 1]


def split_by_routes(groups: list[list[int]], route_ids: torch.Tensor, route_valid: torch.Tensor, prompt_width: int):
    """Keep in a group only the rows whose replayed prompt routes (ids and validity, `[B, S, ...]`) equal its first
    row's: a shared prefix runs once, on the first row's routes, so any row that would route its prompt differently
    runs alone (R3 sampler routes can differ between siblings, e.g. vLLM prefix-cache hits)."""
    out = []
    for rows in groups:
        ids, valid = route_ids[rows, : prompt_width - 1], route_valid[rows, : prompt_width - 1]
        same = [(ids[i] == ids[0]).all() and (valid[i] == valid[0]).all() for i in range(len(rows))]
        kept = [r for r, ok in zip(rows, same) if bool(ok)]
        if len(kept) > 1:
            out.append(kept)
    return out


def group_order(spans: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """Row order with each group's rows together: units (groups, and rows in none) longest first by the end of
    their longest row, rows inside a group longest first. Stable."""
    b = spans.size(0)
    in_group = [False] * b
    for rows in groups:
        for r in rows:
            in_group[r] = True
    end = spans[:, 1].tolist()
    units = [(max(end[r] for r in rows), rows) for rows in groups]
    units += [(end[r], [r]) for r in range(b) if not in_group[r]]
    units.sort(key=lambda u: -u[0])  # stable: ties keep the group order
    order = []
    for _, rows in units:
        order += sorted(rows, key=lambda r: -end[r])
    return torch.tensor(order, dtype=torch.long)


# ------------------------------------------------------------------------------------ whole-group mini-batches
def group_rows(micro_batches: list[dict], per_row_keys: list[str]) -> list[dict]:
    """`group_minibatches`: the rows of a rollout buffer (TRL's shuffled, split micro-batches) laid out again so that
    each prompt's rows are consecutive, groups in the order TRL's shuffle first placed them, then cut into as many
    equal micro-batches. Consecutive micro-batches form an optimizer step, so a step holds whole groups whenever its
    row count is a multiple of the group size. Every per-row value moves with its row."""
    pooled = dict(micro_batches[0])
    for key in per_row_keys:
        values = [mb[key] for mb in micro_batches]
        pooled[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(map(list, values), [])
    mask = pooled["prompt_mask"]
    key = torch.where(mask.bool(), pooled["prompt_ids"], -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first_seen: dict[int, int] = {}
    for row, g in enumerate(inverse.cpu().tolist()):
        first_seen.setdefault(g, row)
    rank = torch.tensor([first_seen[g] for g in inverse.cpu().tolist()])
    order = torch.sort(rank, stable=True).indices.tolist()
    return cut(pooled, per_row_keys, order, len(micro_batches))


def cut(pooled: dict, per_row_keys: list[str], order: list[int], pieces: int) -> list[dict]:
    """`pooled`'s rows in `order`, cut into `pieces` equal micro-batches (non-row values copied as they are)."""
    rows = len(order) // pieces
    out = []
    for i in range(pieces):
        batch = dict(pooled)
        take = order[i * rows : (i + 1) * rows]
        for key in per_row_keys:
            value = pooled[key]
            batch[key] = (
                value[torch.tensor(take, device=value.device)]
                if isinstance(value, torch.Tensor)
                else [value[j] for j in take]
            )
        out.append(batch)
    return out


def group_length_keys(batch: dict, length_keys: torch.Tensor) -> torch.Tensor:
    """Sort keys that order whole groups by their longest row (then rows by length inside a group), so sorting an
    optimizer step by length keeps each group's rows together."""
    mask = batch["prompt_mask"]
    key = torch.where(mask.bool(), batch["prompt_ids"], -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    inverse = inverse.cpu()
    group_max = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=length_keys.dtype)
    group_max = group_max.scatter_reduce(0, inverse, length_keys, reduce="amax", include_self=False)
    scale = int(length_keys.max()) + 1 if len(length_keys) else 1
    # group's longest row, then the group itself (ties between groups), then the row's own length
    return (group_max[inverse] * (len(group_max) + 1) + inverse) * scale + length_keys
