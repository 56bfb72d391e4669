"""End to end on CPU, offline: a few optimizer steps of each variant on tiny Qwen3 / Qwen3-MoE / LoRA models.

`steps_per_generation` defaults to 4 mini-batches per rollout, so from the second mini-batch on the old
log-probs are real and the ratios move away from 1: that is where the variants differ.
"""

import pytest
import torch
from datasets import Dataset
from helpers.smallest_bug import (
    LastStepStart,
    last_step_gap,
)
from transformers import AutoModelForCausalLM

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.rounding import loss_bound, sgd_weights_bound
from trl_gspo.testing import build_tiny_model
from trl_gspo.token_advantages import discounted_turn_advantages

PROMPTS = ["add 1 2 =", "copy a b c :", "count 1 2 3 :", "what is 4 + 5 ?"]


def length_reward(completions, **kwargs):
    """Rewards short completions that contain a digit: varied enough that groups have non-zero advantages."""
    return [float(any(ch.isdigit() for ch in c)) + 1.0 / (1 + len(c.split())) for c in completions]


def train(model, tokenizer, tmp_path, max_steps=4, peft_config=None, trainer_cls=GSPOTrainer, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3,  # large enough that a tiny model's ratios leave the 3e-4 clip range
        logging_steps=1,
        max_steps=max_steps,
        seed=0,
    )
    args = GSPOConfig(**{**settings, **overrides})
    trainer = trainer_cls(
        model,
        length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.add_callback(LastStepStart())  # the last-step companion measures where that step ran
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, changed, logs


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_each_variant_trains_with_off_policy_minibatches(level, tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=0)
    trainer, changed, logs = train(model, tokenizer, tmp_path, importance_sampling_level=level)
    assert trainer.args.steps_per_generation == 4
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    assert len(changed) == len(dict(trainer.model.named_parameters()))  # every weight moved
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert all(key in entry for entry in logs)
    # Mini-batch 1 of each rollout is on-policy (ratio exactly 1: nothing clips); later ones are off-policy.
    assert logs[0]["clip_ratio/region_mean"] == 0.0
    assert max(entry["clip_ratio/region_mean"] for entry in logs[1:]) > 0.0


def test_lora_trains_only_the_adapter(tokenizer, tmp_path):
    from peft import LoraConfig

    model = build_tiny_model(tokenizer, seed=0)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, changed, logs = train(model, tokenizer, tmp_path, peft_config=peft_config)
    assert changed and all("lora_" in name for name in changed)
    assert any("lora_B" in name for name in changed)
    assert max(entry["clip_ratio/region_mean"] for entry in logs[1:]) > 0.0


def test_moe_trains_with_router_aux_loss(tiny_moe_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    trainer, changed, logs = train(model, tokenizer, tmp_path)
    assert trainer.aux_loss_enabled
    assert all(entry["aux_loss"] > 0 for entry in logs)
    assert any(".mlp.gate." in name for name in changed)  # routers are trained
    assert any(".experts." in name for name in changed)


def test_gspo_token_equals_gspo_end_to_end_and_differs_with_token_advantages(tokenizer, tmp_path):
    """Five mini-batch updates (one rollout batch's four, then the first of the next: the companion's last step is
    on-policy, nothing clipped), same seed: GSPO-token with the sequence advantage on every token (here through the
    documented multi-turn hook, single-turn completions) ends at GSPO's weights; with advantages that vary along the
    completion it does not."""

    class TurnCreditTrainer(GSPOTrainer):
        def token_advantages(self, inputs):
            return discounted_turn_advantages(inputs)

    class LaterTokensCountMore(GSPOTrainer):
        def token_advantages(self, inputs):
            ramp = torch.linspace(0.0, 2.0, inputs["completion_mask"].size(1))
            return inputs["advantages"][:, None] * ramp

    def final_weights(**overrides):
        # Plain SGD: Adam divides by sqrt(v), so on weights whose gradient is ~0 it turns float rounding (the two
        # paths sum the same terms in a different order) into a full-size step, and the comparison stops being about
        # the algorithm (rounding.sgd_weights_bound bounds SGD's runs; seen: 1.5e-6 apart after 4 Adam steps).
        trainer, _, _ = train(
            build_tiny_model(tokenizer, seed=0), tokenizer, tmp_path, max_steps=5, optim="sgd", **overrides
        )
        return trainer, {n: p.detach() for n, p in trainer.model.named_parameters()}

    trainer, gspo = final_weights(importance_sampling_level="sequence")
    gspo_token = final_weights(importance_sampling_level="sequence_token", trainer_cls=TurnCreditTrainer)[1]
    ramped = final_weights(importance_sampling_level="sequence_token", trainer_cls=LaterTokensCountMore)[1]
    # Each step's gradient: fp32 rounding of the policy loss over its rows (rounding.loss_bound).
    args = trainer.args
    seq_len = max(len(tokenizer(p).input_ids) for p in PROMPTS) + args.max_completion_length
    positions = args.per_device_train_batch_size * seq_len
    size = max(b["old_per_token_logps"].abs().max().item() for b in trainer._buffered_inputs)  # log-probs' size
    step = loss_bound(torch.float32, trainer.model.config, seq_len, positions, size, positions)
    bound = {n: sgd_weights_bound(torch.float32, step, args, 5, p.norm().item()) for n, p in gspo.items()}
    for name in gspo:
        assert (gspo_token[name] - gspo[name]).norm().item() <= bound[name], name
    # companion (helpers/smallest_bug.py): one token mis-masked in the GSPO run's last optimizer step moves that step,
    # and so the end weights, past some parameter's bound
    assert last_step_gap(trainer, bound) > 1
    assert any((ramped[n] - gspo[n]).norm().item() > bound[n] for n in gspo)  # beyond rounding


def test_sequence_level_rejects_per_token_advantages_at_run_time(tokenizer, tmp_path):
    class PerTokenTrainer(GSPOTrainer):
        def token_advantages(self, inputs):
            return inputs["advantages"][:, None].expand_as(inputs["completion_mask"]).float()

    model = build_tiny_model(tokenizer, seed=0)
    with pytest.raises(ValueError, match="Per-token advantages of shape \\(B, T\\) need"):
        train(model, tokenizer, tmp_path, max_steps=1, trainer_cls=PerTokenTrainer)
