"""`GSPOConfig` fields of asynchronous generation (`AsyncOptions`) and their checks.

The feature itself is rollout/async_rollouts.py (the source) and async_backends.py (the generator side).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..common.validation import check_bool, check_int

logger = logging.getLogger(__name__)


@dataclass
class AsyncOptions:
    r"""
    `GSPOConfig` fields of asynchronous generation (this module).

    Parameters:
        async_generation (`bool`, *optional*, defaults to `False`):
            Generate the next rollout batches in a generator thread while the trainer trains on the current one. Pays
            when generation and training use different devices: vLLM server mode (`vllm serve` on other GPUs), or
            transformers `generate` on a spare device (`generation_device`); refused with vLLM colocate. Samples are
            trained `max_staleness` rollout batches after the weights that generated them, with the decoupled
            objective correcting for it.
        max_staleness (`int`, *optional*, defaults to `1`):
            How many rollout batches ahead the generator works: batch k + `max_staleness` is generated with the weights
            of the start of batch k. `0` generates each batch when it is due (no overlap; same weights as the
            synchronous trainer). Larger values queue more batches (absorbing uneven generation times) at the cost of
            more staleness.
        generation_device (`str` or `None`, *optional*, defaults to `None`):
            Device of the transformers generator's copy of the policy (e.g. `"cuda:1"`); `None`: the trainer's device.
            Only with `async_generation=True` and without vLLM.
        async_generation_timeout (`float`, *optional*, defaults to `1800.0`):
            Seconds the trainer waits for one rollout batch (or one checkpoint's batches in flight) before raising,
            e.g. when a vLLM server stopped answering.
    """

    async_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate the next rollout batches in a background thread while training on the current one "
            "(vLLM server mode or a spare generation_device), so the step costs max(generation, training) instead of "
            "their sum. Stale samples are corrected by the decoupled objective (behaviour weight pi_prox / pi_sampler)."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "Rollout batches the generator works ahead (async_generation). 1: one-step off-policy, the usual "
            "choice. 0: no overlap (matches the synchronous trainer). More queues more batches and adds staleness."
        },
    )
    generation_device: str | None = field(
        default=None,
        metadata={
            "help": "Device of the async transformers generator's copy of the policy (e.g. 'cuda:1'); default: the "
            "trainer's device. Generating on another device is what lets generation and training overlap."
        },
    )
    async_generation_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds the trainer waits for one rollout batch from the generator before raising (a vLLM server "
            "that stopped answering gives an error instead of a hang)."
        },
    )

    def _validate_options(self):
        check_bool("async_generation", self.async_generation)
        check_int("max_staleness", self.max_staleness, 0, "rollout batches the generator works ahead")
        timeout = self.async_generation_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"async_generation_timeout={timeout!r} must be a number of seconds > 0.")
        if self.generation_device is not None:
            if not self.async_generation or self.use_vllm:
                raise ValueError(
                    f"generation_device={self.generation_device!r} places the asynchronous transformers generator; it "
                    "needs async_generation=True and use_vllm=False (vLLM places its own engine)."
                )
            try:
                torch.device(self.generation_device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(
                    f"generation_device={self.generation_device!r} is not a torch device ({exc})."
                ) from None
        if not self.async_generation:
            return
        if self.use_vllm and self.vllm_mode == "colocate":
            raise ValueError(
                "async_generation=True with vllm_mode='colocate': colocated vLLM generates on the training GPUs, so "
                "generation and training cannot overlap. Run a vLLM server on other GPUs (`vllm serve`, docs/vllm.md) with vllm_mode='server', "
                "or use transformers generation on a spare device (use_vllm=False, generation_device='cuda:N')."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "async_generation=True with use_transformers_continuous_batching=True is not supported: continuous "
                "batching returns no sampler log-probs for the behaviour correction. Use regular generate or vLLM server."
            )
        if self.old_logprobs_source == "sampler":
            logger.warning(
                "async_generation with old_logprobs_source='sampler': GSPO's clipped ratio is anchored on the sampler's "
                "log-probs of weights up to max_staleness rollout batches old, so most sequences start outside the "
                "3e-4/4e-4 clip range (a clip fraction near 0.4 is reported with such setups). The default "
                "'recompute' anchors it on the proximal policy and corrects the staleness with a behaviour weight."
            )
        if not self.vllm_importance_sampling_correction:
            logger.warning(
                "async_generation with vllm_importance_sampling_correction=False: stale samples are trained without the "
                "behaviour weight pi_prox / pi_sampler (the ratio is still anchored on the proximal policy)."
            )
