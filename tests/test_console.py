"""The compact console (trl_gspo/cli/console.py): one line per logging step with the watched numbers, while loggers,
`log_history` and the demo's `metrics.csv` still get every metric; `--console stock` restores transformers' dicts."""

import csv
import re
import warnings

import pytest
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from trl_gspo import GSPOTrainer
from trl_gspo.cli.commands import main
from trl_gspo.cli.console import CompactProgressCallback, format_line, quiet_library_deprecations, use_console
from trl_gspo.cli.demo import build_demo_model, demo_config, demo_reward, make_demo_dataset

#: A compact training line: step counter, then the groups the demo logs (no KL: beta = 0).
LINE = re.compile(
    r"^step +(\d+)/(\d+) \| reward \d\.\d{3} ± \d\.\d{3} \| clip seq \d\.\d{3} tok \d\.\d{3} \| entropy \d+\.\d{3} "
    r"\| len \d+\.\d \| grad [\d.e+-]+ \| \d+\.\d+ s/step$"
)
#: Metrics the compact line leaves out but every logger must still get (TRL's, GSPO's diagnostics, throughput).
FULL = {
    "loss",
    "learning_rate",
    "reward",
    "clip_ratio/region_mean",
    "clip_fraction/token/total",
    "seq_ratio/p95",
    "ratio_dispersion/token_logratio_std",
    "completions/max_length",
    "throughput/padding_fraction",
}


# ----------------------------------------------------------------------------------------------- the line
LOG = {
    "loss": 0.0054,
    "grad_norm": 0.8583,
    "learning_rate": 3e-4,
    "reward": 0.4125,
    "reward_std": 0.2131,
    "entropy": 3.846,
    "clip_ratio/region_mean": 0.25,
    "clip_fraction/sequence/total": 0.10625,
    "clip_fraction/token/total": 0.10434,
    "completions/mean_length": 2.943,
    "step_time": 0.02038,
    "seq_ratio/mean": 1.001,
    "epoch": 0.01,
}


def test_line_holds_the_watched_numbers_in_order():
    assert format_line(LOG, 40, 2000) == (
        "step   40/2000 | reward 0.412 ± 0.213 | clip seq 0.106 tok 0.104 | entropy 3.846 | len 2.9 | grad 0.858 "
        "| 0.020 s/step"
    )


def test_line_shows_kl_when_logged_and_trl_clip_ratio_without_diagnostics():
    with_kl = format_line({**LOG, "kl": 0.00123}, 5, 10)
    assert "| entropy 3.846 | kl 0.00123 | len" in with_kl
    no_diagnostics = {k: v for k, v in LOG.items() if not k.startswith(("clip_fraction/", "seq_ratio/"))}
    assert "| clip 0.250 |" in format_line(no_diagnostics, 5, 10)
    assert "clip 0.250" not in format_line(LOG, 5, 10)  # one clip group: GSPO's fractions win


def test_line_leaves_out_what_a_window_did_not_log_and_formats_long_steps():
    line = format_line({"loss": 0.1, "grad_norm": 1.5, "entropy": 2.0, "step_time": 42.42}, 3, 10)
    assert line == "step  3/10 | entropy 2.000 | grad 1.5 | 42.4 s/step"


def test_eval_summary_and_unknown_logs():
    assert format_line({"eval_reward": 0.5, "eval_reward_std": 0.1, "eval_loss": 0.0}, 50, 100) == (
        "eval step  50/100 | reward 0.500 ± 0.100"
    )
    summary = {"train_runtime": 12.34, "train_samples_per_second": 99.0, "train_steps_per_second": 3.24}
    assert format_line(summary, 40, 40) == "done: 40 steps in 12.3 s (3.24 steps/s)"
    assert format_line({"my_metric": 0.123456, "total_flos": 5}, 1, 2) == "{'my_metric': '0.1235'}"  # nothing lost


def test_use_console_swaps_only_the_printing_callbacks_and_rejects_bad_modes(tmp_path):
    model, tokenizer = build_demo_model()
    trainer = GSPOTrainer(
        model,
        demo_reward,
        args=demo_config(str(tmp_path), max_steps=1, report_to=[]),
        train_dataset=make_demo_dataset(16),
        processing_class=tokenizer,
    )
    before = [type(cb) for cb in trainer.callback_handler.callbacks]
    use_console(trainer, "stock")
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == before
    use_console(trainer, "compact")
    after = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert ProgressCallback in before and CompactProgressCallback in after
    assert [t for t in after if t is not CompactProgressCallback] == [t for t in before if t is not ProgressCallback]
    with pytest.raises(ValueError, match="console='quiet' is not supported; allowed: compact, stock"):
        use_console(trainer, "quiet")


