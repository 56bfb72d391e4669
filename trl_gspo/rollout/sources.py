"""The registry of rollout sources: which `RolloutSource` a config asks for.

It sits above the pipeline and its sources, so the pipeline's base (pipeline.py) never imports the sources it runs:
`GSPOTrainer` sets `make_rollout_source = rollout_source`, and `RolloutPipeline` calls it once at construction.
"""

from __future__ import annotations

from .async_rollouts import AsyncRollouts
from .dynamic_sampling import DynamicSampling
from .pipeline import SynchronousRollouts


def rollout_source(trainer):
    """The `RolloutSource` the config asks for: `AsyncRollouts` when `async_generation` (with `dynamic_sampling` too,
    it fills each batch through a `DynamicSampling` of its own), else `DynamicSampling` when `dynamic_sampling`, else
    TRL's own behaviour, `SynchronousRollouts`."""
    if trainer.args.async_generation:
        return AsyncRollouts(trainer)
    if trainer.args.dynamic_sampling:
        return DynamicSampling(trainer)
    return SynchronousRollouts(trainer)
