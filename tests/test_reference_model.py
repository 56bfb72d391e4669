"""The KL reference model under the default layouts (padding_free / shared_prefix "auto").

TRL runs a log-prob forward on a second model for `beta > 0`: a separate reference model (also the one
`sync_ref_model` keeps updating), or the policy with its PEFT adapter disabled (or switched to a "ref" adapter). The
forward pipeline plans packed and shared-prefix layouts for every forward, so each of those models must run through
the segment attention, or be given a layout that needs none. Checked here:

- `beta > 0` with the defaults, dense and MoE: whole training runs equal stock `trl.GRPOTrainer`'s (same rollouts
  through a fixed `rollout_func`, SGD): the loss and `kl` of every step, and the weights after each optimizer step,
  which are the gradients summed; the reference forward did take a segment layout, so the case is the failing one;
- `use_bias_correction_kl`, `sync_ref_model=True`, LoRA (disabled adapter and a "ref" adapter) the same way;
- a model whose attention cannot be routed falls back under "auto" with one logged line, and an explicit True
  refuses it before the first step, naming the model and the setting;
- TRL's rollout dispatch on a trainer built without `GSPOTrainer.__init__`, as TRL's own unit tests build one.
"""

import dataclasses
import logging
import math
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch
from datasets import Dataset
from helpers.smallest_bug import (
    LastStepStart,
    dropped_token_gap,
    last_step_gap,
)
from test_padding import FixedRollouts, _varied_reward, needs_fused_head
from transformers import AutoModelForCausalLM, BloomConfig, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, sgd_weights_bound
from trl_gspo.testing import save_tiny_model

pytestmark = needs_fused_head


def _settings(tmp_path, **overrides):
    """Two rollout batches (4 optimizer steps each, the paper's default; the run's 5th and last step is the first of
    the second, on-policy), rows of varied lengths, SGD at a constant learning rate of 0.2: large enough that one token
    mis-masked in the last step moves the end weights past their rounding bound in every case (at 0.05 under the
    linear decay, 0.56 to 1.6 times it; the runs themselves end within 0.15 % of it)."""
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        num_generations=3,
        max_completion_length=10,
        learning_rate=0.2,
        optim="sgd",
        logging_steps=1,
        max_steps=5,
        disable_tqdm=True,
        beta=0.1,
        lr_scheduler_type="constant",
    )
    return {**settings, **overrides}


def stock_config(settings: dict, tmp_path) -> GRPOConfig:
    """The `GRPOConfig` of a stock run equal to `GSPOConfig(**settings)`: the same settings, plus each TRL field whose
    default GSPOConfig changes (the paper's level, clip range, loss type, ...) at GSPOConfig's default."""
    ours = {f.name: f for f in dataclasses.fields(GSPOConfig)}
    changed = {
        f.name: getattr(GSPOConfig, f.name)
        for f in dataclasses.fields(GRPOConfig)
        if f.init and f.default is not dataclasses.MISSING and ours[f.name].default != f.default
    }
    assert "importance_sampling_level" in changed and "epsilon" in changed
    resolved = GSPOConfig(**settings)  # GSPOConfig also resolves steps_per_generation to the paper's 4 mini-batches
    stock = GRPOConfig(
        **{**changed, **settings, "output_dir": str(tmp_path), "steps_per_generation": resolved.steps_per_generation}
    )
    differ = [
        f.name
        for f in dataclasses.fields(GRPOConfig)
        if f.name not in ("output_dir", "logging_dir") and getattr(stock, f.name) != getattr(resolved, f.name)
    ]
    assert not differ, differ
    return stock


class SegmentCalls:
    """Counts the packed / shared-prefix model calls of each model the forward pipeline runs that the segment
    attention served (one it did not serve raises before it is counted, and is run again trimmed under "auto")."""

    def __init__(self, trainer):
        self.calls = {}
        original = trainer.logprob_forward._call_model

        def counting(model, layout, **inputs):
            out = original(model, layout, **inputs)
            if layout.packed:
                key = id(trainer.logprob_forward.segment_support(model).model)
                self.calls[key] = self.calls.get(key, 0) + 1
            return out

        trainer.logprob_forward._call_model = counting

    def of(self, model) -> int:
        from trl_gspo.forward.segment_attention import base_model

        return self.calls.get(id(base_model(model)), 0)


