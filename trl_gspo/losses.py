"""GSPO / GSPO-token / GRPO policy-loss math as small pure tensor functions.

Shapes: ``B`` sequences, ``T`` completion positions. ``mask`` is ``(B, T)`` with 1 for tokens that count
(completion tokens that are not padding and not tool output). Log-probabilities are ``(B, T)``. Nothing here
knows about trainers, accelerators or configs, so every function can be checked against the paper
(Zheng et al., 2025, arXiv 2507.18071) line by line and unit-tested on random tensors.

Notation used in the docstrings: ``lp = log pi_theta(y_t | x, y_<t)``, ``old = log pi_old(y_t | ...)``,
``|y_i| = sum_t mask[i, t]``, ``sg[.]`` = stop-gradient (``.detach()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: Default bound on |log importance weight| before ``exp``. ``exp(20) ~ 4.9e8`` is far outside any clip range,
#: so the clamp never changes a value that the clipped objective could use, yet keeps ``exp`` finite (fp32
#: overflows at ~88.7) when a policy drifts wildly or a log-prob is corrupted.
DEFAULT_MAX_LOG_RATIO = 20.0


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each row's valid tokens, ``(B, T) -> (B,)``.

    A row with no valid token (empty completion, everything masked) gives 0 rather than 0/0: the divisor is
    clamped to 1, as the paper's ``1/|y_i|`` has no meaning for ``|y_i| = 0``.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def token_log_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO / PPO token-level log importance weight, ``(B, T)``.

        log w_i,t = lp_i,t - old_i,t

    ``mask`` is unused (kept so every level has the same signature); padding is removed at aggregation.
    """
    return logps - old_logps


def sequence_log_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO sequence-level log importance weight, ``(B, 1)`` (paper, Eq. 7).

        log s_i = (1/|y_i|) * sum_t mask_i,t * (lp_i,t - old_i,t)

    i.e. ``s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|)``, a length-normalised (geometric-mean)
    sequence likelihood ratio. Its gradient spreads ``1/|y_i|`` evenly over the sequence's valid tokens.
    """
    return masked_sequence_mean(logps - old_logps, mask).unsqueeze(-1)


def sequence_token_log_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token log importance weight, ``(B, T)`` (paper, Eq. 13).

        s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]
        log s_i,t = sg[log s_i] + lp_i,t - sg[lp_i,t]

    Numerically ``s_i,t == s_i`` for every t (the last two terms cancel to exactly 0.0), so clipping decisions
    match GSPO's; but the gradient of token t is ``s_i * grad lp_i,t``, which lets each token carry its own
    advantage. With ``A_i,t == A_i`` the objective, clip decisions and gradient equal GSPO's.
    """
    seq = sequence_log_weights(logps, old_logps, mask).detach()
    return seq + (logps - logps.detach())


#: Registry: ``importance_sampling_level`` -> function computing the log importance weight.
LOG_WEIGHT_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_log_weights,
    "sequence": sequence_log_weights,
    "sequence_token": sequence_token_log_weights,
}

#: Levels whose weight is one value per sequence (numerically), so token-sum losses mis-weight them.
SEQUENCE_LEVELS = ("sequence", "sequence_token")


def importance_ratio(log_weights: torch.Tensor, max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO) -> torch.Tensor:
    """``exp`` of the log importance weight, with ``log w`` clamped to ``[-max_log_ratio, max_log_ratio]`` first.

    Inside the bound the clamp is the identity (value and gradient), so it never changes a normal step; outside
    it the ratio saturates (gradient 0) instead of overflowing to ``inf``. ``None`` disables the clamp.
    """
    if max_log_ratio is not None:
        log_weights = log_weights.clamp(min=-max_log_ratio, max=max_log_ratio)
    return torch.exp(log_weights)


