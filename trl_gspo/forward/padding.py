"""Stop running the model on padding: trimmed, length-sorted and packed layouts (the `PaddingRemoval` part).

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
   (forward/segment_attention.py), never by transformers' packed-sequence detection. The same layout runs a prompt once
   for several completions (forward/shared_prefix.py).

pipeline.py plans every forward with these layouts (the cheapest per model call) and makes the model calls.
The layouts themselves (`ForwardLayout`, the plans) are layouts.py.
**Sorting permutes every per-row value** of the rollout batch (tensors whose first dimension is the row count, and
lists of that length), whatever its key, like TRL's `shuffle_sequence_dict` / `split_tensor_dict`. A tensor whose
first dimension is not the row count (e.g. concatenated image patches) disables sorting for that rollout, logged
once. `arrange_micro_batches` is that arrangement as a pure function (sorting, whole-group mini-batches).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..common import trl_compat
from ..common.validation import check_bool, check_choice
from . import fused_head, shared_prefix

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
            apart by the segment attention (forward/segment_attention.py), so no padding is computed. `"auto"`: per model
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
        self.padding_free = shared_prefix.tristate("padding_free", self.padding_free)
        check_choice("sort_by_length", self.sort_by_length, SORT_SETTINGS)
        if self.padding_free is True and not self.trim_padding:
            raise ValueError(
                "padding_free=True removes all padding, but trim_padding=False asks to keep it; set trim_padding=True "
                "(the default) or padding_free=False."
            )


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
    keys = _per_row_keys(micro_batches[0])
    if keys is None:
        return None
    pooled = dict(micro_batches[0])
    for key in keys:
        values = [mb[key] for mb in micro_batches]
        pooled[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(map(list, values), [])
    keys_ = length_keys(pooled)
    if grouped:
        keys_ = shared_prefix.group_length_keys(pooled, keys_)
    order = torch.sort(keys_, descending=True, stable=True).indices.tolist()
    rows = len(order) // len(micro_batches)
    out = []
    for i in range(len(micro_batches)):
        batch = dict(pooled)
        for key in keys:
            value, take = pooled[key], order[i * rows : (i + 1) * rows]
            batch[key] = (
                value[torch.tensor(take, device=value.device)]
                if isinstance(value, torch.Tensor)
                else [value[j] for j in take]
            )
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


# ------------------------------------------------------------------------------------------------- the part
class PaddingRemoval:
    """The run's padding-removal decisions (which forwards may trim, sort or pack), the arrangement of each fresh
    rollout buffer (`arrange`: length-sorted and, with `group_minibatches`, whole-group micro-batches, after TRL's
    shuffle and split), and the `throughput/*` counts of the forwards (`count`, `flush`)."""

    def __init__(self, args, run, num_iterations: int, per_micro_batch_statistics: list[str]):
        self.args, self.run, self.num_iterations = args, run, num_iterations  # run: trainer.RunView
        # The path calls the model with TRL's fused log-prob head (TRL >= 1.15); older TRL: its own padded loop.
        self.fused = fused_head.available()
        if not self.fused:
            if args.padding_free is True:
                raise ValueError(
                    f"padding_free=True needs TRL's fused log-prob head (TRL >= 1.15); the installed TRL is "
                    f"{trl_compat.installed_trl_version()}. Upgrade TRL or set padding_free=False."
                )
            if args.trim_padding or args.sort_by_length != "never":
                logger.warning(
                    "TRL %s has no fused log-prob head (TRL >= 1.15): trim_padding and sort_by_length are off, every "
                    "forward runs TRL's own padded loop.",
                    trl_compat.installed_trl_version(),
                )
        reasons = per_micro_batch_statistics
        self.sort_micro_batches = self.fused and (
            args.sort_by_length == "always" or (args.sort_by_length == "auto" and not reasons)
        )
        if args.sort_by_length == "auto" and reasons:
            logger.info(
                "sort_by_length='auto': micro-batches keep TRL's order because %s is computed per micro-batch "
                "(sorting would change it); set sort_by_length='always' to sort anyway.",
                " and ".join(reasons),
            )
        self.sort_no_grad = self.fused and args.sort_by_length != "never"
        # real tokens, positions run, positions TRL would run, prompt positions a shared prefix did not run again
        self.throughput = torch.zeros(4, dtype=torch.float64)
        self.throughput_step = 0
        self._warned = set()

    # ------------------------------------------------------------------------------ sorted micro-batches
    def arrange(self, micro_batches: list[dict], first_step: int, cost=None) -> list[dict]:
        """A fresh rollout buffer (TRL's shuffled, split micro-batches) arranged for the forwards
        (`arrange_micro_batches`); `first_step` is the micro-step that will use entry 0 first. `cost`: the loss
        forward's estimated cost of a micro-batch (forward/pipeline.py) when it may share prompts, else None: sorting
        then also weighs keeping each prompt's rows together (rows still never leave their optimizer step)."""
        grouped = self.args.group_minibatches
        if not (self.sort_micro_batches or grouped):
            return micro_batches
        buffer = arrange_micro_batches(
            list(micro_batches),
            first_step,
            self.args.steps_per_generation,
            self.num_iterations,
            self.args.gradient_accumulation_steps,
            sort=self.sort_micro_batches,
            group_minibatches=grouped,
            cost=cost,
        )
        if buffer is None:
            self.warn_once(
                "sort",
                "Rollout batch holds values that are not per row (e.g. image patches): micro-batches keep TRL's order.",
            )
            return micro_batches
        return buffer

    # ------------------------------------------------------------------------------------ throughput/*
    def count(self, spans, layouts, batch_shape) -> None:
        """Count one planned forward of the training phase (real tokens, positions run, positions TRL would run)."""
        if not self.run.training:
            return
        processed = sum(layout.source.numel() for layout in layouts)
        saved = sum(layout.shared_positions for layout in layouts)
        counts = [float(spans[:, 2].sum()), processed, batch_shape[0] * batch_shape[1], saved]
        self.throughput += torch.tensor(counts, dtype=torch.float64)

    def flush(self, accelerator) -> dict[str, float]:
        """`throughput/*` of the logging window, summed over processes (one all-reduce per log call), per optimizer
        step; the counts start again."""
        totals = self.throughput.to(accelerator.device)
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        real, processed, stock, saved = totals.tolist()
        steps = max(self.run.global_step - self.throughput_step, 1)
        self.throughput.zero_()
        self.throughput_step = self.run.global_step
        if stock == 0:
            return {}
        padding = max(processed + saved - real, 0.0)
        return {
            "throughput/tokens_per_step": real / steps,
            "throughput/padding_per_step": padding / steps,
            "throughput/padding_fraction": padding / max(processed, 1.0),
            "throughput/stock_padding_fraction": (stock - real) / stock,
            "throughput/positions_vs_stock": processed / stock,
            "throughput/prompt_tokens_saved_per_step": saved / steps,
        }

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def arrange_micro_batches(
    buffer, first_step, steps_per_generation, num_iterations, accumulation, *, sort, group_minibatches, cost=None
):
    """A fresh rollout buffer (TRL's shuffled, split micro-batches) arranged for the forwards, a pure function.

    `group_minibatches`: rows laid out again group by group over the whole buffer (shared_prefix.group_rows), so
    whole groups share an optimizer step. `sort`: inside each set of micro-batches that always fall in the same
    optimizer steps (`optimizer_step_groups`), rows ordered longest first, so a row never changes optimizer step
    here; whole prompt groups by their longest row when grouped, or when `cost` (a micro-batch's estimated loss
    forward cost) says keeping each prompt's rows together (so the loss forward shares the prompt) is cheaper than
    pure length order. None if a value is not per row (nothing is arranged)."""
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
def sort_changes_statistics(loss, entropy_bonus: bool, top_entropy_quantile: float, aux_loss: bool) -> list[str]:
    """What a length-sorted micro-batch would change (each is computed per micro-batch), for `sort_by_length='auto'`:
    a loss normalised by the micro-batch's own tokens (`loss`: its losses.PolicyLoss), the entropy bonus, the
    top-entropy mask, the MoE aux loss."""
    reasons = []
    if loss.per_micro_batch_normalizer:
        reasons.append(f"loss_type={loss.name!r} (token mean per micro-batch)")
    if entropy_bonus:
        reasons.append("the entropy bonus")
    if top_entropy_quantile < 1.0:
        reasons.append("the top-entropy mask (top_entropy_quantile < 1)")
    if aux_loss:
        reasons.append("the MoE router aux loss")
    return reasons
