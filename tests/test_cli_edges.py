"""What a user meets in the first hour with the CLI: the demo resumed after SIGTERM, an edited copy of a recipe, one-line
errors for a broken YAML file, a bad choice and the demo's recipe given to `train`, and a console without checkpoint
progress bars or a spurious tied-head warning, whose summary counts this run's steps and which prints the eval score."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from datasets import DatasetDict
from helpers.recipes import train_recipe

from trl_gspo.cli import resources
from trl_gspo.cli.commands import main, say_resources
from trl_gspo.cli.demo import make_demo_dataset
from trl_gspo.cli.resources import cpu_cores, threads_source
from trl_gspo.cli.shipped import SHIPPED

ROOT = Path(__file__).resolve().parent.parent
#: A demo of a few steps: small data, one line per step, no progress bar.
SMALL_DEMO = ["--num_train_prompts", "64", "--num_eval_prompts", "8", "--logging_steps", "1", "--disable_tqdm", "true"]


def _error_line(err: str) -> str:
    """The CLI's one error line; nothing else of the command may reach stderr (no usage, no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("trl-gspo ") and ": error: " in lines[0], err
    return lines[0]


def _step_lines(out: str) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in out.splitlines() if line.startswith("step ")]


# --------------------------------------------------------------------------------------- demo resume
def _demo(out: Path, pause: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STEP_PAUSE": str(pause)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = ["demo", "--config", "demo", "--output_dir", str(out), "--max_steps", "12", "--save_strategy", "steps"]
    argv += ["--save_steps", "4"]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "cli_slow_steps.py"), *argv, *SMALL_DEMO, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_demo_resumes_after_sigterm_like_train(tmp_path):
    """SIGTERM mid-run, then `trl-gspo demo --resume_from_checkpoint true`: the run continues from the signal's
    checkpoint (no step run twice), leaves the earlier checkpoints as they were, counts only its own steps, and ends at
    the uninterrupted run's weights exactly."""
    straight = _demo(tmp_path / "straight", 0.0)
    assert straight.wait(timeout=300) == 0, straight.stdout.read()

    out = tmp_path / "run"
    proc, lines = _demo(out, 0.3), []
    for line in proc.stdout:  # a real step past the first checkpoint, then preempt the process
        lines.append(line)
        if _step_lines(line) == [5]:
            proc.send_signal(signal.SIGTERM)
    log = "".join(lines)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved[0] == 4 and 4 < saved[-1] < 12, (saved, log)
    before = _files(out)

    resume = _demo(out, 0.0, "--resume_from_checkpoint", "true")
    resumed_log = resume.communicate(timeout=300)[0]
    assert resume.returncode == 0, resumed_log
    steps = _step_lines(resumed_log)
    assert steps[0] == saved[-1] + 1 and steps[-1] == 12, resumed_log  # continued, not started over
    assert f"done: {12 - saved[-1]} steps" in resumed_log, resumed_log  # this run's steps, not the whole schedule
    after = _files(out)
    untouched = {name: mtime for name, mtime in before.items() if name.startswith("checkpoint-")}
    assert untouched and {name: after.get(name) for name in untouched} == untouched
    final, reference = _weights(out), _weights(tmp_path / "straight")
    assert final.keys() == reference.keys()
    assert all((final[k] == reference[k]).all() for k in final), "resumed weights differ from the uninterrupted run"