def run(trainer_cls, args, model_dir, tokenizer, peft_config=None, model=None):
    """Train; returns (trainer, per-step logs, weights after each optimizer step, segment call counts, reference
    log-probs of each rollout batch)."""
    trainer = trainer_cls(
        model if model is not None else model_dir,
        _varied_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 64}),
        processing_class=tokenizer,
        rollout_func=FixedRollouts(tokenizer, prompt_lengths=(3, 9)),
        peft_config=peft_config,
    )
    weights = []

    class Snapshot(TrainerCallback):  # the weights after each optimizer step
        def on_step_end(self, *a, **k):
            weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})

    trainer.add_callback(Snapshot())
    calls = SegmentCalls(trainer) if isinstance(trainer, GSPOTrainer) else None
    ref_logps, score = [], trainer._generate_and_score_completions

    def scoring(inputs):
        output = score(inputs)
        ref_logps.append(output["ref_per_token_logps"] * output["completion_mask"])
        return output

    trainer._generate_and_score_completions = scoring
    trainer.add_callback(LastStepStart())  # the last-step companion measures where that step ran
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    return trainer, logs, weights, calls, ref_logps


def assert_same_training(stock, ours):
    """Same reference log-probs for every rollout, same loss at every step, same weights after every optimizer step
    (`kl` is a mean per micro-batch, which length-sorted micro-batches change: it is not compared), each within fp32's
    rounding (trl_gspo/rounding.py): a forward for the log-probs; a forward and the loss's sums for the loss, whose terms
    are advantage x ratio, each of size ~1 (TRL scales advantages to unit standard deviation) while their mean is
    near 0; a forward and backward per step for the weights (plain SGD)."""
    (trainer, stock_logs, stock_weights, _, stock_ref), (_, our_logs, our_weights, _, our_ref) = stock, ours
    args, config = trainer.args, trainer.model.config
    seq_len = 8 + args.max_completion_length  # FixedRollouts(prompt_lengths=(3, 9)): prompts of up to 8 tokens
    positions = args.per_device_train_batch_size * args.gradient_accumulation_steps * seq_len
    size = max(logps.abs().max().item() for logps in stock_ref)  # the log-probs' size (rounding.loss_bound)
    assert len(our_ref) == len(stock_ref) > 1
    for rollout, (a, b) in enumerate(zip(stock_ref, our_ref)):
        gap = relative_gap(b, a, math.inf)
        assert gap <= model_bound(torch.float32, config, seq_len), f"reference log-probs of rollout {rollout + 1}"
    assert len(our_logs) == len(stock_logs) == len(our_weights) == len(stock_weights) > 0
    value = loss_bound(torch.float32, config, seq_len, positions, size)
    for step, (a, b) in enumerate(zip(stock_logs, our_logs)):
        assert b["loss"] == pytest.approx(a["loss"], rel=value, abs=value), f"step {step + 1}: loss"
    assert any(row["kl"] > 1e-6 for row in our_logs), "the KL term never moved: the case compares nothing"
    gradient = loss_bound(torch.float32, config, seq_len, positions + args.gradient_accumulation_steps, size, positions)
    for step, (a, b) in enumerate(zip(stock_weights, our_weights)):
        assert a.keys() == b.keys()
        bounds = {}
        for name in a:
            bounds[name] = sgd_weights_bound(torch.float32, gradient, args, step + 1, a[name].norm().item())
            assert (b[name] - a[name]).norm().item() <= bounds[name], f"step {step + 1}: {name}"
    # companions (helpers/smallest_bug.py), in stock's run: one completion token mis-masked lands outside the
    # reference log-probs' bound in every rollout, and, in the last optimizer step (its micro-batches accumulated, the
    # KL term with them), moves the end weights past some parameter's bound. The loss's own check cannot show such a
    # bug: the last step is the first of a rollout batch, on-policy, where every sequence's ratio is exactly 1 and a
    # token's mask changes the loss only through the KL term and the normalisation (measured: 0.06 % to 5 % of its bound)
    assert min(dropped_token_gap(ref, ref != 0) for ref in stock_ref) > model_bound(torch.float32, config, seq_len)
    assert last_step_gap(trainer, bounds) > 1


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-moe-ref"), moe=True)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("extra", [{}, {"use_bias_correction_kl": True}], ids=["kl", "bias-corrected-kl"])
def test_beta_with_default_layouts_equals_stock(moe, extra, tokenizer, tiny_model_dir, moe_dir, tmp_path):
    model_dir = moe_dir if moe else tiny_model_dir
    settings = _settings(tmp_path / "ours", **extra)
    args = GSPOConfig(**settings)
    assert (args.padding_free, args.shared_prefix) == ("auto", "auto")
    ours = run(GSPOTrainer, args, model_dir, tokenizer)
    stock = run(GRPOTrainer, stock_config(settings, tmp_path / "stock"), model_dir, tokenizer)
    assert_same_training(stock, ours)
    trainer, calls = ours[0], ours[3]
    assert trainer.ref_model is not None and calls.of(trainer.ref_model) > 0, (
        "the reference never took a segment layout"
    )


