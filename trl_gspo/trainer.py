"""`GSPOTrainer`: `trl.GRPOTrainer` whose policy loss goes through three hooks, and the one seam on TRL.

TRL 1.16 computes the whole loss in one method, `GRPOTrainer._compute_loss`, with the importance ratio and the
clipped objective written inline. This class owns that method: generation, rewards, advantages, old/ref log-probs,
vLLM, PEFT, optimisation and logging stay TRL's. The loss is rebuilt as a short pipeline that calls TRL's own helpers
for the forward pass and masks, and three hooks for what GSPO changes:

    importance_log_weights(logps, old_logps, mask)   # token / sequence / sequence_token (losses.py)
    policy_loss(ratio, advantages, logps)            # the loss type's surrogate (losses.POLICY_LOSSES)
    behaviour_weight(inputs, old_logps, mask)        # weight for the sampling policy: decoupled pi_prox / mu when
                                                     # generation runs ahead (rollout/async_rollouts.py), else TRL's vLLM one

plus `token_advantages(inputs)`, the place to supply per-token advantages for GSPO-token. Everything between (KL term,
entropy mask and bonus, off-policy mask, aggregation and gradient-accumulation normalisation, MoE aux loss, metrics)
follows TRL's semantics; `tests/test_parity.py` checks loss and gradients against stock `GRPOTrainer`.

This module is also the one place where trl-gspo touches TRL: every TRL / transformers method the trainer overrides is
defined here, a few lines each, marked `@override(part)` and saying in its docstring why no public seam does it,
delegating to the part that does the work (common/seam.py holds the runtime patches; docs/design.md tables both). The
features are parts the trainer builds in `__init__` with what they need passed in:

    diagnostics        guards/diagnostics.py       GSPO's per-micro-batch diagnostics, reduced at `log`
    nonfinite          guards/nonfinite.py          a NaN/inf micro-batch contributes nothing; bad steps skipped
    moe_routing        moe/routing_replay.py        router hooks: routes recorded, replayed (R2 / R3), MoE metrics
    sampler_logprobs   rollout/sampler_logprobs.py  pi_old from the sampler, the sampler-trainer gap
    padding            forward/padding.py           trimmed / sorted / packed layouts allowed, micro-batch order
    logprob_forward    forward/pipeline.py          every log-prob forward, planned per model
    rollout            rollout/pipeline.py          TRL's rollout code steered: sampling apart from scoring
    rollout_source     rollout/sources.py           how a rollout batch is produced (TRL's, dynamic, asynchronous)
    precision          guards/precision.py          bf16 weights without fp32 master weights: upcast, refused or allowed
    weight_updates     guards/weight_updates.py     `weights_changed`: did the last optimizer step move the weights
    clip_band          clip_band.py                 the clip range: fixed, from each update's spread, or a target

Parts read the trainer's changing state (mode, step, TRL's metric lists) through a `RunView` (common/trl_compat.py).
"""

from __future__ import annotations

import os
import shutil

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.extras.profiling import profiling_decorator
from trl.trainer.utils import RepeatSampler

from . import losses
from .clip_band import ClipBand
from .common import engine, metrics, model_card
from .common.seam import TRLCalls, colocated_engine_with_routes, override
from .common.trl_compat import RunView
from .config import GSPOConfig, check_reference_source, log_differences_from_grpo, trainer_args
from .forward import padding
from .forward.pipeline import LogprobForward
from .guards import checkpointing
from .guards.diagnostics import Diagnostics
from .guards.nonfinite import NonFiniteGuard
from .guards.precision import check_trainable_precision, saved_as_loaded
from .guards.rewards_guard import check_reward_matrix, guard_reward_funcs
from .guards.weight_updates import WeightUpdates
from .moe.routing import RouterHooks
from .moe.routing_replay import MoERouting
from .rollout import colocate_cpu_sync, served_model
from .rollout.async_rollouts import DecoupledBehaviourWeight
from .rollout.pipeline import RolloutPipeline, split_rollout
from .rollout.sampler_logprobs import SamplerLogprobs
from .rollout.shared_prefill import SharedPrefill
from .rollout.sources import rollout_source
from .rollout.vllm_setup import check_vllm_setup
from .token_advantages import checked_advantages

