"""`make gpu-check` (`python -m benchmarks.gpu`, benchmarks/gpu/) on a CPU machine: the dry run lists every part with its skip reason, the
driver survives parts that crash, fail or overrun their budget, and the parts' own checks run (on CPU stand-ins where
the GPU is only a device choice) and fail when the property they check is broken."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import check, measure, parts, passes, quick  # noqa: E402
from benchmarks.gpu.check import Part  # noqa: E402

CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


def _script(tmp_path, name, body: str):
    """A part command: a small Python script that gets the result path as its argument."""
    path = tmp_path / f"{name}.py"
    path.write_text("import json, sys, time\nout = sys.argv[1]\n" + body)
    return lambda out: [sys.executable, str(path), out]


# ----------------------------------------------------------------------------------------------- dry run
def test_dry_run_lists_every_part_with_its_skip_reason_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        env=CPU_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [part.name for part in check.PARTS]
    assert {
        "parity_bf16",
        "demo_cuda",
        "benchmark",
        "loss_path",
        "packing",
        "vllm_routes",
        "vllm_colocate",
        "zero2",
        "zero3",
    } == set(names)
    one_gpu = [part.budget_s for part in check.PARTS if not part.name.startswith("zero")]
    assert sum(one_gpu) <= 43 * 60  # the whole check fits its 45-minute cap (--max-minutes) on one GPU, set-up included
    listed = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert list(listed) == names, proc.stdout
    assert all("skipped" in line and "no CUDA GPU visible" in line for line in listed.values()), proc.stdout
    assert "needs 2 GPUs, 0 visible" in listed["zero2"] and "needs 2 GPUs, 0 visible" in listed["zero3"]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert list(report["parts"]) == names
    assert all(e["status"] == "skipped" and "no CUDA GPU visible" in e["reason"] for e in report["parts"].values())
    table = (tmp_path / "gpu-check.md").read_text()
    assert all(f"| {name} |" in table for name in names) and table.count("| skipped |") == len(names)


def test_every_reason_is_listed_when_several_things_are_missing():
    env = check.environment()
    assert env["supported"]["transformers"] == ">=5.17.0,<6"  # read from pyproject.toml
    env.update(gpus=["GPU"], modules={"vllm": False, "flash_attn": False, "deepspeed": False})
    reasons = {part.name: part.missing(env) for part in check.PARTS}
    assert reasons["parity_bf16"] == [] and reasons["packing"] == []
    assert reasons["vllm_colocate"] == ["vllm not installed"]
    assert reasons["zero3"] == ["needs 2 GPUs, 1 visible", "deepspeed not installed"]
    # an image with an older transformers and no TRL: every part says so
    env.update(gpus=[], versions={**env["versions"], "trl": None, "transformers": "5.16.0", "datasets": None})
    assert check.PARTS[0].missing(env) == [
        "no CUDA GPU visible",
        "trl not installed",
        "transformers 5.16.0 outside the supported >=5.17.0,<6",
        "datasets not installed",
    ]


# ------------------------------------------------------------------------------------------- the driver
def test_driver_records_crash_failure_timeout_and_goes_on(tmp_path):
    fakes = [
        Part(
            "crash",
            "exits 3",
            60,
            lambda env: [],
            _script(
                tmp_path,
                "crash",
                "import os; print('about to fail in', os.getcwd(), '/usr/lib/python3/site-packages/x.py'); sys.exit(3)",
            ),
        ),
        Part(
            "slow",
            "sleeps past its budget",
            2,
            lambda env: [],
            _script(tmp_path, "slow", "json.dump({'status': 'ok', 'x': 1}, open(out, 'w')); time.sleep(120)"),
        ),
        Part(
            "failed",
            "its check fails",
            60,
            lambda env: [],
            _script(
                tmp_path,
                "failed",
                "json.dump({'status': 'failed', 'problems': ['gap 0.3']}, open(out, 'w')); sys.exit(1)",
            ),
        ),
        Part(
            "good",
            "passes",
            60,
            lambda env: [],
            _script(tmp_path, "good", "json.dump({'status': 'ok', 'x': 2.5}, open(out, 'w'))"),
            headline=lambda r: {"x": r["x"]},
        ),
        Part("absent", "needs what is missing", 60, lambda env: ["no widget"], lambda out: ["false"]),
    ]
    env = {"gpus": ["GPU"], "cuda": "13.0", "versions": {"torch": "x"}, "modules": {}}  # parts with own needs only
    start = time.perf_counter()
    report = check.run(fakes, env, str(tmp_path / "out"), log=lambda *a, **k: None)
    assert time.perf_counter() - start < 60  # the sleeping part was stopped at its budget, not waited for
    entries = report["parts"]
    assert {name: e["status"] for name, e in entries.items()} == {
        "crash": "error",
        "slow": "timeout",
        "failed": "failed",
        "good": "ok",
        "absent": "skipped",
    }
    assert "exit code 3" in entries["crash"]["error"] and "about to fail" in entries["crash"]["log_tail"]
    assert "2 s budget (partial result kept)" in entries["slow"]["error"] and entries["slow"]["result"]["x"] == 1
    assert entries["failed"]["error"] == "gap 0.3"
    assert entries["good"]["headline"] == {"x": 2.5} and "log_tail" not in entries["good"]
    assert entries["absent"]["reason"] == "no widget"
    saved = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert saved["parts"].keys() == entries.keys()
    # the committed results hold no path of this machine; the (git-ignored) log keeps the raw text
    assert saved["parts"]["crash"]["log_tail"].strip() == "about to fail in <repo> <site-packages>/x.py"
    assert str(ROOT) in (tmp_path / "out" / "gpu-check-logs" / "crash.log").read_text()
    # a later run of one part keeps the others' entries
    keep = {name: entry for name, entry in saved["parts"].items() if name != "good"}
    again = check.run(fakes[3:4], env, str(tmp_path / "out"), keep=keep, log=lambda *a, **k: None)
    assert list(again["parts"]) == ["crash", "slow", "failed", "absent", "good"]


def test_the_whole_run_has_a_time_cap(tmp_path):
    part = Part("late", "never starts", 60, lambda env: [], lambda out: ["true"])
    report = check.run([part], {"gpus": ["GPU"], "modules": {}}, None, max_seconds=10, log=lambda *a, **k: None)
    assert report["parts"]["late"]["status"] == "skipped"
    assert report["parts"]["late"]["reason"].startswith("only 10 s of the run's 10 s (--max-minutes) left")


def test_benchmark_headline_reads_run_py_ratios_and_mfu():
    result = {
        "machine": {"attention": "sdpa"},  # `run.py --out`: the machine block, then every scenario run
        "scenarios": {
            "equal_settings": {"ratio_seconds_per_step": 0.9712, "mfu": {"stock": 0.31, "ours": 0.33}},
            "loss_path": {"ratio_seconds": 1.02, "ratio_cpu_seconds": 1.5},
            "long_tail": {
                "long_tail": {
                    "trim_sort": {"ratio_seconds_per_step": 0.61},
                    "median": {"stock": {"seconds_per_step": 2.0}},
                },
                "long_tail_one_micro_batch": {"packed": {"ratio_seconds_per_step": 0.52}},
            },
            "logprob_memory": {"ratio_ours_over_stock": 0.25},
        },
    }
    assert check._bench_headline(result) == {
        "equal_settings ours/stock": 0.971,
        "equal_settings MFU stock": 0.31,
        "equal_settings MFU ours": 0.33,
        "loss_path ours/stock": 1.02,
        "long_tail.long_tail.trim_sort ours/stock": 0.61,
        "long_tail.long_tail_one_micro_batch.packed ours/stock": 0.52,
        "logprob_memory ours/stock": 0.25,
        "attention": "sdpa",
    }


# -------------------------------------------------------------------------------- the parts' own checks, on CPU
def test_bf16_parity_passes_on_cpu_and_fails_when_our_loss_drifts(monkeypatch):
    result = parts.parity_bf16(device="cpu")
    assert result["status"] == "ok" and result["passed"] == len(result["cases"]) == 6, result["problems"]
    case = result["cases"]["sequence-grpo (GSPO)"]
    assert 0 < case["grad_error_stock"] < 0.05  # bf16 really ran: rounding error against fp32, and small

    from trl_gspo import GSPOTrainer

    policy_loss = GSPOTrainer.policy_loss
    monkeypatch.setattr(GSPOTrainer, "policy_loss", lambda self, *a, **k: 1.1 * policy_loss(self, *a, **k))
    drifted = parts.parity_bf16(device="cpu")
    assert drifted["status"] == "failed" and drifted["passed"] == 0
    assert "sequence-grpo (GSPO): loss error" in drifted["problems"][0]


def test_colocate_smoke_on_cpu_and_it_notices_when_pi_old_is_recomputed(monkeypatch):
    import torch

    from trl_gspo.rounding import model_bound
    from trl_gspo.testing import build_tokenizer, tiny_config

    result = parts.vllm_colocate(use_vllm=False, device="cpu", max_steps=4)
    assert result["status"] == "ok", result["problems"]
    assert result["pi_old_passes"] == 0 and result["replay_coverage"] > 0.5
    # same weights, same fp32 model: sampler == trainer up to one forward's rounding, relative to the log-probs' size
    bound = model_bound(torch.float32, tiny_config(len(build_tokenizer()), moe=True), result["positions"])
    assert result["sampler_logp_abs_diff"] <= bound * result["logp_scale"]

    from trl_gspo.rollout.sampler_logprobs import SamplerLogprobs

    monkeypatch.setattr(SamplerLogprobs, "reuses", property(lambda self: False))
    broken = parts.vllm_colocate(use_vllm=False, device="cpu", max_steps=4)
    assert broken["status"] == "failed" and broken["pi_old_passes"] == 1
    assert "TRL's pi_old pass ran 1 times (sampler log-probs not reused)" in broken["problems"]


def test_saved_demo_check_and_zero_command(tmp_path):
    from trl_gspo.cli.demo import build_demo_model, run_demo

    out = tmp_path / "demo"
    run_demo(str(out), num_train_prompts=32, num_eval_prompts=8, max_steps=2, logging_steps=1, disable_tqdm=True)
    assert parts.check_saved_demo(str(out), steps=2) == []
    assert parts.check_saved_demo(str(out), steps=3) == ["metrics.csv ends at step 2, expected 3"]
    build_demo_model(seed=0)[0].save_pretrained(out)  # the initial weights, as if training had not happened
    assert parts.check_saved_demo(str(out), steps=2) == ["the saved weights look untrained"]
    assert parts.check_saved_demo(str(tmp_path / "nothing"), steps=2)[0].startswith("output unreadable")

    cmd = parts.zero_command(3, "run")
    config = cmd[cmd.index("--config_file") + 1]
    assert Path(config).name == "zero3.yaml" and Path(config).is_file()
    assert cmd[cmd.index("--num_processes") + 1] == "2" and cmd[cmd.index("--bf16") + 1] == "true"


@pytest.mark.parametrize("target", ["gpu-check", "gpu-quick"])
def test_make_target_runs_the_dry_run(tmp_path, target):
    proc = subprocess.run(
        [
            "make",
            target,
            f"GPU_PYTHON={sys.executable}",
            f"WHEELS={tmp_path / 'none'}",
            f"GPU_CHECK_ARGS=--dry-run --out-dir {tmp_path}",
        ],
        cwd=ROOT,
        env=CPU_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = check.PARTS if target == "gpu-check" else check.QUICK
    assert json.loads((tmp_path / f"{target}.json").read_text())["parts"].keys() == {p.name for p in listed}


def test_zero_part_streams_its_launch_and_checks_what_it_saved(monkeypatch, capsys):
    # the 2-GPU launch replaced by the one-process CPU demo: the same outputs for the part to check
    def cpu_demo(stage, output_dir):
        return [
            sys.executable,
            "-m",
            "trl_gspo",
            "demo",
            "--config",
            "demo",
            "--output_dir",
            output_dir,
            "--max_steps",
            str(parts.ZERO_STEPS),
            "--logging_steps",
            "10",
            "--num_train_prompts",
            "64",
            "--num_eval_prompts",
            "8",
            "--disable_tqdm",
            "true",
        ]

    monkeypatch.setattr(parts, "zero_command", cpu_demo)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = parts.zero(2)
    assert result["status"] == "ok" and result["exit_code"] == 0, result
    assert re.fullmatch(r"0\.\d{3} -> 0\.\d{3}", result["held_out"])
    assert f"step {parts.ZERO_STEPS}/{parts.ZERO_STEPS} | reward" in capsys.readouterr().out  # streamed

    monkeypatch.setattr(parts, "zero_command", lambda stage, out: [sys.executable, "-c", "import sys; sys.exit(7)"])
    failed = parts.zero(3)
    assert failed["status"] == "failed" and failed["problems"][0] == "launcher exited 7"
    assert failed["problems"][1].startswith("output unreadable")


def test_vllm_routes_part_dry_run(tmp_path):
    """`python -m benchmarks.gpu routes` (routes.py, the gpu-check part that checks vLLM's route layout) runs its whole
    path on CPU, with a stand-in engine in place of vLLM; the driver's part runs the same entry point."""
    (vllm_routes,) = [part for part in check.PARTS if part.name == "vllm_routes"]
    assert vllm_routes.command("r.json") == [sys.executable, "-m", "benchmarks.gpu", "routes", "--out", "r.json"]
    assert check.main(["routes", "--dry-run", "--max-tokens", "6", "--out", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["completions"]) == 4
    for entry in report["completions"]:
        assert entry["shape"][0] == entry["prompt_tokens"] + entry["completion_tokens"] - 1
        assert entry["rows_with_route"] == entry["shape"][0]
    assert report["mismatch_token_layer"] == 0.0  # same fp32 weights on CPU: generate and forward route alike


# ------------------------------------------------------------------------------------------- make gpu-quick
def test_quick_profile_dry_run_and_budget(tmp_path, capsys):
    """`make gpu-quick` lists its four parts (skipped on CPU, why); their budgets fit its 8 minutes with room for
    each process's start; its results go to gpu-quick.json / .md, leaving the full run's files alone."""
    assert check.main(["--profile", "quick", "--dry-run", "--out-dir", str(tmp_path)]) == 0
    names = [part.name for part in check.QUICK]
    assert names == ["probe", "attention", "passes", "loss"]
    assert sum(part.budget_s for part in check.QUICK) <= 8 * 60 - 20
    report = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert report["target"] == "gpu-quick" and report["max_minutes"] == 8 and list(report["parts"]) == names
    assert all("no CUDA GPU visible" in entry["reason"] for entry in report["parts"].values())
    assert not (tmp_path / "gpu-check.json").exists() and "`make gpu-quick`" in (tmp_path / "gpu-quick.md").read_text()
    assert check.quick_parts(tiny=True)[1].command("out")[-5:] == [
        "--part",
        "attention",
        "--result",
        "out",
        "--tiny",
    ]
    assert check.quick_parts(tiny=True)[0].missing(check.environment()) == []  # the CPU runs --tiny


def test_quick_parts_run_on_cpu_at_tiny_shapes(tmp_path):
    """Every quick part's code on the CPU (`--tiny`: toy shapes, the stand-in varlen kernel): the probe reads
    varlen_attn's options and alignment, the attention arms match the dense reference, the passes and the loss run
    every arm at every shape with the planner's choice logged, the pi_old forward's calls make no host sync; each
    result file is the part's result. Timings at these shapes mean nothing."""
    probe = quick.probe(str(tmp_path / "probe.json"), tiny=True)
    assert probe["status"] == "ok", probe["problems"]
    if probe["varlen_attn"]["signature"] is not None:
        assert probe["varlen_attn"]["bottom_right_error"] <= probe["varlen_attn"]["bottom_right_bound"]
    assert probe["masked_gqa_block"]["accepted"]["MATH"] is True
    attention = quick.attention(str(tmp_path / "attention.json"), tiny=True)
    assert attention["status"] == "ok", attention["problems"]
    arms = {name: arm for name, arm in attention["tiny"].items() if name != "layout"}
    assert {"stock", "sdpa_blocks", "torch_varlen"} <= set(arms)
    assert all(arm["check"]["status"] == "ok" and arm["forward_backward_ms"] > 0 for arm in arms.values())
    for part in (passes.passes, passes.loss):
        result = part(str(tmp_path / f"{part.__name__}.json"), tiny=True)
        assert result["status"] == "ok", result["problems"]
        assert json.loads((tmp_path / f"{part.__name__}.json").read_text()) == json.loads(json.dumps(result))
        for shape in passes.PASS_SHAPES:
            assert set(result[shape]) == {"tokens", *passes.ARMS}
            assert all(len(result[shape][arm]["runs_ms"]) == measure.TINY_REPS for arm in passes.ARMS)
            assert result[shape]["shared"]["plan"]["layouts"].startswith("s1x")  # one row: the varlen kernel's
            assert result[shape]["trimmed"]["plan"]["layouts"].startswith("t")
    assert result["equal_settings"]["shared"]["plan"]["kernel"] == "torch varlen_attn"


def test_quick_checks_can_fail(tmp_path, monkeypatch):
    """A varlen kernel aligned top-left fails the attention part's check; a host sync fails `no_sync`."""
    import torch

    def top_left(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):  # keys 0..i
        key, value = (x.repeat_interleave(query.size(1) // x.size(1), 1) for x in (key, value))
        outs = []
        for i in range(len(cu_seq_q) - 1):
            q, k, v = (x[c[i] : c[i + 1]] for x, c in ((query, cu_seq_q), (key, cu_seq_k), (value, cu_seq_k)))
            allowed = torch.ones(len(q), len(k), dtype=torch.bool).tril(0)
            scores = torch.einsum("qhd,khd->hqk", q, k) * q.size(-1) ** -0.5
            outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v))
        return torch.cat(outs)

    monkeypatch.setattr(measure, "cpu_varlen", top_left)
    attention = quick.attention(None, tiny=True)
    assert attention["status"] == "failed" and any("torch_varlen" in p for p in attention["problems"])
    with pytest.raises(RuntimeError, match="host sync"):
        with measure.no_sync(torch.device("cpu")):
            torch.tensor([1.0]).item()
