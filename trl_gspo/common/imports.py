"""Dotted import paths (`pkg.module.attr`) resolved with importlib only, never evaluated as code.

Recipes name reward functions, a `trainer_class` and a dynamic-sampling filter this way; the CLI (cli/rewards.py,
cli/commands.py) and dynamic sampling (rollout/dynamic_sampling.py) share this one resolver.
"""

from __future__ import annotations

import importlib
import os
import sys


def import_object(path: str, search_dirs: tuple = ()):
    """`pkg.module.attr` -> the attribute, via importlib only. Modules in `search_dirs` (the CLI passes the recipe's
    folder) and in the working directory (as with `trl grpo`) are importable, so a recipe can name a module that
    sits next to it wherever it is launched from. Raises ValueError naming what is missing."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted import path (expected 'package.module.name').")
    for folder in (*search_dirs, os.getcwd()):  # kept on sys.path: dataloader workers and pickling import it again
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} (from {path!r}): {err}") from err
    if not hasattr(module, attr):
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r}).")
    return getattr(module, attr)
