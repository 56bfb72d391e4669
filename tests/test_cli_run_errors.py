"""Mistakes met once a `trl-gspo train` run has started, or that would only show there: another model's checkpoint,
chat prompts without a chat template, a reward function that raises, Ctrl-C, a launch option without an accelerate
config, a training argument transformers 5 removed. Each ends the command with a short message (the reward's own
frames, then one line), a non-zero exit, and no output folder created for nothing."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.recipes import train_recipe, write_recipe

from trl_gspo.cli import commands
from trl_gspo.cli.commands import main
from trl_gspo.cli.demo import make_demo_dataset
from trl_gspo.cli.recipe_inputs import check_chat_template
from trl_gspo.guards import checkpointing
from trl_gspo.testing import build_tiny_model, build_tokenizer, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def _error_line(err: str, code: str = "error: ") -> str:
    """The command's only line on stderr besides library log lines (which never start with `trl-gspo `)."""
    lines = [line for line in err.splitlines() if line.startswith("trl-gspo ")]
    assert len(lines) == 1 and code in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def copy_jsonl(tmp_path):
    path = tmp_path / "copy.jsonl"
    make_demo_dataset(32).to_json(str(path))
    return str(path)


# ------------------------------------------------------------------------------ another model's checkpoint
def _checkpoint_of(model_dir, folder: Path) -> str:
    """A complete checkpoint folder holding the weights and config.json of `model_dir`."""
    shutil.copytree(model_dir, folder)
    checkpointing.mark_complete(str(folder))
    return str(folder)


