"""Stop running the model on padding: trimmed, length-sorted and packed layouts (`PaddingRemoval` mixin).

TRL 1.16 pads the whole rollout batch once (prompts left, completions right, each to the longest in the batch)
and runs every forward at that width: the loss forward, the no-grad pi_old pass and the reference pass. With
long-tailed completion lengths most of those positions are padding. Three exact ways to skip them:

1. **Trim** (`GSPOConfig.trim_padding`, default on): each model call gets only the columns where at least one of
   its rows has a real token; outputs are scattered back to the batch width. Kept tokens keep their absolute
   positions (`position_ids` are passed when leading columns go), so the math is TRL's; only float rounding
   differs (matmul shapes change). The model's own attention runs, with the padding mask.
2. **Sort** (`GSPOConfig.sort_by_length`): rows of each optimizer step are ordered by length before they are
   cut into micro-batches, so each micro-batch trims to its own short width. A row never leaves its optimizer
   step. The no-grad passes sort the whole batch and unsort their outputs.
3. **Pack** (`GSPOConfig.padding_free`, `"auto"` by default): the real tokens of a call's sequences are laid end to
   end in rows (`segment_layout`), each at its padded-batch position, kept apart by the segment attention
   (segment_attention.py), never by transformers' packed-sequence detection. The same layout runs a prompt once
   for several completions (shared_prefix.py).

forward.py plans every forward with these layouts (the cheapest per model call) and makes the model calls.
**`ForwardLayout`** says where each position `[row, col]` of a call's input `[rows, width]` came from:
`layout.source[row, col]` is the flat index `b * S + s` into the `[B, S]` `input_ids` given to
`_get_per_token_logps_and_entropies`, or -1 for filler (the tail of a packed row); `aliases` adds the batch
positions a shared prompt prefix also stands for. `layout.to_model(x, fill)` moves any per-position tensor
`[B, S, ...]` into the call's layout (one gather or a slice); `layouts_to_batch` maps per-call outputs back.
**Sorting permutes every per-row value** of the rollout batch (tensors whose first dimension is the row count, and
lists of that length), whatever its key, like TRL's `shuffle_sequence_dict` / `split_tensor_dict`. A tensor whose
first dimension is not the row count (e.g. concatenated image patches) disables sorting for that rollout, logged
once. `arrange_micro_batches` is that arrangement as a pure function (sorting, whole-group mini-batches).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import fused_head, trl_compat
from .segment_attention import SegmentPlan
from .validation import check_bool, check_choice

logger = logging.getLogger(__name__)

SORT_SETTINGS = ("auto", "always", "never")


# ------------------------------------------------------------------------------------------------ options
@dataclass
class PaddingOptions:
    r"""
    `GSPOConfig` fields of padding removal (this module).

    Parameters:
        trim_padding (`bool`, *optional*, defaults to `True`):
            Run every forward (loss, pi_old pass, reference pass) only on the columns where some row of that call
            has a real token, and pad the outputs back. TRL pads the whole rollout batch to its longest completion;
            trimming changes no token's inputs or positions, only float rounding.
        sort_by_length (`str`, *optional*, defaults to `"auto"`):
            Order the rows of each optimizer step by length (after TRL's shuffle) before they are cut into
            micro-batches, so each micro-batch trims to its own width. A row never moves to another optimizer step.
            `"auto"`: on when the gradient is unchanged (every loss type except `bnpo`, no entropy bonus, no
            top-entropy mask, no MoE aux loss, which are computed per micro-batch); `"always"`: on anyway (opt in);
            `"never"`: TRL's order everywhere. Apart from `"never"`, the no-grad passes also sort the whole batch and
            unsort their outputs (exact in every setting). Metrics averaged per micro-batch (e.g. `clip_ratio/*`)
            can read differently with sorting on, since micro-batches hold other rows.
        padding_free (`str` or `bool`, *optional*, defaults to `"auto"`):
            Pack the real tokens of a forward's sequences end to end, each token at its padded-batch position, kept
            apart by the segment attention (segment_attention.py), so no padding is computed. `"auto"`: per model
            call, where the token counts say it costs less than trimming (e.g. one micro-batch per optimizer step,
            where sorting cannot narrow it), and not in a forward with the MoE load-balancing loss; `True`: every
            call (with an MoE aux loss, the filler at the end of packed rows is counted by the load-balancing loss:
            transformers has no mask for it there); `False`: never.
    """

    trim_padding: bool = field(
        default=True,
        metadata={
            "help": "Skip the all-padding columns of every forward (loss, pi_old, reference) and pad outputs back. "
            "TRL pads the rollout batch to its longest completion, so with long-tailed lengths most positions are "
            "padding; trimming changes only float rounding."
        },
    )
    sort_by_length: str = field(
        default="auto",
        metadata={
            "help": "Order each optimizer step's rows by length before cutting micro-batches, so each trims to its "
            "own width (rows never change optimizer step). 'auto': on where the gradient is unchanged (off for "
            "bnpo, entropy bonus, top-entropy mask, MoE aux loss: per-micro-batch statistics); 'always'; 'never'.",
            "choices": list(SORT_SETTINGS),
        },
    )
    padding_free: str = field(
        default="auto",
        metadata={
            "help": "Pack sequences end to end so no padding is computed (exact: each token keeps its position, "
            "sequences kept apart by the segment attention). 'auto' (where the token counts say it is cheaper than "
            "trimming, e.g. one micro-batch per optimizer step), true, or false."
        },
    )

    def _validate_options(self):
        check_bool("trim_padding", self.trim_padding)
        from .shared_prefix import tristate

        self.padding_free = tristate("padding_free", self.padding_free)
        check_choice("sort_by_length", self.sort_by_length, SORT_SETTINGS)
        if self.padding_free is True and not self.trim_padding:
            raise ValueError(
                "padding_free=True removes all padding, but trim_padding=False asks to keep it; set trim_padding=True "
                "(the default) or padding_free=False."
            )


# ------------------------------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class ForwardLayout:
    """Where each position of one model call's input `[rows, width]` came from.

    `source[row, col]`: flat index `b * S + s` into the original `[B, S]` input (`batch_shape`), -1 for filler.
    `position_ids`: what the model is told (`None`: its default `0..width-1`). A trimmed call carries `rows` and
    `columns = (lead, end)`: its input is `x[rows, lead:end]`, which `to_model` slices instead of gathering.
    `packed`: a segment layout, several sequences per row (segment_attention.py), with `segments` its attention
    plan, `segment_lengths` the lengths of the units and filler runs laid end to end, row by row, and `aliases`
    (`[2, n]`: model flat position, batch flat position) the rows a shared prompt prefix also stands for.
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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.source.shape)

    @property
    def shared_positions(self) -> int:
        """Prompt positions this call did not run again because a sibling's prefix stood for them."""
        return 0 if self.aliases is None else self.aliases.size(1)

    def to(self, device) -> ForwardLayout:
        if self.source.device == torch.device(device):
            return self
        moved = {k: getattr(self, k) for k in ("source", "position_ids", "rows", "aliases")}
        moved = {k: None if v is None else v.to(device) for k, v in moved.items()}
        return ForwardLayout(**moved, batch_shape=self.batch_shape, packed=self.packed,
                             segment_lengths=self.segment_lengths, columns=self.columns,
                             segments=self.segments)  # fmt: skip  (the plan moves when its call is built)

    def to_model(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """`[B, S, ...]` -> `[rows, width, ...]`: the values at the positions this call's input holds, `fill` at
        filler positions."""
        b, s = self.batch_shape
        if tuple(x.shape[:2]) != (b, s):
            raise ValueError(f"to_model expects a [{b}, {s}, ...] tensor, got {tuple(x.shape)}.")
        if self.columns is not None:
            return x.index_select(0, self.rows)[:, self.columns[0] : self.columns[1]]
        out = x.reshape(b * s, *x.shape[2:])[self.source.clamp(min=0)]
        filler = self.source < 0
        if self.packed and bool(filler.any()):
            out = out.masked_fill(filler.view(*filler.shape, *([1] * (x.dim() - 2))), fill)
        return out


def layouts_to_batch(layouts, outputs, fill=0, columns_from: int = 0) -> torch.Tensor:
    """Inverse of `ForwardLayout.to_model` over the model calls of one batch: each `outputs[i]` is
    `[rows_i, width_i, ...]` in `layouts[i]`; returns `[B, S - columns_from, ...]` with `fill` where no call held
    the position. Keeping only columns `>= columns_from` (the completion) scatters less. Differentiable."""
    b, s = layouts[0].batch_shape
    width = s - columns_from
    if all(layout.columns is not None for layout in layouts):
        rows = torch.cat([layout.rows for layout in layouts])
        if rows.numel() == b:  # trimmed calls that cover every row once: pad each back, then undo the row order
            parts = [_pad_columns(y, layout.columns, columns_from, s, fill) for layout, y in zip(layouts, outputs)]
            out = torch.cat(parts)
            return out if len(layouts) == 1 and bool((rows == torch.arange(b, device=rows.device)).all()) else (
                out.index_select(0, torch.argsort(rows))
            )  # fmt: skip
    index, values = [], []
    for layout, y in zip(layouts, outputs):
        col = layout.source % s
        keep = (layout.source >= 0) & (col >= columns_from)
        index.append((layout.source // s * width + col - columns_from)[keep])
        values.append(y[keep])
    values = torch.cat(values)
    out = values.new_full((b * width, *values.shape[1:]), fill)
    return out.index_put((torch.cat(index),), values).view(b, width, *values.shape[1:])


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


def packed_layout(rows: torch.Tensor, spans, batch_shape, one_row: bool, multiple_of=None) -> ForwardLayout:
    """Layout of one call with the real tokens of `rows` laid end to end (`segment_layout` with one sequence per
    unit), each token at its position in the padded batch, sequences kept apart by the segment attention."""
    return segment_layout([[int(r)] for r in rows], spans, batch_shape, None, one_row, pack=True, multiple_of=multiple_of)


def segment_layout(units, spans, batch_shape, prompt_width, one_row: bool, pack: bool = True, multiple_of=None):
    """Layout of one call whose rows hold units laid end to end (segment_attention.py): `units` lists batch rows,
    each unit's rows sharing one prompt. A unit of one row is the row's real tokens, one sequence. A unit of several
    rows (`prompt_width` given) is their common prefix (prompt but its last token, taken from the unit's first row)
    followed by one segment per row (its last prompt token and its completion): the prompt runs once.

    `pack`: units placed first-fit decreasing into rows as long as the longest unit (`one_row`: all in one row, for
    flash-attention varlen); otherwise one unit per row. Filler ends a row (source -1, attends to itself). Each token
    keeps its column in the padded batch as position id, as TRL's padded forward gives it. `aliases` lists, for the
    prefix positions, the other rows' batch positions they stand for (their routes and counts)."""
    b, s = batch_shape
    pieces = []  # per unit: (width, prefix (row, start, length) or None, segments [(row, start, length)])
    for unit in units:
        if len(unit) == 1:
            r = unit[0]
            start, end = int(spans[r, 0]), int(spans[r, 1])
            pieces.append((end - start, None, [(r, start, end - start)]))
            continue
        first = int(spans[unit[0], 0])
        prefix = (unit[0], first, prompt_width - 1 - first)
        segments = [(r, prompt_width - 1, int(spans[r, 1]) - prompt_width + 1) for r in unit]
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
    source = torch.full((len(bins), capacity), -1, dtype=torch.long)
    alias_model, alias_batch, plan_rows, seg_lengths = [], [], [], []
    for j, members in enumerate(bins):
        at, row_units = 0, []
        for i in members:
            width, shared, segments = pieces[i]
            prefix_len = 0
            if shared is not None:
                unit, (r0, start, prefix_len) = shared
                cols = torch.arange(start, start + prefix_len)
                source[j, at : at + prefix_len] = r0 * s + cols
                for r in unit[1:]:
                    alias_model.append(j * capacity + at + torch.arange(prefix_len)), alias_batch.append(r * s + cols)
            pos = at + prefix_len
            for r, start, length in segments:
                source[j, pos : pos + length] = r * s + torch.arange(start, start + length)
                pos += length
            row_units.append((prefix_len, [seg[2] for seg in segments]))
            seg_lengths.append(width)
            at += width
        if at < capacity:
            seg_lengths.append(capacity - at)
        plan_rows.append(row_units)
    position_ids = torch.where(source >= 0, source % s, 0)
    aliases = None
    if alias_model:
        aliases = torch.stack([torch.cat(alias_model), torch.cat(alias_batch)])
    plan = SegmentPlan.from_units(plan_rows, capacity)
    return ForwardLayout(source, batch_shape, position_ids, True, tuple(seg_lengths), segments=plan, aliases=aliases)


def plan_layouts(spans, batch_shape, prompt_width, chunk_rows, *, sort, trim, pack, one_row=False, multiple_of=None):
    """The model calls for one `_get_per_token_logps_and_entropies` call: one layout per chunk of `chunk_rows` rows
    (TRL's chunking, so ZeRO-3 ranks make the same number of calls), rows sorted by length first if `sort`. The
    trainer's forward (forward.py) chooses among layouts by cost; this is the fixed plan of the given settings."""
    b = batch_shape[0]
    order = length_order(spans) if sort else torch.arange(b)
    layouts = []
    for start in range(0, b, chunk_rows):
        rows = order[start : start + chunk_rows]
        if pack and packable(spans, rows):
            layouts.append(packed_layout(rows, spans, batch_shape, one_row, multiple_of))
        else:  # a row with padding inside its span cannot be packed as one sequence: trim instead
            layouts.append(trimmed_layout(rows, spans, batch_shape, prompt_width, trim or pack, multiple_of))
    return layouts


def packable(spans, rows) -> bool:
    """Every row's real tokens are contiguous and it has some (a hole would be attended across when packed)."""
    lengths = (spans[rows, 1] - spans[rows, 0]).clamp(min=0)
    return bool((spans[rows, 2] == lengths).all() and (lengths > 0).all())


# ---------------------------------------------------------------------------------------- sorted micro-batches
def length_keys(batch: dict) -> torch.Tensor:
    """Sort key of each row of a rollout batch: one past its last real completion column, then prompt length."""
    mask = batch["completion_mask"]
    cols = torch.arange(1, mask.size(1) + 1, device=mask.device)
    end = torch.where(mask != 0, cols, 0).amax(1)
    return (end * (batch["prompt_mask"].size(1) + 1) + batch["prompt_mask"].sum(1)).cpu()


def _row_count(batch: dict) -> int:
    return len(batch["completion_mask"])


def _per_row_keys(batch: dict) -> list[str] | None:
    """Keys whose values are per row (first dimension = rows), or None if some tensor is not (then no sorting)."""
    rows, keys = _row_count(batch), []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 or isinstance(value, (list, tuple)):
            if len(value) != rows:
                return None
            keys.append(key)
    return keys


def sort_rows_by_length(micro_batches: list[dict], grouped: bool = False) -> list[dict] | None:
    """Pool the rows of `micro_batches` (one optimizer step's), order them longest first, cut them again into as
    many equal micro-batches. Every per-row value is permuted, whatever its key; the rest is kept as is. None if a
    value is neither per-row nor a scalar (e.g. image patches concatenated over rows). `grouped`: whole prompt
    groups ordered by their longest row, each group's rows kept together (shared_prefix.group_length_keys)."""
    from .shared_prefix import group_length_keys

    keys = _per_row_keys(micro_batches[0])
    if keys is None:
        return None
    pooled = dict(micro_batches[0])
    for key in keys:
        values = [mb[key] for mb in micro_batches]
        pooled[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(map(list, values), [])
    keys_ = length_keys(pooled)
    if grouped:
        keys_ = group_length_keys(pooled, keys_)
    order = torch.sort(keys_, descending=True, stable=True).indices.tolist()
    rows = len(order) // len(micro_batches)
    out = []
    for i in range(len(micro_batches)):
        batch = dict(pooled)
        for key in keys:
            value, take = pooled[key], order[i * rows : (i + 1) * rows]
            batch[key] = value[torch.tensor(take, device=value.device)] if isinstance(value, torch.Tensor) else [
                value[j] for j in take
            ]
        out.append(batch)
    return out


def optimizer_step_groups(first_step: int, steps_per_generation: int, num_iterations: int, accumulation: int):
    """Micro-batch indices of a fresh rollout buffer that always land in the same optimizer steps.

    TRL uses buffer entry `step % steps_per_generation` at micro-step `step`, from `first_step` until the next
    regeneration (every `steps_per_generation * num_iterations` micro-steps); micro-step `step` belongs to optimizer
    step `step // accumulation`. Entries whose optimizer steps agree at every use can exchange rows."""
    generate_every = steps_per_generation * num_iterations
    last = (first_step // generate_every + 1) * generate_every
    uses: dict[int, list[int]] = {k: [] for k in range(steps_per_generation)}
    for step in range(first_step, last):
        uses[step % steps_per_generation].append(step // accumulation)
    groups: dict[tuple, list[int]] = {}
    for k, steps in uses.items():
        groups.setdefault(tuple(steps) if steps else ("unused", k), []).append(k)
    return list(groups.values())


# ------------------------------------------------------------------------------------------------- mixin
class PaddingRemoval:
    """`GSPOTrainer` mixin: length-sorted (and, with `group_minibatches`, whole-group) micro-batches of each fresh
    rollout buffer (`_arrange_micro_batches`, called by rollout.py after TRL's shuffle and split), the settings the
    forward pipeline (forward.py) plans with, and `throughput/*` at each `log`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.args
        # The path calls the model with TRL's fused log-prob head (TRL >= 1.15); older TRL: its own padded loop.
        self._padding_path = fused_head.available()
        if not self._padding_path:
            if config.padding_free is True:
                raise ValueError(
                    f"padding_free=True needs TRL's fused log-prob head (TRL >= 1.15); the installed TRL is "
                    f"{trl_compat.installed_trl_version()}. Upgrade TRL or set padding_free=False."
                )
            if config.trim_padding or config.sort_by_length != "never":
                logger.warning(
                    "TRL %s has no fused log-prob head (TRL >= 1.15): trim_padding and sort_by_length are off, every "
                    "forward runs TRL's own padded loop.", trl_compat.installed_trl_version()
                )
        reasons = sort_changes_statistics(self)
        self._sort_micro_batches = self._padding_path and (
            config.sort_by_length == "always" or (config.sort_by_length == "auto" and not reasons)
        )
        if config.sort_by_length == "auto" and reasons:
            logger.info(
                "sort_by_length='auto': micro-batches keep TRL's order because %s is computed per micro-batch "
                "(sorting would change it); set sort_by_length='always' to sort anyway.", " and ".join(reasons)
            )
        self._sort_no_grad = self._padding_path and config.sort_by_length != "never"
        # real tokens, positions run, positions TRL would run, prompt positions a shared prefix did not run again
        self._throughput = torch.zeros(4, dtype=torch.float64)
        self._throughput_step = 0
        self._warned = set()

    # ------------------------------------------------------------------------------ sorted micro-batches
    def _arrange_micro_batches(self, micro_batches: list[dict], first_step: int) -> list[dict]:
        """A fresh rollout buffer arranged for the forwards (`arrange_micro_batches`; called by rollout.py after TRL's
        shuffle and split; `first_step` is the micro-step that will use entry 0 first)."""
        grouped = self.args.group_minibatches
        if not (self._sort_micro_batches or grouped):
            return micro_batches
        # Sorting may also keep each prompt's rows together inside an optimizer step, so the loss forward shares the
        # prompt: the forward's cost model picks between the two orders (rows still never leave their step).
        sharing = self.args.shared_prefix is not False and not self._segment_support(self.model).problem
        buffer = arrange_micro_batches(
            list(micro_batches), first_step, self.args.steps_per_generation, self.num_iterations,
            self.args.gradient_accumulation_steps, sort=self._sort_micro_batches, group_minibatches=grouped,
            cost=self._loss_forward_cost if sharing else None,
        )  # fmt: skip
        if buffer is None:
            self._warn_once("sort", "Rollout batch holds values that are not per row (e.g. image patches): "
                                    "micro-batches keep TRL's order.")  # fmt: skip
            return micro_batches
        return buffer

    # ------------------------------------------------------------------------------------ throughput/*
    def _count_throughput(self, spans, layouts, batch_shape):
        if not self.model.training:
            return
        processed = sum(layout.source.numel() for layout in layouts)
        saved = sum(layout.shared_positions for layout in layouts)
        self._throughput += torch.tensor([float(spans[:, 2].sum()), processed, batch_shape[0] * batch_shape[1], saved],
                                         dtype=torch.float64)  # fmt: skip

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:  # TRL's own split: training logs are the train-mode ones (every rank calls log)
            self._log_throughput()
        super().log(logs, start_time)

    def _log_throughput(self):
        """Counts of the logging window, summed over processes (one all-reduce per log call), per optimizer step."""
        totals = self._throughput.to(self.accelerator.device)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        real, processed, stock, saved = totals.tolist()
        steps = max(self.state.global_step - self._throughput_step, 1)
        self._throughput.zero_()
        self._throughput_step = self.state.global_step
        if stock == 0:
            return
        metrics = self._metrics["train"]
        metrics["throughput/tokens_per_step"].append(real / steps)
        metrics["throughput/padding_per_step"].append(max(processed + saved - real, 0.0) / steps)
        metrics["throughput/padding_fraction"].append(max(processed + saved - real, 0.0) / max(processed, 1.0))
        metrics["throughput/stock_padding_fraction"].append((stock - real) / stock)
        metrics["throughput/positions_vs_stock"].append(processed / stock)
        metrics["throughput/prompt_tokens_saved_per_step"].append(saved / steps)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def arrange_micro_batches(buffer, first_step, steps_per_generation, num_iterations, accumulation, *, sort,
                          group_minibatches, cost=None):  # fmt: skip
    """A fresh rollout buffer (TRL's shuffled, split micro-batches) arranged for the forwards, a pure function.

    `group_minibatches`: rows laid out again group by group over the whole buffer (shared_prefix.group_rows), so
    whole groups share an optimizer step. `sort`: inside each set of micro-batches that always fall in the same
    optimizer steps (`optimizer_step_groups`), rows ordered longest first, so a row never changes optimizer step
    here; whole prompt groups by their longest row when grouped, or when `cost` (a micro-batch's estimated loss
    forward cost) says keeping each prompt's rows together (so the loss forward shares the prompt) is cheaper than
    pure length order. None if a value is not per row (nothing is arranged)."""
    from . import shared_prefix

    keys = _per_row_keys(buffer[0])
    if keys is None:
        return None
    if group_minibatches:
        buffer = shared_prefix.group_rows(buffer, keys)
    if not sort:
        return buffer
    for group in optimizer_step_groups(first_step, steps_per_generation, num_iterations, accumulation):
        if len(group) < 2:
            continue
        batches = [buffer[k] for k in group]
        sorted_batches = sort_rows_by_length(batches, grouped=group_minibatches)
        if cost is not None and not group_minibatches:
            by_group = sort_rows_by_length(batches, grouped=True)
            if sum(map(cost, by_group)) < sum(map(cost, sorted_batches)):
                sorted_batches = by_group
        for k, batch in zip(group, sorted_batches):
            buffer[k] = batch
    return buffer


# ------------------------------------------------------------------------------------------------ helpers
def sort_changes_statistics(trainer) -> list[str]:
    """What a length-sorted micro-batch would change (each is computed per micro-batch), for `sort_by_length='auto'`."""
    reasons = []
    if trainer.loss_type == "bnpo":
        reasons.append("loss_type='bnpo' (token mean per micro-batch)")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        reasons.append("the entropy bonus")
    if trainer.top_entropy_quantile < 1.0:
        reasons.append("the top-entropy mask (top_entropy_quantile < 1)")
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append("the MoE router aux loss")
    return reasons
