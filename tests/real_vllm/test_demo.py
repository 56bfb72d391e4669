"""The command line with vLLM's CPU build: `trl-gspo demo --config demo --use_vllm true --vllm_mode colocate`
generates with a real colocated engine and learns, offline; set-ups that cannot start are refused in one line before any
engine starts."""

import re
import time

import pytest
import yaml

from trl_gspo.cli.commands import main
from trl_gspo.cli.demo import make_demo_dataset

#: Held-out reward after 300 of the demo's steps with a colocated vLLM engine (bf16, vLLM's choice for the fp32 model),
#: 100 unseen prompts, greedy: 0.353 (seed 0) and 0.223 (seed 1), 2026-11-26, from 0.000 before training.
LEARNED_AT_LEAST = 0.15


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("trl-gspo ")]
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


def test_the_demo_generates_with_colocated_vllm_and_learns(tmp_path, capfd, colocated_engine):
    # capfd, not capsys: vLLM writes around its process groups through sys.stdout's file descriptor
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--config",
        "demo",
        "--use_vllm",
        "true",
        "--vllm_mode",
        "colocate",
        "--output_dir",
        str(out),
        "--max_steps",
        "300",
    ]
    assert main([*argv, "--num_eval_prompts", "100", "--logging_steps", "50", "--disable_tqdm", "true"]) == 0
    printed = capfd.readouterr().out
    assert "trl-gspo demo: generation: vLLM, colocated in the trainer's process (engine dtype bfloat16)" in printed
    before, after = map(float, re.search(r"before (\d\.\d+) -> after (\d\.\d+)", printed).groups())
    assert before <= 0.05 and after >= LEARNED_AT_LEAST, printed
    assert (out / "initial-model" / "config.json").is_file() and (out / "initial-model" / "tokenizer.json").is_file()


def _recipe(tmp_path, model_dir, **keys) -> str:
    data = tmp_path / "copy.jsonl"
    make_demo_dataset(16).to_json(str(data))
    recipe = dict(
        model_name_or_path=str(model_dir),
        dataset_name=str(data),
        reward_funcs=["demo_reward"],
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        report_to="none",
        max_steps=1,
        use_vllm=True,
        **keys,
    )
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "recipe.yaml")


def test_a_head_size_the_cpu_attention_cannot_run_is_refused_before_an_engine_starts(tmp_path, tiny_model_dir, capsys):
    """The suite's tiny model has head_dim 16 (the plain demo's): the CPU build's engine would start for about a minute
    and then fail with `Unsupported CPU attention configuration`."""
    start = time.monotonic()
    assert main(["train", "--config", _recipe(tmp_path, tiny_model_dir, vllm_mode="colocate")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "head_dim=16 is not one its CPU attention runs" in line, line
    assert time.monotonic() - start < 30  # refused up front, not after an engine start

    from trl_gspo import GSPOConfig, GSPOTrainer

    args = GSPOConfig(str(tmp_path / "api"), use_cpu=True, bf16=False, report_to=[], use_vllm=True)
    with pytest.raises(ValueError, match="head_dim=16"):  # the Python API refuses it the same way
        GSPOTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args)


def test_server_mode_on_cpu_is_refused_naming_what_runs_instead(tmp_path, vllm_model_dir, capsys):
    """TRL pushes the trained weights to a server over NCCL, which needs CUDA: without it the run would stop at set-up
    with TRL's NotImplementedError. No server is needed to see the refusal: it comes before any connection."""
    recipe = _recipe(tmp_path, vllm_model_dir, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9")
    assert main(["train", "--config", recipe]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "vllm_mode='server' needs a CUDA device" in line and "vllm_mode: colocate" in line, line