def clipped_surrogate_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Negated two-sided PPO clipped surrogate (paper, Eq. 5 for GSPO; Eq. 2 for GRPO).

        loss = -min( r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A )

    ``r`` is ``(B, 1)`` (one ratio per sequence) or ``(B, T)``; ``A`` is ``(B, 1)`` or ``(B, T)``; the result
    broadcasts. ``delta`` (INTELLECT-2's two-sided variant) additionally caps the unclipped ratio from above.
    Where the clip is active the loss is constant in ``r``, so the sample contributes no gradient.
    """
    clipped = ratio.clamp(min=1 - epsilon_low, max=1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo_loss(ratio: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_max: float) -> torch.Tensor:
    """MiniMax-M1's CISPO: the importance weight is capped and detached, the gradient flows through ``logps``.

    loss = -sg[min(r, epsilon_max)] * A * lp
    """
    return -ratio.clamp(max=epsilon_max).detach() * advantages * logps


def sapo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO's soft-gated surrogate (Gao et al., 2025, arXiv 2511.20347): a sigmoid gate instead of a hard clip.

        loss = -(4 / tau) * sigmoid(tau * (r - 1)) * A,    tau = temperature_pos if A > 0 else temperature_neg

    At ``r = 1`` the gate's slope is 1, like the plain surrogate ``r * A``; far from 1 it flattens, so off-policy
    samples fade out smoothly. Shapes broadcast like :func:`clipped_surrogate_loss`.
    """
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def clip_indicators(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the clipped side of the min is active (the sample gives no gradient), as float masks.

    Low: ``r < 1 - epsilon_low`` with ``A < 0``; high: ``r > 1 + epsilon_high`` with ``A > 0``. Shapes broadcast
    like :func:`clipped_surrogate_loss`.
    """
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    return low, high


def sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence aggregation (``loss_type="grpo"``, the GSPO paper's): mean over each sequence's valid tokens,
    then mean over sequences. Each sequence weighs the same whatever its length.

        L = (1/B) * sum_i (1/|y_i|) * sum_t mask_i,t * loss_i,t

    A ``(B, 1)`` ``per_token_loss`` (one value per sequence) is broadcast over the sequence's tokens first.
    """
    return masked_sequence_mean(per_token_loss.expand_as(mask), mask).mean()


def token_sum_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor | float) -> torch.Tensor:
    """Token-sum aggregation (``dapo``, ``bnpo``, ``dr_grpo``, ``cispo``): ``sum_i,t mask * loss / normalizer``.

    Each sequence weighs in proportion to its length: not GSPO's objective when the weight is per sequence.
    """
    return (per_token_loss * mask).sum() / normalizer


def sequence_sum_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LUSPO aggregation: sum over each sequence's valid tokens, mean over sequences (length-weighted GSPO)."""
    return (per_token_loss * mask).sum(-1).mean()


# ------------------------------------------------------------------------------------------ the loss registry
# Each `loss_type` is one registry entry (verl's `register_policy_loss` in `core_algos.py` is the model): its
# per-token surrogate, how the per-token loss is reduced, where its clip is active and the metric names TRL logs for
# that clip. The trainer looks the entry up once; nothing outside this module and the config asks which loss it runs.


@dataclass(frozen=True)
class LossSettings:
    """The knobs a surrogate reads: TRL's clip range (`epsilon_low`, `epsilon_high`; CISPO's cap is `epsilon_high`),
    INTELLECT-2's `delta` and SAPO's gate temperatures."""

    epsilon_low: float
    epsilon_high: float
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05


@dataclass(frozen=True)
class Normalizers:
    """What an aggregation divides by besides the micro-batch itself, from the trainer's accumulation state."""

    accumulation: float  # micro-batches whose gradients add up to one optimizer step (1 in evaluation)
    max_completion_length: int
    # active tokens of the whole accumulated generation batch, this process's share of one micro-step (dapo, cispo);
    # a function, so the batch is asked for the count only by the aggregations that use it
    batch_tokens: Callable[[], torch.Tensor | float]


def _sequence_mean(per_token_loss, mask, n: Normalizers):
    loss = sequence_mean_loss(per_token_loss, mask)
    return loss / n.accumulation, loss.detach()


def _sequence_sum(per_token_loss, mask, n: Normalizers):
    loss = sequence_sum_loss(per_token_loss, mask)
    return loss / n.accumulation, loss.detach()


def _token_mean(per_token_loss, mask, n: Normalizers):  # BNPO: mean over the micro-batch's active tokens
    loss = token_sum_loss(per_token_loss, mask, mask.sum().clamp(min=1.0))
    return loss / n.accumulation, loss.detach()


def _token_sum_fixed(per_token_loss, mask, n: Normalizers):  # Dr. GRPO: a constant divisor, rows x max length
    loss = token_sum_loss(per_token_loss, mask, per_token_loss.size(0) * n.max_completion_length)
    return loss / n.accumulation, loss.detach()


def _batch_token_sum(per_token_loss, mask, n: Normalizers):  # DAPO: over the whole generation batch's tokens
    loss = token_sum_loss(per_token_loss, mask, n.batch_tokens())
    return loss, loss.detach()


#: How a per-token loss becomes the micro-batch's loss: `(per_token_loss, mask, Normalizers) -> (loss to backpropagate,
#: the unscaled policy loss TRL logs)`, each as TRL 1.10 to 1.16 computes it.
AGGREGATIONS: dict[str, Callable] = {
    "sequence_mean": _sequence_mean,
    "sequence_sum": _sequence_sum,
    "token_mean": _token_mean,
    "token_sum_fixed": _token_sum_fixed,
    "batch_token_sum": _batch_token_sum,
}
#: Aggregations that sum tokens, so a per-sequence weight gets multiplied by the sequence's length.
TOKEN_SUM_AGGREGATIONS = ("token_mean", "token_sum_fixed", "batch_token_sum")


@dataclass(frozen=True)
class Clip:
    """Where a surrogate's clip is active, and the metrics TRL logs for it.

    `indicators(ratio, advantages, settings) -> (low, high)` float masks (the ratio is detached). `means`: `(metric,
    indicator)` pairs averaged over tokens (per-token indicators) or sequences, indicator one of "low", "high",
    "region" (either); `extremes`: `(metric, indicator, "min" | "max")` over the per-sequence means. `two_sided`: the
    epsilons form a clip range `[1 - epsilon, 1 + epsilon_high]`, so both must lie in (0, 1)."""

    indicators: Callable
    means: tuple = ()
    extremes: tuple = ()
    two_sided: bool = False


def _two_sided(ratio, advantages, s: LossSettings):
    return clip_indicators(ratio, advantages, s.epsilon_low, s.epsilon_high)


def _upper_only(ratio, advantages, s: LossSettings):  # CISPO truncates the weight from above only
    high = ((ratio > s.epsilon_high) & (advantages > 0)).float()
    return torch.zeros_like(high), high


def _never(ratio, advantages, s: LossSettings):  # SAPO's soft gate never clips
    zeros = torch.zeros_like(ratio * advantages)
    return zeros, zeros


TWO_SIDED_CLIP = Clip(
    _two_sided,
    means=(("clip_ratio/low_mean", "low"), ("clip_ratio/high_mean", "high"), ("clip_ratio/region_mean", "region")),
    extremes=(("clip_ratio/low_min", "low", "min"), ("clip_ratio/high_max", "high", "max")),
    two_sided=True,
)
UPPER_CLIP = Clip(_upper_only, means=(("cispo_clip_ratio", "high"),))
NO_CLIP = Clip(_never)


@dataclass(frozen=True)
class PolicyLoss:
    """One `loss_type`. `surrogate(ratio, advantages, logps, settings)` is the per-token (or per-sequence) loss,
    None for a loss computed by TRL's own code (it has no importance ratio to hook); `aggregation` a key of
    `AGGREGATIONS`; `levels` the `importance_sampling_level` values it is defined for."""

    name: str
    surrogate: Callable | None
    aggregation: str | None
    clip: Clip
    levels: tuple[str, ...]

    @property
    def native(self) -> bool:
        """TRL's own loss code runs (the trainer only guards its result)."""
        return self.surrogate is None

    @property
    def token_sum(self) -> bool:
        """Weights each sequence by its length (a token sum)."""
        return self.aggregation in TOKEN_SUM_AGGREGATIONS

    @property
    def per_micro_batch_normalizer(self) -> bool:
        """Divides by a count of the micro-batch's own tokens, so which rows share a micro-batch changes it."""
        return self.aggregation == "token_mean"

    def aggregate(self, per_token_loss, mask, normalizers: Normalizers):
        return AGGREGATIONS[self.aggregation](per_token_loss, mask, normalizers)


#: Registry: `loss_type` -> its `PolicyLoss`, in the order `GSPOConfig` lists the choices.
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str, *, aggregation: str | None, clip: Clip = NO_CLIP, levels=tuple(LOG_WEIGHT_FUNCTIONS)
):
    """Decorator registering `surrogate` as `loss_type=name` (use `register_policy_loss(name, ...)(None)` for a loss
    TRL computes itself)."""
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; allowed: {', '.join(AGGREGATIONS)}.")

    def register(surrogate):
        POLICY_LOSSES[name] = PolicyLoss(name, surrogate, aggregation, clip, tuple(levels))
        return surrogate

    return register


