"""Every log-prob forward of the training phase, as one explicit pipeline (the `LogprobForward` part).

TRL calls `_get_per_token_logps_and_entropies` for the loss forward (one call per micro-batch, with grad), its
no-grad pi_old pass over the rollout batch, and the reference pass. The trainer's override of that method calls the
`LogprobForward` part; each feature is a named step in it, in this order:

    1. pi_old from the sampler         rollout/sampler_logprobs.py   (`old_logprobs_source="sampler"`: no model call)
    2. the router pass                 moe/routing_replay.py     (MoE: record / replay routes for pi_old and loss)
    3. the plan                        `plan_forward` (forward/planner.py: layouts.py, shared_prefix.py groups),
                                       then each call prepared on the host and copied to the device (`_prepare`)
    4. the model calls                 `_run_calls` here     (routes follow each layout; segment attention armed)
    5. back to the batch               layouts.py (`layouts_to_batch`), padding.py (throughput counts), routes kept

The plan cuts the batch into TRL's chunks (the same number of model calls on every ZeRO-3 rank) and gives each chunk
the cheapest exact layout by a token-count cost model (planner.py): trimmed (the model's own attention on the
columns some row uses), packed (sequences end to end, segment attention) or shared (each prompt once for the
completions of it in the chunk, segment attention). `trim_padding`, `sort_by_length`, `padding_free` and
`shared_prefix` say which are allowed or forced; the device and the varlen kernel that would serve segment calls
(segment_attention.varlen_kernel) say what `"auto"` may choose. Everything the calls need is worked out on the host
and copied ahead of them without waiting, so on CUDA step 4 makes no host sync. Multimodal inputs, and TRL without
its fused log-prob head (< 1.15), go to TRL's own padded loop (step 3 and 4 replaced, steps 1, 2 and 5 unchanged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..common import trl_compat
from ..common.model_config import text_config
from . import fused_head, segment_attention, shared_prefix
from .layouts import ForwardLayout, row_spans, scatter, scatter_plan
from .planner import block_cost, choose_layout, pair_cost, plan_forward

logger = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------------- the part
@dataclass
class SegmentSupport:
    """What the forward pipeline knows of one model it runs (the policy, the reference model, ...)."""

    model: torch.nn.Module  # inside DDP / DeepSpeed wrappers (segment_attention.base_model)
    configs: list  # the configs its attention reads the implementation from: armed for its segment calls
    problem: str | None  # why it cannot take packed / shared-prefix layouts (None: it can)


class LogprobForward:
    """Every log-prob forward (the steps in the module docstring): the trainer's `_get_per_token_logps_and_entropies`
    calls it, and `release` ends each training / evaluation step by disarming what its forwards armed (replayed routes
    kept for the backward's recompute, the segment attention).

    Collaborators: `trl`, TRL's own implementations (common/seam.py `TRLCalls`: its
    `_get_per_token_logps_and_entropies` is the padded loop multimodal inputs and TRL < 1.15 take); `sampler` (rollout/sampler_logprobs.py: pi_old without a model call); `routes`
    (moe/routing_replay.py: the router pass); `padding` (forward/padding.py: which layouts the run allows, the
    throughput counts).

    Layouts are chosen per model: every model a forward runs (the policy, TRL's reference model, a reference made by
    disabling a PEFT adapter, which is the policy, each inside its DDP / DeepSpeed wrapper) is looked at once
    (`segment_support`). One that cannot take a segment layout (segment_attention.unsupported) runs trimmed and
    sorted layouts under `"auto"`, said once in the log; `padding_free=True` / `shared_prefix=True` refuse it, for
    the policy and the reference model before the first step."""

    def __init__(
        self,
        args,
        run,
        accelerator,
        *,
        trl,
        sampler,
        routes,
        padding,
        pad_token_id,
        aux_loss: bool,
        reference=None,
    ):
        self.args, self.run, self.accelerator = args, run, accelerator  # run: trainer.RunView
        self.trl, self.sampler, self.routes, self.padding = trl, sampler, routes, padding
        self.pad_token_id = pad_token_id or 0
        self.aux_loss = aux_loss  # the loss forward adds the MoE load-balancing loss
        self.pair_cost = pair_cost(run.model.config)
        self.block_cost = block_cost(run.model.config)
        self.segment_models: dict[int, SegmentSupport] = {}
        self.armed: dict[int, object] = {}  # configs switched to the segment attention during this step
        self._said: set = set()  # kernels named in the log for explicit True settings
        if args.shared_prefix is True and not padding.fused:
            raise ValueError(
                f"shared_prefix=True: TRL {trl_compat.installed_trl_version()} has no fused log-prob head "
                "(TRL >= 1.15). Set shared_prefix='auto' or False."
            )
        for role, model in (("the policy", run.model), ("the reference model", reference)):
            if model is not None:
                self.segment_support(model, role)

    def segment_support(self, model, role: str | None = None) -> SegmentSupport:
        """The forward pipeline's record of `model` (see the class docstring), made on first sight."""
        base = segment_attention.base_model(model)
        support = self.segment_models.get(id(base))
        if support is None:
            support = SegmentSupport(
                base,
                segment_attention.attention_configs(base),
                segment_attention.unsupported(base),
            )
            self.segment_models[id(base)] = support
            if support.problem:
                self._segment_layouts_off(support, role or "a model the forward runs")
        return support

    def _segment_layouts_off(self, support: SegmentSupport, who: str) -> None:
        """`support.model` takes no segment layout: an explicit True setting raises, "auto" says so once."""
        what = f"{who} ({type(support.model).__name__}) cannot take packed or shared-prefix layouts: {support.problem}"
        forced = [name for name in ("padding_free", "shared_prefix") if getattr(self.args, name) is True]
        if forced:
            raise ValueError(
                f"{' and '.join(f'{name}=True' for name in forced)}: {what}. Set {forced[0]}='auto' (its "
                "forwards then run trimmed and length-sorted) or False."
            )
        if "auto" in (self.args.padding_free, self.args.shared_prefix):
            logger.warning("padding_free / shared_prefix 'auto': %s. Its forwards run trimmed and length-sorted.", what)

    # ------------------------------------------------------------------------------------------ the pipeline
    def __call__(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        role = self.routes.take_role()  # 2. which observed forward this is (moe/routing_replay.py), one shot
        old = self.sampler.pi_old(input_ids.size(0), logits_to_keep, input_ids.device)  # 1. rollout/sampler_logprobs.py
        if old is not None:
            return old, None, None
        b, s = input_ids.shape
        replay = self.routes.replay_table(role, s, logits_to_keep) if role is not None else None
        with self.routes.route_pass(role, replay, b, s) as observed, self._fused_head(input_ids.device):
            prompt_width = s - logits_to_keep
            unsupported = any(v is not None for v in multimodal.values()) or logits_to_keep < 1 or prompt_width < 1
            if not self.padding.fused or unsupported:  # TRL < 1.15 was logged at construction
                if self.padding.fused:
                    self.padding.warn_once(
                        "fallback",
                        "Multimodal inputs (or no prompt / no completion column): this forward runs TRL's own padded "
                        "loop, without trimming, sorting, packing or prompt sharing.",
                    )
                # Keywords from `batch_size` on: TRL 1.14 takes them keyword-only.
                out = self.trl._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                    **multimodal,
                )
            else:
                support = self.segment_support(model)
                call = (
                    model,
                    support,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size or b,
                    compute_entropy,
                    compute_aux_loss,
                    observed,
                    replay,
                )
                try:
                    out = self._planned_forward(*call)
                except segment_attention.NotServed:
                    # Passed the checks made before the call, yet its attention bypassed the registry. Under "auto",
                    # run this forward again trimmed (no router pass: it has recorded the discarded call's routes).
                    if observed is not None or True in (self.args.padding_free, self.args.shared_prefix):
                        raise
                    support.problem = (
                        "its attention never reached the segment attention in a packed call (it bypasses transformers' "
                        "AttentionInterface)"
                    )
                    self._segment_layouts_off(support, "a model the forward runs")
                    out = self._planned_forward(*call)
        if role is not None:
            self.routes.after_route_pass(role, replay, observed, out, logits_to_keep)  # 5. routes kept / metrics
        if not torch.is_grad_enabled():
            self.release()  # no backward follows a no-grad pass
        return out

    @contextlib.contextmanager
    def _fused_head(self, device):
        """TRL's fused head around the model calls (forward/fused_head.py): labelled positions only on the CPU, the
        tile of `logprob_vocab_chunk_size`."""
        with fused_head.labelled_only(device.type), fused_head.vocab_chunk(self.args.logprob_vocab_chunk_size):
            yield

    def _planned_forward(
        self,
        model,
        support,
        input_ids,
        attention_mask,
        logits_to_keep,
        chunk_rows,
        compute_entropy,
        compute_aux_loss,
        observed,
        replay,
    ):
        b, s = input_ids.shape
        prompt_width = s - logits_to_keep
        spans = row_spans(attention_mask)
        kernel = self.varlen_kernel(support, input_ids.device)
        layouts = self._plan(
            spans, input_ids, attention_mask, prompt_width, chunk_rows, compute_aux_loss, replay, support, kernel
        )
        calls = [self._prepare(layout, support, kernel, input_ids.device) for layout in layouts]
        back = scatter_plan(layouts, prompt_width, input_ids.device)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :prompt_width] = -100  # only completion tokens are scored
        logps, entropies, aux_losses = self._run_calls(
            model, calls, input_ids, attention_mask, labels, compute_entropy, compute_aux_loss, observed
        )
        self.padding.count(spans, layouts, (b, s))
        logps = scatter(back, logps, 0.0)
        entropies = scatter(back, entropies, 0.0) if compute_entropy else None
        aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    def _prepare(self, layout: ForwardLayout, support: SegmentSupport, kernel, device) -> ForwardLayout:
        """One call's layout on the device, its segment plan built on the host first (varlen arguments for `kernel`,
        else the SDPA blocks) and copied without waiting."""
        if layout.packed:
            plan = layout.segments.build_varlen(kernel) if kernel else layout.segments.build_blocks()
            layout = dataclasses.replace(layout, segments=plan.to(device))
        return layout.to(device)

    def _run_calls(self, model, calls, input_ids, attention_mask, labels, compute_entropy, compute_aux_loss, observed):
        """4. The model calls of one forward: device work only (no host sync on CUDA; tests/test_forward_syncs.py)."""
        logps, entropies, aux_losses = [], [], []
        for layout in calls:
            inputs = {
                "input_ids": layout.to_model(input_ids, self.pad_token_id),
                "fused_lm_head": True,
                "labels": layout.to_model(labels, -100),
            }
            if layout.packed:
                inputs["position_ids"], inputs["use_cache"] = layout.position_ids, False
            else:
                inputs["attention_mask"] = layout.to_model(attention_mask, 0)
                if layout.position_ids is not None:
                    inputs["position_ids"] = layout.position_ids
            if compute_aux_loss:
                inputs["output_router_logits"] = True
            if observed is not None:  # 4. the open router pass follows this call's rows and columns
                observed.set_call_positions(layout.source, layout.aliases)
            with self.accelerator.autocast():
                out = self._call_model(model, layout, **inputs)
            # The fused head scores position t+1 from position t: shift back so column t holds token t's value.
            logps.append(torch.nn.functional.pad(out.log_probs, (1, 0)))
            if compute_entropy:
                entropies.append(torch.nn.functional.pad(out.entropy, (1, 0)))
            if compute_aux_loss:
                aux_losses.append(out.aux_loss)
        return logps, entropies, aux_losses

    # -------------------------------------------------------------------------------------------- 3. the plan
    def _layout_settings(self, compute_aux_loss: bool, support: SegmentSupport):
        """(pack, share) for a forward of `support.model`: each "auto", True or False after what the forward and the
        model rule out."""
        args = self.args
        pack, share = args.padding_free, args.shared_prefix
        if support.problem:
            return False, False  # refused before the first step if either was True (`_segment_layouts_off`)
        if not args.trim_padding:
            pack = False  # `padding_free=True` with trimming off is refused by the config
        if compute_aux_loss and pack == "auto":
            pack = False  # packing would add its filler to the load-balancing loss (explicit True accepts that)
        if compute_aux_loss or not args.trim_padding:
            share = False  # sharing would count each prompt once in the load-balancing loss
        return pack, share

    def varlen_kernel(self, support: SegmentSupport, device) -> str | None:
        """The fused varlen kernel that would serve `support.model`'s segment calls on `device` (None: SDPA blocks),
        for its compute dtype (the mixed-precision dtype, else its weights') and attention dropout."""
        if device.type != "cuda":
            return None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.accelerator.mixed_precision))
        if dtype is None:
            dtype = next(support.model.parameters()).dtype
        dropout = support.model.training and (getattr(text_config(support.model.config), "attention_dropout", 0) or 0)
        return segment_attention.varlen_kernel(device.type, dtype, bool(dropout))

    def _say_kernel(self, pack, share, kernel, device) -> None:
        """Explicit True settings: name once in the log what serves their segment calls."""
        forced = [name for name, value in (("padding_free", pack), ("shared_prefix", share)) if value is True]
        if not forced or (kernel, device.type) in self._said:
            return
        self._said.add((kernel, device.type))
        served = kernel or (
            "the SDPA blocks (segment_attention.py); on CUDA without a fused varlen kernel (torch >= 2.10 or "
            "flash-attn, half precision) they are slower than stock's attention"
            if device.type == "cuda"
            else "the SDPA blocks (segment_attention.py)"
        )
        logger.info(
            "%s: packed / shared calls on %s run %s.", " and ".join(f"{n}=True" for n in forced), device, served
        )

    def _plan(
        self, spans, input_ids, attention_mask, prompt_width, chunk_rows, compute_aux_loss, replay, support, kernel
    ):
        pack, share = self._layout_settings(compute_aux_loss, support)
        self._say_kernel(pack, share, kernel, input_ids.device)
        groups = []
        if share is not False:
            groups = shared_prefix.prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
            if groups and replay is not None:
                groups = shared_prefix.split_by_routes(groups, replay.ids, replay.valid, prompt_width)
        return plan_forward(
            spans,
            tuple(input_ids.shape),
            prompt_width,
            chunk_rows,
            groups=groups,
            sort=self.padding.sort_no_grad and not torch.is_grad_enabled(),  # no-grad passes: sort, unsort outputs
            trim=self.args.trim_padding,
            pack=pack,
            share=share,
            alpha=self.pair_cost,
            multiple_of=self.args.pad_to_multiple_of,
            device=input_ids.device.type,
            kernel=kernel,
            block_overhead=self.block_cost,
        )

    def loss_cost_estimator(self):
        """`loss_cost` when the policy's loss forwards may share prompts (so arranging a rollout buffer weighs keeping
        each prompt's rows together, forward/padding.py), else None."""
        may_share = self.args.shared_prefix is not False and not self.segment_support(self.run.model).problem
        return self.loss_cost if may_share else None

    def loss_cost(self, batch: dict) -> float:
        """Estimated cost of the loss forward on a rollout micro-batch (the cheapest layout `plan_forward` would
        pick), so arrangements of an optimizer step's rows can be compared."""
        support = self.segment_support(self.run.model)
        pack, share = self._layout_settings(self.aux_loss, support)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        spans, prompt_width = row_spans(mask), batch["prompt_mask"].size(1)
        groups = shared_prefix.prompt_groups(batch["prompt_ids"], batch["prompt_mask"]) if share is not False else []
        group_of = {r: tuple(rows) for rows in groups for r in rows}
        rows = list(range(mask.size(0)))
        trim, device = self.args.trim_padding, self.accelerator.device
        kernel = self.varlen_kernel(support, device)
        return choose_layout(
            spans, rows, prompt_width, group_of, trim, pack, share, self.pair_cost, device.type, kernel, self.block_cost
        ).cost

    # ------------------------------------------------------------------------------------- 4. the model call
    def _call_model(self, model, layout: ForwardLayout, **model_inputs):
        """The one model call of the planned forward. A segment layout (packed / shared) runs under the segment
        attention (forward/segment_attention.py) with the plan `_prepare` built, armed here for the model called and
        disarmed when the step is over."""
        if not layout.packed:
            return model(**model_inputs)
        support = self.segment_support(model)
        if model_inputs.get("attention_mask") is not None:
            raise RuntimeError(
                "A packed forward got an attention_mask: its sequences are kept apart by the segment attention's plan, "
                "and a mask would make transformers build a plain causal one. Do not add an attention_mask to packed "
                "calls."
            )
        plan = layout.segments
        if plan.blocks is None and plan.varlen is None:  # a layout not made by `_prepare` (a direct call)
            device = model_inputs["input_ids"].device
            plan = self._prepare(layout, support, self.varlen_kernel(support, device), device).segments
        segment_attention.arm(support.configs)
        self.armed.update((id(config), config) for config in support.configs)
        with segment_attention.segment_call(support.configs):
            out = model(**model_inputs, segment_plan=plan)
        segment_attention.check_served(plan, type(support.model).__name__)
        return out

    def release(self) -> None:
        """The step's forwards and backward are done: disarm the segment attention and any replayed routes, so
        `generate()` runs the plain model."""
        segment_attention.disarm(list(self.armed.values()))
        self.armed.clear()
        self.routes.release()