@pytest.mark.slow
def test_sync_ref_model_with_default_layouts_equals_stock(tokenizer, tiny_model_dir, tmp_path):
    settings = _settings(tmp_path / "ours", sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    ours = run(GSPOTrainer, GSPOConfig(**settings), tiny_model_dir, tokenizer)
    stock = run(GRPOTrainer, stock_config(settings, tmp_path / "stock"), tiny_model_dir, tokenizer)
    assert_same_training(stock, ours)
    trainer, calls = ours[0], ours[3]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [n for n, p in trainer.ref_model.named_parameters() if not torch.equal(p, initial.get_parameter(n))]
    assert moved, "sync_ref_model never updated the reference model"
    assert calls.of(trainer.ref_model) > 0


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["disabled-adapter", "ref-adapter"])
def test_lora_reference_with_default_layouts_equals_stock(reference, tokenizer, tiny_model_dir, tmp_path):
    """LoRA: TRL's reference is the policy with its adapter disabled (a new adapter), or a "ref" copy of the adapter
    it loads when a trained adapter is trained further."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    def model_and_config():
        if reference == "disabled-adapter":
            return AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora
        adapter_dir = tmp_path / "adapter"
        if not adapter_dir.exists():
            torch.manual_seed(1)
            get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(adapter_dir)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True), None  # TRL adds the "ref" copy

    settings = _settings(tmp_path / "ours")
    model, peft_config = model_and_config()
    ours = run(GSPOTrainer, GSPOConfig(**settings), None, tokenizer, peft_config=peft_config, model=model)
    model, peft_config = model_and_config()
    stock = run(
        GRPOTrainer, stock_config(settings, tmp_path / "stock"), None, tokenizer, peft_config=peft_config, model=model
    )
    assert_same_training(stock, ours)
    trainer, calls = ours[0], ours[3]
    assert trainer.ref_model is None and calls.of(trainer.model) > 0


# ------------------------------------------------------------------------ a model the segment attention cannot serve
def _bloom_dir(tmp_path, tokenizer):
    """A tiny Bloom: its attention is computed in its own code, not through transformers' AttentionInterface."""
    config = BloomConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        n_layer=2,
        n_head=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.slow
def test_auto_falls_back_with_one_logged_line_for_a_model_that_cannot_be_routed(tokenizer, tmp_path, caplog):
    model_dir = _bloom_dir(tmp_path / "bloom", tokenizer)
    args = GSPOConfig(**_settings(tmp_path / "run", max_steps=2))
    with caplog.at_level(logging.WARNING, logger="trl_gspo"):
        trainer, logs, _, calls, _ = run(GSPOTrainer, args, model_dir, tokenizer)
    lines = [r.getMessage() for r in caplog.records if "cannot take packed or shared-prefix layouts" in r.getMessage()]
    assert len(lines) == 2, lines  # one for the policy, one for the reference model, each once for the whole run
    assert "the policy (BloomForCausalLM)" in lines[0] and "the reference model (BloomForCausalLM)" in lines[1]
    assert "AttentionInterface" in lines[0]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in logs)
    assert calls.calls == {}  # every forward ran a trimmed layout


@pytest.mark.parametrize("setting", ["padding_free", "shared_prefix"])
def test_explicit_true_refuses_a_model_that_cannot_be_routed_before_the_first_step(setting, tokenizer, tmp_path):
    model_dir = _bloom_dir(tmp_path / "bloom", tokenizer)
    args = GSPOConfig(**_settings(tmp_path / "run", **{setting: True}))
    with pytest.raises(ValueError, match=rf"{setting}=True: the policy \(BloomForCausalLM\) cannot take packed"):
        GSPOTrainer(
            model_dir,
            _varied_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a b"] * 8}),
            processing_class=tokenizer,
        )


