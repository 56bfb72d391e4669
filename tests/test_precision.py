"""Precision (guards/precision.py, guards/weight_updates.py, common/optimizers.py): a full fine-tune of bf16 weights at
the shipped recipes' learning rate trains or stops in one line; `weights_changed` agrees with a direct before/after
comparison of the weights and warns once when the weights do not move; an optimizer whose package is missing fails
in one line when the config is built.

The 2-process ZeRO-2 run recognised as keeping master weights is in tests/test_multiprocess.py."""

import logging

import pytest
import torch
from helpers.fault_utils import make_trainer
from safetensors.torch import load_file
from transformers import TrainerCallback

from trl_gspo import GSPOConfig
from trl_gspo.common import optimizers
from trl_gspo.guards.precision import LowPrecisionWeightsError
from trl_gspo.guards.weight_updates import sample_indices
from trl_gspo.testing import build_tiny_model

#: The shipped full fine-tuning recipes' learning rate, held constant for 4 optimizer steps.
RECIPE_LR = dict(learning_rate=1e-6, lr_scheduler_type="constant", max_steps=4)


def _bf16_trainer(tmp_path, tokenizer, mode, **settings):
    model = build_tiny_model(tokenizer, seed=0).to(torch.bfloat16)
    initial = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, model=model, tokenizer=tokenizer, low_precision_weights=mode, **settings)
    return trainer, initial


def _changed_fraction(model, initial) -> float:
    changed = sum((p.detach().float() != initial[name]).sum().item() for name, p in model.named_parameters())
    return changed / sum(t.numel() for t in initial.values())


def test_bf16_full_fine_tune_at_lr_1e6_trains_in_fp32_and_saves_bf16(tmp_path, tokenizer, caplog):
    trainer, initial = _bf16_trainer(tmp_path, tokenizer, "upcast", **RECIPE_LR)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # before the optimizer exists
    assert trainer.precision.line() == (
        "precision: weights float32 (loaded as bfloat16), compute float32 (no autocast), master weights: the fp32 "
        "weights; final save writes bfloat16"
    )
    with caplog.at_level(logging.WARNING, logger="trl_gspo"):
        trainer.train()
    assert _changed_fraction(trainer.model, initial) >= 0.9
    assert not [r for r in caplog.records if "weights_changed=" in r.getMessage()]
    trainer.save_model(str(tmp_path / "checkpoint"), _internal_call=True)  # what a checkpoint writes: the fp32 weights
    checkpoint = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert {t.dtype for t in checkpoint.values()} == {torch.float32}
    trainer.save_model(str(tmp_path / "final"))
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    trained = dict(trainer.model.named_parameters())
    assert all(
        torch.equal(t, trained[name].detach().to(torch.bfloat16)) for name, t in saved.items() if name in trained
    )
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # the fp32 weights are back after the save


def test_bf16_full_fine_tune_refused_in_one_line_with_error(tmp_path, tokenizer):
    with pytest.raises(LowPrecisionWeightsError) as raised:
        _bf16_trainer(tmp_path, tokenizer, "error", **RECIPE_LR)
    message = str(raised.value)
    assert "\n" not in message and "low_precision_weights='error'" in message
    assert "low_precision_weights='upcast'" in message and "zero2" in message


def test_allowed_bf16_weights_barely_move_and_warn_once(tmp_path, tokenizer, caplog):
    trainer, initial = _bf16_trainer(tmp_path, tokenizer, "allow", **RECIPE_LR)
    with caplog.at_level(logging.WARNING, logger="trl_gspo"):
        trainer.train()
    assert _changed_fraction(trainer.model, initial) < 0.1  # the loss this module prevents by default
    warnings = [r.getMessage() for r in caplog.records if "weights_changed=" in r.getMessage()]
    assert len(warnings) == 1, warnings  # four steps below the threshold, one warning
    assert "at step 1" in warnings[0] and "learning rate 1e-06" in warnings[0]
    assert "master weights: none" in warnings[0]


class DirectComparison(TrainerCallback):
    """Every element the optimizer updates, before and after each optimizer step, compared here without the metric's
    code: the torch optimizer's parameters, in its groups' order (the sample's order)."""

    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
        self.indices = sample_indices([p.numel() for p in self.params])
        self.before = [p.detach().clone() for p in self.params]

    def on_step_end(self, args, state, control, **kwargs):
        changed = [p.detach() != b for p, b in zip(self.params, self.before)]
        whole = sum(c.sum().item() for c in changed) / sum(c.numel() for c in changed)
        sampled = [c.reshape(-1)[i] for c, i in zip(changed, self.indices)]
        self.steps.append((whole, sum(s.sum().item() for s in sampled) / sum(s.numel() for s in sampled)))


