"""`GSPOTrainer`: `trl.GRPOTrainer` whose policy loss goes through three hooks.

TRL 1.16 computes the whole loss in one method, `GRPOTrainer._compute_loss`, with the importance ratio and the
clipped objective written inline. This class owns that one method: generation, rewards, advantages, old/ref
log-probs, vLLM, PEFT, optimisation and logging stay TRL's. The loss is rebuilt as a short pipeline that calls
TRL's own helpers for the forward pass and masks, and three hooks for what GSPO changes:

    importance_log_weights(logps, old_logps, mask)   # token / sequence / sequence_token (losses.py)
    policy_loss(ratio, advantages, logps)            # clipped surrogate (or CISPO)
    behaviour_weight(inputs, old_logps, mask)        # weight for the sampling policy: decoupled pi_prox / mu when
                                                     # generation runs ahead (rollout/async_rollouts.py), else TRL's vLLM one

plus `token_advantages(inputs)`, the place to supply per-token advantages for GSPO-token. Everything between
(KL term, entropy mask and bonus, off-policy mask, aggregation and
gradient-accumulation normalisation, MoE aux loss, metrics) follows TRL's semantics; `tests/test_parity.py`
checks loss and gradients against stock `GRPOTrainer` so drift is caught when the TRL pin moves.

Features around the loss are mixins, one per module: `ResumableTraining` (guards/checkpointing.py), `RolloutPipeline`
(rollout/pipeline.py: owns TRL's rollout path, `_prepare_inputs` -> `_generate_and_score_completions` -> `_generate`, and
calls each feature's step there explicitly; its rollout source may generate ahead of time, rollout/async_rollouts.py), `GuardedRewards` (guards/rewards_guard.py), `MoERouting` (moe/routing_replay.py:
MoE routing metrics and routing replay), `SamplerLogprobReuse` (rollout/sampler_logprobs.py), `TrainingDiagnostics`
(guards/diagnostics.py) and `PaddingRemoval` (forward/padding.py: sorted micro-batches, throughput counts). Every log-prob forward
is one explicit pipeline, `LogprobForward` (forward/pipeline.py), whose named steps call into sampler_logprobs,
routing_replay, padding and shared_prefix. The non-finite guard is a callback (guards/nonfinite.py) plus one line at the
end of the loss.
"""

from __future__ import annotations

import os
import shutil

import torch
from trl import GRPOTrainer

from . import losses
from .common import model_card
from .config import TRL_NATIVE_LOSS_TYPES, GSPOConfig
from .forward.padding import PaddingRemoval
from .forward.pipeline import LogprobForward
from .guards import checkpointing
from .guards.checkpointing import ResumableTraining
from .guards.diagnostics import TrainingDiagnostics
from .guards.nonfinite import NonFiniteGuard
from .guards.rewards_guard import GuardedRewards
from .moe.routing_replay import MoERouting
from .rollout.async_rollouts import decoupled_behaviour_weight
from .rollout.colocate_cpu_sync import check_cpu_colocate_supported, enable_cpu_colocate_sync
from .rollout.pipeline import RolloutPipeline
from .rollout.sampler_logprobs import SamplerLogprobReuse
from .rollout.served_model import check_served_model
from .rollout.sources import rollout_source
from .rollout.vllm_setup import check_vllm_setup

# Optional multimodal inputs TRL forwards to the model when present in a batch.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _check_reference_source(model, args: GSPOConfig, peft_config) -> None:
    """`beta > 0` without PEFT: TRL loads the KL reference model from the policy's path (`config._name_or_path`). A
    policy built in code has none, and TRL would fail deep in the Hub client on an empty repo id: say so here."""
    if args.beta == 0.0 or isinstance(model, str) or peft_config is not None or hasattr(model, "peft_config"):
        return
    if not getattr(getattr(model, "config", None), "_name_or_path", None):
        raise ValueError(
            f"beta={args.beta} needs a KL reference model, which TRL loads from the policy's path "
            "(model.config._name_or_path), but this model was built in code and has none. Save it with "
            "save_pretrained and pass the folder (or set beta=0.0, or train a PEFT adapter: the reference is then the "
            "model with the adapter disabled)."
        )