def clipped_surrogate(ratio, advantages, logps, s: LossSettings) -> torch.Tensor:
    """The two-sided clipped surrogate (`clipped_surrogate_loss`) of GRPO, GSPO and their aggregations."""
    return clipped_surrogate_loss(ratio, advantages, s.epsilon_low, s.epsilon_high, s.delta)


for _name, _aggregation in (("grpo", "sequence_mean"), ("bnpo", "token_mean"), ("dr_grpo", "token_sum_fixed")):
    register_policy_loss(_name, aggregation=_aggregation, clip=TWO_SIDED_CLIP)(clipped_surrogate)
register_policy_loss("dapo", aggregation="batch_token_sum", clip=TWO_SIDED_CLIP)(clipped_surrogate)
# LUSPO: GSPO's ratio with each sequence's loss summed over its tokens (length-weighted), so it needs the sequence level
register_policy_loss("luspo", aggregation="sequence_sum", clip=TWO_SIDED_CLIP, levels=("sequence",))(clipped_surrogate)


@register_policy_loss("cispo", aggregation="batch_token_sum", clip=UPPER_CLIP)
def cispo_surrogate(ratio, advantages, logps, s: LossSettings) -> torch.Tensor:
    """CISPO (`cispo_loss`), capped at `epsilon_high`."""
    return cispo_loss(ratio, advantages, logps, s.epsilon_high)


