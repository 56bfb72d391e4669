"""The forward path's planner: which layout each model call of a log-prob forward gets, by a token-count cost model.

`plan_forward` cuts a batch into TRL's chunks (the same number of model calls on every ZeRO-3 rank) and gives each
chunk the cheapest exact layout: trimmed (the model's own attention on the columns some row uses), packed (sequences
end to end, segment attention) or shared (each prompt once for the completions of it in the chunk, segment
attention). The cost of a layout is its positions run plus `pair_cost` times the (query, key) pairs its attention
computes, plus `block_cost` per SDPA block of a segment call. On the CPU a segment call lays its units in rows as
long as the longest unit or all in one row (no filler; the SDPA blocks keep each query's keys to its own unit's
reach, so a long row costs its positions, not its square), in SDPA blocks of 64, 128 or 256 query positions
(smaller blocks reach back over fewer keys, larger ones make fewer calls), whichever costs least; a varlen kernel
takes one row. Pure functions of the row spans (layouts.row_spans); pipeline.py runs the plan.

The device and the kernel are arguments (`device`, `kernel`: segment_attention.varlen_kernel's answer), so the CPU
can ask the CUDA question. On the CPU the SDPA blocks serve segment calls and the model above decides. On CUDA the
SDPA blocks lose to stock's one flash call whatever the token counts say (each masked GQA block runs PyTorch's math
backend, about 14 kernels, so a pass is launch-bound): there `"auto"` chooses a packed or shared layout only when a
fused varlen kernel serves it and its cost is below `CUDA_MARGIN` of the trimmed call's; otherwise trimmed, which
runs stock's own attention on fewer columns. Explicit `True` settings are obeyed everywhere.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..common.model_config import text_config
from . import segment_attention, shared_prefix
from .layouts import (
    ForwardLayout,
    length_order,
    packable,
    packed_layout,
    segment_layout,
    trimmed_layout,
)

#: Token-equivalents one SDPA block of a segment call costs beyond its arithmetic (kernel launch, gathers, its mask)
#: where the model config does not say more (`block_cost`), and the extra per-position cost of gathering a packed
#: call's input and scattering its output (a trimmed call slices).
BLOCK_OVERHEAD, GATHER_OVERHEAD = 4.0, 0.02
#: A block's fixed cost is time, not arithmetic, so in token-equivalents it shrinks as a token's matmuls grow: 4
#: token-equivalents at hidden 256 (the tiny models, 0.59M multiply-adds per token and layer), about 0.7 on
#: SmolLM2-135M (3.5M), as measured on the CPU (blocks of 32 against 64 query positions over one row of short units).
#: Narrower models than hidden 256 are not measured: they keep `BLOCK_OVERHEAD`, the most `block_cost` gives.
BLOCK_OVERHEAD_MACS = 4.0 * 589_824
#: On CUDA, a packed or shared layout served by a varlen kernel is chosen under "auto" only when its cost is below this
#: share of the trimmed call's. The token counts leave out what such a call adds on a GPU and a trimmed call does
#: not: gathering each segment's prefix keys and values in every layer, a gather of the input and a scatter of the
#: output per position, the plan's copies, and the kernel's lower occupancy on short sequences. Until the GPU check
#: (`make gpu-quick`, part c) measures them, a saving must clear 20 %; trimmed cannot be slower than stock.
CUDA_MARGIN = 0.8


# ------------------------------------------------------------------------------------------------ cost model
def layer_macs(config) -> tuple[int, int] | None:
    """(multiply-adds of one token through a decoder layer's matmuls, query heads x head size), from the model
    config; None if it lacks the fields."""
    config = text_config(config)
    try:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        experts = getattr(config, "num_experts_per_tok", None)
        inner = (
            (config.moe_intermediate_size * experts)
            if experts and getattr(config, "moe_intermediate_size", None)
            else config.intermediate_size
        )
        macs = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inner
        return (macs, heads * head_dim) if macs > 0 else None
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def pair_cost(config) -> float:
    """Cost of one attention (query, key) pair relative to one token through a decoder layer's matmuls:
    `2 * heads * head_dim / (multiply-adds per token)`. From the model config; 1e-3 if it lacks the fields."""
    macs = layer_macs(config)
    return 1e-3 if macs is None else 2.0 * macs[1] / macs[0]


def block_cost(config) -> float:
    """Fixed cost of one SDPA block in token-equivalents: `BLOCK_OVERHEAD_MACS / (multiply-adds per token)`, from
    the model config, at most `BLOCK_OVERHEAD` (also the answer when the config lacks the fields)."""
    macs = layer_macs(config)
    return BLOCK_OVERHEAD if macs is None else min(BLOCK_OVERHEAD, BLOCK_OVERHEAD_MACS / macs[0])


def span_rows(spans) -> list[list[int]]:
    """The row spans (layouts.row_spans) as Python lists `[first, end, count]`, one host copy: the cost model reads
    them element by element, which costs a tensor op per element on a tensor and a list lookup here."""
    return spans.tolist() if isinstance(spans, torch.Tensor) else spans


def trimmed_cost(spans, rows, prompt_width, alpha) -> float:
    spans, rows = span_rows(spans), rows.tolist() if isinstance(rows, torch.Tensor) else rows
    lead = min(min(spans[r][0] for r in rows), prompt_width - 1)
    end = max(max(spans[r][1] for r in rows), prompt_width + 1)
    width, n = end - lead, len(rows)
    padded = any(spans[r][0] > lead or spans[r][1] < end for r in rows)
    pairs = n * width * width if padded else n * width * (width + 1) / 2  # a mask disables SDPA's causal skip
    return n * width + alpha * pairs


def unit_widths(spans, units, prompt_width) -> list[tuple[int, int, list[int]]]:
    """(width, prefix, segment lengths) of each unit of a segment layout (see layouts.segment_layout)."""
    spans = span_rows(spans)
    out = []
    for unit in units:
        if len(unit) == 1:
            n = spans[unit[0]][1] - spans[unit[0]][0]
            out.append((n, 0, [n]))
        else:
            prefix = prompt_width - 1 - spans[unit[0]][0]
            segments = [spans[r][1] - prompt_width + 1 for r in unit]
            out.append((prefix + sum(segments), prefix, segments))
    return out


def varlen_cost(widths, alpha) -> float:
    """Cost of a segment layout in one row run by a varlen kernel: every unit's positions and the gather, and the
    (query, key) pairs the kernel computes (causal per sequence: a prefix with itself, each segment with the prefix
    and causally with itself); no blocks."""
    positions, pairs = 0, 0.0
    for width, prefix, segments in widths:
        positions += width
        pairs += prefix * (prefix + 1) / 2 + sum(n * prefix + n * (n + 1) / 2 for n in segments)
    return positions * (1 + GATHER_OVERHEAD) + alpha * pairs


def segment_cost(widths, pack, one_row, alpha, block=segment_attention.BLOCK, block_overhead=BLOCK_OVERHEAD) -> float:
    """Cost of a segment layout run by the SDPA blocks: positions run (rows x capacity, from first-fit decreasing as
    `segment_layout` places the units), the (query, key) pairs its blocks of `block` query positions compute
    (`block_pairs`, the rule `SegmentPlan.build_blocks` follows), the blocks' fixed cost (`block_overhead`:
    `block_cost`) and the gather. A varlen kernel's call is priced by `varlen_cost`."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i][0]) if pack else range(len(widths))
    capacity = sum(w for w, _, _ in widths) if one_row else max(w for w, _, _ in widths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        j = next((j for j, r in enumerate(room) if r >= widths[i][0]), None) if pack else None
        if j is None:
            rows.append([]), room.append(capacity)
            j = len(rows) - 1
        rows[j].append(i), room.__setitem__(j, room[j] - widths[i][0])
    layout_rows = [[widths[i][1:] for i in members] for members in rows]
    blocks = len(rows) * math.ceil(capacity / block)
    pairs = block_pairs(layout_rows, capacity, block)
    return len(rows) * capacity * (1 + GATHER_OVERHEAD) + alpha * pairs + block_overhead * blocks


def block_pairs(rows, width, block) -> int:
    """(query, key) pairs the SDPA blocks of a segment layout compute: `rows[r]` lists the units of row `r` as
    `(prefix, [segment lengths])`. Per block of `block` query columns, the keys reach back to the earliest own range
    start of its queries (over all rows), plus the prefixes they see (gathered when far), as `build_blocks` does."""
    intervals = []  # per row: (start, end, own_start, ctx_start, ctx_end), in order
    for units in rows:
        row, at = [], 0
        for prefix, segments in units:
            if prefix:
                row.append((at, at + prefix, at, 0, 0))
            start = at + prefix
            for length in segments:
                row.append((start, start + length, start, at, at + prefix if prefix else 0))
                start += length
            at = start
        intervals.append(row)
    total = 0
    for q0 in range(0, width, block):
        q1 = min(q0 + block, width)
        own_min, c0, c1 = q0, None, None
        for row in intervals:
            for start, end, own, ctx0, ctx1 in row:
                if end <= q0 or start >= q1:
                    continue
                own_min = min(own_min, own)
                if ctx1 > ctx0:
                    c0, c1 = (ctx0, ctx1) if c0 is None else (min(c0, ctx0), max(c1, ctx1))
        if c0 is None:
            keys = q1 - own_min
        elif own_min - c1 > block // 2:
            keys = (c1 - c0) + (q1 - own_min)
        else:
            keys = q1 - min(c0, own_min)
        total += len(rows) * (q1 - q0) * keys
    return total


def plan_forward(
    spans,
    batch_shape,
    prompt_width,
    chunk_rows,
    *,
    groups,
    sort,
    trim,
    pack,
    share,
    alpha,
    multiple_of=None,
    device="cpu",
    kernel=None,
    block_overhead=BLOCK_OVERHEAD,
) -> list[ForwardLayout]:
    """One layout per chunk of `chunk_rows` rows, each the cheapest allowed (see the module docstring).

    `pack` / `share`: "auto" (when cheaper), True (wherever possible), False (never). `groups`: rows that share a
    prompt prefix (shared_prefix.prompt_groups); empty when sharing is off for this forward. Rows are taken in
    length order (`sort`) or TRL's; with groups, also in group order, and the cheaper of the two orders wins.
    `device` ("cpu", "cuda", ...) and `kernel` (the varlen kernel serving segment calls, None: the SDPA blocks)
    decide what "auto" may choose (`choose_layout`). `alpha` and `block_overhead`: a (query, key) pair's and an SDPA
    block's cost in token-equivalents (`pair_cost`, `block_cost`)."""
    if not segments_on_auto(device, kernel):
        pack, share = (p if p is True else False for p in (pack, share))
    b = batch_shape[0]
    orders = [length_order(spans) if sort else torch.arange(b)]
    if share is not False and groups:
        orders.append(shared_prefix.group_order(spans, groups))
    group_of = {r: tuple(rows) for rows in groups for r in rows}
    span_list = span_rows(spans)
    best = None
    for order in orders:
        choices, total, order = [], 0.0, order.tolist()
        for start in range(0, b, chunk_rows):
            rows = order[start : start + chunk_rows]
            choice = choose_layout(
                span_list, rows, prompt_width, group_of, trim, pack, share, alpha, device, kernel, block_overhead
            )
            choices.append((rows, choice))
            total += choice.cost
        if best is None or total < best[0]:
            best = (total, choices)
    layouts = []
    for rows, c in best[1]:
        rows_t = torch.tensor(rows, dtype=torch.long)
        if c.kind == "trimmed":
            layouts.append(trimmed_layout(rows_t, spans, batch_shape, prompt_width, trim, multiple_of))
        elif c.kind == "packed":
            layouts.append(packed_layout(rows_t, spans, batch_shape, c.one_row, multiple_of, c.block))
        else:
            layouts.append(
                segment_layout(
                    c.units, spans, batch_shape, prompt_width, c.one_row, pack is not False, multiple_of, c.block
                )
            )
    return layouts


def segments_on_auto(device, kernel) -> bool:
    """Whether "auto" may choose a packed or shared layout: on the CPU always (by cost), on CUDA only when a fused
    varlen kernel serves segment calls (see the module docstring)."""
    return device != "cuda" or kernel is not None


class Choice(NamedTuple):
    """One chunk's layout as `choose_layout` picks it: `kind` ("trimmed", "packed", "shared"), its `cost`, the
    `units` of a shared layout, whether a segment layout lies in one row, and its SDPA blocks' query positions."""

    kind: str
    cost: float
    units: list
    one_row: bool = False
    block: int = segment_attention.BLOCK


def choose_layout(
    spans,
    rows,
    prompt_width,
    group_of,
    trim,
    pack,
    share,
    alpha,
    device="cpu",
    kernel=None,
    block_overhead=BLOCK_OVERHEAD,
) -> Choice:
    """The cheapest allowed layout for one chunk. A segment layout lies in one row (always with a varlen `kernel`;
    with the SDPA blocks on the CPU where that costs less than rows as long as the longest unit), its SDPA blocks of
    the cheapest of `segment_attention.BLOCKS` query positions on the CPU (elsewhere `BLOCK`). On CUDA a segment
    layout's cost counts `1 / CUDA_MARGIN` of itself against the trimmed call's (only when chosen by cost; see
    `segments_on_auto`)."""
    if not segments_on_auto(device, kernel):
        pack, share = (p if p is True else False for p in (pack, share))
    weight = 1 / CUDA_MARGIN if device == "cuda" else 1.0
    spans = span_rows(spans)
    candidates = []
    segments_ok = packable(spans, rows) and all(spans[r][0] < prompt_width for r in rows)
    units = []  # rows of one group together (in the order of their first row), other rows alone
    if share is not False and segments_ok:
        unit_of: dict = {}
        for r in rows:
            key = group_of.get(r)
            if key is None:
                units.append([r])
            elif key in unit_of:
                unit_of[key].append(r)
            else:
                unit_of[key] = [r]
                units.append(unit_of[key])
    shared_ok = any(len(u) > 1 for u in units)

    # The SDPA blocks' one-row layouts and smaller blocks were measured on the CPU; elsewhere (CUDA without a varlen
    # kernel, where every block is a launch-bound math-backend call) they keep rows and 256-position blocks.
    on_cpu = device == "cpu"

    def segment_candidates(kind, widths, packs):
        if kernel is not None:  # one varlen call in one row, no blocks
            candidates.append(Choice(kind, weight * varlen_cost(widths, alpha), units, True))
            return
        for one_row in (False, True) if packs and on_cpu else (False,):
            for block in segment_attention.BLOCKS if on_cpu else (segment_attention.BLOCK,):
                cost = weight * segment_cost(widths, packs, one_row, alpha, block, block_overhead)
                candidates.append(Choice(kind, cost, units, one_row, block))

    if shared_ok:
        segment_candidates("shared", unit_widths(spans, units, prompt_width), pack is not False)
    if pack is not False and segments_ok and not (share is True and shared_ok):
        segment_candidates("packed", unit_widths(spans, [[r] for r in rows], prompt_width), True)
    if not ((pack is True and segments_ok) or (share is True and shared_ok)):
        cost = trimmed_cost(spans, rows, prompt_width, alpha) if trim else math.inf
        candidates.append(Choice("trimmed", cost, units))
    best = min(candidates, key=lambda c: c.cost)
    return best._replace(cost=0.0) if math.isinf(best.cost) else best
