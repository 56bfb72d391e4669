"""Parity of `GSPOTrainer`'s rebuilt loss with the installed stock `trl.GRPOTrainer`: value, gradients, metrics.

Both trainers get a copy of the same tiny model and the same hand-made training batch, and each runs its
`_compute_loss` once, in train mode, with gradient accumulation 2 (so the accumulation normalisers are exercised).
A difference means our pipeline changed something besides its two hooks, or that the installed TRL changed
underneath it. `trl-gspo check` runs every case after an upgrade; `tests/test_parity.py` runs them in the suite.

Levels and loss types covered: `token` and `sequence` (the levels stock TRL has) with every loss type TRL
implements (token-sum types with `sequence` included, opted in), each loss feature our `_compute_loss` re-routes
(KL with and without bias correction, entropy mask, bonus and adaptive controller, `delta`, off-policy mask, MoE aux
loss), and `sequence_token`, which stock TRL lacks: with one advantage per sequence it must equal our `sequence`.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from ..config import GSPOConfig
from ..rounding import loss_bound, model_bound, relative_gap
from ..trainer import GSPOTrainer

B, P, T = 6, 5, 7  # sequences, prompt length, completion length of the hand-made batch

COMMON_SEQ = dict(epsilon=3e-3, epsilon_high=4e-3)  # narrow enough that some sequences clip, wide enough not all
ALLOW = dict(allow_token_sum_with_sequence_level=True)
#: name -> config settings; each case is run by stock `GRPOTrainer` and by `GSPOTrainer`, which must agree.
CASES: dict[str, dict] = {
    "token-grpo": dict(importance_sampling_level="token", loss_type="grpo", epsilon=0.01, epsilon_high=0.012),
    "sequence-grpo (GSPO)": dict(importance_sampling_level="sequence", loss_type="grpo", **COMMON_SEQ),
    "token-dapo": dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.01, epsilon_high=0.015),
    "sequence-dapo": dict(importance_sampling_level="sequence", loss_type="dapo", **COMMON_SEQ, **ALLOW),
    "token-bnpo": dict(importance_sampling_level="token", loss_type="bnpo", epsilon=0.01),
    "sequence-bnpo": dict(importance_sampling_level="sequence", loss_type="bnpo", **COMMON_SEQ, **ALLOW),
    "token-dr_grpo": dict(importance_sampling_level="token", loss_type="dr_grpo", epsilon=0.01),
    "sequence-dr_grpo": dict(importance_sampling_level="sequence", loss_type="dr_grpo", **COMMON_SEQ, **ALLOW),
    "token-cispo": dict(importance_sampling_level="token", loss_type="cispo", epsilon_high=1.01),
    "sequence-cispo": dict(importance_sampling_level="sequence", loss_type="cispo", epsilon_high=1.002, **ALLOW),
    "sequence-luspo": dict(importance_sampling_level="sequence", loss_type="luspo", **COMMON_SEQ),
    "token-sapo": dict(importance_sampling_level="token", loss_type="sapo"),
    "sequence-sapo": dict(importance_sampling_level="sequence", loss_type="sapo"),
    "token-vespo": dict(importance_sampling_level="token", loss_type="vespo"),
    "sequence-grpo-kl": dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.04, **COMMON_SEQ),
    "token-grpo-kl-biascorr": dict(
        importance_sampling_level="token", loss_type="grpo", beta=0.04, use_bias_correction_kl=True, epsilon=0.01
    ),
    "sequence-entropy-mask-bonus": dict(
        importance_sampling_level="sequence",
        loss_type="grpo",
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        **COMMON_SEQ,
    ),
    "token-adaptive-entropy": dict(importance_sampling_level="token", loss_type="grpo", use_adaptive_entropy=True),
    "sequence-delta": dict(importance_sampling_level="sequence", loss_type="grpo", delta=1.005, **COMMON_SEQ),
    "token-off-policy-mask": dict(
        importance_sampling_level="token", loss_type="grpo", off_policy_mask_threshold=0.001, epsilon=0.01
    ),
}
#: Cases run on a Mixture-of-Experts model (TRL adds the router load-balancing loss).
MOE_CASES = {"sequence-grpo-moe-aux": CASES["sequence-grpo (GSPO)"]}
#: Our level without a stock counterpart, and the level it must equal when advantages are one per sequence.
GSPO_TOKEN_CASE = ("sequence_token", "sequence")
#: Sequence-level cases re-run at `sequence_token` (with the clipped surrogate and with SAPO's soft gate).
GSPO_TOKEN_BASES = ("sequence-grpo (GSPO)", "sequence-sapo")


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """How far ours may lie from stock on the hand-made batch: rounding alone (trl_gspo/rounding.py), since both run the
    same math with the sums in another order (ours trims, sorts and packs the forward). `loss` and `metric` are
    relative to the value, plus an absolute floor: `loss_floor` because the loss averages advantage x ratio terms of
    either sign, as large as the advantages, `metric_floor` because the metrics are functions of the log-probs
    (log-ratios are differences of two of them) and carry their rounding. `gradient` is relative to each parameter's
    gradient norm."""

    loss: float
    loss_floor: float
    gradient: float
    metric: float
    metric_floor: float


def tolerances(model, inputs: dict) -> Tolerances:
    """The `Tolerances` of `model` (its config and dtype) on `inputs` (`make_inputs`): a policy loss over the batch
    (`loss_bound`: a forward, importance ratios of log-probs as large as the batch's, the loss's sums over the tokens),
    and for the gradients the backward too."""
    dtype = next(model.parameters()).dtype
    rows, seq_len = inputs["prompt_ids"].size(0), inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    size = inputs["old_per_token_logps"].abs().max().item()
    loss = loss_bound(dtype, model.config, seq_len, rows * seq_len, size)
    return Tolerances(
        loss=loss,
        loss_floor=loss * inputs["advantages"].abs().max().item(),
        gradient=loss_bound(dtype, model.config, seq_len, rows * seq_len, size, rows * seq_len),
        metric=loss,
        metric_floor=model_bound(dtype, model.config, seq_len) * size,
    )


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def make_inputs(model, seed: int = 0, beta: bool = False) -> dict:
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


def build_trainer(trainer_cls, config_cls, model, settings: dict, output_dir, tokenizer):
    """A trainer in train mode on a copy of `model`, ready for `_compute_loss` on a hand-made batch. It runs where
    the model is, in bf16 mixed precision when the model's weights are bf16 (as a GPU run loads them)."""
    from datasets import Dataset

    known = {f.name for f in dataclasses.fields(config_cls)}  # our own fields (e.g. the token-sum opt-in) are not TRL's
    settings = {key: value for key, value in settings.items() if key in known}
    weight = next(model.parameters())
    args = config_cls(
        output_dir=str(output_dir),
        use_cpu=weight.device.type == "cpu",
        bf16=weight.dtype == torch.bfloat16,
        report_to=[],
        per_device_train_batch_size=B,
        num_generations=2,
        max_completion_length=T,
        # Explicit: GRPOConfig and GSPOConfig default these differently.
        **{"steps_per_generation": 4, "epsilon": 0.01, "epsilon_high": 0.012, **settings},
    )
    dataset = Dataset.from_dict({"prompt": ["add 1 2 ="] * 8})
    trainer = trainer_cls(copy.deepcopy(model), _reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # exercise the accumulation normaliser
    return trainer


def loss_and_grads(trainer_cls, config_cls, model, settings, inputs, output_dir, tokenizer):
    """(loss, {parameter: gradient}, {metric: last value}) of one `_compute_loss` + backward, under the autocast a
    training step would use (none in fp32)."""
    trainer = build_trainer(trainer_cls, config_cls, model, settings, output_dir, tokenizer)
    device = next(trainer.model.parameters()).device
    with trainer.accelerator.autocast():
        loss = trainer._compute_loss(trainer.model, {k: v.clone().to(device) for k, v in inputs.items()})
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def differences(reference, candidate, tolerance: Tolerances, what: str = "stock", metrics: bool = True) -> list[str]:
    """Human-readable differences between two `loss_and_grads` results (metrics too if `metrics`) beyond
    `tolerance`; empty when they agree."""
    (ref_loss, ref_grads, ref_metrics), (loss, grads, cand_metrics) = reference, candidate
    found = []

    def close(a, b, rel, floor):
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        return bool(torch.isclose(a, b, rtol=rel, atol=floor, equal_nan=True).all())

    if not close(loss, ref_loss, tolerance.loss, tolerance.loss_floor):
        found.append(f"loss: ours {loss.item():.9g} vs {what} {ref_loss.item():.9g}")
    if grads.keys() != ref_grads.keys():
        missing = sorted(ref_grads.keys() ^ grads.keys())
        found.append(f"gradients: parameters with a gradient differ ({', '.join(missing[:3])}...)")
    for name in sorted(ref_grads.keys() & grads.keys()):
        gap = relative_gap(grads[name], ref_grads[name])
        if not gap <= tolerance.gradient:
            largest = (grads[name].double() - ref_grads[name].double()).abs().max().item()
            found.append(
                f"gradient of {name}: max |ours - {what}| = {largest:.3g} "
                f"(relative to its norm {gap:.3g}; rounding allows {tolerance.gradient:.3g})"
            )
    for key in sorted(ref_metrics.keys() & cand_metrics.keys()) if metrics else ():
        if key.startswith("clip_ratio/") and key.endswith(("_min", "_max")):
            continue  # TRL's per-sequence extrema are NaN for empty completions; ours treat them as 0
        if not close(cand_metrics[key], ref_metrics[key], tolerance.metric, tolerance.metric_floor):
            found.append(f"metric {key}: ours {cand_metrics[key]:.9g} vs {what} {ref_metrics[key]:.9g}")
    return found


def compare_with_stock(settings: dict, model, tokenizer, workdir, seed: int = 2) -> list[str]:
    """Run one case through stock `GRPOTrainer` and `GSPOTrainer`; returns the differences (empty: parity)."""
    from trl import GRPOConfig, GRPOTrainer

    inputs = make_inputs(model, seed=seed, beta=settings.get("beta", 0) > 0)
    stock = loss_and_grads(GRPOTrainer, GRPOConfig, model, settings, inputs, Path(workdir) / "stock", tokenizer)
    ours = loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, Path(workdir) / "ours", tokenizer)
    found = differences(stock, ours, tolerances(model, inputs))
    if not found and not (torch.isfinite(stock[0]) and stock[0].abs() > 0 and stock[1]):
        found.append("the stock loss is zero, non-finite or has no gradient: the case compares nothing")
    return found


def compare_gspo_token(base: str, model, tokenizer, workdir, seed: int = 2) -> list[str]:
    """GSPO-token (`sequence_token`) against our GSPO (`sequence`) on the `base` case, with one advantage per
    sequence: equal loss and gradients (the paper's Eq. 13 reduces to Eq. 7 then). TRL's clip metrics count
    sequences for a `(B, 1)` ratio and tokens for a `(B, T)` one, so they differ by definition and are not compared."""
    level, reference_level = GSPO_TOKEN_CASE
    inputs = make_inputs(model, seed=seed)
    settings = dict(CASES[base], importance_sampling_level=reference_level)
    gspo = loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, Path(workdir) / "seq", tokenizer)
    settings["importance_sampling_level"] = level
    gspo_token = loss_and_grads(GSPOTrainer, GSPOConfig, model, settings, inputs, Path(workdir) / "seqtok", tokenizer)
    return differences(gspo, gspo_token, tolerances(model, inputs), what=reference_level, metrics=False)
