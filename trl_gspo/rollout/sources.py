"""The registry of rollout sources: which `RolloutSource` a config asks for.

It sits above the pipeline and its sources, so the pipeline's base (pipeline.py) never imports the sources it runs:
the trainer calls `rollout_source` once at construction and holds the source it returns.
"""

from __future__ import annotations

from .async_rollouts import AsyncRollouts
from .dynamic_sampling import DynamicSampling
from .pipeline import SynchronousRollouts


def rollout_source(trainer, pipeline):
    """The `RolloutSource` the config asks for: `AsyncRollouts` when `async_generation` (with `dynamic_sampling` too,
    it fills each batch through a `DynamicSampling` of its own), else `DynamicSampling` when `dynamic_sampling`, else
    TRL's own behaviour, `SynchronousRollouts`. `pipeline`: the `RolloutPipeline` steering TRL's rollout code, which
    the non-default sources run in steps."""
    if trainer.args.async_generation:
        return AsyncRollouts(trainer, pipeline)
    if trainer.args.dynamic_sampling:
        return DynamicSampling(trainer, pipeline)
    return SynchronousRollouts(trainer)