def test_weights_changed_agrees_with_a_direct_comparison(tmp_path, tokenizer):
    """bf16 weights updated in place at a learning rate where some elements move and others round away: the logged
    fraction equals the direct count over the sampled elements, and is within sampling error of the whole model's."""
    trainer, _ = _bf16_trainer(tmp_path, tokenizer, "allow", learning_rate=3e-4, max_steps=3)
    comparison = DirectComparison()
    trainer.add_callback(comparison)
    trainer.train()
    logged = [h["weights_changed"] for h in trainer.state.log_history if "weights_changed" in h]
    assert len(logged) == len(comparison.steps) == 3
    for value, (whole, sampled) in zip(logged, comparison.steps):
        assert value == pytest.approx(sampled, abs=1e-12)
        assert abs(value - whole) < 0.05  # 4096 samples: binomial standard error <= 0.008
    assert any(0.05 < value < 0.95 for value in logged), logged  # a case where the two can differ


# ------------------------------------------------------------------------------------------------- optimizers
def test_every_transformers_optimizer_is_tabled():
    from transformers.training_args import OptimizerNames

    tabled = {name for _, names in optimizers.OPTIMIZER_PACKAGES.values() for name in names}
    assert {o.value for o in OptimizerNames} - tabled - set(optimizers.TORCH_OPTIMIZERS) == set()


def test_missing_optimizer_package_fails_in_one_line_when_the_config_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(optimizers, "installed", lambda module: module != "torchao")  # planted: torchao missing
    with pytest.raises(ValueError) as raised:
        GSPOConfig(str(tmp_path), optim="adamw_torch_8bit", use_cpu=True, report_to=[])
    message = str(raised.value)
    assert "\n" not in message and "optim='adamw_torch_8bit' needs the package 'torchao'" in message
    assert "pip install torchao" in message and "adamw_torch" in message
    GSPOConfig(str(tmp_path), optim="adamw_torch", use_cpu=True, report_to=[])  # torch's own: no package needed


