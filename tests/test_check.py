"""`trl-gspo check` and the TRL version gate: what a user relies on after upgrading TRL.

The check must pass on the installed versions and must fail, naming the case and the quantity, when the stock
trainer's semantics change: the tests inject such a change into `trl.GRPOTrainer._compute_loss` itself.
"""

import os
import warnings

import pytest
import torch
from trl import GRPOTrainer

from trl_gspo.cli import check, parity
from trl_gspo.common import trl_compat


def test_check_passes_on_the_installed_versions(capsys):
    assert check.main([]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "trl", "transformers", "accelerate", "peft", "deepspeed", "vllm", "flash-attn", "CUDA"):
        assert f"  {name} " in out, name
    assert "OK: all" in out and "DIFFERS" not in out
    assert out.count("  ok       ") == len(parity.CASES) + len(parity.MOE_CASES) + len(parity.GSPO_TOKEN_BASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: DeepSpeed finds it")
def test_check_tells_deepspeed_it_runs_on_cpu_before_any_case(monkeypatch, capsys):
    """Without it, DeepSpeed's "Setting accelerator to CPU" lands in the middle of the report when transformers first
    imports DeepSpeed, inside the first parity case."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    seen = []
    monkeypatch.setattr(check, "run_parity", lambda log=print: seen.append(os.environ.get("DS_ACCELERATOR")) or {})
    assert check.main([]) == 0
    assert seen == ["cpu"]


def _few_cases(monkeypatch):
    """Two stock-comparable cases, to keep the failure tests short (the full set runs in the test above)."""
    monkeypatch.setattr(parity, "CASES", {k: parity.CASES[k] for k in ("token-grpo", "sequence-grpo (GSPO)")})
    monkeypatch.setattr(parity, "MOE_CASES", {})
    monkeypatch.setattr(parity, "GSPO_TOKEN_BASES", ())


def test_check_fails_naming_the_loss_when_stock_trl_changes_its_loss(monkeypatch, capsys):
    _few_cases(monkeypatch)
    original = GRPOTrainer._compute_loss
    # 1e-2 on a loss whose terms (advantage x ratio) are ~1: far past their fp32 rounding (parity.Tolerances)
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", lambda self, model, inputs: original(self, model, inputs) + 1e-2)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS  token-grpo: loss: ours" in out and "DIFFERS  sequence-grpo (GSPO): loss: ours" in out
    assert "FAILED: 2 of 2 cases differ" in out


def test_check_fails_naming_the_parameter_when_only_a_gradient_changes(monkeypatch, capsys):
    """Same loss value, different gradient (a zero-valued term through one weight): only the gradient check sees it."""
    _few_cases(monkeypatch)
    original = GRPOTrainer._compute_loss

    def perturbed(self, model, inputs):
        weight = model.get_input_embeddings().weight
        return original(self, model, inputs) + 1e-3 * (weight - weight.detach()).sum()

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", perturbed)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert "gradient of model.embed_tokens.weight" in out and "loss: ours" not in out


def test_version_gate_refuses_older_and_warns_on_newer_trl():
    with pytest.raises(
        trl_compat.UnsupportedTRLVersionError,
        match=r"supports TRL >=1\.10\.0,<1\.17 .*installed TRL is 1\.9\.2.*pip show trl",
    ):
        trl_compat.check_trl_version("1.9.2")
    for newer in ("1.17.0", "1.17.0.dev0", "2.0.0"):
        with pytest.warns(UserWarning, match=rf"TRL {newer} is newer .*run `trl-gspo check`"):
            trl_compat.check_trl_version(newer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning inside the tested range
        for tested in ("1.10.0", "1.14.2", "1.16.0", "1.16.3"):
            assert trl_compat.check_trl_version(tested) == tested


def test_the_installed_trl_is_in_the_supported_range():
    from packaging.specifiers import SpecifierSet

    assert trl_compat.installed_trl_version() in SpecifierSet(trl_compat.SUPPORTED_TRL)