@register_policy_loss("sapo", aggregation="sequence_mean", clip=NO_CLIP)
def sapo_surrogate(ratio, advantages, logps, s: LossSettings) -> torch.Tensor:
    """SAPO's soft gate (`sapo_loss`) at the configured temperatures."""
    return sapo_loss(ratio, advantages, s.sapo_temperature_pos, s.sapo_temperature_neg)


# VESPO weights sequences by its own gamma function of the summed log-ratio: TRL computes it (token level only).
register_policy_loss("vespo", aggregation=None, clip=NO_CLIP, levels=("token",))(None)


#: How a behaviour weight outside its bounds is treated: clamped to the bound, or zeroed (the sample is dropped).
BEHAVIOUR_BOUNDS = ("truncate", "mask")


def behaviour_log_weights(
    proximal_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    mask: torch.Tensor,
    per_sequence: bool,
    length_normalized: bool = True,
) -> torch.Tensor:
    """Log of the decoupled objective's behaviour weight ``pi_prox / mu``, ``(B, 1)`` or ``(B, T)``, before bounds.

    Decoupled PPO (AReaL) / rollout correction (verl): a sample drawn by the behaviour policy ``mu`` (the weights that
    generated it, whose log-probs the sampler returned) is trained with the clipped ratio anchored on the proximal
    policy ``pi_prox`` (log-probs recomputed when training on the batch starts, TRL's pi_old), and the staleness is
    corrected by this detached weight multiplying its loss.

        token:                              log w_i,t = log pi_prox(y_t) - log mu(y_t)
        sequence, length-normalised:        log w_i   = (1/|y_i|) sum_t mask * (log pi_prox - log mu)   (geometric mean)
        sequence, summed (TRL's sequence_*): log w_i   = sum_t mask * (log pi_prox - log mu)

    The geometric mean keeps the weight on GSPO's per-token scale: the sum grows with length, so a per-token gap of
    1e-3 over 2,000 tokens already gives e^2. Tokens the sampler could not score (NaN) are left out of the mean and
    get weight 1 (log 0) at token level. Detached: the weight scales the gradient, it has none.
    """
    valid = mask.bool() & ~torch.isnan(behaviour_logps)
    diff = torch.where(valid, proximal_logps.detach() - behaviour_logps, 0.0)
    if not per_sequence:
        return diff
    if length_normalized:
        return masked_sequence_mean(diff, valid).unsqueeze(-1)
    return diff.sum(-1, keepdim=True)


def bounded_behaviour_weights(
    log_weights: torch.Tensor,
    bound: str,
    low: float | None,
    high: float | None,
    max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, outside)``: ``exp(log_weights)`` with TRL's importance-sampling bounds ``[low, high]`` (either may be
    None: unbounded on that side) applied as ``bound`` says (`BEHAVIOUR_BOUNDS`): ``"truncate"`` clamps to the bound,
    ``"mask"`` zeroes the weight (the sample or token contributes nothing). ``outside`` marks the weights the bounds
    changed. ``|log w|`` is clamped at ``max_log_ratio`` before ``exp`` (as for the importance ratio), so a far-off
    sample gives a large finite weight, never inf."""
    weights = importance_ratio(log_weights.detach(), max_log_ratio)
    below = weights < low if low is not None else torch.zeros_like(weights, dtype=torch.bool)
    above = weights > high if high is not None else torch.zeros_like(weights, dtype=torch.bool)
    outside = below | above
    if bound == "truncate":
        return (weights if low is None and high is None else weights.clamp(min=low, max=high)), outside
    if bound == "mask":
        return weights.masked_fill(outside, 0.0), outside
    raise ValueError(f"bound={bound!r}; allowed: {', '.join(BEHAVIOUR_BOUNDS)}.")
