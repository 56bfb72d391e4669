"""Stop running the model on padding: trimmed, length-sorted and packed forwards (`PaddingRemoval` mixin).

TRL 1.16 pads the whole rollout batch once (prompts left, completions right, each to the longest in the batch)
and runs every forward at that width: the loss forward, the no-grad pi_old pass and the reference pass. With
long-tailed completion lengths most of those positions are padding. Three exact ways to skip them, cheapest first:

1. **Trim** (`GSPOConfig.trim_padding`, default on): each model call gets only the columns where at least one of
   its rows has a real token; outputs are scattered back to the batch width. Kept tokens keep their absolute
   positions (`position_ids` are passed when leading columns go), so the math is TRL's; only float rounding
   differs (matmul shapes change).
2. **Sort** (`GSPOConfig.sort_by_length`): rows of each optimizer step are ordered by length before they are
   cut into micro-batches, so each micro-batch trims to its own short width. A row never leaves its optimizer
   step. The no-grad passes sort the whole batch and unsort their outputs.
3. **Pack** (`GSPOConfig.padding_free`, opt-in): the real tokens of a call's sequences are laid end to end in rows,
   `position_ids` restarting at 0 at each sequence and no `attention_mask`, which is what makes transformers keep
   sequences apart (packed-sequence detection for sdpa/eager/flex: block-diagonal mask; flash-attention: varlen
   kernels on one row). Any `attention_mask` or cache turns that detection off *silently*; `_call_model` refuses
   an `attention_mask` on a packed call, and `tests/test_padding.py` checks that no sequence can see another.

Integration points (for mixins that must see every model call, e.g. MoE routing replay):

- **`PaddingRemoval._call_model(model, layout, **model_inputs)`** is the one place where this path calls the
  model: it returns `model(**model_inputs)`. Every forward of `_get_per_token_logps_and_entropies` for text
  inputs (loss, pi_old, reference; trimmed, sorted, packed or none of these) goes through it, once per chunk,
  inside `accelerator.autocast()`. Override it (calling `super()`) to arm hooks for exactly that call.
  Multimodal inputs (any image/video field set) are left to TRL's own loop, which does not call it.
- **`ForwardLayout`** (the `layout` argument) says where each position `[row, col]` of the model input
  `[rows, width]` came from: `layout.source[row, col]` is the flat index `b * S + s` into the `[B, S]` `input_ids`
  given to `_get_per_token_logps_and_entropies`, or -1 for a filler position that exists in no original row (the
  tail of a packed row). `layout.to_model(x, fill)` moves any per-position tensor `[B, S, ...]` into the model
  input's layout `[rows, width, ...]` (one gather); `layouts_to_batch` maps per-call outputs back.
- **Sorting permutes every per-row value** of the rollout batch (tensors whose first dimension is the row count,
  and lists of that length), whatever its key, like TRL's `shuffle_sequence_dict` / `split_tensor_dict`. A
  tensor whose first dimension is not the row count (e.g. concatenated image patches) disables sorting for that
  rollout, logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from trl.extras.profiling import profiling_decorator

from . import fused_head, trl_compat
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
        padding_free (`bool`, *optional*, defaults to `False`):
            Pack the real tokens of each forward's sequences end to end (`position_ids` restarting at 0, no
            attention mask), so no padding is computed at all. flash-attention: one row per call, varlen kernels;
            sdpa/eager/flex: rows no longer than the longest sequence, separated by transformers' packed-sequence
            mask. With an MoE aux loss, the filler at the end of packed rows is counted by the load-balancing
            loss (transformers has no mask for it there).
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
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack sequences end to end with position_ids restarting at 0 and no attention_mask, so no "
            "padding is computed (flash-attention varlen on one row; sdpa/eager: rows no longer than the longest "
            "sequence). Opt-in: on CPU trimming + sorting already removes most padding."
        },
    )

    def _validate_options(self):
        check_bool("trim_padding", self.trim_padding)
        check_bool("padding_free", self.padding_free)
        check_choice("sort_by_length", self.sort_by_length, SORT_SETTINGS)
        if self.padding_free and not self.trim_padding:
            raise ValueError(
                "padding_free=True removes all padding, but trim_padding=False asks to keep it; set trim_padding=True "
                "(the default) or padding_free=False."
            )
#: Attention implementations that keep packed sequences apart through transformers' packed-sequence detection
#: (position_ids restarting at 0, no attention_mask): a block-diagonal mask over rows of several sequences.
MASKED_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


# ------------------------------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class ForwardLayout:
    """Where each position of one model call's input `[rows, width]` came from.

    `source[row, col]`: flat index `b * S + s` into the original `[B, S]` input (`batch_shape`), -1 for filler.
    `position_ids`: what the model is told (`None`: its default `0..width-1`). `packed`: several sequences share a
    row (no attention_mask); `segment_lengths` then lists, row by row, the lengths of the segments (sequences and
    filler runs) laid end to end, as flash-attention's `cu_seq_lens` wants them. A trimmed (unpacked) call also
    carries `rows` and `columns = (lead, end)`: its input is `x[rows, lead:end]`, which `to_model` then slices
    directly instead of gathering.
    """

    source: torch.Tensor
    batch_shape: tuple[int, int]
    position_ids: torch.Tensor | None = None
    packed: bool = False
    segment_lengths: tuple[int, ...] | None = None
    rows: torch.Tensor | None = None
    columns: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.source.shape)

    def to(self, device) -> ForwardLayout:
        if self.source.device == torch.device(device):
            return self
        moved = {k: getattr(self, k) for k in ("source", "position_ids", "rows")}
        moved = {k: None if v is None else v.to(device) for k, v in moved.items()}
        return ForwardLayout(**moved, batch_shape=self.batch_shape, packed=self.packed,
                             segment_lengths=self.segment_lengths, columns=self.columns)  # fmt: skip

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
    """Layout of one call with the real tokens of `rows` laid end to end, each sequence restarting at position 0.

    `one_row`: everything in one row (flash-attention varlen). Otherwise rows no longer than the longest sequence
    (first-fit decreasing), so the block-diagonal mask of sdpa/eager costs no more than the padded batch did.
    Filler at the end of a row is its own segment (positions 0.., source -1): causal attention keeps it from
    reaching any sequence, and its labels are ignored."""
    b, s = batch_shape
    starts, lengths = spans[rows, 0].clamp(max=s), (spans[rows, 1] - spans[rows, 0]).clamp(min=0)
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    capacity = int(lengths.sum()) if one_row else int(lengths.max())
    capacity = max(_round_up_width(0, capacity, 1 << 62, multiple_of)[1], 1)
    bins: list[list[int]] = []  # per packed row: indices into `rows`, in placement order
    room: list[int] = []
    for i in order:  # first-fit decreasing: a loop over sequences, never over tokens
        n = int(lengths[i])
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([]), room.append(capacity)
            j = len(bins) - 1
        bins[j].append(i), room.__setitem__(j, room[j] - n)
    # Segments in placement order: (row in the packed input, source start or -1 for filler, length)
    seg_row, seg_src, seg_len = [], [], []
    for j, members in enumerate(bins):
        for i in members:
            if int(lengths[i]) > 0:
                seg_row.append(j), seg_src.append(int(rows[i]) * s + int(starts[i])), seg_len.append(int(lengths[i]))
        if room[j] > 0:
            seg_row.append(j), seg_src.append(-1), seg_len.append(room[j])
    seg_len_t = torch.tensor(seg_len, dtype=torch.long)
    within = torch.arange(int(seg_len_t.sum())) - torch.repeat_interleave(seg_len_t.cumsum(0) - seg_len_t, seg_len_t)
    seg_src_t = torch.repeat_interleave(torch.tensor(seg_src, dtype=torch.long), seg_len_t)
    source = torch.where(seg_src_t >= 0, seg_src_t + within, -1).view(len(bins), capacity)
    return ForwardLayout(source, batch_shape, within.view(len(bins), capacity), True, tuple(seg_len))


def plan_layouts(spans, batch_shape, prompt_width, chunk_rows, *, sort, trim, pack, one_row=False, multiple_of=None):
    """The model calls for one `_get_per_token_logps_and_entropies` call: one layout per chunk of `chunk_rows` rows
    (TRL's chunking, so ZeRO-3 ranks make the same number of calls), rows sorted by length first if `sort`."""
    b = batch_shape[0]
    order = length_order(spans) if sort else torch.arange(b)
    layouts = []
    for start in range(0, b, chunk_rows):
        rows = order[start : start + chunk_rows]
        holes = bool((spans[rows, 2] != (spans[rows, 1] - spans[rows, 0]).clamp(min=0)).any())
        if pack and not holes:
            layouts.append(packed_layout(rows, spans, batch_shape, one_row, multiple_of))
        else:  # a row with padding inside its span cannot be packed as one sequence: trim instead
            layouts.append(trimmed_layout(rows, spans, batch_shape, prompt_width, trim or pack, multiple_of))
    return layouts


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


def sort_rows_by_length(micro_batches: list[dict]) -> list[dict] | None:
    """Pool the rows of `micro_batches` (one optimizer step's), order them longest first, cut them again into as
    many equal micro-batches. Every per-row value is permuted, whatever its key; the rest is kept as is. None if a
    value is neither per-row nor a scalar (e.g. image patches concatenated over rows)."""
    keys = _per_row_keys(micro_batches[0])
    if keys is None:
        return None
    pooled = dict(micro_batches[0])
    for key in keys:
        values = [mb[key] for mb in micro_batches]
        pooled[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(map(list, values), [])
    order = torch.sort(length_keys(pooled), descending=True, stable=True).indices.tolist()
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
    """`GSPOTrainer` mixin: trimmed / sorted / packed forwards and length-sorted micro-batches (module docstring).

    Overrides TRL's `_get_per_token_logps_and_entropies` (text inputs; multimodal ones go to TRL's loop), sorts the
    micro-batches of each fresh rollout buffer (`_arrange_micro_batches`, called by rollout.py after TRL's shuffle and
    split), and logs `throughput/*` at each `log`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.args
        # The path calls the model with TRL's fused log-prob head (TRL >= 1.15); older TRL: its own padded loop.
        self._padding_path = fused_head.available()
        if not self._padding_path:
            if config.padding_free:
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
        if config.padding_free:
            check_packing_supported(self.model)
        self._throughput = torch.zeros(3, dtype=torch.float64)  # real tokens, positions run, positions TRL would run
        self._throughput_step = 0
        self._warned = set()

    # ------------------------------------------------------------------------------------ the model call
    def _call_model(self, model, layout: ForwardLayout, **model_inputs):
        """The one model call of this path (see the module docstring): override it to arm hooks for that call."""
        if layout.packed and model_inputs.get("attention_mask") is not None:
            raise RuntimeError(
                "A packed forward got an attention_mask: transformers then stops separating the packed sequences "
                "and each one silently attends to the ones before it in its row. Do not add an attention_mask to "
                "packed calls."
            )
        return model(**model_inputs)

    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        b, s = input_ids.shape
        prompt_width = s - logits_to_keep
        unsupported = any(v is not None for v in multimodal.values()) or logits_to_keep < 1 or prompt_width < 1
        if not self._padding_path or unsupported:  # TRL < 1.15 was logged at construction
            if self._padding_path:
                self._warn_once("fallback", "Multimodal inputs (or no prompt / no completion column): this forward "
                                            "runs TRL's own padded loop, without trimming, sorting or packing.")  # fmt: skip
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        spans = row_spans(attention_mask)
        flash = _is_flash(model)
        layouts = plan_layouts(
            spans, (b, s), prompt_width, batch_size or b,
            sort=self._sort_no_grad and not torch.is_grad_enabled(),  # no-grad passes: sort the batch, unsort outputs
            trim=self.args.trim_padding, pack=self.args.padding_free, one_row=flash,
            multiple_of=self.args.pad_to_multiple_of,
        )  # fmt: skip
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :prompt_width] = -100  # only completion tokens are scored
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        logps, entropies, aux_losses = [], [], []
        for layout in layouts:
            layout = layout.to(input_ids.device)
            inputs = {"input_ids": layout.to_model(input_ids, pad_id), "fused_lm_head": True}
            call_labels = layout.to_model(labels, -100)
            if layout.packed:
                # A sequence's first token must not be scored from the previous sequence's last position.
                inputs["labels"] = call_labels.masked_fill(layout.position_ids == 0, -100)
                inputs["position_ids"], inputs["use_cache"] = layout.position_ids, False
                if flash:  # one row: hand flash-attention the segment boundaries (no host sync per layer)
                    inputs.update(_flash_varlen_kwargs(layout.segment_lengths, input_ids.device))
            else:
                inputs["labels"], inputs["attention_mask"] = call_labels, layout.to_model(attention_mask, 0)
                if layout.position_ids is not None:
                    inputs["position_ids"] = layout.position_ids
            if compute_aux_loss:
                inputs["output_router_logits"] = True
            with self.accelerator.autocast():
                out = self._call_model(model, layout, **inputs)
            # The fused head scores position t+1 from position t: shift back so column t holds token t's value.
            logps.append(torch.nn.functional.pad(out.log_probs, (1, 0)))
            if compute_entropy:
                entropies.append(torch.nn.functional.pad(out.entropy, (1, 0)))
            if compute_aux_loss:
                aux_losses.append(out.aux_loss)
        self._count_throughput(spans, layouts, (b, s))
        logps = layouts_to_batch(layouts, logps, 0.0, columns_from=prompt_width)
        entropies = layouts_to_batch(layouts, entropies, 0.0, columns_from=prompt_width) if compute_entropy else None
        aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    # ------------------------------------------------------------------------------ sorted micro-batches
    def _arrange_micro_batches(self, micro_batches: list[dict], first_step: int) -> list[dict]:
        """A fresh rollout buffer, its rows sorted by length within each optimizer step when sorting is on (called by
        rollout.py after TRL's shuffle and split; `first_step` is the micro-step that will use entry 0 first)."""
        if not self._sort_micro_batches:
            return micro_batches
        spg = self.args.steps_per_generation
        groups = optimizer_step_groups(first_step, spg, self.num_iterations, self.args.gradient_accumulation_steps)
        buffer = list(micro_batches)
        for group in groups:
            if len(group) < 2:
                continue
            sorted_batches = sort_rows_by_length([buffer[k] for k in group])
            if sorted_batches is None:
                self._warn_once("sort", "Rollout batch holds values that are not per row (e.g. image patches): "
                                        "micro-batches keep TRL's order.")  # fmt: skip
                return micro_batches
            for k, batch in zip(group, sorted_batches):
                buffer[k] = batch
        return buffer

    # ------------------------------------------------------------------------------------ throughput/*
    def _count_throughput(self, spans, layouts, batch_shape):
        if not self.model.training:
            return
        processed = sum(layout.source.numel() for layout in layouts)
        self._throughput += torch.tensor([float(spans[:, 2].sum()), processed, batch_shape[0] * batch_shape[1]],
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
        real, processed, stock = totals.tolist()
        steps = max(self.state.global_step - self._throughput_step, 1)
        self._throughput.zero_()
        self._throughput_step = self.state.global_step
        if stock == 0:
            return
        metrics = self._metrics["train"]
        metrics["throughput/tokens_per_step"].append(real / steps)
        metrics["throughput/padding_per_step"].append((processed - real) / steps)
        metrics["throughput/padding_fraction"].append((processed - real) / max(processed, 1.0))
        metrics["throughput/stock_padding_fraction"].append((stock - real) / stock)
        metrics["throughput/positions_vs_stock"].append(processed / stock)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


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


def _attention_implementation(model) -> str:
    """The model's attention implementation, looking through DDP / DeepSpeed wrappers (`.module`) without
    `accelerator.unwrap_model`, which costs milliseconds per call (it reads package metadata)."""
    while getattr(model, "config", None) is None and hasattr(model, "module"):
        model = model.module
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager")


def _is_flash(model) -> bool:
    return "flash" in _attention_implementation(model)


def check_packing_supported(model):
    """`padding_free=True` needs an attention that keeps packed sequences apart, and no prompt-learning adapter
    (it adds its own attention_mask / cache, which would silently turn the separation off)."""
    implementation = _attention_implementation(model)
    if "flash" not in implementation and implementation not in MASKED_PACKING_ATTENTION:
        raise ValueError(
            f"padding_free=True with attn_implementation={implementation!r}: packed sequences are kept apart only "
            f"by flash-attention (varlen) or by transformers' packed-sequence masks ({', '.join(MASKED_PACKING_ATTENTION)}). "
            "Load the model with one of those, or set padding_free=False."
        )
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(
            "padding_free=True with a prompt-learning PEFT adapter: its virtual tokens come with an attention mask "
            "or a cache, which makes packed sequences attend to each other. Use padding_free=False (trimming works)."
        )
    if implementation in MASKED_PACKING_ATTENTION and torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            logger.info(
                "padding_free=True with attn_implementation=%r: packed rows use a block-diagonal mask; flash-attn is "
                "installed, load the model with attn_implementation='flash_attention_2' for varlen kernels.",
                implementation,
            )
        except ImportError:
            pass


def _flash_varlen_kwargs(segment_lengths, device) -> dict:
    """flash-attention varlen arguments for a one-row packed call, so the kernels need no host sync per layer."""
    lengths = torch.tensor(segment_lengths, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(device)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