def test_a_model_whose_attention_bypasses_the_registry_at_run_time_falls_back(
    tokenizer, tiny_model_dir, tmp_path, caplog
):
    """Last line of defence: a model that passes the checks made before the call but never reaches the segment
    attention (here: the attention implementation swapped back behind the pipeline's back) is run again trimmed under
    "auto", with the same numbers as a run that never packs."""
    from trl_gspo.forward import segment_attention

    args = GSPOConfig(**_settings(tmp_path / "run", padding_free="auto", beta=0.0))
    trainer = GSPOTrainer(
        tiny_model_dir,
        _varied_reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 8}),
    )
    arm = segment_attention.arm
    try:
        segment_attention.arm = lambda configs: None  # the model keeps its plain attention: nothing is served
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, len(tokenizer), (4, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        mask[2, 7:] = 0
        trainer.args.padding_free = True  # force a packed plan ...
        with pytest.raises(segment_attention.NotServed):  # ... which an explicit True refuses to run unserved
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 5)
        trainer.args.padding_free = "auto"
        trainer.logprob_forward._layout_settings = lambda aux, support: (
            (False, False) if support.problem else (True, False)
        )
        with caplog.at_level(logging.WARNING, logger="trl_gspo"), torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 5)
    finally:
        segment_attention.arm = arm
    assert any("never reached the segment attention" in r.getMessage() for r in caplog.records)
    assert trainer.logprob_forward.segment_support(trainer.model).problem is not None
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, 3:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None])[..., 0] * mask[:, 4:]
    bound = model_bound(torch.float32, trainer.model.config, ids.size(1))  # one forward's fp32 rounding, every token
    assert relative_gap(logps * mask[:, 4:], expected, math.inf) <= bound
    assert dropped_token_gap(expected, mask[:, 4:]) > bound  # companion: one token mis-masked lands outside it


# ---------------------------------------------------------------------- a trainer built without __init__
def _bare_trainer():
    """A GSPOTrainer made the way TRL's own unit tests make a GRPOTrainer: `object.__new__` and the attributes its
    generation dispatch reads, nothing from `__init__`."""
    trainer = object.__new__(GSPOTrainer)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=2, num_input_tokens_seen=0)
    trainer._last_loaded_step = 2
    trainer.use_vllm = trainer.use_transformers_continuous_batching = False
    trainer.processing_class = SimpleNamespace(batch_decode=MagicMock(return_value=["text"]))
    trainer._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    trainer.eos_token_ids = [2]
    trainer.tools = None
    trainer._metrics = {"train": __import__("collections").defaultdict(list)}
    return trainer


def test_rollout_dispatch_on_a_trainer_built_without_init():
    trainer = _bare_trainer()
    trainer.rollout_func = MagicMock(
        return_value={"prompt_ids": [[5, 6]], "completion_ids": [[7, 2]], "logprobs": [[-0.5, -0.25]]}
    )
    outputs = trainer._generate(["a prompt"])
    assert outputs[0] == [[5, 6]] and outputs[1] == [[7, 2]] and outputs[4] == [[-0.5, -0.25]]
    trainer.rollout_func.assert_called_once_with(["a prompt"], trainer)
    assert trainer.sampler_logprobs.logps == [[-0.5, -0.25]]  # our step after TRL's ran too

    trainer.rollout_func = MagicMock(return_value={"prompt_ids": [[5]], "completion_ids": [[7]]})
    with pytest.raises(ValueError, match="rollout_func must return keys"):  # TRL's own error, not an AttributeError
        trainer._generate(["a prompt"])


# ---------------------------------------------------------------------------------- a policy built in code
def test_beta_with_a_policy_built_in_code_is_refused_naming_the_field(tokenizer, tmp_path):
    """TRL loads the reference model from the policy's path; a model built from a config has none, and TRL would fail
    deep in the Hub client on an empty repo id."""
    from trl_gspo.testing import build_tiny_model

    args = GSPOConfig(**_settings(tmp_path))
    with pytest.raises(ValueError, match=r"beta=0.1 needs a KL reference model.*built in code"):
        GSPOTrainer(
            build_tiny_model(tokenizer),
            _varied_reward,
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["a b"] * 8}),
        )


@pytest.mark.slow
def test_demo_with_beta_saves_its_initial_model_for_the_reference(tmp_path):
    from trl_gspo.cli.demo import run_demo

    result = run_demo(str(tmp_path), num_train_prompts=32, num_eval_prompts=4, beta=0.04, max_steps=2, logging_steps=1)
    trainer = result["trainer"]
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "initial-model")
    assert all(torch.equal(p, initial.get_parameter(n)) for n, p in trainer.ref_model.named_parameters())
    assert any(row.get("kl", 0) > 0 for row in trainer.state.log_history)
