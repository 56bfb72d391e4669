"""Small helpers shared by the config, trainer and CLI."""

from __future__ import annotations

import importlib
from typing import Callable


def resolve_callable(path: str, field_name: str) -> Callable:
    """Import `package.module.attr` and return it; never evaluates the string.

    Raises a `ValueError` naming `field_name` and `path` when the module or attribute is missing or not callable.
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{field_name}={path!r} must be a dotted import path such as 'my_pkg.my_module.my_function'.")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{field_name}={path!r} could not be imported: {err}") from err
    if not callable(obj):
        raise ValueError(f"{field_name}={path!r} resolves to a {type(obj).__name__}, not a callable.")
    return obj
