"""The experiments' reports (benchmarks/experiments/harness.py, report_common.py, real_model_report.py and
compare_report.py) on made-up run files: the verdict words come from the paired per-seed intervals alone, runs of
different training code (or without provenance) are not compared unless asked, every run file carries its provenance,
and the docs' verdict words are checked against the report (benchmarks/quoted.py)."""

import json
import math
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "benchmarks" / "experiments"
#: Student-t 97.5 % points by degrees of freedom (tables), for an interval computed apart from scipy.
T975 = dict(
    enumerate(
        [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131],
        start=1,
    )
)
SOURCE = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "gguf", "sha256": "ab"}


@pytest.fixture
def modules(monkeypatch):
    """(harness, real_model_report, quoted), imported as the scripts import each other."""
    import importlib

    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return tuple(importlib.import_module(name) for name in ("harness", "real_model_report", "quoted"))


def made_up_run(arm, seed, after, code="c0de", before=0.2, truncated=(0.75, 0.5, 0.25, 0.125)):
    """A run file as real_model_compare writes it: 4 rollouts of 4 steps, the truncated fraction logged at each."""
    rows = []
    for step in range(1, 17):
        row = {"step": step, "loss": 0.0, "reward": 0.1 * step, "clip_ratio/region_mean": 0.01}
        if (step - 1) % 4 == 0:
            row["completions/clipped_ratio"] = truncated[(step - 1) // 4]
        rows.append(row)
    run = {
        "arm": arm,
        "seed": seed,
        "learning_rate": 5e-6,
        "model_source": SOURCE,
        "settings": {"steps_per_generation": 4},
        "held_out_before": before,
        "held_out_after": after,
        "curve": [[0, before], [16, after]],
        "step_seconds": [1.0] * 16,
        "step_cpu_seconds": [1.0] * 16,
        "load_average": [1.0, 1.0, 1.0],
        "rows": rows,
    }
    if code is not None:
        run["provenance"] = {"training_code": code, "git": {"commit": "abc", "dirty": False}}
    return run


def write_runs(folder: Path, runs) -> Path:
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    for run in runs:
        name = f"{run['arm'].replace(' ', '_')}-lr5e-06-seed{run['seed']}.json"
        (folder / "runs" / name).write_text(json.dumps(run))
    return folder


#: GRPO's held-out accuracy after training by seed; the other arms are it plus per-seed gaps.
BASE = [0.60, 0.62, 0.58, 0.64]
GAPS = {
    "GSPO paper band": [-0.10, -0.12, -0.08, -0.11],  # GRPO ahead of it, every seed, little spread
    "GSPO band 1e-2": [0.05, -0.06, 0.02, -0.03],  # both signs: level
    "GSPO spread k=1": [0.04, 0.05, 0.03, 0.05],  # ahead of GRPO
}


def study(code_of=lambda arm, seed: "c0de"):
    runs = [made_up_run("GRPO dapo", s, BASE[s], code_of("GRPO dapo", s)) for s in range(4)]
    for arm, gaps in GAPS.items():
        runs += [made_up_run(arm, s, BASE[s] + gaps[s], code_of(arm, s)) for s in range(4)]
    return runs


def test_verdict_words_come_from_the_interval_alone(modules, tmp_path):
    harness, report, _ = modules
    summary = report.report(write_runs(tmp_path, study()))
    pairs = summary["pairs"]
    assert pairs["GRPO dapo vs GSPO paper band"]["verdict"] == "ahead"
    assert pairs["GRPO dapo vs GSPO spread k=1"]["verdict"] == "behind"
    level = pairs["GRPO dapo vs GSPO band 1e-2"]
    assert level["low"] < 0 < level["high"] and level["verdict"] == f"level within ±{level['half_width']:.3f}"
    # the interval itself: mean of the paired differences +- t(0.975, n - 1) x SD / sqrt(n)
    diffs = [-g for g in GAPS["GSPO band 1e-2"]]
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    assert level["n"] == 4 and level["mean"] == pytest.approx(mean)
    assert level["half_width"] == pytest.approx(3.182446305284263 * sd / 2)
    assert json.loads((tmp_path / "summary.json").read_text())["pairs"] == json.loads(json.dumps(pairs))
    table = (tmp_path / "comparison.md").read_text()
    assert f"| GRPO dapo vs GSPO band 1e-2 | {mean:+.3f} |" in table and level["verdict"] in table
    # only the seeds both arms ran are paired; one seed gives no interval, and no word claims one
    assert harness.paired({0: 0.5, 1: 0.6, 2: 0.7}, {1: 0.5, 2: 0.5, 3: 0.1})["n"] == 2
    assert harness.paired({0: 0.5}, {0: 0.4})["verdict"] == "no interval (1 paired seed)"
    # where to put seeds: the fewest n with t(0.975, n - 1) x SD / sqrt(n) <= 0.03 at the SD seen so far
    assert level["sd"] == pytest.approx(sd)
    assert level["seeds_for_target"] == next(
        n for n in range(2, 16) if T975[n - 1] * sd / math.sqrt(n) <= harness.TARGET_HALF_WIDTH
    )
    assert harness.seeds_needed(0.045, 0.03) == 12  # the design's plan: t(11) x 0.045 / sqrt(12) = 0.0286
    assert harness.seeds_needed(0.045, 0.03, most=11) is None
    assert f"| {level['seeds_for_target']} |" in table


def cell(table: str, pair: str, title: str) -> str:
    """The pairs table's cell for `pair` under the column headed `title`."""
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| pair |"))
    row = next(line for line in lines if line.startswith(f"| {pair} |"))
    titles = [c.strip() for c in header.strip("|").split("|")]
    return [c.strip() for c in row.strip("|").split("|")][titles.index(title)]


def test_each_pair_names_its_seeds_whose_runs_ran_on_two_cpus(modules, tmp_path):
    """The CPU is part of a run's provenance; a seed whose two runs ran on different CPUs, or on one model with other
    torch kernels, is listed under the pair (its rollouts differ), and only there."""
    _, report, _ = modules
    amd, intel = (
        {"model": "AMD EPYC", "torch_capability": "AVX512"},
        {"model": "Intel Xeon", "torch_capability": "AVX512"},
    )
    where = {("GSPO band 1e-2", 1): intel, ("GSPO spread k=1", 2): {**amd, "torch_capability": "AVX2"}}
    runs = study()
    for run in runs:
        run["provenance"]["cpu"] = where.get((run["arm"], run["seed"]), amd)
    pairs = report.report(write_runs(tmp_path, runs))["pairs"]
    assert pairs["GRPO dapo vs GSPO band 1e-2"]["seeds_on_two_cpus"] == [1]
    assert pairs["GSPO band 1e-2 vs GSPO spread k=1"]["seeds_on_two_cpus"] == [1, 2]
    assert pairs["GRPO dapo vs GSPO paper band"]["seeds_on_two_cpus"] == []
    table = (tmp_path / "comparison.md").read_text()
    assert "seeds run on two CPUs |" in table
    assert cell(table, "GSPO band 1e-2 vs GSPO spread k=1", "seeds run on two CPUs") == "1, 2"
    assert cell(table, "GRPO dapo vs GSPO paper band", "seeds run on two CPUs") == "none"


def test_each_pair_names_its_seeds_whose_runs_ran_with_two_package_sets(modules, tmp_path):
    """Package versions are part of a run's provenance too; a seed whose two runs ran with different versions (a
    newer transformers in a fresh venv, say) is listed under the pair, and only there, in its own column."""
    _, report, _ = modules
    runs = study()
    for run in runs:
        versions = {"torch": "2.13.0+cpu", "trl": "1.16.0", "transformers": "5.24.0"}
        if (run["arm"], run["seed"]) == ("GSPO spread k=1", 0):
            versions["transformers"] = "5.25.0"
        run["provenance"]["versions"] = versions
    pairs = report.report(write_runs(tmp_path, runs))["pairs"]
    assert pairs["GRPO dapo vs GSPO spread k=1"]["seeds_on_two_package_sets"] == [0]
    assert pairs["GSPO band 1e-2 vs GSPO spread k=1"]["seeds_on_two_package_sets"] == [0]
    assert pairs["GRPO dapo vs GSPO band 1e-2"]["seeds_on_two_package_sets"] == []
    table = (tmp_path / "comparison.md").read_text()
    assert "seeds run on two package sets |" in table
    assert cell(table, "GRPO dapo vs GSPO spread k=1", "seeds run on two package sets") == "0"
    assert cell(table, "GRPO dapo vs GSPO band 1e-2", "seeds run on two package sets") == "none"
    assert cell(table, "GRPO dapo vs GSPO spread k=1", "seeds run on two CPUs") == "none"


def test_the_truncated_fraction_is_reported_per_run_and_per_arm(modules, tmp_path):
    _, report, _ = modules
    summary = report.report(write_runs(tmp_path, study()))
    arm = summary["GRPO dapo lr5e-06"]
    assert arm["truncated_first_rollout"]["mean"] == 0.75
    assert arm["truncated_last_quarter"]["mean"] == 0.125  # the last of the four rollouts
    assert "0.750 [0.750, 0.750] -> 0.125" in (tmp_path / "comparison.md").read_text()


def test_runs_of_different_training_code_are_not_compared_unless_asked(modules, tmp_path, capsys):
    harness, report, _ = modules
    folder = write_runs(tmp_path, study(lambda arm, seed: "0ther" if arm == "GSPO band 1e-2" else "c0de"))
    with pytest.raises(SystemExit) as err:
        report.report(folder)
    assert "different training code" in str(err.value) and "\n" not in str(err.value)
    assert "--allow-mixed-code" in str(err.value) and not (folder / "summary.json").exists()
    summary = report.report(folder, allow_mixed=True)
    assert summary["provenance"]["training_code"] == "mixed" and summary["pairs"]
    grouped = summary["provenance"]["runs_by_training_code"]
    assert sorted(grouped) == ["0ther", "c0de"] and len(grouped["0ther"]) == 4 and len(grouped["c0de"]) == 12
    # some runs without provenance among runs with it: refused the same way
    mixed = write_runs(tmp_path / "mixed", study(lambda arm, seed: None if seed == 3 else "c0de"))
    with pytest.raises(SystemExit, match=harness.NOT_RECORDED):
        report.report(mixed)


def test_runs_without_provenance_are_reported_but_never_paired(modules, tmp_path, capsys):
    """The studies before the regime studies: their tables as before, one line saying why there are no verdicts."""
    _, report, _ = modules
    folder = write_runs(tmp_path, study(lambda arm, seed: None))  # written by a harness that kept no provenance
    summary = report.report(folder)
    assert "pairs" not in summary and "provenance" not in summary
    runs = [json.loads(path.read_text()) for path in sorted((folder / "runs").glob("GRPO_dapo*.json"))]
    assert summary["GRPO dapo lr5e-06"]["held_out_after"]["mean"] == pytest.approx(
        sum(run["held_out_after"] for run in runs) / len(runs)
    )
    assert report.NO_PROVENANCE in capsys.readouterr().out.splitlines()
    assert (tmp_path / "comparison.md").read_text().startswith(report.NO_PROVENANCE)


def compare_results(code_of=lambda variant, seed: "c0de"):
    """compare.py's results ({(model, variant): runs}) with only what the verdicts read: the held-out reward after
    training per seed (BASE plus a gap per variant) and the provenance. The dense variants against GRPO: the paper's
    band behind, the spread ahead; the MoE's replay arm: both signs, level."""
    gaps = {
        ("dense", "GRPO"): [0.0] * 4,
        ("dense", "GSPO"): GAPS["GSPO paper band"],
        ("dense", "GSPO-token"): GAPS["GSPO spread k=1"],
        ("moe", "GRPO"): [0.0] * 4,
        ("moe", "GRPO+R3"): GAPS["GSPO band 1e-2"],
    }
    results = {}
    for (model, variant), gap in gaps.items():
        results[(model, variant)] = [
            {"seed": s, "held_out": BASE[s] + gap[s], "rows": []}
            | ({"provenance": {"training_code": code_of(variant, s)}} if code_of(variant, s) else {})
            for s in range(4)
        ]
    return results


def test_compare_report_pairs_the_held_out_reward_per_model(modules, capsys):
    """compare.py's report (compare_report.py) gives the same verdicts from the same intervals as the real model's."""
    import importlib

    compare_report = importlib.import_module("compare_report")
    pairs = compare_report.held_out_pairs(compare_results())
    assert pairs["dense"]["GRPO vs GSPO"]["verdict"] == "ahead"
    assert pairs["dense"]["GRPO vs GSPO-token"]["verdict"] == "behind"
    level = pairs["moe"]["GRPO vs GRPO+R3"]
    assert level["n"] == 4 and level["verdict"] == f"level within ±{level['half_width']:.3f}"
    assert level["verdict"].startswith("level within ±") and level["low"] < 0 < level["high"]
    text = compare_report.pairs_markdown(pairs)
    assert "\nmoe:\n" in text and f"| GRPO vs GRPO+R3 | {level['mean']:+.3f} |" in text and level["verdict"] in text
    # runs without provenance: reported, never paired unless asked; different training code: one line, unless asked
    old = compare_results(lambda variant, seed: None)
    assert compare_report.held_out_pairs(old) == {}
    assert compare_report.report_common.NO_PROVENANCE in capsys.readouterr().out
    assert compare_report.held_out_pairs(old, allow_mixed=True)["dense"]["GRPO vs GSPO"]["verdict"] == "ahead"
    with pytest.raises(SystemExit, match="different training code"):
        compare_report.held_out_pairs(compare_results(lambda variant, seed: "0ther" if variant == "GSPO" else "c0de"))


def test_a_run_file_carries_its_provenance(modules, tmp_path):
    harness, _, _ = modules
    from trl_gspo import GSPOConfig

    args = GSPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", epsilon=1e-2)
    held_out = {"name": "addition test split", "shuffle_seed": 4321, "size": 1000}
    record = harness.provenance(harness.resolved_config(args), held_out, harness.Clock(), threads=1)
    assert {"git", "versions", "cpu", "threads", "config", "held_out", "wall_seconds", "cpu_seconds"} <= set(record)
    assert set(record["git"]) == {"commit", "dirty"}
    assert {"python", "torch", "trl", "transformers", "accelerate", "datasets", "trl-gspo"} <= set(record["versions"])
    assert record["versions"]["torch"] and record["cpu"]["torch_capability"]
    assert record["config"]["epsilon"] == 0.01 and record["config"]["importance_sampling_level"] == "sequence"
    assert "output_dir" not in record["config"] and str(tmp_path) not in json.dumps(record)  # no machine paths
    assert len(record["training_code"]) == 64 and "trl_gspo.trainer" in record["training_modules"]
    assert not harness.LOCATING_MODULES & set(record["training_modules"])


def test_the_training_code_hash_follows_training_sources_only(modules, tmp_path):
    harness, _, _ = modules

    def module(name, text):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        return types.SimpleNamespace(__file__=str(path))

    loaded = {
        "trl_gspo.trainer": module("trainer", "a = 1\n"),
        "trl_gspo.common.model_store": module("model_store", "where = 'hub'\n"),
        "trl": module("trl", "x = 1\n"),
    }
    first = harness.training_code(loaded)
    assert first["modules"] == ["trl_gspo.trainer"]
    Path(loaded["trl_gspo.common.model_store"].__file__).write_text("where = 'gguf'\n")  # locating the model only
    Path(loaded["trl"].__file__).write_text("x = 2\n")  # not trl-gspo's code (its version is recorded)
    assert harness.training_code(loaded) == first
    Path(loaded["trl_gspo.trainer"].__file__).write_text('"""A docstring."""\n\n# a comment\na = 1  # why\n')
    assert harness.training_code(loaded) == first  # docstrings and comments are not code
    Path(loaded["trl_gspo.trainer"].__file__).write_text("a = 2\n")
    assert harness.training_code(loaded)["sha256"] != first["sha256"]
    assert harness.training_code(sys.modules)["sha256"] != first["sha256"]


def test_git_state_without_git_says_so(modules, tmp_path, monkeypatch):
    harness, _, _ = modules
    assert harness.git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert harness.git_state() == {"commit": None, "dirty": None}


# ------------------------------------------------------------------------------------ the docs' verdict words
def test_a_verdict_word_that_disagrees_with_the_report_fails_the_check(modules, tmp_path):
    _, report, quoted = modules
    summary = report.report(write_runs(tmp_path / "results" / "s", study()))
    level = summary["pairs"]["GRPO dapo vs GSPO band 1e-2"]["verdict"]
    doc = tmp_path / "guide.md"
    link = 'results/s/summary.json "pairs.GRPO dapo vs {}.verdict"'
    text = (
        f"GRPO is [ahead]({link.format('GSPO paper band')}) of the paper's band and [{level}]({link.format('GSPO band 1e-2')})"
        f' with band 1e-2, by [0.10](results/s/summary.json "pairs.GRPO dapo vs GSPO paper band.mean").\n'
    )
    doc.write_text(text)
    assert quoted.problems([doc]) == []
    doc.write_text(text.replace("[ahead]", "[behind]"))  # a word changed
    found = quoted.problems([doc])
    assert len(found) == 1 and "quotes 'behind'" in found[0] and "gives 'ahead'" in found[0]
    assert quoted.write([doc]) == 0 and len(quoted.problems([doc])) == 1  # a changed word waits for a reread
    assert quoted.write([doc], flips=True) == 1 and doc.read_text() == text  # then rewritten from the report
    doc.write_text(text.replace(level, "level within ±0.001"))  # the half-width changed
    assert len(quoted.problems([doc])) == 1
    assert quoted.write([doc]) == 1 and doc.read_text() == text  # the same word: rewritten without asking
    doc.write_text(text.replace("vs GSPO paper band.verdict", "vs GSPO nothing.verdict"))  # no such pair
    found = quoted.problems([doc])
    assert len(found) == 1 and "KeyError" in found[0] and "GSPO nothing" in found[0]
    doc.write_text(text + "\nGSPO is level within ±0.05 of GRPO.\n")  # a verdict written, not quoted
    found = quoted.problems([doc])
    assert len(found) == 1 and "'level within ±0.05' links to no report" in found[0]
    doc.write_text(text + "\nGRPO is ahead of GSPO, and band 1e-2 level with it.\n")  # bare comparative words
    assert quoted.problems([doc], verdict_docs=[]) == []  # allowed in a doc that gives no verdicts
    found = quoted.problems([doc], verdict_docs=[doc])
    assert [line.split(": ", 1)[1] for line in found] == [
        "'ahead' links to no report",
        "'level with' links to no report",
    ]
    named = 'The words "ahead" and "behind" come from [the design](real-model.md#the-studies-behind-this-guide).\n'
    doc.write_text(text + named)  # a word named in quotation marks, or part of an anchor, is not a verdict
    assert quoted.problems([doc], verdict_docs=[doc]) == []


def test_each_run_makes_the_missing_run_files_and_reads_back_the_rest(modules, tmp_path):
    harness, _, _ = modules
    made = []

    def produce(item, path):
        made.append(item)
        if item == "child":  # a child process writes its own file
            path.write_text(json.dumps({"by": "child"}))
            return None
        return {"by": "parent", "item": item}

    harness.write_json(tmp_path / "old.json", {"by": "earlier"})
    plan = ["old", "new", "child"]
    runs = harness.each_run(plan, lambda item: tmp_path / f"{item}.json", produce, jobs=2)
    assert sorted(made) == ["child", "new"]
    assert runs == [{"by": "earlier"}, {"by": "parent", "item": "new"}, {"by": "child"}]  # plan order
    assert harness.each_run(plan, lambda item: tmp_path / f"{item}.json", produce, reuse=False)[0]["by"] == "parent"


def test_a_quoted_key_may_hold_a_dot(modules, tmp_path):
    """A pair at a learning rate such as 1.5e-05 has a dot in its key; the dotted path still finds it."""
    _, _, quoted = modules
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"pairs": {"A vs B at lr1.5e-05": {"verdict": "ahead"}}, "runs": [{"n": 3}]}))
    assert quoted.lookup(path, "pairs.A vs B at lr1.5e-05.verdict") == "ahead"
    assert quoted.lookup(path, "runs.0.n") == 3
    with pytest.raises(KeyError):
        quoted.lookup(path, "pairs.A vs C.verdict")


