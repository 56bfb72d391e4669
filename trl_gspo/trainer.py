"""`GSPOTrainer`: `trl.GRPOTrainer` whose policy loss goes through two hooks.

TRL 1.16 computes the whole loss in one method, `GRPOTrainer._compute_loss`, with the importance ratio and the
clipped objective written inline. This subclass owns that one method and nothing else: generation, rewards,
advantages, old/ref log-probs, vLLM, PEFT, optimisation and logging stay TRL's. The loss is rebuilt as a short
pipeline that calls TRL's own helpers for the forward pass and masks, and two hooks for what GSPO changes:

    importance_log_weights(logps, old_logps, mask)   # token / sequence / sequence_token (losses.py)
    policy_loss(ratio, advantages, logps)            # clipped surrogate (or CISPO)

plus `token_advantages(inputs)`, the place to supply per-token advantages for GSPO-token. Everything between
(KL term, entropy mask and bonus, vLLM importance-sampling correction, off-policy mask, aggregation and
gradient-accumulation normalisation, MoE aux loss, metrics) follows TRL's semantics; `tests/test_parity.py`
checks loss and gradients against stock `GRPOTrainer` so drift is caught when the TRL pin moves.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from . import checkpointing, fused_head, losses, rewards_guard, sampler_logprobs
from .config import TRL_NATIVE_LOSS_TYPES, GSPOConfig
from .diagnostics import TrainingDiagnostics
from .nonfinite import NonFiniteGuard

logger = logging.getLogger(__name__)

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


class GSPOTrainer(TrainingDiagnostics, GRPOTrainer):
    """GRPO trainer with GSPO (`importance_sampling_level="sequence"`) and GSPO-token (`"sequence_token"`).

    Drop-in for `trl.GRPOTrainer`: same constructor, `args` must be a [`GSPOConfig`] (its defaults are the
    paper's). To train GSPO-token with per-token advantages, subclass and override [`token_advantages`].
    """

    def __init__(self, model, reward_funcs=None, args: GSPOConfig | None = None, *positional, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GSPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GSPO")
        elif not isinstance(args, GSPOConfig):
            raise TypeError(
                f"GSPOTrainer needs args=GSPOConfig(...), got {type(args).__name__}. A plain GRPOConfig carries "
                "GRPO's defaults (token level, epsilon 0.2, dapo loss); build GSPOConfig with the same arguments."
            )
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._guard_reward_funcs()
        self._nonfinite = NonFiniteGuard(self, args.max_consecutive_nonfinite)
        self.add_callback(self._nonfinite)
        self._signal_checkpoint = checkpointing.SignalCheckpoint(self) if args.checkpoint_on_signal else None
        if self._signal_checkpoint is not None:
            self.add_callback(self._signal_checkpoint)
        self._init_sampler_logprob_reuse()

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
        """Hook 2: per-token (or per-sequence) policy loss from the ratio: the two-sided clipped surrogate, or CISPO."""
        if self.loss_type == "cispo":
            return losses.cispo_loss(ratio, advantages, logps, self.epsilon_high)
        return losses.clipped_surrogate_loss(ratio, advantages, self.epsilon_low, self.epsilon_high, self.args.delta)

    # --------------------------------------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_NATIVE_LOSS_TYPES:  # SAPO/VESPO have no clipped ratio to hook: TRL's code as is
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]

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
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
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

        self._record_diagnostics(mode, inputs, logps, old_logps, ratio, advantages, mask)  # diagnostics.py
        self._log_loss_metrics(mode, ratio, advantages, mask, entropies, per_token_kl)
        if mode == "train":  # a NaN/inf ratio or loss: this micro-batch contributes nothing (see nonfinite.py)
            loss = self._nonfinite.guard_loss(loss, ratio, logps)
        return loss

    # ------------------------------------------------------------------- faults: rewards, checkpoints, resume
    def _guard_reward_funcs(self):
        """Wrap reward callables so raising, malformed or non-finite rewards fail clearly (see rewards_guard.py)."""
        policy = self.args.nonfinite_reward
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if not isinstance(func, nn.Module) and not getattr(func, "__gspo_guarded__", False):
                count = functools.partial(self._count_nonfinite_rewards, name) if policy == "none" else None
                self.reward_funcs[i] = rewards_guard.guard_reward_function(func, name, policy, count)

    def _count_nonfinite_rewards(self, name: str, count: int):
        self._metrics["train" if self.model.training else "eval"][f"rewards/{name}/nonfinite"].append(count)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_guard.check_reward_matrix(rewards_per_func, self.reward_funcs, self.reward_func_names)
        return rewards_per_func

    def _save_checkpoint(self, model, trial):
        """HF's checkpoint plus TRL's rollout buffer, with a completion marker written last (see checkpointing.py)."""
        path = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            checkpointing.mark_incomplete(path)
        super()._save_checkpoint(model, trial)
        os.makedirs(path, exist_ok=True)
        checkpointing.save_rollout_state(path, self.accelerator.process_index, self._step, self._buffered_inputs)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpointing.mark_complete(path)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints and restoring TRL's rollout buffer."""
        resume_from_checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint is not None:
            state = checkpointing.load_rollout_state(
                resume_from_checkpoint, self.accelerator.process_index, self.accelerator.device
            )
            if state is not None and (state[1] is None or len(state[1]) == self.args.steps_per_generation):
                self._step, self._buffered_inputs = state
            elif state is not None:  # batch settings changed since the save: TRL regenerates, as stock TRL does
                checkpointing.logger.warning("Rollout state of %s does not match steps_per_generation=%d; ignored.",
                                             resume_from_checkpoint, self.args.steps_per_generation)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:  # also when training raised: give the process its own signal handlers back
            if self._signal_checkpoint is not None:
                self._signal_checkpoint.restore_handlers()

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
        if self.loss_type == "grpo":
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
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
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

    def _log_loss_metrics(self, mode, ratio, advantages, mask, entropies, per_token_kl):
        """TRL's loss metrics (same names), reduced across processes in one collective."""
        metrics = self._metrics[mode]
        mask = mask.float()

        def sum_and_count(x):  # per-sequence tensors (B, 1) count sequences, per-token ones count valid tokens
            if x.size(1) == 1:
                return x.sum(), torch.tensor(float(x.size(0)), device=x.device)
            x = x.expand_as(mask)
            return (x * mask).sum(), mask.sum()

        names, stats = ["entropy"], [*sum_and_count(entropies)]
        if per_token_kl is not None:
            names.append("kl")
            stats += sum_and_count(per_token_kl)
        if self.loss_type == "cispo":
            names.append("cispo_clip_ratio")
            stats += sum_and_count(((ratio > self.epsilon_high) & (advantages > 0)).float())
            low = high = None
        else:
            low, high = losses.clip_indicators(ratio, advantages, self.epsilon_low, self.epsilon_high)
            names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
            for x in (low, high, torch.maximum(low, high)):
                stats += sum_and_count(x)
        totals = self.accelerator.reduce(torch.stack(stats).detach(), reduction="sum").tolist()
        for i, name in enumerate(names):
            metrics[name].append(totals[2 * i] / max(totals[2 * i + 1], 1.0))
        if low is not None:
            low_per_seq = losses.masked_sequence_mean(low.expand_as(mask), mask) if low.size(1) > 1 else low[:, 0]
            high_per_seq = losses.masked_sequence_mean(high.expand_as(mask), mask) if high.size(1) > 1 else high[:, 0]
            gathered = self.accelerator.gather(torch.stack([low_per_seq, high_per_seq]).detach())
            metrics["clip_ratio/low_min"].append(gathered[0].min().item())
            metrics["clip_ratio/high_max"].append(gathered[1].max().item())

    # ------------------------------------------------ sampler log-prob reuse (GSPOConfig.old_logprobs_source)
    def _init_sampler_logprob_reuse(self):
        self._reuse_armed = False  # True between generation and TRL's old-policy forward, when that is replaced
        self._sampler_logps = None  # per-completion sampler log-probs of the rollout being scored
        self._rollout_global_step = None  # optimizer step the current rollout batch was sampled at
        self._warned_no_sampler_logps = False

    def _old_logps_pass_needed(self) -> bool:
        """TRL 1.16's condition for its no-grad pi_old forward in `_generate_and_score_completions`."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _reuses_sampler_logps(self) -> bool:
        return self.args.old_logprobs_source == "sampler" and self._old_logps_pass_needed()

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self._reuses_sampler_logps() or self.use_vllm or self.use_transformers_continuous_batching:
            # vLLM already returns the sampled tokens' log-probs; otherwise stock TRL generation, untouched.
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        module = self.accelerator.unwrap_model(self.model)  # the module generate() calls (DDP/FSDP/DeepSpeed off)
        module = module.get_base_model() if hasattr(module, "get_base_model") else module  # PEFT: the HF model
        with sampler_logprobs.SamplerLogprobRecorder(module, self.temperature) as recorder:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return completion_ids, recorder.completion_logprobs(completion_ids)

    def _generate(self, prompts):
        outputs = super()._generate(prompts)
        self._sampler_logps = outputs[4]  # final per-completion log-probs (after any tool-call turns)
        return outputs

    def _generate_and_score_completions(self, inputs):
        self._sampler_logps = None
        self._reuse_armed = self._reuses_sampler_logps()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._reuse_armed, self._sampler_logps = False, None
        if self.model.training:
            self._rollout_global_step = self.state.global_step
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        if vllm_is and self.args.vllm_importance_sampling_length_normalized:
            self._length_normalize_is_ratio(output)
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._reuse_armed:
            # One shot: after generation, TRL's first log-prob call is the pi_old pass (ref log-probs come later).
            self._reuse_armed = False
            old_logps = self._sampler_old_logps(input_ids.size(0), logits_to_keep, input_ids.device)
            if old_logps is not None:
                return old_logps, None, None
        with fused_head.vocab_chunk(self.args.logprob_vocab_chunk_size):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )

    def _sampler_old_logps(self, batch_size, width, device):
        """The sampler's log-probs as a `(B, T)` pi_old, or None to fall back to TRL's recompute (logged)."""
        if self._sampler_logps is None:
            if not self._warned_no_sampler_logps:
                logger.warning(
                    "old_logprobs_source='sampler' but this generation path returned no log-probs (e.g. a "
                    "rollout_func without them); recomputing pi_old with a forward pass instead."
                )
                self._warned_no_sampler_logps = True
            return None
        if len(self._sampler_logps) != batch_size:
            raise RuntimeError(
                f"Sampler log-probs cover {len(self._sampler_logps)} completions but the batch has {batch_size}; "
                "use old_logprobs_source='recompute' with this generation setup."
            )
        old_logps = sampler_logprobs.pad_logprobs(self._sampler_logps, width, device)
        # A NaN (vLLM could not score a token) would poison the ratio; every process must take the same branch,
        # since the fallback forward is collective under ZeRO-3.
        has_nan = torch.isnan(old_logps).any().float().reshape(1)
        if self.accelerator.num_processes > 1:
            has_nan = self.accelerator.reduce(has_nan, reduction="sum")
        if has_nan.item() > 0:
            logger.warning("Sampler returned NaN log-probs for some tokens; recomputing pi_old for this rollout batch.")
            return None
        return old_logps

    def _log_sampler_mismatch(self, mode, logps, inputs, mask):
        """Sampler vs trainer log-prob gap, on the mini-batches still at the sampler's weights (no extra forward)."""
        sampler = inputs.get("sampling_per_token_logps")
        if sampler is None or mode != "train" or self.state.global_step != self._rollout_global_step:
            return
        stats = sampler_logprobs.mismatch_stats(logps, sampler, mask, self.epsilon_low, self.epsilon_high)
        for name, value in sampler_logprobs.summarize_mismatch(self.accelerator.gather(stats)).items():
            self._metrics[mode][name].append(value)

    def _length_normalize_is_ratio(self, output):
        """Replace TRL's exp(sum) sequence-level vLLM correction by exp(mean) (see `length_normalized_is_ratio`)."""
        mask = output["completion_mask"]
        mask = mask if "tool_mask" not in output else mask * output["tool_mask"]
        ratio = sampler_logprobs.length_normalized_is_ratio(
            output["old_per_token_logps"],
            output["sampling_per_token_logps"],
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        output["importance_sampling_ratio"] = ratio
        gathered = self.accelerator.gather(ratio.flatten())
        metrics = self._metrics["train" if self.model.training else "eval"]
        for name, value in (("min", gathered.min()), ("mean", gathered.mean()), ("max", gathered.max())):
            metrics[f"sampling/importance_sampling_ratio_length_normalized/{name}"].append(value.item())