def test_another_models_checkpoint_is_refused_before_anything_loads(
    tmp_path, tiny_model_dir, copy_jsonl, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    checkpoint = _checkpoint_of(tiny_model_dir, tmp_path / "out" / "checkpoint-2")  # hidden size 64
    wide = tmp_path / "wide"
    tiny_config(len(build_tokenizer()), hidden_size=128).save_pretrained(wide)  # a config is all the check reads
    recipe = train_recipe(tmp_path, str(wide), copy_jsonl, save_strategy="steps")
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    assert main(["train", "--config", recipe, "--resume_from_checkpoint", "true"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert (
        f"resume_from_checkpoint: {checkpoint} holds weights of another model than model_name_or_path={str(wide)!r} "
        "(hidden_size 64 in the checkpoint, 128 in the model; head_dim 16 in the checkpoint, 32 in the model; "
        "intermediate_size 128 in the checkpoint, 256 in the model). Resume with the model the checkpoint was trained "
        "from, or train " in line
    ), line
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before

    # Nothing to resume from is one line too (it used to fail inside train(), after the model loaded).
    assert main(["train", "--config", recipe, "--resume_from_checkpoint", "true", "--output_dir", "nowhere"]) == 2
    assert "'nowhere' holds no complete checkpoint-N folder" in _error_line(capsys.readouterr().err)
    assert not (tmp_path / "nowhere").exists()


def test_the_trainer_refuses_another_models_checkpoint_before_loading_its_weights(tmp_path, tiny_model_dir):
    """Library use: `train(resume_from_checkpoint=...)` names the fields instead of torch's size mismatch list; the
    checkpoint of the same model passes the check."""
    from trl_gspo import GSPOConfig, GSPOTrainer

    checkpoint = _checkpoint_of(tiny_model_dir, tmp_path / "checkpoint-2")
    assert checkpointing.checkpoint_model_mismatch(checkpoint, build_tiny_model(build_tokenizer()).config, "m") is None
    tokenizer = build_tokenizer()
    args = GSPOConfig(str(tmp_path / "run"), use_cpu=True, bf16=False, report_to=[], max_steps=1)
    trainer = GSPOTrainer(
        build_tiny_model(tokenizer, hidden_size=128),
        lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=make_demo_dataset(8),
        processing_class=tokenizer,
    )
    with pytest.raises(
        checkpointing.ResumeError,
        match=r"holds weights of another model than the trainer's model \(Qwen3ForCausalLM\)"
        r" \(hidden_size 64 in the checkpoint, 128 in the model;",
    ):
        trainer.train(resume_from_checkpoint=checkpoint)


def _adapter_checkpoint(folder: Path, hidden_size: int = 64) -> str:
    """A complete checkpoint holding only a LoRA adapter (as a `use_peft` run saves it) of a tiny model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model(build_tokenizer(), hidden_size=hidden_size), LoraConfig(r=4))
    model.save_pretrained(folder)
    checkpointing.mark_complete(str(folder))
    return str(folder)


def test_an_adapter_over_another_base_model_is_refused_before_anything_loads(
    tmp_path, tiny_model_dir, copy_jsonl, capsys, monkeypatch
):
    """An adapter checkpoint holds no config.json: its LoRA matrices are compared with the layers they adapt (torch's
    size mismatch list otherwise, once the weights load); the adapter over its own base passes."""
    checkpoint = _adapter_checkpoint(tmp_path / "out" / "checkpoint-2")  # trained on hidden size 64
    assert checkpointing.checkpoint_model_mismatch(checkpoint, build_tiny_model(build_tokenizer()).config, "m") is None
    monkeypatch.chdir(tmp_path)
    wide = tmp_path / "wide"
    tiny_config(len(build_tokenizer()), hidden_size=128).save_pretrained(wide)
    recipe = train_recipe(tmp_path, str(wide), copy_jsonl, save_strategy="steps", use_peft=True)
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    assert main(["train", "--config", recipe, "--resume_from_checkpoint", "true"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{checkpoint} holds a LoRA adapter trained on another base model than model_name_or_path=" in line, line
    assert "in the checkpoint, in_features 128 in the model" in line and "Traceback" not in line, line
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before


def test_the_demo_resuming_another_models_checkpoint_is_one_line(tmp_path, capsys):
    """The demo builds its model in code, so the trainer's own check answers; `main` prints its one line."""
    checkpoint = tmp_path / "demo" / "checkpoint-2"
    tiny_config(len(build_tokenizer()), hidden_size=128).save_pretrained(checkpoint)  # all the check reads
    checkpointing.mark_complete(str(checkpoint))
    argv = ["--output_dir", str(tmp_path / "demo"), "--resume_from_checkpoint", "true", "--disable_tqdm", "true"]
    assert main(["demo", "--config", "demo", *argv, "--num_train_prompts", "16", "--num_eval_prompts", "4"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{checkpoint} holds weights of another model than the trainer's model" in line, line
    assert "(hidden_size 128 in the checkpoint, 64 in the model;" in line, line


# ---------------------------------------------------------------------------------- chat prompts, no template
def test_chat_prompts_with_a_tokenizer_without_chat_template_fail_at_the_tokenizer(tmp_path, tiny_model_dir, capsys):
    plain = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((plain / "tokenizer_config.json").read_text())
    chat = make_demo_dataset(16).map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    chat.to_json(str(tmp_path / "chat.jsonl"))
    recipe = train_recipe(tmp_path, str(plain), str(tmp_path / "chat.jsonl"))
    assert main(["train", "--config", recipe]) == 2
    line = _error_line(capsys.readouterr().err)
    assert (
        f"dataset split 'train': the prompts are chat messages (lists of role/content), but the tokenizer of "
        f"model_name_or_path={str(plain)!r} has no chat template"
        in line
        and "chat_template.jinja" in line
        and "plain text" in line
    ), line
    assert not (tmp_path / "out").exists()
    check_chat_template(chat, "train", tiny_model_dir)  # the same prompts with a template: nothing to say


# -------------------------------------------------------------------------------- a reward function raises
USER_REWARDS = """
def _score(completion, target):
    return {"never": 1.0}[completion]


def broken_reward(completions, target, **kwargs):
    return [_score(c, t) for c, t in zip(completions, target)]
"""


def test_a_reward_that_raises_shows_its_own_frames_then_one_line(
    tmp_path, tiny_model_dir, copy_jsonl, capsys, monkeypatch
):
    module = tmp_path / "user_rewards.py"
    module.write_text(USER_REWARDS)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the recipe's folder on it
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    recipe = train_recipe(tmp_path, tiny_model_dir, copy_jsonl, reward_funcs=["user_rewards.broken_reward"])
    assert main(["train", "--config", recipe, "--max_steps", "1", "--disable_tqdm", "true"]) == 1
    sys.modules.pop("user_rewards", None)
    err = capsys.readouterr().err
    shown = err[err.index("Traceback of the reward function") :].splitlines()
    assert (
        shown[-1].startswith("trl-gspo train: error: Reward function 'broken_reward' raised on sample 0 (prompt='copy ")
        and "): KeyError: " in shown[-1]
    ), err
    files = [line for line in shown if line.lstrip().startswith("File ")]
    assert [line.split(", in ")[1] for line in files] == ["broken_reward", "<listcomp>", "_score"] or [
        line.split(", in ")[1] for line in files
    ] == ["broken_reward", "_score"], err  # Python 3.12 inlines the list comprehension
    assert all(f'File "{module}"' in line for line in files), err
    assert len(shown) <= 12 and "Traceback (most recent call last)" not in err and "direct cause" not in err, err
    assert not (tmp_path / "out").exists()  # the trainer created it; the failed run leaves nothing behind


# ----------------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
def test_ctrl_c_prints_where_the_checkpoint_is_and_exits_130(tmp_path, tiny_model_dir, copy_jsonl):
    out = tmp_path / "out"
    recipe = train_recipe(tmp_path, tiny_model_dir, copy_jsonl, max_steps=50, logging_steps=1, disable_tqdm=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STEP_PAUSE": "0.3"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "cli_slow_steps.py"), "train", "--config", recipe],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and sum(seen.startswith("step ") for seen in lines) == 1:  # training has started
            proc.send_signal(signal.SIGINT)  # once: a second Ctrl-C would not wait for the checkpoint
    log = "".join(lines)
    assert proc.wait(timeout=120) == 130, log
    saved = checkpointing.last_complete_checkpoint(str(out))
    assert saved is not None and checkpointing.checkpoint_problem(saved) is None, log
    step = int(saved.rsplit("-", 1)[1])
    assert log.strip().splitlines()[-1] == (
        f"trl-gspo train: stopped by SIGINT (Ctrl-C) after step {step}; checkpoint saved to {saved}. To continue, run "
        "the same command with --resume_from_checkpoint true."
    ), log
    assert "Traceback" not in log and log.count("Stopped by SIGINT") + log.count("stopped by SIGINT") == 1, log


def test_an_interrupt_without_a_checkpoint_is_one_line_too(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(commands.COMMANDS, "train", interrupted)
    assert main(["train"]) == 130
    assert (
        capsys.readouterr().err
        == "trl-gspo train: interrupted (Ctrl-C); no checkpoint was saved for this interruption.\n"
    )


# ------------------------------------------------------------------------- arguments in the wrong place or gone
@pytest.mark.parametrize("flags", [["--num_processes", "2"], ["--num_processes=2"]])
def test_a_launch_option_without_accelerate_config_says_where_it_goes(tmp_path, copy_jsonl, capsys, flags):
    recipe = train_recipe(tmp_path, "/nonexistent/model", copy_jsonl)
    assert main(["train", "--config", recipe, *flags]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(
        "trl-gspo train: error: --num_processes 2 is an option of `accelerate launch`, which trl-gspo runs only with "
        "--accelerate_config: add --accelerate_config multi_gpu (DDP; without a CUDA device its processes run on the "
        "CPU)"
    ), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("launched", ["by --accelerate_config zero2", "by accelerate launch itself"])
def test_deepspeed_on_a_machine_without_cuda_needs_use_cpu(
    tmp_path, tiny_model_dir, copy_jsonl, capsys, monkeypatch, launched
):
    """Without `use_cpu: true` each DeepSpeed process would train alone on a CPU-only machine: one line before any
    process starts (our relaunch) or any config is built (each rank of a plain `accelerate launch`)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("subprocess.call", lambda *a, **k: pytest.fail("a process was launched"))
    recipe = train_recipe(tmp_path, str(tiny_model_dir), copy_jsonl, use_cpu=False)
    argv = ["train", "--config", recipe]
    if launched == "by --accelerate_config zero2":
        argv += ["--accelerate_config", "zero2", "--num_processes", "2"]
    else:
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert main(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert "DeepSpeed without a CUDA device needs use_cpu: true" in line and "--use_cpu true" in line, line
    assert not (tmp_path / "out").exists()
    if launched == "by --accelerate_config zero2":  # with use_cpu the same launch goes ahead
        launches = []
        monkeypatch.setattr("subprocess.call", lambda command, **k: launches.append(command) or 0)
        assert main([*argv, "--use_cpu", "true"]) == 0 and len(launches) == 1


@pytest.mark.parametrize(
    "key, value, replacement",
    [
        (
            "logging_dir",
            "logs",
            "TensorBoard writes under output_dir/runs/, or in the folder the TENSORBOARD_LOGGING_DIR",
        ),
        ("warmup_ratio", 0.1, "warmup_steps takes the ratio"),
        ("evaluation_strategy", "steps", "transformers renamed it eval_strategy"),
    ],
)
def test_a_training_argument_transformers_removed_names_its_replacement(
    tmp_path, copy_jsonl, capsys, key, value, replacement
):
    recipe = train_recipe(tmp_path, "/nonexistent/model", copy_jsonl)
    assert main(["train", "--config", recipe, f"--{key}", str(value)]) == 2  # a flag
    line = _error_line(capsys.readouterr().err)
    assert f"error: --{key}: " in line and replacement in line and "Did you mean" not in line, line
    with_key = write_recipe(tmp_path / "with_key.yaml", **{**_keys(recipe), key: value})  # a recipe key
    assert main(["train", "--config", with_key]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"error: recipe key {key!r}: " in line and replacement in line and "Did you mean" not in line, line
    assert not (tmp_path / "out").exists()


def _keys(recipe: str) -> dict:
    import yaml

    return yaml.safe_load(Path(recipe).read_text())