def test_the_short_study_plans_the_seeds_its_design_gives_each_arm(modules):
    """docs/real-model.md's design: seeds 0-11 for the close pairs' arms, 0-7 for the paper's band, 0-3 for k = 2,
    seed 0 for stock TRL's GSPO (the parity check), seed by seed; seeds asked for by name run for every arm asked
    for. The long and stale studies run the controller (clip_target_fraction) at seed 0 only."""
    import importlib

    compare = importlib.import_module("real_model_compare")
    study = compare.STUDIES["regime-short"]
    plan = compare.study_plan(study, study["arms"])
    per_arm = {arm: [seed for a, _, seed in plan if a == arm] for arm in study["arms"]}
    assert per_arm["GRPO dapo"] == per_arm["GSPO spread k=1"] == list(range(12))
    assert per_arm["GSPO paper band"] == list(range(8)) and per_arm["GSPO spread k=2"] == list(range(4))
    assert per_arm["stock GSPO"] == [0]
    assert len(plan) == 4 * 12 + 8 + 4 + 1
    assert [seed for _, _, seed in plan] == sorted(seed for _, _, seed in plan)  # whole seeds first
    asked = compare.study_plan(study, ["GSPO spread k=2"], seeds=[5, 6])
    assert asked == [("GSPO spread k=2", 5e-6, 5), ("GSPO spread k=2", 5e-6, 6)]
    for name, seeds in (("regime-stale", 6), ("regime-long", 4)):
        other = compare.STUDIES[name]
        plan = compare.study_plan(other, other["arms"])
        assert [seed for arm, _, seed in plan if arm == "GSPO target 0.15"] == [0]
        assert [seed for arm, _, seed in plan if arm == "GRPO dapo"] == list(range(seeds))