class GSPOTrainer(
    ResumableTraining,
    RolloutPipeline,
    GuardedRewards,
    MoERouting,
    SamplerLogprobReuse,
    TrainingDiagnostics,
    PaddingRemoval,
    LogprobForward,
    GRPOTrainer,
):
    """GRPO trainer with GSPO (`importance_sampling_level="sequence"`) and GSPO-token (`"sequence_token"`).

    Drop-in for `trl.GRPOTrainer`: same constructor, `args` must be a [`GSPOConfig`] (its defaults are the
    paper's). To train GSPO-token with per-token advantages, subclass and override [`token_advantages`].
    """

    make_rollout_source = staticmethod(rollout_source)  # the rollout path's source, picked from the config

    def __init__(self, model, reward_funcs=None, args: GSPOConfig | None = None, *positional, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GSPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GSPO")
        elif not isinstance(args, GSPOConfig):
            raise TypeError(
                f"GSPOTrainer needs args=GSPOConfig(...), got {type(args).__name__}. A plain GRPOConfig carries "
                "GRPO's defaults (token level, epsilon 0.2, dapo loss); build GSPOConfig with the same arguments."
            )
        _check_reference_source(model, args, kwargs.get("peft_config"))
        check_cpu_colocate_supported(args.use_vllm, args.vllm_mode)  # vLLM's CPU build: before its engine starts
        check_vllm_setup(args, model)  # vLLM missing, a server push without CUDA, a model vLLM cannot load: one line
        # Model card (name, paper, tags) of the variant trained; set before TRL's __init__ tags the model with them.
        self._name, self._paper, self._tag_names = model_card.card_fields(
            args.importance_sampling_level, args.loss_type, GRPOTrainer._paper
        )
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        check_served_model(self)  # vLLM server mode: the server serves this model (before any step)
        enable_cpu_colocate_sync(self)  # vLLM colocate on its CPU build: weight syncs that reach the engine
        self._guard_reward_funcs()
        self._nonfinite = NonFiniteGuard(self, args.max_consecutive_nonfinite)
        self.add_callback(self._nonfinite)
        self.add_callback(checkpointing.SamplerEpoch(self))  # each epoch's prompt order, also after a resume
        self._signal_checkpoint = checkpointing.SignalCheckpoint(self) if args.checkpoint_on_signal else None
        if self._signal_checkpoint is not None:
            self.add_callback(self._signal_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """`Trainer.save_model`, plus TRL's model card (naming the variant, its paper and tags) next to the weights;
        checkpoints and `push_to_hub` write theirs through TRL already."""
        super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        output_dir = output_dir or self.args.output_dir
        self.create_model_card(model_name=os.path.basename(os.path.normpath(output_dir)))  # into args.output_dir
        card = os.path.join(self.args.output_dir, "README.md")
        if os.path.abspath(output_dir) != os.path.abspath(self.args.output_dir) and os.path.exists(card):
            shutil.copyfile(card, os.path.join(output_dir, "README.md"))

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, naming a base model loaded from a local folder by the folder's name (`common/model_card.py`)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            base = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None)
            model_card.name_local_base_model(os.path.join(self.args.output_dir, "README.md"), base)

    def _get_grad_norm(self, model, grad_norm=None):
        """HF's pre-clip gradient norm, kept for the non-finite guard's optimizer-step check (guards/nonfinite.py)."""
        self.last_grad_norm = super()._get_grad_norm(model, grad_norm)
        return self.last_grad_norm

    # ------------------------------------------------------------------------------------------------ hooks
    def token_advantages(self, inputs: dict) -> torch.Tensor:
        """Advantages used by the loss: `(B,)` (one per completion, TRL's default) or `(B, T)` (one per token).

        Override to give each token its own advantage, e.g. a different advantage per turn of a multi-turn
        completion; `inputs` holds `completion_ids`, `completion_mask` and TRL's `(B,)` `advantages`. Per-token
        advantages need `importance_sampling_level="sequence_token"` (or `"token"`): `"sequence"` has one ratio
        per sequence and would silently average them, so it raises. From a recipe, name the subclass with the
        CLI's `trainer_class` key. `trl_gspo.token_advantages` has a multi-turn example.
        """
        return inputs["advantages"]

    def importance_log_weights(self, logps, old_logps, mask) -> torch.Tensor:
        """Hook 1: log importance weight, `(B, 1)` or `(B, T)`, for the configured level (see `losses.py`)."""
        return losses.LOG_WEIGHT_FUNCTIONS[self.importance_sampling_level](logps, old_logps, mask)

    def policy_loss(self, ratio, advantages, logps) -> torch.Tensor:
        """Hook 2: per-token (or per-sequence) policy loss from the ratio: the two-sided clipped surrogate, CISPO or
        SAPO's soft gate."""
        if self.loss_type == "cispo":
            return losses.cispo_loss(ratio, advantages, logps, self.epsilon_high)
        if self.loss_type == "sapo":
            return losses.sapo_loss(ratio, advantages, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)
        return losses.clipped_surrogate_loss(ratio, advantages, self.epsilon_low, self.epsilon_high, self.args.delta)

    def behaviour_weight(self, inputs: dict, proximal_logps, mask) -> torch.Tensor | None:
        """Hook 3: detached weight, `(B, 1)` or `(B, T)`, for the policy that sampled the batch (multiplies the loss),
        or None. Asynchronous generation: the decoupled objective's `pi_prox / mu`, `pi_prox` being the pi_old the
        ratio is anchored on (rollout/async_rollouts.py). Synchronous vLLM: TRL's sampler correction, computed at scoring."""
        if self.args.async_generation and self.model.training:
            return decoupled_behaviour_weight(self, inputs, proximal_logps, mask)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"]
        return None

    # --------------------------------------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        if (
            self.loss_type in TRL_NATIVE_LOSS_TYPES
        ):  # VESPO has no ratio to hook: TRL's code, guarded (guards/nonfinite.py)
            return self._nonfinite.guard_loss(super()._compute_loss(model, inputs), mode)
        completion_ids = inputs["completion_ids"]
        mask = (
            inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        )

        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        self._log_sampler_mismatch(mode, logps, inputs, mask)
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)

        advantages = self._checked_advantages(inputs, mask)
        # Without off-policy mini-batches TRL skips the old-policy forward: pi_old == sg[pi_theta].
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps

        ratio = losses.importance_ratio(self.importance_log_weights(logps, old_logps, mask), self.args.max_log_ratio)
        per_token_loss = self.policy_loss(ratio, advantages, logps)

        if self.off_policy_mask_threshold is not None:
            sampling_logps = inputs.get("sampling_per_token_logps", old_logps)
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages, logps, sampling_logps, mask, self.off_policy_mask_threshold
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        behaviour = self.behaviour_weight(inputs, old_logps, mask)
        if behaviour is not None:
            per_token_loss = per_token_loss * behaviour
        per_token_kl = None
        if self.beta != 0.0:
            ref_logps = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # k3 estimator
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * ratio
            per_token_loss = per_token_loss + self.beta * per_token_kl

        loss, policy_loss = self._aggregate(per_token_loss, mask, inputs, mode)
        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropies, mask if entropy_mask is None else mask * entropy_mask, mode)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        low, high = self._clip_indicators(ratio, advantages)
        self._record_diagnostics(mode, inputs, logps, old_logps, low, high, advantages, mask)  # guards/diagnostics.py
        self._log_loss_metrics(mode, low, high, mask, entropies, per_token_kl)
        return self._nonfinite.guard_loss(loss, mode, ratio, logps)  # NaN/inf: the micro-batch counts for nothing

    # ------------------------------------------------------------------------------------------- internals
    def _checked_advantages(self, inputs, mask) -> torch.Tensor:
        advantages = self.token_advantages(inputs)
        if advantages.dim() == 1:
            return advantages.unsqueeze(1)
        if advantages.dim() != 2 or advantages.size(0) != mask.size(0) or advantages.size(1) not in (1, mask.size(1)):
            raise ValueError(
                f"token_advantages must return shape (B,) or (B, T) = ({mask.size(0)}, {mask.size(1)}), got "
                f"{tuple(advantages.shape)}."
            )
        if advantages.size(1) > 1 and self.importance_sampling_level == "sequence":
            raise ValueError(
                "Per-token advantages of shape (B, T) need importance_sampling_level='sequence_token' (GSPO-token) "
                "or 'token': with 'sequence' there is one ratio per completion and the token advantages would be "
                "silently averaged."
            )
        return advantages

    def _accumulation(self, mode: str) -> float:
        """Divisor that makes accumulated micro-batch gradients average (TRL turns HF's own scaling off)."""
        return self.current_gradient_accumulation_steps if mode == "train" else 1.0

    def _aggregate(self, per_token_loss, mask, inputs, mode) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the per-token loss as `loss_type` says; returns (loss to backpropagate, unscaled policy loss)."""
        if self.loss_type in ("grpo", "sapo"):
            loss = losses.sequence_mean_loss(per_token_loss, mask)
        elif self.loss_type == "luspo":
            loss = losses.sequence_sum_loss(per_token_loss, mask)
        elif self.loss_type == "bnpo":
            loss = losses.token_sum_loss(per_token_loss, mask, mask.sum().clamp(min=1.0))
        elif self.loss_type == "dr_grpo":
            loss = losses.token_sum_loss(per_token_loss, mask, per_token_loss.size(0) * self.max_completion_length)
        else:  # dapo, cispo: normalised by the active tokens of the whole accumulated generation batch
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = losses.token_sum_loss(per_token_loss, mask, normalizer)
            return loss, loss.detach()
        return loss / self._accumulation(mode), loss.detach()

    def _entropy_bonus(self, entropies, effective_mask, mode) -> torch.Tensor:
        """`coef * mean entropy` to subtract from the loss, with TRL's adaptive coefficient controller."""
        entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / self._accumulation(mode)
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0  # the controller only pays the bonus while entropy is at or below its target
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = (
                stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            )
            if self.accelerator.sync_gradients:  # last micro-batch of the optimizer step: update the coefficient
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                self._last_world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if self._last_world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy

    def _clip_indicators(self, ratio, advantages) -> tuple[torch.Tensor, torch.Tensor]:
        """Float masks (low, high) of where the clip is active, shared by TRL's metrics and the diagnostics.
        CISPO truncates the weight from above only, so its low side is empty; SAPO's soft gate never clips."""
        ratio = ratio.detach()
        if self.loss_type == "sapo":
            zeros = torch.zeros_like(ratio * advantages)
            return zeros, zeros
        if self.loss_type == "cispo":
            high = ((ratio > self.epsilon_high) & (advantages > 0)).float()
            return torch.zeros_like(high), high
        return losses.clip_indicators(ratio, advantages, self.epsilon_low, self.epsilon_high)

    def _log_loss_metrics(self, mode, low, high, mask, entropies, per_token_kl):
        """TRL's loss metrics (same names and values) from one gather and one device-to-host copy per micro-batch;
        stock TRL issues a reduce or gather, each followed by a sync, per metric (six for the clipped losses)."""
        metrics = self._metrics[mode]
        mask = mask.float()

        def sum_and_count(x):  # per-sequence tensors (B, 1) count sequences, per-token ones count valid tokens
            if x.size(1) == 1:
                return x.sum(), torch.tensor(float(x.size(0)), device=x.device)
            x = x.expand_as(mask)
            return (x * mask).sum(), mask.sum()

        def per_sequence(x):  # (B,) mean over each completion's tokens, for the min/max over sequences
            return losses.masked_sequence_mean(x.expand_as(mask), mask) if x.size(1) > 1 else x[:, 0]

        names, stats = ["entropy"], [*sum_and_count(entropies)]
        if per_token_kl is not None:
            names.append("kl")
            stats += sum_and_count(per_token_kl)
        clipped = self.loss_type not in ("cispo", "sapo")  # TRL logs no clip metric for SAPO's soft gate
        if self.loss_type == "cispo":
            names.append("cispo_clip_ratio")
            stats += sum_and_count(high)
        elif clipped:
            names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
            for x in (low, high, torch.maximum(low, high)):
                stats += sum_and_count(x)
        local = torch.stack(stats)
        if clipped:
            local = torch.cat([local, per_sequence(low), per_sequence(high)])
        gathered = self.accelerator.gather(local.detach().float()).view(self.accelerator.num_processes, -1).cpu()
        totals = gathered[:, : len(stats)].sum(0).tolist()
        for i, name in enumerate(names):
            metrics[name].append(totals[2 * i] / max(totals[2 * i + 1], 1.0))
        if clipped:
            per_seq = gathered[:, len(stats) :].view(gathered.size(0), 2, -1)  # (processes, low/high, B)
            metrics["clip_ratio/low_min"].append(per_seq[:, 0].min().item())
            metrics["clip_ratio/high_max"].append(per_seq[:, 1].max().item())