# ------------------------------------------------------------------------------------ recipes edited
def test_an_edited_recipe_copy_is_what_runs_and_the_first_line_names_it(tmp_path, monkeypatch, capsys):
    assert main(["recipes", str(tmp_path)]) == 0
    copy = tmp_path / "recipes" / "demo.yaml"
    recipe = yaml.safe_load(copy.read_text())
    copy.write_text(yaml.safe_dump({**recipe, "max_steps": 3, "num_train_prompts": 32, "num_eval_prompts": 8}))
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for folder, value in ((tmp_path, "demo"), (copy.parent, "demo"), (elsewhere, "../recipes/demo.yaml")):
        monkeypatch.chdir(folder)
        out = tmp_path / "out" / folder.name
        assert main(["demo", "--config", value, "--output_dir", str(out), "--disable_tqdm", "true"]) == 0
        printed = capsys.readouterr().out
        assert printed.splitlines()[0] == f"trl-gspo demo: recipe {copy}", printed
        assert "trained 3 steps" in printed, printed  # the edited max_steps, not the shipped 2000

    # A path that is not there is an error naming it, not the shipped recipe of the same name taken silently.
    assert main(["demo", "--config", "recipes/demo.yaml"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "'recipes/demo.yaml': no such file" in line and "--config demo" in line


def test_the_copy_demo_names_the_shipped_recipe_and_runs_on_one_thread(tmp_path, monkeypatch, capsys):
    """`trl-gspo demo --config demo` runs the shipped `demo` recipe and says so; without OMP_NUM_THREADS it picks one
    thread for its tiny model and names it; stdout is no terminal here, so no progress bar is drawn."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS")
    try:
        argv = ["demo", "--config", "demo", "--output_dir", str(tmp_path / "o"), "--max_steps", "1", *SMALL_DEMO[:-2]]
        assert main(argv) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)  # the suite's setting (conftest.py)
    out, err = capsys.readouterr()
    first = out.splitlines()[:3]
    assert first[0] == f"trl-gspo demo: recipe {SHIPPED['recipe'] / 'demo.yaml'} (shipped)", out
    why = "the demo's choice for its tiny model; OMP_NUM_THREADS overrides"
    assert first[1] == f"trl-gspo demo: 1 process on cpu, 1 thread ({why}), {_cores(cpu_cores())}", out
    assert first[2].startswith("trl-gspo demo: generation: "), out
    assert "\r" not in out + err and "it/s" not in err, err


def _cores(count: int) -> str:
    return f"{count} core{'s' if count != 1 else ''}"


def test_the_users_thread_count_wins_over_the_demos(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(resources, "STARTING_THREADS", 1)
    try:
        torch.set_num_threads(2)  # torch.set_num_threads before the command
        assert resources.pick_threads(1, "the demo's") == "torch.set_num_threads(2)" and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert resources.pick_threads(1, "the demo's") == "OMP_NUM_THREADS=3" and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(resources, "STARTING_THREADS", 2)  # torch's own count: the demo's choice applies
        assert resources.pick_threads(1, "the demo's") == "the demo's" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


def test_processes_devices_and_threads_in_one_line_and_a_warning_when_cores_are_short(monkeypatch, capsys):
    from types import SimpleNamespace

    cpu = SimpleNamespace(process_index=0, world_size=2, device=torch.device("cpu"))
    monkeypatch.setattr(resources, "cpu_cores", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    say_resources("train", cpu, threads_source())
    out, err = capsys.readouterr()
    assert out == "trl-gspo train: 2 processes on cpu, 1 thread each (OMP_NUM_THREADS=1), 1 core\n"
    assert err.count("warning") == 1 and "2 processes x 1 thread = 2 threads on 1 core" in err, err
    assert "OMP_NUM_THREADS=1 (processes x threads at most the cores)" in err, err
    say_resources("train", SimpleNamespace(**{**vars(cpu), "process_index": 1}), threads_source())
    assert capsys.readouterr() == ("", "")  # the main process speaks for all

    # `accelerate launch --num_processes 2` without --multi_gpu on a machine without GPUs: one process, said so
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    monkeypatch.setattr(resources, "cpu_cores", lambda: 2)
    say_resources("train", SimpleNamespace(**{**vars(cpu), "world_size": 1}), threads_source())
    out, err = capsys.readouterr()
    assert out.startswith("trl-gspo train: 1 process on cpu, 1 thread (OMP_NUM_THREADS=1)"), out
    warning = [line for line in err.splitlines() if line.strip()]
    assert len(warning) == 1 and "accelerate launch started a single process" in warning[0], err
    assert (
        "--multi_gpu" in warning[0] and "`trl-gspo train --accelerate_config multi_gpu --num_processes N`" in warning[0]
    )


def test_the_custom_task_recipe_copied_out_trains_a_local_file_with_the_users_reward(
    tmp_path, tiny_model_dir, monkeypatch, capfd
):
    """The path most users take: `trl-gspo recipes`, then `trl-gspo train --config custom_task` with a local JSONL file and
    the reward module beside the copied recipe, and any model path; offline, two steps on a tiny model."""
    # The CLI puts the recipe's folder on sys.path (undone after the test); a fresh process has no shipped one there.
    monkeypatch.setattr(sys, "path", [folder for folder in sys.path if folder != str(SHIPPED["recipe"])])
    monkeypatch.delitem(sys.modules, "custom_task_reward", raising=False)
    assert main(["recipes", str(tmp_path)]) == 0
    copied = tmp_path / "recipes"
    assert {"custom_task.yaml", "custom_task_reward.py", "custom_task.jsonl"} <= {p.name for p in copied.iterdir()}
    monkeypatch.chdir(tmp_path)
    tiny = ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4"]
    argv = ["--model_name_or_path", tiny_model_dir, "--use_cpu", "true", "--bf16", "false", "--max_steps", "2", *tiny]
    capfd.readouterr()
    assert main(["train", "--config", "custom_task", *argv, "--save_strategy", "no", "--output_dir", "out"]) == 0
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"trl-gspo train: recipe {copied / 'custom_task.yaml'}", out
    assert lines[1].startswith("trl-gspo train: 1 process on cpu, 1 thread (OMP_NUM_THREADS=1), "), out
    assert sys.modules["custom_task_reward"].__file__ == str(copied / "custom_task_reward.py")  # the copy's module
    assert "\r" not in out + err, err  # stdout is no terminal: no progress bars
    assert "done: 2 steps" in out and (tmp_path / "out" / "model.safetensors").is_file()


# -------------------------------------------------------------------------------------- one-line errors
def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("max_steps: 3\nlearning_rate: [1.0e-3\nseed: 0\n")
    for command in ("demo", "train"):
        assert main([command, "--config", str(recipe)]) == 2
        line = _error_line(capsys.readouterr().err)
        assert f"{recipe}, line 3, column 5" in line and "YAML" in line, line


def test_a_recipe_that_is_no_mapping_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- max_steps\n- 3\n")
    assert main(["demo", "--config", str(recipe)]) == 2
    assert "not a recipe (a YAML mapping of keys)" in _error_line(capsys.readouterr().err)


def test_invalid_choice_is_one_line_without_the_usage(capsys):
    assert main(["demo", "--importance_sampling_level", "seq"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "--importance_sampling_level" in line and "'seq'" in line and "'sequence'" in line, line


def test_a_negative_eval_every_is_one_line(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--config", "demo", "--eval_every", "-3", "--output_dir", str(out)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "eval_every=-3" in line and ">= 0" in line, line
    assert not out.exists()


def test_train_with_the_demo_recipe_says_it_is_the_demos(capsys):
    assert main(["train", "--config", "demo"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "trl-gspo demo --config demo" in line and "'task'" in line, line


# ----------------------------------------------------------------------------------------------- console
@pytest.fixture
def eval_data(tmp_path):
    path = tmp_path / "data"
    DatasetDict(train=make_demo_dataset(64), test=make_demo_dataset(8, split="test")).save_to_disk(str(path))
    return str(path)


def _train(tmp_path, model_dir, data, *extra) -> list[str]:
    recipe = train_recipe(
        tmp_path,
        model_dir,
        data,
        max_steps=4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="epoch",  # 64 prompts are 32 steps an epoch: no evaluation happens within the 4 steps
        per_device_eval_batch_size=8,
    )
    return ["train", "--config", recipe, *extra]


def test_train_console_after_a_resume(tmp_path, tiny_model_dir, eval_data, capfd):
    """Checkpoints are written without progress bars; a resumed run counts its own steps and is not told that the
    tied output head is missing; `train` ends with the eval score of the final model."""
    assert main(_train(tmp_path, tiny_model_dir, eval_data)) == 0
    printed = "".join(capfd.readouterr())
    assert "Writing model shards" not in printed, printed
    score = [line for line in printed.splitlines() if line.startswith("eval (8 prompts) after step 4:")]
    assert len(score) == 1 and "reward" in score[0], printed

    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    assert main(_train(tmp_path, tiny_model_dir, eval_data, "--resume_from_checkpoint", checkpoint)) == 0
    printed = "".join(capfd.readouterr())
    assert "missing keys" not in printed and "lm_head" not in printed, printed
    assert "done: 2 steps" in printed, printed