def test_stock_trl_and_its_trl_gspo_arm_are_checked_for_identity_not_paired(modules, tmp_path):
    """`parity`: the same per-step rewards and lengths are the same rollouts, a loss that differs by rounding is
    measured but does not make them differ; one step's reward, one held-out answer or a missing step is found and
    measured; stock's arm stays out of the paired verdicts."""
    _, report, _ = modules
    ours = [made_up_run("GSPO paper band", s, 0.5 + 0.01 * s) for s in range(3)]
    stock = [made_up_run("stock GSPO", s, 0.5 + 0.01 * s) for s in range(2)]
    for run in ours + stock:
        run["held_out_scores_after"] = [1.0, 0.0, 1.0, 1.0]
    stock[1]["step_cpu_seconds"] = [2.0] * 16
    for step, row in enumerate(stock[0]["rows"]):
        row["loss"] = ours[0]["rows"][step]["loss"] = 0.1 * step
    stock[0]["rows"][3]["loss"] += 3e-7
    others = [made_up_run("GRPO dapo", s, 0.6) for s in range(3)]
    summary = report.report(write_runs(tmp_path / "same", ours + stock + others))
    same = summary["parity"]["GSPO paper band vs stock GSPO at lr5e-06"]
    assert same["same_rollouts"] and same["same_held_out_scores"]
    assert same["seeds"] == [0, 1] and same["steps_compared"] == 32
    assert same["held_out_problems_scored_differently"] == 0
    assert same["largest_step_difference"]["loss"] == pytest.approx(3e-7) and same["median_abs_loss"] == 0.0
    assert same["cpu_seconds_per_step_ratio"] == pytest.approx((1.0 + 0.5) / 2)
    assert list(summary["pairs"]) == ["GRPO dapo vs GSPO paper band"]
    assert (
        "| GSPO paper band vs stock GSPO at lr5e-06 | 0, 1 | yes |" in (tmp_path / "same" / "comparison.md").read_text()
    )

    stock[0]["rows"][5]["reward"] += 0.25
    stock[1]["held_out_scores_after"][2] = 0.0
    summary = report.report(write_runs(tmp_path / "differ", ours + stock))
    differ = summary["parity"]["GSPO paper band vs stock GSPO at lr5e-06"]
    assert not differ["same_rollouts"] and not differ["same_held_out_scores"]
    assert differ["held_out_problems_scored_differently"] == 1
    assert differ["largest_step_difference"]["reward"] == pytest.approx(0.25)
    assert differ["largest_step_difference"]["completions/mean_length"] == 0.0
    del stock[0]["rows"][-1]
    differ = report.report(write_runs(tmp_path / "short", ours + stock))["parity"]
    assert differ["GSPO paper band vs stock GSPO at lr5e-06"]["largest_step_difference"]["loss"] == "inf"
