"""The set-up side of vLLM colocate on its CPU build (trl_gspo/rollout/colocate_cpu_sync.py), without vLLM.

Whether the syncs reach the engine is proved against the real CPU build in tests/real_vllm/test_colocate.py; here a
module tree standing in for `vllm` (a platform that says CPU, with or without the layer-wise reload) checks which
settings are refused, and that nothing is wrapped where the sync needs no help.
"""

import sys
import types

import pytest

from trl_gspo.rollout import colocate_cpu_sync


def _fake_vllm(monkeypatch, *, cpu: bool, reload: bool, version: str = "0.21.0+cpu"):
    """`vllm`, `vllm.platforms` (current_platform.is_cpu()) and, where `reload`, vLLM's layer-wise reload module."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    modules = {"vllm": vllm, "vllm.platforms": platforms}
    if reload:
        loader = types.ModuleType("vllm.model_executor.model_loader.reload")
        loader.initialize_layerwise_reload = loader.finalize_layerwise_reload = lambda *a, **k: None
        modules.update(
            {
                "vllm.model_executor": types.ModuleType("vllm.model_executor"),
                "vllm.model_executor.model_loader": types.ModuleType("vllm.model_executor.model_loader"),
                "vllm.model_executor.model_loader.reload": loader,
            }
        )
    else:
        modules["vllm.model_executor"] = None  # `import vllm.model_executor...` raises ImportError
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_a_cpu_build_without_the_layerwise_reload_is_refused_naming_setting_and_version(monkeypatch):
    _fake_vllm(monkeypatch, cpu=True, reload=False)
    with pytest.raises(
        ValueError,
        match=r"vllm_mode='colocate' on vLLM's CPU build \(0\.21\.0\+cpu\).*layer-wise "
        r"reload.*vllm_mode='server'",
    ):
        colocate_cpu_sync.check_cpu_colocate_supported(True, "colocate")


@pytest.mark.parametrize(
    "cpu, reload, use_vllm, mode",
    [
        (True, True, True, "colocate"),  # the CPU build with the reload: supported
        (False, False, True, "colocate"),  # a CUDA build: TRL's sync works as it is
        (True, False, True, "server"),  # server mode: the server loads the weights
        (True, False, False, "colocate"),  # no vLLM generation at all
    ],
)
def test_what_is_not_refused(monkeypatch, cpu, reload, use_vllm, mode):
    _fake_vllm(monkeypatch, cpu=cpu, reload=reload)
    colocate_cpu_sync.check_cpu_colocate_supported(use_vllm, mode)


def test_without_vllm_nothing_is_checked_or_wrapped(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert colocate_cpu_sync.cpu_build() is False
    colocate_cpu_sync.check_cpu_colocate_supported(True, "colocate")
    generation = types.SimpleNamespace(sync_weights=object())
    trainer = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_generation=generation)
    original = generation.sync_weights
    assert colocate_cpu_sync.enable_cpu_colocate_sync(trainer) is False and generation.sync_weights is original


@pytest.mark.parametrize(
    "cpu, mode, wrapped", [(True, "colocate", True), (False, "colocate", False), (True, "server", False)]
)
def test_only_a_colocated_cpu_engine_gets_the_wrapped_sync(monkeypatch, cpu, mode, wrapped):
    _fake_vllm(monkeypatch, cpu=cpu, reload=True)
    generation = types.SimpleNamespace(sync_weights=lambda: None)
    original = generation.sync_weights
    trainer = types.SimpleNamespace(use_vllm=True, vllm_mode=mode, vllm_generation=generation)
    assert colocate_cpu_sync.enable_cpu_colocate_sync(trainer) is wrapped
    assert (generation.sync_weights is not original) is wrapped


@pytest.mark.parametrize("trl_sync_fails", [False, True])
def test_trls_sync_runs_inside_the_reload_which_is_finalized_even_when_the_sync_fails(monkeypatch, trl_sync_fails):
    """Order of one wrapped sync: experts' kernels dropped, reload opened, TRL's loads, reload finalized, tied heads
    repacked; a failing TRL sync still finalizes (the engine's layers get their tensors back) and its error surfaces."""
    import torch

    _fake_vllm(monkeypatch, cpu=True, reload=True)
    events = []
    reload = sys.modules["vllm.model_executor.model_loader.reload"]
    reload.initialize_layerwise_reload = lambda model: events.append("initialize")
    reload.finalize_layerwise_reload = lambda model, config: events.append(("finalize", config))
    layers = types.ModuleType("vllm.model_executor.layers.vocab_parallel_embedding")

    class VocabParallelEmbedding(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    class ParallelLMHead(VocabParallelEmbedding):
        pass

    layers.VocabParallelEmbedding, layers.ParallelLMHead = VocabParallelEmbedding, ParallelLMHead
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers", types.ModuleType("vllm.model_executor.layers"))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.vocab_parallel_embedding", layers)

    shared = torch.nn.Parameter(torch.zeros(4, 2))
    model = torch.nn.Module()
    model.embed, model.tied_head = VocabParallelEmbedding(shared), ParallelLMHead(shared)
    model.own_head = ParallelLMHead(torch.nn.Parameter(torch.zeros(4, 2)))
    for name in ("tied_head", "own_head"):
        getattr(model, name).quant_method = types.SimpleNamespace(
            process_weights_after_loading=lambda layer, name=name: events.append(("repack", name))
        )
    model.experts = torch.nn.Module()
    model.experts.quant_method = types.SimpleNamespace(moe_kernel="built at load")

    def trl_sync():
        events.append(("trl sync", model.experts.quant_method.moe_kernel))
        if trl_sync_fails:
            raise RuntimeError("gather failed")

    runner = types.SimpleNamespace(model=model, model_config="model config")
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        )
    )
    generation = types.SimpleNamespace(sync_weights=trl_sync, llm=llm)
    colocate_cpu_sync.enable_cpu_colocate_sync(
        types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_generation=generation)
    )
    if trl_sync_fails:
        with pytest.raises(RuntimeError, match="gather failed"):
            generation.sync_weights()
    else:
        generation.sync_weights()
    assert events == ["initialize", ("trl sync", None), ("finalize", "model config"), ("repack", "tied_head")]
