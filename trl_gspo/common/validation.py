"""The one error style of `GSPOConfig` validation: every message names the field, the value and what is allowed.

Each feature module declares its own `GSPOConfig` fields in a small options dataclass next to the code that uses
them (`PaddingOptions` in forward/padding.py, `RoutingReplayOptions` in moe/routing_replay.py, ...) and validates them there;
`GSPOConfig` (config.py) inherits the options classes and calls each one's `_validate_*` method. The checks that
recur across features are these three functions, so a bad value reads the same whichever feature it belongs to.
"""

from __future__ import annotations


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(str, choices))}.")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")


def check_int(name: str, value, minimum: int, why: str = "") -> None:
    """`value` must be an int (not a bool) `>= minimum`; `why` is appended in brackets when given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{f' ({why})' if why else ''}.")
