"""Reuse the sampler's log-probs as pi_old (`GSPOConfig.old_logprobs_source="sampler"`).

Stock TRL gets pi_old for off-policy mini-batches by running the policy once more over the whole rollout batch
right after generation (`old_per_token_logps` in `_generate_and_score_completions`). The sampler already scored
every token it drew, with the same weights, so that pass can be skipped. The GSPO paper (Sec. 4.3 / 5) argues
sequence-level ratios tolerate the small precision gap between the inference and the training engine.

What the sampler log-prob must be: the trainer's `log_softmax(logits / temperature)[token]`, with no top-k,
top-p, min-p or repetition penalty. pi_theta in the ratio is computed that way (TRL's fused LM head), so pi_old
must be the same function at the old weights; a renormalised top-p distribution would bias every ratio below 1.
- transformers `generate`: `output_scores` are post-processing scores (temperature, top-k/top-p masks), and
  `output_logits` keeps a `(B, V)` tensor per step for the whole generation (77 GB at B=64, 2k tokens, 151k vocab).
  Instead `SamplerLogprobRecorder` hooks the model's forward, keeps only the last step's `log_softmax(raw / T)`,
  and gathers it at the token the next step feeds back in: O(B*V) memory, raw logits, no processors.
- vLLM: TRL's colocate engine returns `processed_logprobs` (after temperature and sampling processors), which
  equal the trainer's definition only when top-k/top-p/min-p/penalties are off; `GSPOConfig` enforces that.

The helpers here are pure functions plus one context manager; `SamplerLogprobs` (end of file) is the trainer's part
that the rollout and forward paths call around TRL's generation and old-policy log-prob pass.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..common.validation import check_choice
from ..losses import SEQUENCE_LEVELS, masked_sequence_mean

logger = logging.getLogger(__name__)

#: Where pi_old comes from: TRL's extra forward pass, or the sampler's own log-probs.
OLD_LOGPROBS_SOURCES = ("recompute", "sampler")


@dataclass
class SamplerLogprobOptions:
    r"""
    `GSPOConfig` fields of sampler log-prob reuse and the sampler-trainer correction (this module).

    Parameters:
        old_logprobs_source (`str`, *optional*, defaults to `"recompute"`):
            Where pi_old comes from for off-policy mini-batches. `"recompute"`: TRL's extra no-grad forward over the
            rollout batch after generation (stock behaviour). `"sampler"`: the log-probs the sampler computed while
            generating (transformers `generate` or vLLM), which skips that forward pass. Safe when sampler and
            trainer compute the same distribution up to precision (same weights, `log_softmax(logits/T)`): on vLLM
            that needs top_p=1, top_k off, min_p off and repetition_penalty=1; the mismatch is logged under
            `sampler/*` on every on-policy mini-batch. Saves nothing when every mini-batch is on-policy.
        vllm_importance_sampling_length_normalized (`bool` or `None`, *optional*, defaults to `None`):
            With vLLM, `old_logprobs_source="recompute"` and a `sequence_*` `vllm_importance_sampling_mode`, use
            `exp(mean_t(log pi_old - log pi_vllm))` as the sampler-trainer correction instead of TRL's
            `exp(sum_t ...)`, which grows with length and masks or truncates long completions (with asynchronous
            generation: the behaviour weight of sequence levels, rollout/async_rollouts.py). `None` resolves to `True` for the
            `sequence` and `sequence_token` levels with a `sequence_*` mode, and to `False` otherwise (TRL's own
            correction, e.g. for GRPO); set `False` to keep TRL's `exp(sum)`.
    """

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
    vllm_importance_sampling_length_normalized: bool | None = field(
        default=None,
        metadata={
            "help": "Length-normalise TRL's sequence-level vLLM importance-sampling correction (mean instead of sum "
            "of token log-ratios), GSPO-consistent and stable on long completions: TRL's exp(sum) with its cap of 3 "
            "masks long answers for a tiny per-token gap. Default (None): on for the sequence and sequence_token "
            "levels with a sequence_* mode, off otherwise. Only with old_logprobs_source='recompute' (with 'sampler' "
            "the vLLM correction is an identity and is turned off)."
        },
    )

    def _validate_options(self):
        source = self.old_logprobs_source
        check_choice("old_logprobs_source", source, OLD_LOGPROBS_SOURCES)
        mode = self.vllm_importance_sampling_mode
        if self.vllm_importance_sampling_length_normalized is None:  # GSPO's levels get GSPO's geometric mean
            self.vllm_importance_sampling_length_normalized = (
                self.importance_sampling_level in SEQUENCE_LEVELS
                and mode.startswith("sequence_")
                and not (source == "sampler" and self.use_vllm)
            )
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


class SamplerLogprobRecorder:
    """Record `log_softmax(logits / temperature)` of each sampled token during `model.generate`.

    A forward hook sees the raw logits of the newest position at every decoding step. The sampled token is only
    known at the next step (it is that step's last input id), so the hook keeps one `(B, V)` log-softmax and
    gathers it one step late; the final token is gathered in `completion_logprobs` from the returned ids.
    """

    def __init__(self, module: torch.nn.Module, temperature: float):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature!r} must be > 0 to score sampled tokens.")
        self.module, self.inv_t = module, 1.0 / temperature
        self.steps: list[torch.Tensor] = []  # (B,) log-prob of the token sampled at each finished step
        self.last: torch.Tensor | None = None  # (B, V) log-softmax of the newest position
        self.handle = None

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False

    def _hook(self, module, args, kwargs, output):
        logits = getattr(output, "logits", None)
        if logits is None:  # not a generation step (e.g. a fused-head call): nothing to record
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:].to(self.last.device))[:, 0])
        self.last = torch.log_softmax(logits[:, -1, :].float() * self.inv_t, dim=-1)

    def completion_logprobs(self, completion_ids: list[list[int]]) -> list[list[float]]:
        """Per-completion sampler log-probs, aligned with TRL's EOS-truncated `completion_ids` lists."""
        if self.last is None:
            raise RuntimeError("SamplerLogprobRecorder saw no generation step; was generate() called inside it?")
        n_steps = len(self.steps) + 1
        last_tokens = torch.tensor([ids[-1] if len(ids) == n_steps else 0 for ids in completion_ids])
        final = self.last.gather(-1, last_tokens[:, None].to(self.last.device))[:, 0]
        table = torch.stack([*self.steps, final], dim=1).cpu()  # (B, n_steps)
        too_long = [i for i, ids in enumerate(completion_ids) if len(ids) > n_steps]
        if too_long or table.size(0) != len(completion_ids):
            raise RuntimeError(
                f"Sampler log-probs cover {table.size(0)} sequences x {n_steps} steps but the completions are "
                f"{len(completion_ids)} sequences up to {max(map(len, completion_ids), default=0)} tokens; "
                "use old_logprobs_source='recompute' with this generation setup."
            )
        return [table[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]


def pad_logprobs(logprobs: list[list[float | None]], width: int, device) -> torch.Tensor:
    """Right-pad per-completion log-probs to `(B, width)`; `None` (vLLM could not score a token) becomes NaN."""
    out = torch.zeros(len(logprobs), width, dtype=torch.float32)
    for i, row in enumerate(logprobs):
        row = row[:width]
        if row:
            out[i, : len(row)] = torch.tensor([float("nan") if x is None else x for x in row], dtype=torch.float32)
    return out.to(device)


def mismatch_stats(trainer_logps, sampler_logps, mask, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """What reusing the sampler's log-probs costs, from an on-policy batch (trainer weights == sampler weights).

    Returns a `(7,)` tensor: [sum |delta| over valid tokens, valid token count, max |delta| per token,
    sum |seq log-ratio|, sequence count, max |seq log-ratio|, sequences whose ratio exp(seq log-ratio) lies outside
    [1 - epsilon_low, 1 + epsilon_high]], with delta = trainer - sampler and seq log-ratio its masked mean per
    sequence (log s_i of GSPO at the start of the rollout, which is exactly 0 when pi_old is recomputed).
    Sums and counts, not means, so processes can be reduced in one collective.
    """
    mask = mask.bool() & ~torch.isnan(sampler_logps)
    delta = torch.where(mask, trainer_logps.detach().float() - sampler_logps.float(), 0.0)
    abs_delta = delta.abs()
    has_tokens = mask.sum(-1) > 0
    seq_log_ratio = masked_sequence_mean(delta, mask)
    abs_seq = seq_log_ratio.abs() * has_tokens
    ratio = torch.exp(seq_log_ratio)
    outside = ((ratio < 1 - epsilon_low) | (ratio > 1 + epsilon_high)) & has_tokens
    zero = abs_delta.new_zeros(())
    return torch.stack(
        [
            abs_delta.sum(),
            mask.sum().float(),
            abs_delta.max() if abs_delta.numel() else zero,
            abs_seq.sum(),
            has_tokens.sum().float(),
            abs_seq.max() if abs_seq.numel() else zero,
            outside.sum().float(),
        ]
    )


def summarize_mismatch(stats: torch.Tensor) -> dict[str, float]:
    """Metric values from `mismatch_stats` rows gathered across processes, `(P, 7)` or `(7,)`."""
    stats = stats.reshape(-1, 7)
    total = stats.sum(0)
    return {
        "sampler/logp_abs_diff/mean": (total[0] / total[1].clamp(min=1)).item(),
        "sampler/logp_abs_diff/max": stats[:, 2].max().item(),
        "sampler/seq_log_ratio_abs/mean": (total[3] / total[4].clamp(min=1)).item(),
        "sampler/seq_log_ratio_abs/max": stats[:, 5].max().item(),
        "sampler/seq_outside_clip_frac": (total[6] / total[4].clamp(min=1)).item(),
    }


def length_normalized_is_ratio(old_logps, sampling_logps, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """GSPO-consistent sampler->trainer importance weight: `exp(mean_t(log pi_old - log pi_sampler))`, `(B, 1)`.

    TRL's `sequence_*` modes use `exp(sum_t ...)`: a per-token gap of 1e-3 on a 2k-token answer gives e^2 ~ 7.4,
    past the default cap of 3, so long answers are masked (or truncated) for a mismatch GSPO's own ratio would
    average away. The mean keeps the correction on the same per-token scale as GSPO's s_i. Tokens the sampler
    could not score (NaN) are left out of the mean. `mode` is TRL's `vllm_importance_sampling_mode`: `*_truncate`
    clamps to [clip_min, clip_max], `*_mask` zeroes weights outside it.
    """
    valid = mask.bool() & ~torch.isnan(sampling_logps)
    diff = torch.where(valid, old_logps - sampling_logps, 0.0)
    ratio = torch.exp(masked_sequence_mean(diff, valid)).unsqueeze(-1)
    if mode == "sequence_truncate":
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode == "sequence_mask":
        low = clip_min if clip_min is not None else -float("inf")
        high = clip_max if clip_max is not None else float("inf")
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(
        f"vllm_importance_sampling_mode={mode!r}: the length-normalised correction is a sequence-level weight; "
        "allowed modes: 'sequence_truncate', 'sequence_mask'."
    )


class SamplerLogprobs:
    """pi_old from the sampler when `old_logprobs_source="sampler"`, the sampler-trainer gap metrics and the
    length-normalised vLLM correction (module docstring). The rollout path calls `begin_rollout`, `recording`, `keep`,
    `finish_rollout` and `end_rollout` around TRL's generation and scoring, the forward path `pi_old`; with reuse off they do nothing.

    Whether pi_old comes from the sampler (`reuses`) and whether transformers samples (so the recorder is needed; vLLM
    returns the log-probs itself) are read from the run when a rollout starts. The defaults turn everything off."""

    def __init__(
        self,
        run,
        accelerator,
        source: str = "recompute",
        temperature: float = 1.0,
        length_normalized_is: tuple | None = None,
    ):
        self.run, self.accelerator = run, accelerator  # run: trainer.RunView
        self.source, self.temperature = source, temperature  # `old_logprobs_source`, the sampling temperature
        # (vllm_importance_sampling_mode, _clip_min, _clip_max) when TRL's vLLM correction, where it runs, is replaced
        # by its length-normalised form; None: TRL's own
        self.length_normalized_is = length_normalized_is
        self.armed = False  # True between generation and TRL's old-policy forward, when that is replaced
        self.supplied = False  # the rollout batch being scored took its pi_old from the sampler
        self.logps = None  # per-completion sampler log-probs of the rollout being scored
        self._warned_missing = False

    # --------------------------------------------------------------------------------- the rollout path
    @property
    def reuses(self) -> bool:
        """pi_old comes from the sampler: asked for, and TRL runs its pi_old pass at all (else pi_old is the current
        policy's own log-probs, and nothing is reused)."""
        return self.source == "sampler" and self.run.old_pass_runs

    def recording(self, model):
        """Context for one generation call of TRL's `generate` path: a `SamplerLogprobRecorder` on the module that
        generates (`model` inside its DDP / FSDP / DeepSpeed wrapper and PEFT), when pi_old will come from the sampler
        and transformers samples (else None)."""
        if not (self.reuses and self.run.sampling_path == "generate"):
            return contextlib.nullcontext()
        module = self.accelerator.unwrap_model(model)  # the module generate() calls
        module = module.get_base_model() if hasattr(module, "get_base_model") else module  # PEFT: the HF model
        return SamplerLogprobRecorder(module, self.temperature)

    def keep(self, outputs) -> None:
        """After TRL's `_generate`: the final per-completion sampler log-probs (after any tool-call turns)."""
        self.logps = outputs[4]

    def begin_rollout(self) -> None:
        """Before TRL scores a rollout batch: answer its pi_old pass from the sampler, when that is the source."""
        self.logps = None
        self.armed, self.supplied = self.reuses, False

    def end_rollout(self) -> None:
        self.armed, self.logps = False, None

    def finish_rollout(self, output: dict) -> None:
        """After TRL scored a rollout batch: the length-normalised vLLM correction, when asked for."""
        if self.length_normalized_is is not None and self.run.vllm_correction:
            self._length_normalize_is_ratio(output)

    # --------------------------------------------------------------------------------- the forward path
    def pi_old(self, batch_size, width, device):
        """Step 1 of the forward pipeline (forward/pipeline.py): the sampler's log-probs when this forward is TRL's
        pi_old pass and reuse is on, else None (the model runs)."""
        if not self.armed:
            return None
        # One shot: after generation, TRL's first log-prob call is the pi_old pass (ref log-probs come later).
        self.armed = False
        old_logps = self.old_logps(batch_size, width, device)
        self.supplied = old_logps is not None
        return old_logps

    def old_logps(self, batch_size, width, device):
        """The sampler's log-probs as a `(B, T)` pi_old, or None to fall back to TRL's recompute (logged)."""
        if self.logps is None:
            if not self._warned_missing:
                logger.warning(
                    "old_logprobs_source='sampler' but this generation path returned no log-probs (e.g. a "
                    "rollout_func without them); recomputing pi_old with a forward pass instead."
                )
                self._warned_missing = True
            return None
        if len(self.logps) != batch_size:
            raise RuntimeError(
                f"Sampler log-probs cover {len(self.logps)} completions but the batch has {batch_size}; "
                "use old_logprobs_source='recompute' with this generation setup."
            )
        old_logps = pad_logprobs(self.logps, width, device)
        # A NaN (vLLM could not score a token) would poison the ratio; every process must take the same branch,
        # since the fallback forward is collective under ZeRO-3.
        has_nan = torch.isnan(old_logps).any().float().reshape(1)
        if self.accelerator.num_processes > 1:
            has_nan = self.accelerator.reduce(has_nan, reduction="sum")
        if has_nan.item() > 0:
            logger.warning("Sampler returned NaN log-probs for some tokens; recomputing pi_old for this rollout batch.")
            return None
        return old_logps

    # --------------------------------------------------------------------------------------- the loss
    def log_mismatch(self, mode, logps, inputs, mask, epsilon_low, epsilon_high, at_sampler_weights: bool) -> None:
        """Sampler vs trainer log-prob gap, on the mini-batches still at the sampler's weights (no extra forward)."""
        sampler = inputs.get("sampling_per_token_logps")
        if sampler is None or mode != "train" or not at_sampler_weights:
            return
        stats = mismatch_stats(logps, sampler, mask, epsilon_low, epsilon_high)
        for name, value in summarize_mismatch(self.accelerator.gather(stats)).items():
            self.run.log_metric(name, value, mode)

    def _length_normalize_is_ratio(self, output):
        """Replace TRL's exp(sum) sequence-level vLLM correction by exp(mean) (see `length_normalized_is_ratio`)."""
        mask = output["completion_mask"]
        mask = mask if "tool_mask" not in output else mask * output["tool_mask"]
        mode, clip_min, clip_max = self.length_normalized_is
        ratio = length_normalized_is_ratio(
            output["old_per_token_logps"], output["sampling_per_token_logps"], mask, mode, clip_min, clip_max
        )
        output["importance_sampling_ratio"] = ratio
        gathered = self.accelerator.gather(ratio.flatten())
        for name, value in (("min", gathered.min()), ("mean", gathered.mean()), ("max", gathered.max())):
            self.run.log_metric(f"sampling/importance_sampling_ratio_length_normalized/{name}", value.item())
