"""The optimizers of transformers' `optim` field that need a package besides torch, checked when the config is built.

transformers imports an optimizer's package only when the Trainer creates the optimizer, after the model has loaded
(and, with vLLM, after its engine started), and a missing one fails there with a long traceback. `GSPOConfig`'s
validation calls `check_optimizer_package`, so a recipe or a script fails in one line before anything loads, naming
the package and an optimizer that needs none. `OPTIMIZER_PACKAGES` covers every name of transformers'
`OptimizerNames` that needs one; `TORCH_OPTIMIZERS` the rest (`tests/test_precision.py` checks that the two cover
every name the installed transformers knows).
"""

from __future__ import annotations

import importlib.util

#: module to import -> (pip package, the `optim` values that need it).
OPTIMIZER_PACKAGES = {
    "bitsandbytes": (
        "bitsandbytes",
        (
            "adamw_bnb_8bit",
            "adamw_8bit",
            "paged_adamw_32bit",
            "paged_adamw_8bit",
            "ademamix",
            "ademamix_8bit",
            "paged_ademamix_32bit",
            "paged_ademamix_8bit",
            "lion_32bit",
            "lion_8bit",
            "paged_lion_32bit",
            "paged_lion_8bit",
            "rmsprop_bnb",
            "rmsprop_bnb_8bit",
            "rmsprop_bnb_32bit",
        ),
    ),
    "torchao": ("torchao", ("adamw_torch_4bit", "adamw_torch_8bit")),
    "galore_torch": (
        "galore-torch",
        (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        ),
    ),
    "apollo_torch": ("apollo-torch", ("apollo_adamw", "apollo_adamw_layerwise")),
    "lomo_optim": ("lomo-optim", ("lomo", "adalomo")),
    "grokadamw": ("grokadamw", ("grokadamw",)),
    "schedulefree": ("schedulefree", ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd")),
    "optimi": ("torch-optimi", ("stable_adamw",)),
    "torchdistx": ("torchdistx", ("adamw_anyprecision",)),
    "torch_xla": ("torch-xla", ("adamw_torch_xla",)),
    "torch_npu": ("torch-npu", ("adamw_torch_npu_fused",)),
    "apex": ("apex", ("adamw_apex_fused",)),  # transformers < 5 (kept for configs written then)
}
#: `optim` values torch alone runs.
TORCH_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")


def installed(module: str) -> bool:
    """Whether `module` can be imported (found on the path; nothing is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needed_package(optim) -> tuple[str, str] | None:
    """(module, pip package) that `optim` needs, or None (torch's own, or a name this table does not know)."""
    name = str(getattr(optim, "value", optim))
    for module, (package, names) in OPTIMIZER_PACKAGES.items():
        if name in names:
            return module, package
    return None


def check_optimizer_package(optim) -> None:
    """Raise a one-line ValueError when `optim` needs a package that is not installed."""
    needed = needed_package(optim)
    if needed is None or installed(needed[0]):
        return
    name = str(getattr(optim, "value", optim))
    raise ValueError(
        f"optim={name!r} needs the package {needed[1]!r}, which is not installed: `pip install {needed[1]}`, or choose "
        "an optimizer torch runs alone, e.g. optim: adamw_torch_fused (adamw_torch on CPU) or adafactor (less "
        "optimizer memory)."
    )