def test_missing_optimizer_package_stops_a_recipe_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from helpers.recipes import train_recipe

    from trl_gspo.cli.commands import main

    monkeypatch.setattr(optimizers, "installed", lambda module: module != "bitsandbytes")  # planted
    recipe = train_recipe(tmp_path, "/nonexistent/model", "/nonexistent/data.jsonl", optim="paged_adamw_8bit")
    assert main(["train", "--config", recipe]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "needs the package 'bitsandbytes'" in lines[0], lines


# ---------------------------------------------------------------------------------------------- the engines
def _accelerator(deepspeed=None, fsdp=False, mixed_precision="no"):
    """What `check_trainable_precision` reads of an accelerator: DeepSpeed's config, FSDP, the mixed precision."""
    from types import SimpleNamespace

    plugin = None if deepspeed is None else SimpleNamespace(deepspeed_config=deepspeed)
    state = SimpleNamespace(deepspeed_plugin=plugin, fsdp_plugin=object() if fsdp else None)
    return SimpleNamespace(state=state, mixed_precision=mixed_precision, is_main_process=True)


@pytest.mark.parametrize(
    "accelerator, requested, line",
    [
        (  # the shipped ZeRO-3 config on GPUs: DeepSpeed casts to bf16 and keeps fp32 partitions
            _accelerator({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, mixed_precision="bf16"),
            "bfloat16",
            "weights bfloat16, compute bfloat16 (DeepSpeed), master weights: DeepSpeed ZeRO-3's fp32 copy; final save "
            "writes bfloat16",
        ),
        (  # ZeRO-3 without bf16 (a CPU run): partitions in fp32 whatever the load, and the final save says so
            _accelerator({"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}),
            "bfloat16",
            "weights float32 (loaded as bfloat16), compute float32 (no autocast), master weights: DeepSpeed ZeRO-3's "
            "fp32 copy; final save writes float32",
        ),
        (  # DeepSpeed without ZeRO, in bf16: its bf16 optimizer keeps fp32 master weights
            _accelerator({"zero_optimization": {"stage": 0}, "bf16": {"enabled": "true"}}, mixed_precision="bf16"),
            None,
            "weights bfloat16, compute bfloat16 (DeepSpeed), master weights: DeepSpeed's fp32 copy (its bf16/fp16 "
            "optimizer); final save writes bfloat16",
        ),
        (  # FSDP with a mixed precision: accelerate upcasts the sharded parameters
            _accelerator(fsdp=True, mixed_precision="bf16"),
            None,
            "weights bfloat16, compute bfloat16 (autocast), master weights: FSDP's fp32 sharded parameters (accelerate "
            "upcasts them for mixed precision); final save writes bfloat16",
        ),
    ],
    ids=["zero3-bf16", "zero3-cpu", "deepspeed-stage0-bf16", "fsdp-bf16"],
)
def test_engines_keeping_master_weights_are_recognised(tokenizer, accelerator, requested, line):
    from trl_gspo.guards.precision import check_trainable_precision

    model = build_tiny_model(tokenizer, seed=0).to(torch.bfloat16)
    for mode in ("error", "upcast"):  # neither refuses nor upcasts
        precision = check_trainable_precision(model, accelerator, mode, peft=False, requested=requested)
        assert precision.line() == f"precision: {line}" and not precision.upcast
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_engines_without_master_weights_are_not_trusted(tokenizer):
    """DeepSpeed stage 0 in fp32 and FSDP without mixed precision update the bf16 weights themselves."""
    from trl_gspo.guards.precision import check_trainable_precision

    for accelerator in (_accelerator({"zero_optimization": {"stage": 0}}), _accelerator(fsdp=True)):
        model = build_tiny_model(tokenizer, seed=0).to(torch.bfloat16)
        with pytest.raises(LowPrecisionWeightsError):
            check_trainable_precision(model, accelerator, "error", peft=False)


# -------------------------------------------------------------------------------------------------- the CLI
def test_cli_says_what_runs_and_refuses_in_one_line(tmp_path, tiny_model_dir, capsys):
    """A recipe's `dtype: bfloat16` trained in one process: the precision line, and the final save in bf16; with
    `low_precision_weights: error` one line instead of a traceback."""
    from helpers.recipes import train_recipe

    from trl_gspo.cli.commands import main
    from trl_gspo.cli.demo import make_demo_dataset

    data = tmp_path / "copy.jsonl"
    make_demo_dataset(16).to_json(str(data))
    recipe = train_recipe(tmp_path, str(tiny_model_dir), str(data), dtype="bfloat16", max_steps=1, save_strategy="no")
    assert main(["train", "--config", recipe, "--disable_tqdm", "true"]) == 0
    out = capsys.readouterr().out
    assert "trl-gspo train: precision: weights float32 (loaded as bfloat16), compute float32 (no autocast)" in out
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert main(["train", "--config", recipe, "--low_precision_weights", "error"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "low_precision_weights='error'" in lines[0], lines


# ------------------------------------------------------------------------------------------ quiet ZeRO runs
def test_deepspeed_builds_are_announced_before_they_start(monkeypatch):
    from trl_gspo.common import engine

    built = set()
    monkeypatch.setattr(engine, "_op_built", lambda name: name in built)
    offload = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}
    notes = engine.deepspeed_build_notes(offload, cuda=False)
    assert [note.split(" (")[1].split(")")[0] for note in notes] == ["deepspeed_shm_comm", "cpu_adam"]
    assert all("first run on this machine only" in note for note in notes)
    assert (
        engine.deepspeed_build_notes({**offload, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none"}, True) == []
    )
    assert engine.deepspeed_build_notes({}, cuda=False) == []  # no DeepSpeed
    built.update({"deepspeed_shm_comm", "cpu_adam"})  # compiled by an earlier run
    assert engine.deepspeed_build_notes(offload, cuda=False) == []


def test_only_the_collective_deprecations_are_filtered_and_only_under_deepspeed():
    import warnings

    from trl_gspo.common.engine import quiet_deepspeed_collectives

    def shown(env, message, module="torch.distributed.c10d_logger"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_deepspeed_collectives(env)
            warnings.warn_explicit(message, FutureWarning, "c10d_logger.py", 83, module=module)
        return len(caught)

    deepspeed = {"ACCELERATE_USE_DEEPSPEED": "true"}
    collective = (
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`"
    )
    assert shown(deepspeed, collective) == 0
    assert shown({}, collective) == 1  # not a DeepSpeed run
    assert shown(deepspeed, "`torch.load` default is deprecated") == 1  # another deprecation
    assert shown(deepspeed, collective, module="my_module") == 1  # raised elsewhere
