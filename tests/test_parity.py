"""Upstream parity: GSPOTrainer's rebuilt loss equals stock trl.GRPOTrainer's, value and gradient.

The cases live in `trl_gspo/cli/parity.py` (what `trl-gspo check` runs after a TRL upgrade): for the levels TRL has
(`token`, `sequence`), every loss type and every loss feature our `_compute_loss` re-routes, both trainers see the
same weights and the same batch. A mismatch means our pipeline changed something besides the two hooks, or that TRL
changed underneath. `sequence_token` has no stock counterpart: with sequence advantages it must equal `sequence`.
"""

import pytest
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.cli import parity
from trl_gspo.testing import build_tiny_model


@pytest.mark.parametrize("name", list(parity.CASES))
def test_loss_and_gradients_match_stock_trl(name, tokenizer, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # a path, so beta > 0 can load the reference
    found = parity.compare_with_stock(parity.CASES[name], model, tokenizer, tmp_path)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("base", parity.GSPO_TOKEN_BASES)
def test_gspo_token_equals_gspo_with_sequence_advantages(base, tokenizer, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    found = parity.compare_gspo_token(base, model, tokenizer, tmp_path)
    assert not found, "\n".join(found)


def test_parity_comparison_catches_a_gradient_only_difference(tokenizer, tiny_model_dir, tmp_path):
    """The comparison itself: a change with the same loss value but another gradient must be reported."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inputs = parity.make_inputs(model, seed=2)
    settings = parity.CASES["sequence-grpo (GSPO)"]
    loss, grads, metrics = parity.loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, tmp_path, tokenizer)
    name = next(iter(grads))
    shifted = {**grads, name: grads[name] + 1e-4}
    tolerance = parity.tolerances(model, inputs)
    found = parity.differences((loss, grads, metrics), (loss, shifted, metrics), tolerance)
    assert len(found) == 1 and found[0].startswith(f"gradient of {name}: max |ours - stock| = 0.0001 (relative to")
    # a loss 1e-2 off: far past fp32's rounding of its advantage x ratio terms (tolerance.loss_floor, ~2e-4)
    assert parity.differences((loss, grads, metrics), (loss + 1e-2, grads, metrics), tolerance)[0].startswith(
        "loss: ours"
    )


def test_sequence_parity_case_actually_clips(tokenizer, tmp_path):
    """Guard for the parity matrix: the GSPO case must exercise both the clipped and the unclipped branches."""
    model = build_tiny_model(tokenizer, seed=1)
    inputs = parity.make_inputs(model, seed=2)
    settings = parity.CASES["sequence-grpo (GSPO)"]
    _, _, metrics = parity.loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, tmp_path, tokenizer)
    assert 0.0 < metrics["clip_ratio/region_mean"] < 1.0


def test_moe_aux_loss_parity(tiny_moe_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    settings = parity.MOE_CASES["sequence-grpo-moe-aux"]
    inputs = parity.make_inputs(model, seed=3)
    stock = parity.loss_and_grads(GRPOTrainer, GRPOConfig, model, settings, inputs, tmp_path / "a", tokenizer)
    ours = parity.loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, tmp_path / "b", tokenizer)
    tolerance = parity.tolerances(model, inputs)
    assert ours[2]["aux_loss"] == pytest.approx(stock[2]["aux_loss"], rel=tolerance.metric) and ours[2]["aux_loss"] > 0
    assert [n for n in ours[1] if "mlp.gate." in n + "."], "router weights must receive gradient (aux loss)"
    found = parity.differences(stock, ours, tolerance)
    assert not found, "\n".join(found)


def _count_work(trainer_cls, config_cls, model, inputs, tmp_path, tokenizer):
    """Model forwards and cross-process collectives (each followed by a host sync in TRL) in one `_compute_loss`."""
    settings = parity.CASES["sequence-grpo (GSPO)"]
    trainer = parity.build_trainer(trainer_cls, config_cls, model, settings, tmp_path, tokenizer)
    counts = {"forward": 0, "collective": 0}
    trainer.model.register_forward_hook(lambda *a: counts.__setitem__("forward", counts["forward"] + 1))
    for name in ("gather", "reduce", "gather_for_metrics"):
        original = getattr(trainer.accelerator, name)

        def counted(*a, _original=original, **k):
            counts["collective"] += 1
            return _original(*a, **k)

        setattr(trainer.accelerator, name, counted)
    trainer._compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()}).backward()
    return counts


def test_loss_path_adds_no_forward_and_fewer_collectives_than_stock(tokenizer, tmp_path):
    """The hooks and diagnostics must not add a pass or a per-micro-batch sync: one forward like stock, and TRL's
    metrics from one gather (stock: a reduce or gather per metric). Diagnostics are reduced at log time only."""
    model = build_tiny_model(tokenizer, seed=1)
    inputs = parity.make_inputs(model, seed=2)
    stock = _count_work(GRPOTrainer, GRPOConfig, model, inputs, tmp_path / "a", tokenizer)
    ours = _count_work(GSPOTrainer, GSPOConfig, model, inputs, tmp_path / "b", tokenizer)
    assert stock["forward"] == ours["forward"] == 1
    assert stock["collective"] == 6 and ours["collective"] == 1
