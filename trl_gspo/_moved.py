"""Old import paths of modules that moved into the package's folders, kept for one release with a DeprecationWarning.

Until 0.1.0 every module sat directly in `trl_gspo/` (`trl_gspo.demo`, `trl_gspo.tiny`, `trl_gspo.checkpointing`, ...);
they now live in the folder of their path (docs/design.md, module map). `import trl_gspo.demo` still works: a finder
on `sys.meta_path` answers the old name with the module at its new place (the same module object, so attributes and
monkeypatches are shared) and warns once per name. The finder and `MOVED` go in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old dotted path -> new dotted path
MOVED = {
    f"trl_gspo.{old}": f"trl_gspo.{new}"
    for old, new in {
        "validation": "common.validation",
        "metrics": "common.metrics",
        "trl_compat": "common.trl_compat",
        "model_card": "common.model_card",
        "prompt_stream": "rollout.prompt_stream",
        "dynamic_sampling": "rollout.dynamic_sampling",
        "async_rollouts": "rollout.async_rollouts",
        "sampler_logprobs": "rollout.sampler_logprobs",
        "padding": "forward.padding",
        "shared_prefix": "forward.shared_prefix",
        "segment_attention": "forward.segment_attention",
        "fused_head": "forward.fused_head",
        "routing": "moe.routing",
        "route_sources": "moe.route_sources",
        "routing_replay": "moe.routing_replay",
        "nonfinite": "guards.nonfinite",
        "rewards_guard": "guards.rewards_guard",
        "checkpointing": "guards.checkpointing",
        "diagnostics": "guards.diagnostics",
        "recipe_inputs": "cli.recipe_inputs",
        "rewards": "cli.rewards",
        "console": "cli.console",
        "demo": "cli.demo",
        "check": "cli.check",
        "parity": "cli.parity",
        "tiny": "cli.tiny",
    }.items()
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module at its new place, with a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path works until the next release. Import {new} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at the new place is already executed


def install() -> None:
    """Put the finder on `sys.meta_path` once (after the standard finders: a real module of that name wins)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
