"""`GSPOConfig`: `trl.GRPOConfig` with the GSPO paper's defaults, the `sequence_token` level, and validation.

The fields of each feature live next to the feature, in a small options dataclass that also validates them
(`PaddingOptions` in forward/padding.py, `RoutingReplayOptions` in moe/routing_replay.py, ...; errors in the style of
common/validation.py). `GSPOConfig` inherits them all and holds what is GSPO itself: the level, the clip range, the loss
aggregation and the log-ratio clamp, with the paper's defaults.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, field, fields

from trl import GRPOConfig

from .clip_band import ClipBandOptions, moving_band_field
from .common.optimizers import check_optimizer_package
from .common.validation import check_choice
from .forward.fused_head import FusedHeadOptions
from .forward.padding import PaddingOptions
from .forward.shared_prefix import SharedPrefixOptions
from .guards.checkpointing import CheckpointOptions
from .guards.diagnostics import DiagnosticsOptions
from .guards.nonfinite import NonFiniteOptions
from .guards.precision import PrecisionOptions
from .guards.rewards_guard import RewardGuardOptions
from .losses import DEFAULT_MAX_LOG_RATIO, LOG_WEIGHT_FUNCTIONS, POLICY_LOSSES, SEQUENCE_LEVELS
from .moe.routing_replay import RoutingReplayOptions
from .rollout.async_options import AsyncOptions
from .rollout.dynamic_sampling import DynamicSamplingOptions
from .rollout.sampler_logprobs import SamplerLogprobOptions
from .rollout.shared_prefill import SharedPrefillOptions

logger = logging.getLogger(__name__)

#: Every `loss_type`, in the registry's order (losses.py: its surrogate, aggregation, clip and metrics).
KNOWN_LOSS_TYPES = tuple(POLICY_LOSSES)
#: Mini-batch updates per rollout batch in the paper's setting.
PAPER_MINI_BATCHES_PER_ROLLOUT = 4
#: Largest allowed `max_log_ratio`: exp(88.7) overflows float32 (and bfloat16, which has the same exponent range).
MAX_FINITE_LOG_RATIO = 88.0

#: Each feature's fields and their validation, in the order they are checked.
FEATURE_OPTIONS = (
    ClipBandOptions,
    PrecisionOptions,
    NonFiniteOptions,
    RewardGuardOptions,
    CheckpointOptions,
    FusedHeadOptions,
    SamplerLogprobOptions,
    SharedPrefillOptions,
    DiagnosticsOptions,
    RoutingReplayOptions,
    PaddingOptions,
    SharedPrefixOptions,
    DynamicSamplingOptions,
    AsyncOptions,
)


@dataclass
class GSPOConfig(*FEATURE_OPTIONS, GRPOConfig):
    r"""
    Configuration for [`GSPOTrainer`]: every [`trl.GRPOConfig`] field, with the GSPO paper's defaults, plus each
    feature's fields (documented in its options class: `ClipBandOptions`, `PrecisionOptions`, `NonFiniteOptions`,
    `RewardGuardOptions`, `CheckpointOptions`, `FusedHeadOptions`, `SamplerLogprobOptions`, `SharedPrefillOptions`,
    `DiagnosticsOptions`, `RoutingReplayOptions`, `PaddingOptions`, `SharedPrefixOptions`, `DynamicSamplingOptions`,
    `AsyncOptions`).

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

    def __post_init__(self):
        # The arguments as given, before any default is derived from them: `differences_from_grpo` tells which ones
        # the user set (GRPOConfig would keep those) from the ones GSPOConfig's defaults filled in.
        self._arguments = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        self._validate_counts()  # before TRL's __post_init__, which divides by some of these
        given = {"steps_per_generation": self.steps_per_generation, "generation_batch_size": self.generation_batch_size}
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = PAPER_MINI_BATCHES_PER_ROLLOUT * self.gradient_accumulation_steps
        try:
            super().__post_init__()
        except ValueError as err:
            generation_batch = self.generation_batch_size
            if isinstance(generation_batch, int) and generation_batch % self.num_generations:
                raise ValueError(self._generation_batch_message(given)) from err
            raise
        self._validate()

    def _generation_batch_message(self, given: dict) -> str:
        """TRL's "generation_batch_size (32) must be divisible by num_generations (3)", saying where 32 comes from
        (the user may never have set it)."""
        batch, n = self.generation_batch_size, self.num_generations
        if given["generation_batch_size"] is not None:
            source = f"generation_batch_size={batch} (set in the config)"
        else:
            steps = self.steps_per_generation
            why = (
                "set in the config"
                if given["steps_per_generation"] is not None
                else f"the default: {PAPER_MINI_BATCHES_PER_ROLLOUT} x gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}, the paper's {PAPER_MINI_BATCHES_PER_ROLLOUT} mini-batches per "
                "rollout"
            )
            processes = batch // (self.per_device_train_batch_size * steps)
            source = (
                f"the generation batch of {batch} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {processes} process(es) x steps_per_generation {steps} "
                f"({why})"
            )
        divisors = [d for d in range(2, batch + 1) if batch % d == 0][:6]
        return (
            f"num_generations={n} must divide {source}: each rollout batch holds whole groups of num_generations "
            f"completions. Use num_generations in {divisors}, or change per_device_train_batch_size / "
            "steps_per_generation."
        )

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
        check_choice("importance_sampling_level", level, tuple(LOG_WEIGHT_FUNCTIONS))
        check_choice("loss_type", loss_type, KNOWN_LOSS_TYPES)
        policy = POLICY_LOSSES[loss_type]
        if policy.clip.two_sided:
            for name in ("epsilon", "epsilon_high"):
                value = getattr(self, name)
                if value is not None and not 0.0 < value < 1.0:
                    raise ValueError(
                        f"{name}={value!r} is out of range: the clip range [1 - epsilon, 1 + epsilon_high] needs "
                        f"0 < {name} < 1 (GSPO paper: epsilon=3e-4, epsilon_high=4e-4; GRPO: 0.2 / 0.28)."
                    )
        elif moving_band_field(self):  # clip_band.py scales a band this loss type does not have
            two_sided = [name for name, loss in POLICY_LOSSES.items() if loss.clip.two_sided]
            raise ValueError(
                f"{moving_band_field(self)} needs a clip band [1 - epsilon, 1 + epsilon_high], which "
                f"loss_type={loss_type!r} does not have; use it with loss_type in {two_sided}."
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
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0 (sampling divides the logits by it).")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta!r} must be >= 0 (KL penalty coefficient; 0 disables it, the default).")
        if level in SEQUENCE_LEVELS and policy.token_sum and not self.allow_token_sum_with_sequence_level:
            raise ValueError(
                f"loss_type={loss_type!r} sums token losses, so with importance_sampling_level={level!r} every "
                "sequence is weighted by its length, which is not GSPO's objective. Use loss_type='grpo' (the paper's "
                "per-sequence mean), or set allow_token_sum_with_sequence_level=True to accept it knowingly."
            )
        if loss_type == "luspo" and level not in policy.levels:
            raise ValueError(
                f"loss_type='luspo' is a length-weighted variant of GSPO and needs importance_sampling_level='sequence', "
                f"got {level!r}."
            )
        if loss_type == "vespo" and level not in policy.levels:
            raise ValueError(
                f"loss_type='vespo' computes its own sequence-level weights and ignores importance_sampling_level; set "
                f"importance_sampling_level='token' (got {level!r})."
            )
        for options in FEATURE_OPTIONS:  # each feature checks its own fields (its module, common/validation.py's style)
            options._validate_options(self)
        check_optimizer_package(self.optim)  # a missing bitsandbytes / torchao fails here, not after the model loaded
        on_policy = self.num_iterations == 1 and self.steps_per_generation <= self.gradient_accumulation_steps
        if on_policy and level != "token":
            logger.warning(
                "steps_per_generation (%s) <= gradient_accumulation_steps (%s) with num_iterations=1: every update is "
                "on-policy, all importance ratios are exactly 1 and GSPO reduces to GRPO. The paper trains 4 "
                "mini-batches per rollout batch (steps_per_generation = 4 * gradient_accumulation_steps).",
                self.steps_per_generation,
                self.gradient_accumulation_steps,
            )


