"""Upstream parity: GSPOTrainer's rebuilt loss equals stock trl.GRPOTrainer's, value and gradient.

For the levels TRL has (`token`, `sequence`) and every loss feature our `_compute_loss` re-routes (loss types,
KL with and without bias correction, entropy mask and bonus, delta, off-policy mask, MoE aux loss), both trainers
see the same weights and the same batch. A mismatch means our pipeline changed something besides the two hooks,
or that TRL changed underneath the pin.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.tiny import build_tiny_model

B, P, T = 6, 5, 7


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["add 1 2 ="] * 8})


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _make_inputs(model, seed=0, beta=False):
    """A hand-made training batch: left-padded prompts, right-padded completions of lengths 1..T (one empty),
    old/ref log-probs near the current ones so ratios straddle the clip range, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(4, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, 1, 3, 0, T - 1, 4])
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], 1)
        logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
        logps = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, completion_ids[..., None])[..., 0]
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, 0.3, -1.2, 0.0]),
        "old_per_token_logps": logps + 0.02 * torch.randn(B, T, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.05 * torch.randn(B, T, generator=g)
    return inputs


def _trainer(trainer_cls, config_cls, model, settings, tmp_path, tokenizer):
    """A trainer in train mode on a copy of `model`, ready for `_compute_loss` on a hand-made batch."""
    args = config_cls(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=B,
        num_generations=2,
        max_completion_length=T,
        # Explicit: GRPOConfig and GSPOConfig default these differently.
        **{"steps_per_generation": 4, "epsilon": 0.01, "epsilon_high": 0.012, **settings},
    )
    trainer = trainer_cls(copy.deepcopy(model), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # exercise the accumulation normaliser
    return trainer


def _loss_and_grads(trainer_cls, config_cls, model, settings, inputs, tmp_path, tokenizer):
    trainer = _trainer(trainer_cls, config_cls, model, settings, tmp_path, tokenizer)
    loss = trainer._compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()})
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


COMMON_SEQ = dict(epsilon=3e-3, epsilon_high=4e-3)
CASES = {
    "token-grpo": dict(importance_sampling_level="token", loss_type="grpo", epsilon=0.01, epsilon_high=0.012),
    "sequence-grpo (GSPO)": dict(importance_sampling_level="sequence", loss_type="grpo", **COMMON_SEQ),
    "token-dapo": dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.01, epsilon_high=0.015),
    "token-bnpo": dict(importance_sampling_level="token", loss_type="bnpo", epsilon=0.01),
    "token-dr_grpo": dict(importance_sampling_level="token", loss_type="dr_grpo", epsilon=0.01),
    "token-cispo": dict(importance_sampling_level="token", loss_type="cispo", epsilon_high=1.01),
    "sequence-luspo": dict(importance_sampling_level="sequence", loss_type="luspo", **COMMON_SEQ),
    "sequence-grpo-kl": dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.04, **COMMON_SEQ),
    "token-grpo-kl-biascorr": dict(
        importance_sampling_level="token", loss_type="grpo", beta=0.04, use_bias_correction_kl=True, epsilon=0.01
    ),
    "sequence-entropy-mask-bonus": dict(
        importance_sampling_level="sequence", loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01, **COMMON_SEQ
    ),
    "token-adaptive-entropy": dict(importance_sampling_level="token", loss_type="grpo", use_adaptive_entropy=True),
    "sequence-delta": dict(importance_sampling_level="sequence", loss_type="grpo", delta=1.005, **COMMON_SEQ),
    "token-off-policy-mask": dict(
        importance_sampling_level="token", loss_type="grpo", off_policy_mask_threshold=0.001, epsilon=0.01
    ),
}
ALLOW = {"allow_token_sum_with_sequence_level": True}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_match_stock_trl(name, tokenizer, tiny_model_dir, tmp_path):
    settings = CASES[name]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # a path, so beta > 0 can load the reference
    inputs = _make_inputs(model, seed=2, beta=settings.get("beta", 0) > 0)
    ref_loss, ref_grads, ref_metrics = _loss_and_grads(GRPOTrainer, GRPOConfig, model, settings, inputs, tmp_path / "a", tokenizer)
    loss, grads, metrics = _loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, tmp_path / "b", tokenizer)

    assert torch.isfinite(ref_loss) and ref_loss.abs() > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=f"gradient of {n}")
    for key in ref_metrics.keys() & metrics.keys():
        if key.startswith("clip_ratio/") and key.endswith(("_min", "_max")):
            continue  # TRL's per-sequence extrema are NaN for empty completions; ours treat them as 0
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key


def test_sequence_parity_case_actually_clips(tokenizer, tmp_path):
    """Guard for the parity matrix: the GSPO case must exercise both the clipped and the unclipped branches."""
    model = build_tiny_model(tokenizer, seed=1)
    inputs = _make_inputs(model, seed=2)
    _, _, metrics = _loss_and_grads(GSPOTrainer, GSPOConfig, model, CASES["sequence-grpo (GSPO)"], inputs, tmp_path, tokenizer)
    assert 0.0 < metrics["clip_ratio/region_mean"] < 1.0


def test_moe_aux_loss_parity(tiny_moe_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    settings = CASES["sequence-grpo (GSPO)"]
    inputs = _make_inputs(model, seed=3)
    ref_loss, ref_grads, ref_metrics = _loss_and_grads(GRPOTrainer, GRPOConfig, model, settings, inputs, tmp_path / "a", tokenizer)
    loss, grads, metrics = _loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, tmp_path / "b", tokenizer)
    assert metrics["aux_loss"] == pytest.approx(ref_metrics["aux_loss"]) and metrics["aux_loss"] > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    router = [n for n in grads if "gate" in n and "mlp.gate." in n + "."]
    assert router, "router weights must receive gradient (aux loss)"
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=f"gradient of {n}")


def _count_work(trainer_cls, config_cls, model, inputs, tmp_path, tokenizer):
    """Model forwards and cross-process collectives (each followed by a host sync in TRL) in one `_compute_loss`."""
    trainer = _trainer(trainer_cls, config_cls, model, CASES["sequence-grpo (GSPO)"], tmp_path, tokenizer)
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
    inputs = _make_inputs(model, seed=2)
    stock = _count_work(GRPOTrainer, GRPOConfig, model, inputs, tmp_path / "a", tokenizer)
    ours = _count_work(GSPOTrainer, GSPOConfig, model, inputs, tmp_path / "b", tokenizer)
    assert stock["forward"] == ours["forward"] == 1
    assert stock["collective"] == 6 and ours["collective"] == 1