#: Optional multimodal inputs TRL forwards to the model when present in a batch.
_FORWARD_KEYS = tuple(
    "pixel_values image_grid_thw num_images pixel_attention_mask spatial_shapes num_tiles image_sizes token_type_ids "
    "mm_token_type_ids image_position_ids".split()
)


class GSPOTrainer(GRPOTrainer):
    """GRPO trainer with GSPO (`importance_sampling_level="sequence"`) and GSPO-token (`"sequence_token"`).

    Drop-in for `trl.GRPOTrainer`: same constructor, `args` must be a [`GSPOConfig`] (its defaults are the
    paper's). To train GSPO-token with per-token advantages, subclass and override [`token_advantages`].
    """

    def __init__(self, model, reward_funcs=None, args: GSPOConfig | None = None, *positional, **kwargs):
        args = trainer_args(model, args)
        check_reference_source(model, args, kwargs.get("peft_config"))
        colocate_cpu_sync.check_cpu_colocate_supported(args.use_vllm, args.vllm_mode)  # before vLLM's engine starts
        check_vllm_setup(args, model)  # vLLM missing, a server push without CUDA, a model vLLM cannot load: one line
        # Model card (name, paper, tags) of the variant trained; set before TRL's __init__ tags the model with them.
        self._name, self._paper, self._tag_names = model_card.card_fields(
            args.importance_sampling_level, args.loss_type, GRPOTrainer._paper
        )
        with colocated_engine_with_routes(args.routing_replay == "R3" and args.use_vllm):  # R3: vLLM returns routes
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self.run, self.trl = RunView(self), TRLCalls(GSPOTrainer, self)  # TRL's state; TRL's own implementations
        # bf16 weights of a full fine-tune without fp32 master weights: upcast (default), refused or allowed, before the
        # optimizer exists (guards/precision.py); `precision.line()` says what runs.
        peft = kwargs.get("peft_config") is not None or hasattr(self.model, "peft_config")
        requested = (args.model_init_kwargs or {}).get("dtype") if isinstance(model, str) else None
        self.precision = check_trainable_precision(
            self.model, self.accelerator, args.low_precision_weights, peft, requested
        )
        engine.agree_gradient_accumulation(self.accelerator, args.gradient_accumulation_steps)  # DeepSpeed's, quietly
        if self.accelerator.is_main_process:
            log_differences_from_grpo(args)  # what switching the import changed, said once
        self.loss_fn = losses.POLICY_LOSSES[args.loss_type]
        self.clip_band = ClipBand.for_config(args, (self.epsilon_low, self.epsilon_high), self.accelerator, self.run)
        self._build_parts(args)
        served_model.check_served_model(self)  # vLLM server mode: the server serves this model (before any step)
        colocate_cpu_sync.enable_cpu_colocate_sync(self)  # vLLM colocate on its CPU build: syncs that reach the engine
        guard_reward_funcs(self.reward_funcs, self.reward_func_names, args.nonfinite_reward, self._count_nonfinite)
        self.nonfinite = NonFiniteGuard(self.run, self.accelerator, args.max_consecutive_nonfinite)
        self.sampler_epoch = checkpointing.SamplerEpoch()  # each epoch's prompt order, also after a resume
        self.signal_checkpoint = checkpointing.SignalCheckpoint(self.accelerator) if args.checkpoint_on_signal else None
        self.weight_updates = WeightUpdates(self.precision.line)  # weights_changed, sampled around each optimizer step
        for part in (self.nonfinite, self.sampler_epoch, self.signal_checkpoint, self.weight_updates, self.clip_band):
            if part is not None:
                self.add_callback(part)

    def _build_parts(self, args: GSPOConfig) -> None:
        """The features of the forward and rollout paths, each with what it needs (module docstring)."""
        aux_loss = getattr(self, "aux_loss_enabled", False)
        self.diagnostics = Diagnostics(args.diagnostics, self.max_completion_length)
        per_micro_batch = padding.sort_changes_statistics(
            self.loss_fn, getattr(self, "_entropy_bonus_enabled", False), self.top_entropy_quantile, aux_loss
        )
        self.padding = padding.PaddingRemoval(args, self.run, self.num_iterations, per_micro_batch)
        hooks = RouterHooks.for_model(self.model) if args.diagnostics or args.routing_replay != "none" else None
        self.moe_routing = MoERouting(self.run, args.routing_replay, hooks, self.model.config, self.diagnostics)
        self.moe_routing.check(getattr(self, "tools", None))
        if args.routing_replay == "R3" and self.use_vllm:
            self.moe_routing.capture_vllm_routes(self.vllm_generation, self.accelerator)
        clip = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        length_normalized = args.vllm_importance_sampling_length_normalized  # TRL's vLLM correction as exp(mean)
        correction = (self.vllm_importance_sampling_mode, *clip) if length_normalized else None
        self.sampler_logprobs = SamplerLogprobs(
            self.run, self.accelerator, args.old_logprobs_source, self.temperature, correction
        )
        self.logprob_forward = LogprobForward(
            args,
            self.run,
            self.accelerator,
            trl=self.trl,
            sampler=self.sampler_logprobs,
            routes=self.moe_routing,
            padding=self.padding,
            pad_token_id=getattr(self.processing_class, "pad_token_id", None),
            aux_loss=aux_loss,
            reference=getattr(self, "ref_model", None),
        )
        self.rollout = self._rollout_pipeline(args.shared_prefill)
        self.rollout_source = rollout_source(self, self.rollout)
        self.behaviour = DecoupledBehaviourWeight(args, self.diagnostics.windows["train"])

    def _rollout_pipeline(self, shared_prefill: bool) -> RolloutPipeline:
        prefill = SharedPrefill(self.run, self.accelerator, self.moe_routing, shared_prefill)
        return RolloutPipeline(
            self, self.run, self.trl, sampler=self.sampler_logprobs, routes=self.moe_routing, prefill=prefill
        )

    def _count_nonfinite(self, name: str, count: int) -> None:
        """`rewards/<name>/nonfinite` (guards/rewards_guard.py, `nonfinite_reward="none"`)."""
        self.run.log_metric(f"rewards/{name}/nonfinite", count)

    # ------------------------------------------------------------------------------------------ the rollout path
    @override("rollout/pipeline.py, forward/padding.py")
    @profiling_decorator
    def _prepare_inputs(self, generation_batch):
        """TRL's rollout buffer (when a batch is due, its shuffle and split) has no hook: the rollout source makes the
        batch, and the micro-batches are ordered for the forwards."""
        if not self.model.training:
            self.rollout_source.pause()  # evaluation generates on the main thread
            return self._generate_and_score_completions(generation_batch)
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:  # None: resumed, no buffer
            batch = self.rollout_source.next_batch(generation_batch)
            cost = self.logprob_forward.loss_cost_estimator()
            self._buffered_inputs = self.padding.arrange(split_rollout(batch, spg), self._step, cost)
        self.rollout_source.poll()
        return self._buffered_inputs[self._step % spg]

    @override("rollout/pipeline.py")
    def _generate_and_score_completions(self, inputs):
        """The sampler's log-probs and the MoE routes are recorded around TRL's scoring, and the batch is stamped with
        the step that sampled it (a `rollout_func` replaces generation only)."""
        return self._rollout().generate_and_score(inputs)

    @override("rollout/pipeline.py")
    def _generate(self, prompts):
        """Completions sampled earlier (dynamic sampling, asynchronous generation) reach TRL's scoring here, and a
        source that scores later stops here."""
        return self._rollout().generate(prompts)

    @override("rollout/pipeline.py")
    def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # arguments vary across TRL releases (trl_compat)
        """TRL returns neither the sampler's raw log-probs nor R3's routes from transformers' `generate`, and has no
        way to hand the call to a generator thread."""
        return self._rollout().generate_single_turn(prompt_ids, args, kwargs)

    @override("guards/rewards_guard.py, rollout/dynamic_sampling.py")
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's reward matrix is checked (inf, a reward model's NaN) before the advantages; dynamic sampling scores
        rows whose rewards it gathered while filling the batch."""
        given = self._rollout().given_rewards
        if given is not None:
            return given
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        check_reward_matrix(rewards_per_func, self.reward_funcs, self.reward_func_names)
        return rewards_per_func

    def _rollout(self) -> RolloutPipeline:
        """The rollout pipeline. TRL's own unit tests build a trainer with `object.__new__` and call its generation
        methods: such a trainer gets parts that record nothing (no sampler reuse, no MoE routes)."""
        if "rollout" not in vars(self):
            self.run, self.trl = RunView(self), TRLCalls(GSPOTrainer, self)
            self.sampler_logprobs = SamplerLogprobs(self.run, self.accelerator)
            self.moe_routing = MoERouting(self.run, "none", None, None, None)
            self.rollout = self._rollout_pipeline(shared_prefill=False)
        return self.rollout

    # ------------------------------------------------------------------------------------------ the forward path
    @override("forward/pipeline.py")
    @profiling_decorator
    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):  # TRL's arguments (trl_compat)
        """TRL calls it for every log-prob forward (loss, pi_old, reference), with no hook for the layout of the model
        calls, the sampler's pi_old or the router pass."""
        return self.logprob_forward(model, *args, **kwargs)

    @override("forward/pipeline.py, moe/routing_replay.py")
    def training_step(self, *args, **kwargs):
        """Replayed routes and the segment attention stay armed through the backward (gradient checkpointing
        recomputes on them) and are disarmed before anything generates, also when the step raises; no callback
        fires between a micro-step's backward and the next."""
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self.logprob_forward.release()

    @override("forward/pipeline.py, moe/routing_replay.py")
    def prediction_step(self, *args, **kwargs):
        """As `training_step`, for evaluation: replayed routes and the segment attention are disarmed after each
        evaluation batch, also when it raises."""
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self.logprob_forward.release()

    # ---------------------------------------------------------------------------------------------- logging
    @override("guards/diagnostics.py, forward/padding.py, guards/weight_updates.py")
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL averages its metric lists here, before any callback sees the logs: the diagnostics and throughput
        windows and the last step's `weights_changed` are reduced across processes into those lists first."""
        mode = self.run.mode
        values = self.diagnostics.flush(mode, self.accelerator)
        if mode == "train":  # TRL's own split: training logs are the train-mode ones (every rank calls log)
            values.update(self.padding.flush(self.accelerator))
            values.update(self.weight_updates.flush(self.accelerator, logs.get("grad_norm"), self.state.global_step))
        for name, value in values.items():
            self._metrics[mode][name].append(value)
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------ checkpoints, resume
    @override("guards/checkpointing.py, clip_band.py")
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """Resume only from complete checkpoints of this model, with TRL's rollout buffer, the rollout source and the
        clip band put back; the signal handlers and the source are released when training ends or raises."""
        resume_from_checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint is not None:
            model = self.accelerator.unwrap_model(self.model)
            name = f"the trainer's model ({getattr(model.config, '_name_or_path', '') or type(model).__name__})"
            if problem := checkpointing.checkpoint_model_mismatch(resume_from_checkpoint, model.config, name):
                raise checkpointing.ResumeError(problem)  # before HF loads the weights: torch lists every shape
            process, device = self.accelerator.process_index, self.accelerator.device
            state = checkpointing.load_rollout_state(resume_from_checkpoint, process, device)
            spg = self.args.steps_per_generation
            if state is not None and checkpointing.rollout_state_matches(state, spg, resume_from_checkpoint):
                self._step, self._buffered_inputs = state["step"], state["buffered_inputs"]
                self.rollout_source.load_state_dict(state.get("source", {}))
            self.clip_band.load(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:  # also when training raised: give the process its own signal handlers back, stop the rollout source
            if self.signal_checkpoint is not None:
                self.signal_checkpoint.restore_handlers()
            self.rollout_source.close()

    @override("guards/checkpointing.py")
    def _get_train_sampler(self, *args, **kwargs):
        """TRL's sampler draws each epoch's order from one generator, so a run resumed in epoch 2 would replay epoch
        1's; the sampler is made only here."""
        sampler = super()._get_train_sampler(*args, **kwargs)
        if type(sampler) is RepeatSampler:
            sampler = checkpointing.EpochRepeatSampler.like(sampler)
            self.sampler_epoch.follow(sampler)
        return sampler

    @override("guards/checkpointing.py, clip_band.py")
    def _save_checkpoint(self, model, trial):
        """A checkpoint's completion marker is deleted before HF writes the folder and written last, with TRL's
        rollout buffer and the clip band beside it (HF does not save them); `on_save` comes too late for the first."""
        path = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with checkpointing.completion_marked(path, self.args.should_save, self.accelerator):
            super()._save_checkpoint(model, trial)
            state = {"step": self._step, "buffered_inputs": self._buffered_inputs}
            state["source"] = self.rollout_source.state_dict()
            checkpointing.save_rollout_state(path, self.accelerator.process_index, state)
            self.clip_band.save(path, self.args.should_save)

    @override("guards/checkpointing.py")
    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers < 5.18 loads the optimizer state onto the `cpu:0` of a plain multi-process CPU run, which
        torch cannot map back; there it is loaded on `cpu`."""
        engine = self.is_deepspeed_enabled or self.is_fsdp_enabled
        if checkpointing.optimizer_needs_cpu_map(self.args, engine):
            if checkpointing.load_optimizer_and_scheduler(checkpoint, self.optimizer, self.lr_scheduler):
                return
        super()._load_optimizer_and_scheduler(checkpoint)

    @override("guards/nonfinite.py")
    def _get_grad_norm(self, model, grad_norm=None):
        """HF computes the pre-clip gradient norm here and hands it to no callback; the non-finite guard's step check
        reuses it rather than pass over the gradients again."""
        norm = super()._get_grad_norm(model, grad_norm)
        self.nonfinite.observe_grad_norm(norm)
        return norm

    @override("common/model_card.py, guards/precision.py")
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The final save writes TRL's model card (variant, paper, tags) next to the weights, and an upcast run's
        weights in the dtype they were loaded in; checkpoints and `push_to_hub` write their cards through TRL already."""
        with saved_as_loaded(self.model, self.precision, final=not _internal_call):  # checkpoints keep fp32 weights
            super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        output_dir = output_dir or self.args.output_dir
        self.create_model_card(model_name=os.path.basename(os.path.normpath(output_dir)))  # into args.output_dir
        card = os.path.join(self.args.output_dir, "README.md")
        if os.path.abspath(output_dir) != os.path.abspath(self.args.output_dir) and os.path.exists(card):
            shutil.copyfile(card, os.path.join(output_dir, "README.md"))

    @override("common/model_card.py")
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card names a base model only by Hub id; one loaded from a local folder is named by the folder."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            base = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None)
            model_card.name_local_base_model(os.path.join(self.args.output_dir, "README.md"), base)

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
        """Hook 2: per-token (or per-sequence) policy loss from the ratio: the loss type's surrogate (the two-sided
        clipped surrogate, CISPO or SAPO's soft gate; losses.POLICY_LOSSES)."""
        return self.loss_fn.surrogate(ratio, advantages, logps, self.clip_band.settings)

    def behaviour_weight(self, inputs: dict, proximal_logps, mask) -> torch.Tensor | None:
        """Hook 3: detached weight, `(B, 1)` or `(B, T)`, for the policy that sampled the batch (multiplies the loss),
        or None. Asynchronous generation: the decoupled objective's `pi_prox / mu`, `pi_prox` being the pi_old the
        ratio is anchored on (rollout/async_rollouts.py). Synchronous vLLM: TRL's sampler correction, computed at
        scoring."""
        if self.args.async_generation and self.model.training:
            return self.behaviour(inputs, proximal_logps, mask)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"]
        return None

    # --------------------------------------------------------------------------------------------- the loss
    @override("the loss (losses.py)")
    def _compute_loss(self, model, inputs):
        """TRL computes the ratio, the clip and the aggregation inline here, with no hook for any of them."""
        mode = self.run.mode
        at_sampler_weights = mode == "train" and self.state.global_step == self.rollout.sampled_at
        with self.moe_routing.loss_forward(inputs, at_sampler_weights):  # moe/routing_replay.py: replay, metrics
            if self.loss_fn.native:  # VESPO has no ratio to hook: TRL's code, guarded (guards/nonfinite.py)
                return self.nonfinite.guard_loss(super()._compute_loss(model, inputs), mode)
            return self._gspo_loss(model, inputs, mode, at_sampler_weights)

    def _gspo_loss(self, model, inputs, mode: str, at_sampler_weights: bool):
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # multi-turn tool use: tool output is not the model's
            mask = mask * inputs["tool_mask"]

        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)

        advantages = checked_advantages(self.token_advantages(inputs), mask, self.importance_sampling_level)
        # pi_old = sg[pi_theta] where TRL skips its pass; all ratios are 1 there and where it ran at this step's weights
        old_logps = inputs.get("old_per_token_logps")
        ratios_one = mode == "train" and (old_logps is None or self.rollout.pi_old_at == self.state.global_step)
        old_logps = logps.detach() if old_logps is None else old_logps

        log_weights = self.importance_log_weights(logps, old_logps, mask)
        self.clip_band.fit(mode, log_weights, mask, ratios_one)  # clip_spread_scale: this micro-batch's band
        self.sampler_logprobs.log_mismatch(mode, logps, inputs, mask, *self.clip_band.band, at_sampler_weights)
        ratio = losses.importance_ratio(log_weights, self.args.max_log_ratio)
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

        loss, policy_loss = self.loss_fn.aggregate(per_token_loss, mask, self._normalizers(inputs, mode))
        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropies, mask if entropy_mask is None else mask * entropy_mask, mode)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        low, high = self.loss_fn.clip.indicators(ratio.detach(), advantages, self.clip_band.settings)
        self.diagnostics.record(mode, logps, old_logps, low, high, advantages, mask)
        self.clip_band.record(mode, low, high, mask, ratios_one)  # clip_target_fraction: the step's counts
        trl_metrics = metrics.loss_metrics(
            self.loss_fn.clip, low, high, mask, entropies, per_token_kl, self.accelerator
        )
        for name, value in trl_metrics.items():  # TRL's names and values (common/metrics.py)
            self._metrics[mode][name].append(value)
        return self.nonfinite.guard_loss(loss, mode, ratio, logps)  # NaN/inf: the micro-batch counts for nothing

    # ------------------------------------------------------------------------------------------- internals
    def _accumulation(self, mode: str) -> float:
        """Divisor that makes accumulated micro-batch gradients average (TRL turns HF's own scaling off)."""
        return self.current_gradient_accumulation_steps if mode == "train" else 1.0

    def _normalizers(self, inputs, mode) -> losses.Normalizers:
        """What the loss type's aggregation divides by (losses.AGGREGATIONS), from TRL's accumulation state."""

        # dapo / cispo: the active tokens of the whole accumulated generation batch, this process's share per micro-step
        def batch_tokens():  # read only by the aggregations that need it (TRL's `num_items_in_batch`)
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                tokens = tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return tokens

        return losses.Normalizers(self._accumulation(mode), self.max_completion_length, batch_tokens)

    def _entropy_bonus(self, entropies, effective_mask, mode) -> torch.Tensor:
        """`coef * mean entropy` to subtract from the loss, with TRL's adaptive coefficient controller."""
        entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / self._accumulation(mode)
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0  # the controller only pays the bonus while entropy is at or below its target
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
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
