"""benchmarks/experiments/compare.py end to end on a tiny setting: data and plots written, every variant and seed present."""

import csv
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compare_module():
    spec = importlib.util.spec_from_file_location(
        "compare", os.path.join(ROOT, "benchmarks", "experiments", "compare.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare"] = module
    spec.loader.exec_module(module)
    return module


def test_compare_runs_end_to_end_and_writes_plots_and_data(tmp_path):
    compare = _compare_module()
    out = tmp_path / "cmp"
    compare.main(
        [
            "--output-dir",
            str(out),
            "--seeds",
            "0",
            "1",
            "--moe-seeds",
            "0",
            "--max-steps",
            "4",
            "--tiny",
            "--num-prompts",
            "16",
            "--eval-prompts",
            "8",
            "--max-completion-length",
            "6",
        ]
    )

    for name in ("reward.png", "clip_fraction.png", "ratio_dispersion.png", "routing_shift.png"):
        path = out / name
        assert path.exists() and path.stat().st_size > 5000, name  # a real figure, not an empty canvas
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    runs = {(r["model"], r["variant"], r["seed"]) for r in rows}
    expected = {("dense", v, s) for v in compare.DEFAULT_VARIANTS for s in ("0", "1")}
    expected |= {("moe", v, "0") for v in compare.DEFAULT_VARIANTS}
    assert runs == expected
    assert len(rows) == 4 * len(expected)  # one row per optimizer step
    assert all(r["clip_fraction/token/total"] != "" for r in rows)
    assert all(r["moe/routing_shift"] != "" for r in rows if r["model"] == "moe")
    assert all(r["moe/routing_shift"] == "" for r in rows if r["model"] == "dense")
    assert len(json.loads((out / "metrics.json").read_text())) == len(rows)

    summary = json.loads((out / "summary.json").read_text())["results"]
    assert set(summary) == {f"{m}/{v}" for m, v, _ in expected}
    assert summary["dense/GSPO"]["clip_fraction_token_mean"] is not None
    assert summary["moe/GSPO"]["routing_shift_mean_off_policy"] is not None
    assert summary["moe/GSPO"]["routing_shift_by_updates_since_rollout"]["0"] == 0  # on-policy mini-batch: no shift
    # every run file carries its provenance, and the report pairs the variants' held-out rewards over seeds
    saved = json.loads((out / "runs" / "dense-GSPO-1" / "result.json").read_text())
    assert {"git", "versions", "cpu", "config", "held_out", "training_code"} <= set(saved["provenance"])
    assert saved["provenance"]["config"]["importance_sampling_level"] == "sequence"
    pairs = json.loads((out / "summary.json").read_text())["pairs"]
    assert pairs["dense"]["GRPO vs GSPO"]["n"] == 2 and pairs["moe"]["GRPO vs GSPO"]["n"] == 1
    verdict = pairs["dense"]["GRPO vs GSPO"]["verdict"]
    assert verdict in ("ahead", "behind") or verdict.startswith("level within ±")

    # --replot rebuilds the summary and plots from the saved data alone
    for name in ("summary.json", "reward.png", "routing_shift.png"):
        (out / name).unlink()
    compare.main(["--output-dir", str(out), "--replot"])
    assert (out / "routing_shift.png").stat().st_size > 5000
    assert json.loads((out / "summary.json").read_text())["results"] == summary


def test_routing_replay_experiment_smoke_run_writes_its_table(tmp_path):
    """`--experiment routing-replay` on one seed, 2 steps: all five arms run on the MoE, replay arms replay (coverage:
    every completion token under R2, all but the last sampled token under R3), and the table and plot are written."""
    compare = _compare_module()
    out = tmp_path / "rr"
    compare.main(
        [
            "--output-dir",
            str(out),
            "--experiment",
            "routing-replay",
            "--moe-seeds",
            "0",
            "--max-steps",
            "2",
            "--tiny",
            "--eval-prompts",
            "8",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())["results"]
    assert set(summary) == {f"moe/{v}" for v in compare.ROUTING_EXPERIMENT["variants"]}
    assert summary["moe/GRPO+R2"]["replay_coverage_mean"] == 1.0
    assert 0 < summary["moe/GSPO+R3"]["replay_coverage_mean"] < 1
    assert summary["moe/GRPO+R3"]["r3_sampler_mismatch_mean"] is not None
    assert summary["moe/GRPO"].get("replay_coverage_mean") is None
    table = (out / "routing_replay.md").read_text()
    assert all(v in table for v in compare.ROUTING_EXPERIMENT["variants"])
    assert (out / "routing_replay.png").stat().st_size > 5000


def test_compare_rejects_unknown_variant(tmp_path):
    compare = _compare_module()
    with pytest.raises(ValueError, match="unknown variants"):
        compare.run(str(tmp_path), variants=("PPO",))


def test_dynamic_sampling_experiment_smoke_run_writes_its_table_and_plot(tmp_path):
    """`--experiment dynamic-sampling` on one seed, a few steps, tiny batches: both tasks and arms run, held-out points
    are recorded at step 0 and at the end, the dynamic-sampling arm generates more tokens than it trains on while the
    plain arm trains on all it generates, and the table, plot and --replot work."""
    compare = _compare_module()
    out = tmp_path / "ds"
    compare.main(
        ["--output-dir", str(out), "--experiment", "dynamic-sampling", "--seeds", "0", "--max-steps", "4", "--tiny"]
    )
    summary = json.loads((out / "summary.json").read_text())["results"]
    assert set(summary) == {"copy3", "copy5"} and all(set(s) == {"GSPO", "GSPO+DS"} for s in summary.values())
    for task in summary.values():
        assert task["GSPO"]["generated_per_trained_token"] == 1.0 and task["GSPO"]["rounds"] is None
        assert task["GSPO+DS"]["generated_per_trained_token"] >= 1.0 and task["GSPO+DS"]["rounds"] >= 1
        ds = task["GSPO+DS"]
        assert ds["generated_per_signal_token"] >= ds["generated_per_trained_token"]
        if not ds["underfilled"]:  # full batches hold passing groups only: every trained token carries signal
            assert ds["generated_per_signal_token"] == ds["generated_per_trained_token"]
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert len(runs) == 4 and all([p["step"] for p in r["points"]] == [0, 4] for r in runs)
    table = (out / "dynamic_sampling.md").read_text()
    assert "| copy5 | GSPO+DS | 1 |" in table
    assert (out / "dynamic_sampling.png").stat().st_size > 5000
    (out / "summary.json").unlink()
    compare.main(["--output-dir", str(out), "--experiment", "dynamic-sampling", "--replot"])
    assert json.loads((out / "summary.json").read_text())["results"] == summary


def test_async_experiment_smoke_writes_table_and_plot(tmp_path):
    """`--experiment async` on one seed and a few steps: every arm trains, the table names degradation per arm."""
    compare = _compare_module()
    out = tmp_path / "async"
    compare.main(
        [
            "--output-dir",
            str(out),
            "--experiment",
            "async",
            "--seeds",
            "0",
            "--max-steps",
            "12",
            "--tiny",
            "--eval-prompts",
            "8",
        ]
    )
    summary = json.loads((out / "async_summary.json").read_text())["results"]
    assert set(summary) == set(compare.async_experiment.ARMS)
    assert summary["GSPO async s2"]["staleness_mean"] > summary["GSPO async s1"]["staleness_mean"] > 0
    assert summary["GSPO async s1"]["behaviour_weight_mean"] is not None
    assert summary["GSPO async s1 no-corr"]["behaviour_weight_mean"] is None  # correction off: no weight computed
    assert summary["GRPO sync"]["staleness_mean"] is None and "degraded" not in summary["GRPO sync"]
    assert "degraded" in summary["GRPO async s4 no-corr"]
    table = (out / "async.md").read_text()
    assert table.count("\n| GSPO async") == 6 and "Degradation:" in table
    assert (out / "async.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
