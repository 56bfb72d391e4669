"""What the machine has, for `make gpu-check` / `make gpu-quick` (check.py): GPUs, the packages the parts need and
trl-gspo's supported ranges, and the checks that say why a part cannot run here. Nothing here imports TRL (a missing
TRL must not stop the check), nor any other module of this folder.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def environment() -> dict:
    """GPUs and the packages the parts need; nothing here imports TRL (a missing TRL must not stop the check)."""
    from importlib import metadata

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    versions = {}
    for name in ("torch", "trl", "transformers", "accelerate", "peft", "datasets", "deepspeed", "vllm", "flash-attn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    modules = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "flash_attn", "deepspeed")}
    modules["torch_varlen"] = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return {
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "versions": versions,
        "supported": supported_ranges(),
        "modules": modules,
        "python": platform.python_version(),
    }


#: Packages every part imports, checked against trl-gspo's supported ranges (pyproject.toml's dependencies).
CORE = ("torch", "trl", "transformers", "accelerate", "datasets")


def supported_ranges() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library; the ranges go unchecked
        return {}
    from packaging.requirements import Requirement

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        requirements = [Requirement(line) for line in tomllib.load(f)["project"]["dependencies"]]
    order = {">": 0, "!": 1, "<": 2}  # lower bound first, as pyproject.toml writes them
    return {
        req.name: ",".join(sorted(map(str, req.specifier), key=lambda spec: order.get(spec[0], 1)))
        for req in requirements
        if req.name in CORE
    }


def core(env) -> list[str]:
    """A missing core package, or one outside the supported range (e.g. an image's older transformers)."""
    from packaging.specifiers import SpecifierSet

    reasons = []
    for name in CORE:
        version, wanted = env["versions"].get(name), env.get("supported", {}).get(name)
        if version is None:
            reasons.append(f"{name} not installed")
        elif wanted and not SpecifierSet(wanted).contains(version.split("+")[0], prereleases=True):
            reasons.append(f"{name} {version} outside the supported {wanted}")
    return reasons


def cuda(env) -> list[str]:
    return [] if env["gpus"] else ["no CUDA GPU visible"]


def modules(*names) -> Callable[[dict], list[str]]:
    return lambda env: [f"{name} not installed" for name in names if not env["modules"].get(name)]


def needs(*checks) -> Callable[[dict], list[str]]:
    """Reasons a part cannot run here (all of them, so a dry run on CPU says everything a GPU machine must have)."""
    base = (cuda, core)
    return lambda env: [reason for check in (*base, *checks) for reason in check(env)]


def two_gpus(env) -> list[str]:
    return [] if len(env["gpus"]) >= 2 else [f"needs 2 GPUs, {len(env['gpus'])} visible"]
