"""`GSPOConfig`: `trl.GRPOConfig` with the GSPO paper's defaults, the `sequence_token` level, and validation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trl import GRPOConfig

from . import fused_head, trl_compat
from .losses import DEFAULT_MAX_LOG_RATIO, LOG_WEIGHT_FUNCTIONS, SEQUENCE_LEVELS
from .padding import SORT_SETTINGS

#: MoE routing replay modes (see routing_replay.py).
ROUTING_REPLAY_MODES = ("none", "R2", "R3")

logger = logging.getLogger(__name__)

#: Loss types whose surrogate is the two-sided clipped ratio (their epsilons must lie in (0, 1)).
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: Loss types that sum tokens over the batch, so a per-sequence weight gets multiplied by the sequence length.
TOKEN_SUM_LOSS_TYPES = ("dapo", "bnpo", "dr_grpo", "cispo")
#: Loss types with no importance ratio to hook (VESPO weights sequences by its own clamped gamma function):
#: GSPOTrainer runs TRL's own code for them, under the non-finite guard.
TRL_NATIVE_LOSS_TYPES = ("vespo",)
KNOWN_LOSS_TYPES = CLIPPED_LOSS_TYPES + ("cispo", "sapo") + TRL_NATIVE_LOSS_TYPES
#: Where pi_old comes from: TRL's extra forward pass, or the sampler's own log-probs (see sampler_logprobs.py).
OLD_LOGPROBS_SOURCES = ("recompute", "sampler")
#: Mini-batch updates per rollout batch in the paper's setting.
PAPER_MINI_BATCHES_PER_ROLLOUT = 4
#: Largest allowed `max_log_ratio`: exp(88.7) overflows float32 (and bfloat16, which has the same exponent range).
MAX_FINITE_LOG_RATIO = 88.0


@dataclass
class GSPOConfig(GRPOConfig):
    r"""
    Configuration for [`GSPOTrainer`]: every [`trl.GRPOConfig`] field, with the GSPO paper's defaults.

    Defaults that differ from `trl.GRPOConfig` (paper, arXiv 2507.18071, Sec. 5):
    - `importance_sampling_level="sequence"` (GSPO) instead of `"token"` (GRPO).
    - `epsilon=3e-4`, `epsilon_high=4e-4` instead of `0.2`: sequence ratios are geometric means, so they stay
      within ~1e-3 of 1; a 0.2 range would never clip.
    - `loss_type="grpo"` (mean over each sequence's tokens, then over sequences) instead of `"dapo"` (token sum,
      which weights each sequence by its length and is not GSPO's objective).
    - `steps_per_generation`: when neither it nor `generation_batch_size` is set, it defaults to
      `4 * gradient_accumulation_steps`, i.e. four optimizer steps (mini-batches) per rollout batch, as in the paper.
      With one update per rollout batch every ratio is exactly 1 and GSPO reduces to GRPO.
    - `beta=0.0` (no KL term), as in `trl.GRPOConfig`.

    Parameters:
        importance_sampling_level (`str`, *optional*, defaults to `"sequence"`):
            `"token"`: GRPO's per-token ratio (upstream TRL behaviour). `"sequence"`: GSPO's length-normalised
            sequence ratio `s_i`. `"sequence_token"`: GSPO-token, `sg[s_i] * pi/sg[pi]` per token, which accepts
            per-token advantages and equals GSPO when every token carries its sequence's advantage.
        allow_token_sum_with_sequence_level (`bool`, *optional*, defaults to `False`):
            Opt in to a token-sum `loss_type` (`dapo`, `bnpo`, `dr_grpo`, `cispo`) with a sequence-level ratio.
            Such a loss weights each sequence by its length, which is not GSPO's objective, so it is an error
            unless set.
        max_log_ratio (`float` or `None`, *optional*, defaults to `20.0`):
            Bound on |log importance weight| applied before `exp`. Inside the bound it changes nothing; outside it
            keeps the ratio finite (fp32 `exp` overflows past ~88). `None` disables the clamp.
        max_consecutive_nonfinite (`int`, *optional*, defaults to `10`):
            Non-finite guard: a micro-batch whose importance ratio or loss is NaN/inf contributes no gradient, and an
            optimizer step whose gradient is NaN/inf (or whose every micro-batch was dropped) is skipped. After this
            many consecutive optimizer steps with such an event, training saves a checkpoint and raises
            `NonFiniteTrainingError`. Counted in the logged metrics `nonfinite/microbatches` and
            `nonfinite/skipped_steps`.
        nonfinite_reward (`str`, *optional*, defaults to `"error"`):
            What to do when a reward function returns NaN or +-inf for a sample. `"error"`: raise, naming the reward
            function, the sample and the value. `"none"`: treat the value like `None` ("not applicable", TRL's
            convention), log a warning and count it in the metric `rewards/<name>/nonfinite`.
        checkpoint_on_signal (`bool`, *optional*, defaults to `True`):
            On SIGTERM or SIGINT during `train()`, finish the current optimizer step, save a checkpoint, then exit
            (SIGTERM: `SystemExit(143)`; SIGINT: `KeyboardInterrupt`). Resume with `resume_from_checkpoint`.
        old_logprobs_source (`str`, *optional*, defaults to `"recompute"`):
            Where pi_old comes from for off-policy mini-batches. `"recompute"`: TRL's extra no-grad forward over the
            rollout batch after generation (stock behaviour). `"sampler"`: the log-probs the sampler computed while
            generating (transformers `generate` or vLLM), which skips that forward pass. Safe when sampler and
            trainer compute the same distribution up to precision (same weights, `log_softmax(logits/T)`): on vLLM
            that needs top_p=1, top_k off, min_p off and repetition_penalty=1; the mismatch is logged under
            `sampler/*` on every on-policy mini-batch. Saves nothing when every mini-batch is on-policy.
        vllm_importance_sampling_length_normalized (`bool`, *optional*, defaults to `False`):
            With vLLM, `old_logprobs_source="recompute"` and a `sequence_*` `vllm_importance_sampling_mode`, use
            `exp(mean_t(log pi_old - log pi_vllm))` as the sampler-trainer correction instead of TRL's
            `exp(sum_t ...)`, which grows with length and masks or truncates long completions.
        diagnostics (`bool`, *optional*, defaults to `True`):
            Record the GSPO diagnostics (`seq_ratio/*`, `clip_fraction/*`, `ratio_dispersion/*`, `logratio_by_len/*`,
            `nonfinite/{logps,old_logps,advantages}`, and `moe/*` router recording on MoE models) on every
            micro-batch. They add no device sync (reduced at log time) but cost ~0.7 ms of tensor ops per micro-batch
            (see `benchmarks/run.py`); `False` turns them off. TRL's own metrics and the non-finite guard stay.
        logprob_vocab_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Vocabulary columns per tile of TRL's fused log-prob head (`None`: TRL's 32768). Without Triton (CPU),
            TRL folds each `[tokens, chunk]` fp32 tile with ~8 tile-sized temporaries in the backward, so at a 151k
            vocabulary x 2k tokens the log-prob path peaks above the size of the full fp32 logits; 4096 cuts that
            peak ~6x (see `benchmarks/run.py`). With Triton (CUDA) the fold is in place and the default is fine.
        routing_replay (`str`, *optional*, defaults to `"none"`):
            MoE routing replay (see `routing_replay.py`). `"none"`: every forward routes natively (the GSPO paper's
            setting). `"R2"`: record the top-k experts of every token in TRL's pi_old forward and force them in the
            loss forward (the paper's "Routing Replay" baseline for GRPO); needs that forward, i.e. off-policy
            mini-batches (`steps_per_generation > gradient_accumulation_steps` or `num_iterations > 1`) and
            `old_logprobs_source="recompute"`. `"R3"`: record the sampler's routes while generating (transformers
            `generate`, vLLM with `enable_return_routed_experts`, or a `rollout_func` returning `routed_experts`) and
            force them in the pi_old and loss forwards, removing the sampler/trainer routing mismatch. Works with every
            `importance_sampling_level`. Gate weights are recomputed from the current router logits at the forced
            experts, so the router keeps training; the load-balancing loss stays on the router's own picks.
        trim_padding (`bool`, *optional*, defaults to `True`):
            Run every forward (loss, pi_old pass, reference pass) only on the columns where some row of that call
            has a real token, and pad the outputs back. TRL pads the whole rollout batch to its longest completion;
            trimming changes no token's inputs or positions, only float rounding (see `trl_gspo/padding.py`).
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

    importance_sampling_level: str = field(
        default="sequence",
        metadata={
            "help": "Where the importance ratio lives. 'sequence' (GSPO, default): one length-normalised ratio per "
            "completion, stable on long answers and MoE models. 'sequence_token' (GSPO-token): the same value per "
            "token but token-wise gradients, for per-token advantages. 'token': GRPO's per-token ratio.",
            "choices": list(LOG_WEIGHT_FUNCTIONS),
        },
    )
    epsilon: float = field(
        default=3e-4,
        metadata={"help": "Lower clip range: ratios below 1 - epsilon stop pushing down. Paper's GSPO value: 3e-4."},
    )
    epsilon_high: float | None = field(
        default=4e-4,
        metadata={
            "help": "Upper clip range: ratios above 1 + epsilon_high stop pushing up. Paper's GSPO value: 4e-4. "
            "For loss_type='cispo' this is CISPO's cap on the ratio instead."
        },
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "How token losses are aggregated. 'grpo' (default): mean per sequence, then over sequences, "
            "which is GSPO's objective. Token-sum types ('dapo', 'bnpo', 'dr_grpo', 'cispo') weight sequences by "
            "length and need allow_token_sum_with_sequence_level with a sequence level. 'luspo' needs 'sequence'; "
            "'sapo' (soft gate instead of a clip) takes any level; 'vespo' runs TRL's own loss code and needs 'token'.",
            "choices": list(KNOWN_LOSS_TYPES),
        },
    )
    allow_token_sum_with_sequence_level: bool = field(
        default=False,
        metadata={
            "help": "Accept a token-sum loss_type with a sequence-level ratio. Off by default because it weights "
            "each sequence by its length, which silently turns GSPO into a different objective."
        },
    )
    max_log_ratio: float | None = field(
        default=DEFAULT_MAX_LOG_RATIO,
        metadata={
            "help": "Clamp |log importance weight| to this bound before exp so a drifting policy or a corrupted "
            "log-prob cannot overflow the ratio to inf. Far outside any clip range, so normal steps are unchanged."
        },
    )
    max_consecutive_nonfinite: int = field(
        default=10,
        metadata={
            "help": "Micro-batches with a NaN/inf ratio or loss contribute nothing and optimizer steps with a NaN/inf "
            "gradient are skipped, so weights never receive a NaN; after this many consecutive affected optimizer "
            "steps the run is broken, not unlucky: save a checkpoint and stop with an error."
        },
    )
    nonfinite_reward: str = field(
        default="error",
        metadata={
            "help": "A NaN/inf reward is a bug in the reward function, so it is an error by default ('error'). 'none' "
            "treats it like None (not applicable, TRL's convention: no reward signal from that function for that "
            "sample), with a warning and the metric rewards/<name>/nonfinite.",
            "choices": ["error", "none"],
        },
    )
    checkpoint_on_signal: bool = field(
        default=True,
        metadata={
            "help": "Save a checkpoint when SIGTERM/SIGINT arrives (preemption, Ctrl-C) at the end of the current "
            "optimizer step, then exit, so a preempted run loses at most one step. Resume with "
            "resume_from_checkpoint."
        },
    )
    old_logprobs_source: str = field(
        default="recompute",
        metadata={
            "help": "Source of pi_old for off-policy mini-batches. 'recompute' (TRL's extra forward pass after "
            "generation) or 'sampler' (reuse the log-probs computed while sampling, skipping that pass; the paper's "
            "infrastructure shortcut, safe because sequence ratios average the engine precision gap; the gap is "
            "logged under sampler/*).",
            "choices": list(OLD_LOGPROBS_SOURCES),
        },
    )
    vllm_importance_sampling_length_normalized: bool = field(
        default=False,
        metadata={
            "help": "Length-normalise TRL's sequence-level vLLM importance-sampling correction (mean instead of sum "
            "of token log-ratios), GSPO-consistent and stable on long completions. Only for sequence_* modes with "
            "old_logprobs_source='recompute' (with 'sampler' the correction is an identity and is turned off)."
        },
    )
    diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log GSPO's per-micro-batch diagnostics (sequence-ratio spread, clip fractions, ratio dispersion "
            "by length, non-finite counts, MoE routing shift): what shows whether GSPO behaves. They cost ~0.7 ms of "
            "tensor ops per micro-batch, so False turns them off for the last bit of speed; TRL's metrics remain."
        },
    )
    logprob_vocab_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Vocabulary columns per tile in TRL's fused log-prob head; None keeps TRL's 32768. On CPU "
            "(no Triton) a smaller tile, e.g. 4096, cuts the log-prob path's peak memory several-fold at large "
            "vocabularies, since TRL's torch fallback keeps several tile-sized fp32 temporaries."
        },
    )

    routing_replay: str = field(
        default="none",
        metadata={
            "help": "MoE routing replay. 'none' (default, the GSPO paper: GSPO needs no replay). 'R2': replay the "
            "experts chosen in TRL's pi_old forward in the loss forward (the paper's GRPO baseline). 'R3': replay the "
            "sampler's experts in the pi_old and loss forwards (removes the sampler/trainer routing mismatch).",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )
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
            "help": "Pack sequences end to end with position_ids restarting at 0 and no attention mask, so no "
            "padding is computed (flash-attention varlen on one row; sdpa/eager: rows no longer than the longest "
            "sequence). Opt-in: on CPU trimming + sorting already removes most padding."
        },
    )

    def __post_init__(self):
        self._validate_counts()  # before TRL's __post_init__, which divides by some of these
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = PAPER_MINI_BATCHES_PER_ROLLOUT * self.gradient_accumulation_steps
        super().__post_init__()
        self._validate()

    def _validate_counts(self):
        """Integer fields TRL divides by or loops over: a bad value would surface as a ZeroDivisionError or a
        TypeError inside TRL, or as a run that silently never generates."""
        minimums = {"num_generations": 2, "num_iterations": 1, "steps_per_generation": 1, "generation_batch_size": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is None and name in ("steps_per_generation", "generation_batch_size"):
                continue  # derived by __post_init__
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                why = " (GRPO/GSPO advantages compare completions within a group)" if name == "num_generations" else ""
                raise ValueError(f"{name}={value!r} is not allowed: it must be an integer >= {minimum}{why}.")

    def _validate(self):
        level, loss_type = self.importance_sampling_level, self.loss_type
        if level not in LOG_WEIGHT_FUNCTIONS:
            raise ValueError(
                f"importance_sampling_level={level!r} is not supported; allowed: {', '.join(LOG_WEIGHT_FUNCTIONS)}."
            )
        if loss_type not in KNOWN_LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not supported; allowed: {', '.join(KNOWN_LOSS_TYPES)}.")
        if loss_type in CLIPPED_LOSS_TYPES:
            for name in ("epsilon", "epsilon_high"):
                value = getattr(self, name)
                if value is not None and not 0.0 < value < 1.0:
                    raise ValueError(
                        f"{name}={value!r} is out of range: the clip range [1 - epsilon, 1 + epsilon_high] needs "
                        f"0 < {name} < 1 (GSPO paper: epsilon=3e-4, epsilon_high=4e-4; GRPO: 0.2 / 0.28)."
                    )
        elif loss_type == "cispo" and self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high={self.epsilon_high!r} is CISPO's ratio cap and must be > 0 (e.g. 5.0).")
        if self.delta is not None and self.delta <= 1 + (self.epsilon_high or self.epsilon):
            raise ValueError(
                f"delta={self.delta!r} must be greater than 1 + epsilon_high; a smaller cap would clip ratios "
                "inside the trust region."
            )
        if self.max_log_ratio is not None and not 0 < self.max_log_ratio <= MAX_FINITE_LOG_RATIO:
            raise ValueError(
                f"max_log_ratio={self.max_log_ratio!r} is out of range: it must satisfy 0 < max_log_ratio <= "
                f"{MAX_FINITE_LOG_RATIO} (beyond that exp overflows in fp32/bf16), or be None to disable the clamp."
            )
        if isinstance(self.max_consecutive_nonfinite, bool) or not isinstance(self.max_consecutive_nonfinite, int) or (
            self.max_consecutive_nonfinite < 1
        ):
            raise ValueError(
                f"max_consecutive_nonfinite={self.max_consecutive_nonfinite!r} must be an integer >= 1 (consecutive "
                "optimizer steps with a NaN/inf before training stops)."
            )
        if self.nonfinite_reward not in ("error", "none"):
            raise ValueError(f"nonfinite_reward={self.nonfinite_reward!r} is not supported; allowed: error, none.")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0 (sampling divides the logits by it).")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta!r} must be >= 0 (KL penalty coefficient; 0 disables it, the default).")
        if level in SEQUENCE_LEVELS and loss_type in TOKEN_SUM_LOSS_TYPES and not self.allow_token_sum_with_sequence_level:
            raise ValueError(
                f"loss_type={loss_type!r} sums token losses, so with importance_sampling_level={level!r} every "
                "sequence is weighted by its length, which is not GSPO's objective. Use loss_type='grpo' (the paper's "
                "per-sequence mean), or set allow_token_sum_with_sequence_level=True to accept it knowingly."
            )
        if loss_type == "luspo" and level != "sequence":
            raise ValueError(
                f"loss_type='luspo' is a length-weighted variant of GSPO and needs importance_sampling_level='sequence', "
                f"got {level!r}."
            )
        if loss_type == "vespo" and level != "token":
            raise ValueError(
                f"loss_type='vespo' computes its own sequence-level weights and ignores importance_sampling_level; set "
                f"importance_sampling_level='token' (got {level!r})."
            )
        self._validate_old_logprobs_source()
        self._validate_routing_replay()
        self._validate_padding()
        on_policy = self.num_iterations == 1 and self.steps_per_generation <= self.gradient_accumulation_steps
        if on_policy and level != "token":
            logger.warning(
                "steps_per_generation (%s) <= gradient_accumulation_steps (%s) with num_iterations=1: every update is "
                "on-policy, all importance ratios are exactly 1 and GSPO reduces to GRPO. The paper trains 4 "
                "mini-batches per rollout batch (steps_per_generation = 4 * gradient_accumulation_steps).",
                self.steps_per_generation,
                self.gradient_accumulation_steps,
            )

    def _validate_padding(self):
        for name in ("trim_padding", "padding_free"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False.")
        if self.sort_by_length not in SORT_SETTINGS:
            raise ValueError(
                f"sort_by_length={self.sort_by_length!r} is not supported; allowed: {', '.join(SORT_SETTINGS)}."
            )
        if self.padding_free and not self.trim_padding:
            raise ValueError(
                "padding_free=True removes all padding, but trim_padding=False asks to keep it; set trim_padding=True "
                "(the default) or padding_free=False."
            )

    def _validate_old_logprobs_source(self):
        chunk = self.logprob_vocab_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"logprob_vocab_chunk_size={chunk!r} must be a positive int, or None for TRL's default.")
        if chunk is not None and not fused_head.available():
            raise ValueError(
                f"logprob_vocab_chunk_size={chunk!r} sets the tile of TRL's fused log-prob head, which the installed "
                "TRL does not have (it arrived in TRL 1.15; older releases compute the completion logits in full). "
                "Leave it None, or upgrade TRL."
            )
        source = self.old_logprobs_source
        if source not in OLD_LOGPROBS_SOURCES:
            raise ValueError(
                f"old_logprobs_source={source!r} is not supported; allowed: {', '.join(OLD_LOGPROBS_SOURCES)}."
            )
        mode = self.vllm_importance_sampling_mode
        if self.vllm_importance_sampling_length_normalized and not mode.startswith("sequence_"):
            raise ValueError(
                f"vllm_importance_sampling_length_normalized=True needs a sequence-level vllm_importance_sampling_mode "
                f"('sequence_mask' or 'sequence_truncate'), got {mode!r}; token modes have no length to normalise."
            )
        if source != "sampler":
            return
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "old_logprobs_source='sampler' needs per-token log-probs from the sampler, which transformers "
                "continuous batching (use_transformers_continuous_batching=True) does not return; use "
                "old_logprobs_source='recompute' or the regular generate / vLLM paths."
            )
        if self.use_vllm:
            # vLLM's processed log-probs are renormalised after these processors; the trainer's are not.
            processed = {
                "top_p": self.top_p != 1.0,
                "top_k": self.top_k not in (None, 0, -1),
                "min_p": self.min_p not in (None, 0.0),
                "repetition_penalty": self.repetition_penalty != 1.0,
            }
            bad = [f"{name}={getattr(self, name)!r}" for name, on in processed.items() if on]
            if bad:
                raise ValueError(
                    f"old_logprobs_source='sampler' with vLLM and {', '.join(bad)}: vLLM returns log-probs of the "
                    "truncated/penalised sampling distribution, while the trainer's pi_theta is log_softmax(logits / "
                    "temperature), so every ratio would be biased. Use top_p=1.0, top_k=0, min_p=None, "
                    "repetition_penalty=1.0, or old_logprobs_source='recompute'."
                )
            if self.vllm_importance_sampling_correction:
                # pi_old is then the sampler's log-prob, so TRL's pi_old / pi_vllm correction is exp(0) = 1.
                logger.warning(
                    "old_logprobs_source='sampler' makes the vLLM importance-sampling correction an identity "
                    "(pi_old is vLLM's own log-prob); turning vllm_importance_sampling_correction off. The "
                    "sampler-trainer gap now enters GSPO's clipped sequence ratio and is logged under sampler/*."
                )
                self.vllm_importance_sampling_correction = False
            if self.vllm_importance_sampling_length_normalized:
                raise ValueError(
                    "vllm_importance_sampling_length_normalized=True has no effect with old_logprobs_source='sampler' "
                    "(the correction is an identity and is turned off); unset one of them."
                )

    def _validate_routing_replay(self):
        mode = self.routing_replay
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={mode!r} is not supported; allowed: {', '.join(ROUTING_REPLAY_MODES)}.")
        if mode == "R2":
            old_pass = trl_compat.old_logprob_pass_runs(
                self.steps_per_generation, self.num_iterations, self.gradient_accumulation_steps,
                bool(self.use_vllm and self.vllm_importance_sampling_correction),
            )  # fmt: skip
            if not old_pass:
                raise ValueError(
                    f"routing_replay='R2' records routes in TRL's pi_old forward, which does not run here: with "
                    f"steps_per_generation={self.steps_per_generation} <= gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps} and num_iterations={self.num_iterations} every mini-batch is "
                    "on-policy, so the loss forward already routes exactly as pi_old did and replay would change "
                    "nothing. Use several mini-batches per rollout (e.g. steps_per_generation = 4 * "
                    "gradient_accumulation_steps) or routing_replay='none'."
                )
            if self.old_logprobs_source == "sampler":
                raise ValueError(
                    "routing_replay='R2' records routes in TRL's pi_old forward, which old_logprobs_source='sampler' "
                    "skips. Use routing_replay='R3' (the sampler's routes, consistent with the sampler's log-probs) or "
                    "old_logprobs_source='recompute'."
                )
        if mode != "none" and self.use_liger_kernel:
            raise ValueError(
                f"routing_replay={mode!r} replays routes in TRL's log-prob forward, which use_liger_kernel=True replaces "
                "by Liger's fused loss; set use_liger_kernel=False or routing_replay='none'."
            )
        if mode == "R3" and self.use_transformers_continuous_batching:
            raise ValueError(
                "routing_replay='R3' needs the sampler's expert routes, which transformers continuous batching "
                "(use_transformers_continuous_batching=True) does not expose; use generate, vLLM, or routing_replay='R2'."
            )