#: Why GSPOConfig's defaults differ from GRPOConfig's, said with each difference at start-up (a difference found
#: without an entry here is still listed, as GSPOConfig's default).
WHY_NOT_GRPO = {
    "importance_sampling_level": "GSPO's length-normalised sequence ratio",
    "epsilon": "sequence ratios stay within ~1e-3 of 1, so GRPO's range would never clip",
    "epsilon_high": "the paper's upper clip for sequence ratios",
    "loss_type": "mean per sequence, GSPO's objective; a token sum weights each sequence by its length",
    "steps_per_generation": (
        f"the paper's {PAPER_MINI_BATCHES_PER_ROLLOUT} mini-batch updates per rollout batch (with one, every ratio is "
        "1 and GSPO is GRPO); TRL logs `reward` only on the steps that generate"
    ),
    "generation_batch_size": "completions per rollout batch, from steps_per_generation",
}


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def differences_from_grpo(args: GSPOConfig) -> dict[str, tuple]:
    """{field: (this config's value, GRPOConfig's value)} for the fields where GSPOConfig's defaults made `args`
    differ from what `trl.GRPOConfig` makes of the same arguments (an argument equal to GSPOConfig's default counts as
    not given), in `WHY_NOT_GRPO`'s order.

    No GRPOConfig is built: building TrainingArguments inside a running job sets process-wide state (under
    `accelerate launch` with DeepSpeed it replaces transformers' global DeepSpeed config, so one rank would stop
    gathering ZeRO-3's shards). GRPOConfig's value is its class default for an argument not given, and for the
    rollout size TRL's own rule when neither `steps_per_generation` nor `generation_batch_size` is given: one
    optimizer step's batches per generation. tests/test_config.py compares the result with a GRPOConfig it builds."""
    grpo_fields = {f.name: f for f in fields(GRPOConfig) if f.init}
    ours = {f.name: _default(f) for f in fields(GSPOConfig) if f.init}
    arguments = getattr(args, "_arguments", None) or {name: getattr(args, name) for name in ours}
    given = {name for name, value in arguments.items() if name in grpo_fields and value != ours[name]}
    grpo = {name: _default(f) for name, f in grpo_fields.items() if name not in given and _default(f) != ours[name]}
    if arguments.get("steps_per_generation") is None and arguments.get("generation_batch_size") is None:
        grpo["steps_per_generation"] = args.gradient_accumulation_steps
        grpo["generation_batch_size"] = (
            args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        )
    found = {name: (getattr(args, name), value) for name, value in grpo.items() if getattr(args, name) != value}
    order = [name for name in WHY_NOT_GRPO if name in found] + [name for name in found if name not in WHY_NOT_GRPO]
    return {name: found[name] for name in order}


def log_differences_from_grpo(args: GSPOConfig) -> None:
    """Say once, at start-up, what switching from `GRPOConfig` changed for these arguments, and why."""
    differences = differences_from_grpo(args)
    if not differences:
        return
    parts = [
        f"{name}={ours!r} (GRPOConfig: {grpo!r}; {WHY_NOT_GRPO.get(name, 'GSPOConfig default')})"
        for name, (ours, grpo) in differences.items()
    ]
    logger.warning(
        "GSPOConfig's defaults differ from what GRPOConfig makes of the same arguments: %s. Pass GRPO's values to "
        "GSPOConfig to keep them.",
        "; ".join(parts),
    )


def trainer_args(model, args) -> GSPOConfig:
    """The trainer's `args`: as given, or the paper's defaults named after the model; a plain `GRPOConfig` is refused."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return GSPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GSPO")
    if not isinstance(args, GSPOConfig):
        raise TypeError(
            f"GSPOTrainer needs args=GSPOConfig(...), got {type(args).__name__}. A plain GRPOConfig carries "
            "GRPO's defaults (token level, epsilon 0.2, dapo loss); build GSPOConfig with the same arguments."
        )
    return args


def check_reference_source(model, args: GSPOConfig, peft_config) -> None:
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
