"""The model a run loads, decided once per run: rank 0 resolves a known Hub id (`common/model_store.resolve_model`,
which may ask the Hub and download) and the other ranks are told its answer, so a network blip cannot give two ranks
of one run different weights (the Hub's or the prepared GGUF copy). What was decided goes into the run's output
folder (`model_source.json`: the Hub id, the source, the Hub revision or the weights' SHA-256)."""

from __future__ import annotations

import json
from pathlib import Path

from accelerate.utils import broadcast_object_list

from ..common import model_store
from .recipe_inputs import RecipeError

#: The file in a run's output folder that says which copy of the model it trained.
RECORD = "model_source.json"


def resolved_or_error(name: str) -> model_store.Resolved | str:
    try:
        return model_store.resolve_model(name)
    except model_store.ModelSourceError as err:
        return str(err)


def resolve_for_run(name: str, args) -> model_store.Resolved:
    """`name` resolved on rank 0 and the answer given to every rank (its error too, raised everywhere alike)."""
    if args.world_size > 1:
        answer = [resolved_or_error(name) if args.process_index == 0 else None]
        broadcast_object_list(answer, from_process=0)
        answer = answer[0]
    else:
        answer = resolved_or_error(name)
    if isinstance(answer, str):
        raise RecipeError(answer)
    return answer


def write_record(resolved: model_store.Resolved, output_dir: str) -> None:
    """`model_source.json` in `output_dir` (the main process, once the model is saved)."""
    Path(output_dir, RECORD).write_text(json.dumps(resolved.record(), indent=2) + "\n")
