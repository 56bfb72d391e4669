"""What the command line says about precision and the engine around start-up, each in one line.

- Before the config is built (which starts DeepSpeed's process group): the DeepSpeed ops about to be compiled in
  silence on a first run (`common/engine.deepspeed_build_notes`).
- After the trainer is built: what runs, from `GSPOTrainer.precision` (guards/precision.py): weight dtype, compute
  dtype, where the master weights live and the dtype the final save writes.
- `low_precision_weights="error"` refusing a run: one line, like a recipe error.
"""

from __future__ import annotations

import contextlib
import os

from ..common.engine import deepspeed_build_notes
from ..guards.precision import LowPrecisionWeightsError
from .recipe_inputs import RecipeError


def say_deepspeed_builds(command: str) -> None:
    """Rank 0: one line per DeepSpeed op this run is about to compile (none when prebuilt or cached)."""
    if os.environ.get("RANK", "0") != "0":
        return
    import torch

    for note in deepspeed_build_notes(os.environ, torch.cuda.is_available()):
        print(f"trl-gspo {command}: {note}", flush=True)


def precision_line(command: str, trainer) -> str:
    return f"trl-gspo {command}: {trainer.precision.line()}"


@contextlib.contextmanager
def precision_refusal_as_recipe_error():
    """`low_precision_weights="error"` stops the run in one line (the trainer raises before training)."""
    try:
        yield
    except LowPrecisionWeightsError as err:
        raise RecipeError(str(err)) from err