def test_only_the_checkpointing_rename_warnings_are_hidden():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_deprecations()
        warnings.warn("`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("`use_cache` is deprecated", FutureWarning)
        warnings.warn("`gradient_checkpointing` is deprecated", UserWarning)
    assert [str(w.message) for w in seen] == ["`use_cache` is deprecated", "`gradient_checkpointing` is deprecated"]


# ------------------------------------------------------------------------------------------- in training
class Recorder(TrainerCallback):
    """Stands in for a `report_to` logger: transformers' integrations are callbacks that get the same dicts."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.mark.parametrize("disable_tqdm", [False, True], ids=["progress-bar", "printer"])
def test_one_line_per_logging_step_while_the_logger_gets_every_metric(tmp_path, capsys, disable_tqdm):
    model, tokenizer = build_demo_model()
    recorder = Recorder()
    args = demo_config(str(tmp_path), max_steps=6, logging_steps=2, steps_per_generation=2, disable_tqdm=disable_tqdm)
    trainer = GSPOTrainer(
        model,
        demo_reward,
        args=args,
        train_dataset=make_demo_dataset(64),
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    use_console(trainer, "compact")
    capsys.readouterr()
    trainer.train()
    out = capsys.readouterr().out.splitlines()
    steps = [LINE.match(line) for line in out]
    assert [(int(m[1]), int(m[2])) for m in steps if m] == [(2, 6), (4, 6), (6, 6)], out
    assert [line for line, m in zip(out, steps) if not m] == [re.search(r"done: 6 steps in .*", out[-1])[0]], out
    step_logs = [row for row in recorder.logs if "loss" in row]
    assert len(step_logs) == 3 and all(FULL <= set(row) for row in step_logs), [sorted(r) for r in step_logs]
    history = [{k: v for k, v in row.items() if k != "step"} for row in trainer.state.log_history if "loss" in row]
    assert step_logs == history  # what metrics.csv is written from


def test_demo_cli_console_compact_and_stock(tmp_path, capsys):
    argv = [
        "demo",
        "--config",
        "demo",
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
        "--steps_per_generation",
        "2",
        "--num_train_prompts",
        "32",
        "--num_eval_prompts",
        "8",
    ]
    assert main([*argv, "--output_dir", str(tmp_path / "compact")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [int(m[1]) for m in map(LINE.match, out) if m] == [2, 4], out
    assert not any(line.startswith("{") for line in out), out
    assert any(line.startswith("held-out reward (greedy, 8 unseen prompts): before") for line in out)
    rows = list(csv.DictReader(open(tmp_path / "compact" / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [2, 4] and FULL <= set(rows[0])  # the CSV keeps every metric

    assert main([*argv, "--output_dir", str(tmp_path / "stock"), "--console", "stock"]) == 0
    out = capsys.readouterr().out.splitlines()
    dicts = [line for line in out if line.startswith("{'loss'")]
    assert len(dicts) == 2
    assert all("'seq_ratio/p95'" in line and "'clip_fraction/token/total'" in line for line in dicts)
    assert not any(map(LINE.match, out))
    assert (tmp_path / "stock" / "reward_curve.png").exists()


def test_train_cli_prints_compact_lines(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "copy.jsonl"
    make_demo_dataset(64).to_json(str(data))
    argv = [
        "train",
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--reward_funcs",
        "demo_reward",
        "--output_dir",
        str(tmp_path / "out"),
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--max_completion_length",
        "4",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--steps_per_generation",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [int(m[1]) for m in map(LINE.match, out) if m] == [1, 2, 3], out
    assert not any(line.startswith("{") for line in out), out


def test_no_progress_bar_off_a_terminal_unless_the_recipe_or_a_flag_sets_it(tmp_path, monkeypatch):
    from helpers.recipes import train_recipe

    from trl_gspo.cli import console
    from trl_gspo.cli.parser import parse

    recipe = ["--config", train_recipe(tmp_path, "model", "data.jsonl")]
    assert parse("train", recipe, defaults=console.progress_bar_default())[1].disable_tqdm is True  # captured stdout
    assert (
        parse("train", [*recipe, "--disable_tqdm", "false"], defaults=console.progress_bar_default())[1].disable_tqdm
        is False
    )
    monkeypatch.setattr(console.sys, "stdout", type("Terminal", (), {"isatty": staticmethod(lambda: True)})())
    assert console.progress_bar_default() == {}
