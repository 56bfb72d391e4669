"""Where each position of a model call comes from: `ForwardLayout` and the plans that build one per call (trimmed,
length-sorted, packed, shared-prefix segments), for the forward pipeline (pipeline.py) and the options of
forward/padding.py and forward/shared_prefix.py.

**`ForwardLayout`** says where each position `[row, col]` of a call's input `[rows, width]` came from:
`layout.source[row, col]` is the flat index `b * S + s` into the `[B, S]` `input_ids` given to
`_get_per_token_logps_and_entropies`, or -1 for filler (the tail of a packed row); `aliases` adds the batch
positions a shared prompt prefix also stands for. `layout.to_model(x, fill)` moves any per-position tensor
`[B, S, ...]` into the call's layout (one gather or a slice); `layouts_to_batch` maps per-call outputs back.

Layouts are planned on the host from the row spans; `ForwardLayout.to` and `scatter_plan` move what the calls need
to the device ahead of them, so the calls and the scatter back make no host sync (no `.any()`, `nonzero`, `.item()`
or boolean indexing on a device tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .segment_attention import BLOCK, SegmentPlan, to_device


# ------------------------------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class ForwardLayout:
    """Where each position of one model call's input `[rows, width]` came from.

    `source[row, col]`: flat index `b * S + s` into the original `[B, S]` input (`batch_shape`), -1 for filler.
    `position_ids`: what the model is told (`None`: its default `0..width-1`). A trimmed call carries `rows` and
    `columns = (lead, end)`: its input is `x[rows, lead:end]`, which `to_model` slices instead of gathering.
    `packed`: a segment layout, several sequences per row (forward/segment_attention.py), with `segments` its attention
    plan, `segment_lengths` the lengths of the units and filler runs laid end to end, row by row, and `aliases`
    (`[2, n]`: model flat position, batch flat position) the rows a shared prompt prefix also stands for. `filler`:
    whether any position is filler (worked out on the host when the layout is made; kept by `to`).
    """

    source: torch.Tensor
    batch_shape: tuple[int, int]
    position_ids: torch.Tensor | None = None
    packed: bool = False
    segment_lengths: tuple[int, ...] | None = None
    rows: torch.Tensor | None = None
    columns: tuple[int, int] | None = None
    segments: SegmentPlan | None = None
    aliases: torch.Tensor | None = None
    filler: bool | None = None

    def __post_init__(self):
        if self.filler is None:  # layouts are made on the host (the planner); `to` passes the answer along
            object.__setattr__(self, "filler", bool((self.source < 0).any()))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.source.shape)

    @property
    def shared_positions(self) -> int:
        """Prompt positions this call did not run again because a sibling's prefix stood for them."""
        return 0 if self.aliases is None else self.aliases.size(1)

    def to(self, device) -> ForwardLayout:
        """This layout's tensors on `device`, copied without a host sync (`to_device`); the plan moves when its call
        is prepared (forward/pipeline.py)."""
        if self.source.device == torch.device(device):
            return self
        moved = {k: getattr(self, k) for k in ("source", "position_ids", "rows", "aliases")}
        moved = {k: None if v is None else to_device(v, device) for k, v in moved.items()}
        return ForwardLayout(
            **moved,
            batch_shape=self.batch_shape,
            packed=self.packed,
            segment_lengths=self.segment_lengths,
            columns=self.columns,
            segments=self.segments,
            filler=self.filler,
        )

    def to_model(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """`[B, S, ...]` -> `[rows, width, ...]`: the values at the positions this call's input holds, `fill` at
        filler positions."""
        b, s = self.batch_shape
        if tuple(x.shape[:2]) != (b, s):
            raise ValueError(f"to_model expects a [{b}, {s}, ...] tensor, got {tuple(x.shape)}.")
        if self.columns is not None:
            return x.index_select(0, self.rows)[:, self.columns[0] : self.columns[1]]
        out = x.reshape(b * s, *x.shape[2:])[self.source.clamp(min=0)]
        if self.packed and self.filler:
            filler = self.source < 0
            out = out.masked_fill(filler.view(*filler.shape, *([1] * (x.dim() - 2))), fill)
        return out


def layouts_to_batch(layouts, outputs, fill=0, columns_from: int = 0) -> torch.Tensor:
    """Inverse of `ForwardLayout.to_model` over the model calls of one batch: each `outputs[i]` is
    `[rows_i, width_i, ...]` in `layouts[i]` (host layouts); returns `[B, S - columns_from, ...]` with `fill` where no
    call held the position. Keeping only columns `>= columns_from` (the completion) scatters less. Differentiable."""
    device = outputs[0].device
    return scatter(scatter_plan(layouts, columns_from, device), outputs, fill)


@dataclass(frozen=True)
class ScatterPlan:
    """How `scatter` puts the outputs of a batch's calls back, worked out on the host by `scatter_plan`: `order`
    (trimmed calls covering every row once: each call's output padded back to the full width, then rows reordered
    by `order`, None if already in order) or `keep` / `index` (per call, the flat output positions kept and where
    they go in the flat `[B * width]` batch), both already on the device."""

    batch_shape: tuple[int, int]
    columns_from: int
    columns: list | None = None
    order: torch.Tensor | None = None
    keep: list | None = None
    index: torch.Tensor | None = None


def scatter_plan(layouts, columns_from: int, device) -> ScatterPlan:
    """The host half of `layouts_to_batch`: `layouts` are the host layouts of the calls."""
    b, s = layouts[0].batch_shape
    width = s - columns_from
    if all(layout.columns is not None for layout in layouts):
        rows = torch.cat([layout.rows for layout in layouts])
        if rows.numel() == b:  # trimmed calls that cover every row once: pad each back, then undo the row order
            in_order = len(layouts) == 1 and bool((rows == torch.arange(b)).all())
            order = None if in_order else to_device(torch.argsort(rows), device)
            return ScatterPlan((b, s), columns_from, [layout.columns for layout in layouts], order=order)
    keep, index = [], []
    for layout in layouts:
        source = layout.source.reshape(-1)
        col = source % s
        kept = ((source >= 0) & (col >= columns_from)).nonzero()[:, 0]
        keep.append(to_device(kept, device))
        index.append((source // s * width + col - columns_from)[kept])
    return ScatterPlan((b, s), columns_from, keep=keep, index=to_device(torch.cat(index), device))


def scatter(plan: ScatterPlan, outputs, fill=0) -> torch.Tensor:
    """The device half of `layouts_to_batch`: no host sync."""
    b, s = plan.batch_shape
    width = s - plan.columns_from
    if plan.columns is not None:
        parts = [_pad_columns(y, cols, plan.columns_from, s, fill) for cols, y in zip(plan.columns, outputs)]
        out = torch.cat(parts)
        return out if plan.order is None else out.index_select(0, plan.order)
    values = torch.cat([y.reshape(-1, *y.shape[2:]).index_select(0, kept) for kept, y in zip(plan.keep, outputs)])
    out = values.new_full((b * width, *values.shape[1:]), fill)
    return out.index_put((plan.index,), values).view(b, width, *values.shape[1:])


def _pad_columns(y, columns, columns_from, s, fill):
    """`y` holds columns `[lead, end)` of its rows; return its columns `[columns_from, s)`, `fill` outside `y`."""
    lead, end = columns
    pieces = [y[:, max(columns_from - lead, 0) :]]
    left, right = max(lead - columns_from, 0), s - end
    if left:
        pieces.insert(0, y.new_full((y.size(0), left, *y.shape[2:]), fill))
    if right:
        pieces.append(y.new_full((y.size(0), right, *y.shape[2:]), fill))
    return torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]


# -------------------------------------------------------------------------------------------------- plans
def row_spans(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, 3]` on the host: first real column, one past the last real column, and the count of real tokens of
    each row (`S, 0, 0` for a row with none). One device-to-host copy."""
    b, s = attention_mask.shape
    cols = torch.arange(s, device=attention_mask.device)
    real = attention_mask != 0
    first = torch.where(real, cols, s).amin(1)
    end = torch.where(real, cols + 1, 0).amax(1)
    return torch.stack([first, end, real.sum(1)], 1).cpu()


def length_order(spans: torch.Tensor) -> torch.Tensor:
    """Row order, longest first: by end of the completion, then by real length. Stable, so ties keep TRL's order.

    A trimmed chunk is as wide as its longest completion plus its longest prompt; the completion lengths are the
    long-tailed part. Longest first: the first chunk allocates the largest buffers, later ones reuse them."""
    first, end = spans[:, 0], spans[:, 1]
    key = end * (int(end.max()) + 1 if len(end) else 1) + (end - first).clamp(min=0)
    return torch.sort(key, descending=True, stable=True).indices


def _round_up_width(lead: int, end: int, s: int, multiple_of: int | None) -> tuple[int, int]:
    """Widen `[lead, end)` to a multiple of `pad_to_multiple_of` (TRL's alignment option), trailing side first."""
    if not multiple_of:
        return lead, end
    width = min(-(-(end - lead) // multiple_of) * multiple_of, s)
    end = min(lead + width, s)
    return end - width, end


def trimmed_layout(rows: torch.Tensor, spans, batch_shape, prompt_width: int, trim: bool, multiple_of=None):
    """Layout of one call over `rows` with the all-padding columns at both ends cut (`trim`) or kept.

    At least one prompt column and one completion column stay, so the fused head's shifted output (`width - 1`
    columns) always covers the kept completion columns, as in TRL's own call."""
    b, s = batch_shape
    lead, end = 0, s
    if trim:
        lead = min(int(spans[rows, 0].min()), prompt_width - 1)
        end = max(int(spans[rows, 1].max()), prompt_width + 1)
        lead, end = _round_up_width(lead, end, s, multiple_of)
    cols = torch.arange(lead, end)
    source = rows[:, None] * s + cols[None, :]
    position_ids = cols[None, :].expand(len(rows), -1) if lead > 0 else None  # absolute positions, as in TRL
    return ForwardLayout(source, batch_shape, position_ids, rows=rows, columns=(lead, end))


def packed_layout(
    rows: torch.Tensor, spans, batch_shape, one_row: bool, multiple_of=None, block=BLOCK
) -> ForwardLayout:
    """Layout of one call with the real tokens of `rows` laid end to end (`segment_layout` with one sequence per
    unit), each token at its position in the padded batch, sequences kept apart by the segment attention."""
    return segment_layout(
        [[int(r)] for r in rows], spans, batch_shape, None, one_row, pack=True, multiple_of=multiple_of, block=block
    )


def segment_layout(
    units, spans, batch_shape, prompt_width, one_row: bool, pack: bool = True, multiple_of=None, block=BLOCK
):
    """Layout of one call whose rows hold units laid end to end (forward/segment_attention.py): `units` lists batch rows,
    each unit's rows sharing one prompt. A unit of one row is the row's real tokens, one sequence. A unit of several
    rows (`prompt_width` given) is their common prefix (prompt but its last token, taken from the unit's first row)
    followed by one segment per row (its last prompt token and its completion): the prompt runs once.

    `pack`: units placed first-fit decreasing into rows as long as the longest unit (`one_row`: all in one row, for a
    varlen kernel or where the planner finds it cheaper); otherwise one unit per row. Filler ends a row (source -1,
    attends to itself). Each token keeps its column in the padded batch as position id, as TRL's padded forward gives
    it. `aliases` lists, for the prefix positions, the other rows' batch positions they stand for (their routes and
    counts). `block`: query positions per SDPA block of the call's plan (the planner's choice)."""
    b, s = batch_shape
    spans = spans.tolist() if isinstance(spans, torch.Tensor) else spans  # read element by element below
    pieces = []  # per unit: (width, prefix (row, start, length) or None, segments [(row, start, length)])
    for unit in units:
        if len(unit) == 1:
            r = unit[0]
            start, end = spans[r][0], spans[r][1]
            pieces.append((end - start, None, [(r, start, end - start)]))
            continue
        first = spans[unit[0]][0]
        prefix = (unit[0], first, prompt_width - 1 - first)
        segments = [(r, prompt_width - 1, spans[r][1] - prompt_width + 1) for r in unit]
        pieces.append((prefix[2] + sum(seg[2] for seg in segments), (unit, prefix), segments))
    widths = [p[0] for p in pieces]
    capacity = (sum(widths) if one_row else max(widths)) if pack else max(widths)
    capacity = max(_round_up_width(0, capacity, 1 << 62, multiple_of)[1], 1)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(pieces)), key=lambda i: -widths[i]) if pack else range(len(pieces)):
        j = next((j for j, r in enumerate(room) if r >= widths[i]), None) if pack else None
        if j is None:
            bins.append([]), room.append(capacity)
            j = len(bins) - 1
        bins[j].append(i), room.__setitem__(j, room[j] - widths[i])
    # Built as Python lists and made tensors once: a slice assignment per unit costs more than the whole list.
    source_rows, alias_model, alias_batch, plan_rows, seg_lengths = [], [], [], [], []
    aliased = False
    for j, members in enumerate(bins):
        at, row_units, row = 0, [], []
        for i in members:
            width, shared, segments = pieces[i]
            prefix_len = 0
            if shared is not None:
                unit, (r0, start, prefix_len) = shared
                row += range(r0 * s + start, r0 * s + start + prefix_len)
                for r in unit[1:]:
                    aliased = True
                    alias_model += range(j * capacity + at, j * capacity + at + prefix_len)
                    alias_batch += range(r * s + start, r * s + start + prefix_len)
            for r, start, length in segments:
                row += range(r * s + start, r * s + start + length)
            row_units.append((prefix_len, [seg[2] for seg in segments]))
            seg_lengths.append(width)
            at += width
        if at < capacity:
            seg_lengths.append(capacity - at)
        source_rows.append(row + [-1] * (capacity - len(row)))
        plan_rows.append(row_units)
    source = torch.tensor(source_rows, dtype=torch.long)
    position_ids = torch.where(source >= 0, source % s, 0)
    aliases = torch.tensor([alias_model, alias_batch], dtype=torch.long) if aliased else None
    plan = SegmentPlan.from_units(plan_rows, capacity, block)
    return ForwardLayout(source, batch_shape, position_ids, True, tuple(seg_lengths), segments=plan, aliases=aliases)


def packable(spans, rows) -> bool:
    """Every row's real tokens are contiguous and it has some (a hole would be attended across when packed).
    `spans`: row_spans' tensor or its rows as lists (the planner's)."""
    spans = spans.tolist() if isinstance(spans, torch.Tensor) else spans
    return all(spans[r][1] > spans[r][0] and spans[r][2] == spans[r][1] - spans[r][0] for r in rows)
