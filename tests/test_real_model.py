"""The real model, SmolLM2-135M-Instruct, as `trl-gspo models prepare` leaves it (make test runs that first): the
prepared folder holds exactly the GGUF's weights and gives its logits, GSPO trains it, and the demo runs on it.

A few minutes on 2 CPU cores in all; `tests/test_model_store.py` covers the resolution logic without a model."""

import json
import math

import pytest
import torch

from trl_gspo.common.model_prepare import load_gguf, source_gguf
from trl_gspo.common.model_store import SMOLLM2, is_prepared, prepared_folder, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    folder = prepared_folder(SMOLLM2)
    if not is_prepared(folder) or source_gguf(SMOLLM2) is None:
        pytest.fail(f"no prepared {SMOLLM2} in {folder}: run `trl-gspo models prepare` (make test does it first)")
    return folder


def test_prepared_folder_holds_the_gguf_weights_and_gives_its_logits(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized, gguf_tokenizer = load_gguf(source_gguf(SMOLLM2), dtype=torch.float32)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(smollm2), AutoTokenizer.from_pretrained(smollm2)
    assert not hasattr(model.config, "quantization_config")  # an ordinary folder: it saves and reloads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as the original
    theirs = quantized.state_dict()
    for name, tensor in model.state_dict().items():  # the same fp32 values, bit for bit: nothing rounded on the way
        assert torch.equal(tensor, theirs[name]), name
    chat = [{"role": "user", "content": "What is 27 + 82? Reply with only the number."}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == gguf_tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    texts = [
        "The capital of France is",
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
    ]
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")
        assert torch.equal(ids.input_ids, gguf_tokenizer(text, return_tensors="pt").input_ids)
        with torch.no_grad():
            ours, reference = model(**ids).logits, quantized(**ids).logits
        # Identical weights through the same code and kernels in one process: equal, not merely close.
        assert torch.equal(ours, reference), (ours - reference).abs().max()


def _short_run(smollm2, tmp_path, **settings):
    """A 2-step GSPO run of the real model (steps_per_generation=2: the second mini-batch is off-policy, the sequence
    ratio leaves 1) with a reward that varies within every group, so every advantage is non-zero."""
    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli.addition import make_addition_dataset

    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        learning_rate=1e-5,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        **settings,
    )

    def digits(completions, **kwargs):
        texts = [c[-1]["content"] for c in completions]
        return [sum(ch.isdigit() for ch in text) / max(1, len(text)) + 0.01 * len(text) for text in texts]

    return GSPOTrainer(str(smollm2), digits, args=args, train_dataset=make_addition_dataset(16))


def test_gspo_trains_the_real_model(smollm2, tmp_path):
    """Why the real model: the tiny models are built in code, so only this run shows GSPO training a checkpoint as
    users load it, the prepared folder by path, with its tied embeddings (every weight, the shared one included, must
    move), its 49,152-token vocabulary through the log-prob head and its chat template on the prompts. Two steps of
    one rollout, the second off-policy, are the least that moves the sequence ratio off 1."""
    trainer = _short_run(smollm2, tmp_path)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) == len(before)  # every weight took an update
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2 and all(math.isfinite(row["loss"]) for row in logs)
    assert all(math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0 for row in logs)
    assert "clip_fraction/sequence/total" in logs[-1]


def test_the_clip_band_follows_its_target_on_the_real_model(smollm2, tmp_path):
    """Why the real model: the clip band is set by how far this model's sequence ratios spread after an update (the
    clip-band studies ran on it; a tiny model's spread is another). The on-policy first step leaves the band; the
    second measures a fraction and moves the band toward the target by the stated factor."""
    from trl_gspo.clip_band import GAIN, MAX_STEP_FACTOR

    trainer = _short_run(smollm2, tmp_path, clip_target_fraction=0.15)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["clip_band/epsilon_low"] for row in logs] == [3e-4, 3e-4]  # the first step left the band alone
    assert "clip_band/fraction" not in logs[0]
    fraction = logs[1]["clip_band/fraction"]
    assert fraction == logs[1]["clip_ratio/region_mean"]  # what the user sees in TRL's metric
    factor = (
        min(max((fraction / 0.15) ** GAIN, 1 / MAX_STEP_FACTOR), MAX_STEP_FACTOR) if fraction else 1 / MAX_STEP_FACTOR
    )
    assert trainer.clip_band.band == pytest.approx((3e-4 * factor, 4e-4 * factor), rel=1e-12)
    assert trainer.clip_band.band != (3e-4, 4e-4)


def test_the_demo_runs_on_the_real_model(smollm2, tmp_path, capsys):
    """Why the real model: it is the demo's model, and what `make demo` does with it can only be seen with it: finding
    the prepared copy offline (and saying so), the greedy held-out evaluation of the chat-templated questions, the
    curves and the saved model. Two steps with an evaluation after each, the least that shows one between steps."""
    import csv

    from trl_gspo.cli import main

    out = tmp_path / "demo"
    argv = ["demo", "--output_dir", str(out), "--max_steps", "2", "--logging_steps", "1", "--eval_every", "1"]
    small = ["--num_train_prompts", "16", "--num_eval_prompts", "8", "--per_device_train_batch_size", "4"]
    assert main([*argv, *small, "--num_generations", "4", "--steps_per_generation", "1", "--disable_tqdm", "true"]) == 0
    text = capsys.readouterr().out
    assert f"the prepared copy in {prepared_folder(SMOLLM2)}" in text  # offline: the line says which source
    assert "held-out accuracy (greedy, 8 unseen prompts): before" in text
    with open(out / "held_out.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [0, 1, 2]  # before, every step, after
    assert all(0.0 <= float(row["held_out_accuracy"]) <= 1.0 for row in rows)
    assert (out / "reward_curve.png").stat().st_size > 0 and (out / "model.safetensors").exists()
    # the copy it trained, in its output (cli/run_model.py): the one the store resolves here, offline
    record = json.loads((out / "model_source.json").read_text())
    assert record == resolve_model(SMOLLM2).record() and record["source"] == "gguf" and len(record["sha256"]) == 64
