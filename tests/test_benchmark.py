"""`benchmarks/run.py --tiny` runs every scenario end to end and writes one well-formed file per scenario, with the
date, commit, machine and every repetition (numbers are not asserted: timings on a shared CI machine mean nothing; the
real comparison is the benchmark run itself). Two repetitions, so the medians really pool several runs."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PY = os.path.join(ROOT, "benchmarks", "run.py")


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, RUN_PY, "--tiny", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


#: The scenarios in three runs, which pytest-xdist's workers take side by side (one run of all of them was the suite's
#: longest test): the real model as `make demo` types it (the costliest scenario alone), the tiny models, and SmolLM2's
#: tokenizer and vocabulary on a shrunk model. The vLLM ones are skipped here (vLLM's CPU build only).
GROUPS = {
    "demo": ("demo", "demo_real_vllm"),
    "tiny": (
        "demo_copy",
        "loss_path",
        "equal_settings",
        "equal_settings_no_diagnostics",
        "sampler_logprobs",
        "logprob_memory",
        "async",
        "long_tail",
        "long_prompt",
        "demo_vllm",
        "vllm_generation",
    ),
    "real": (
        "real_equal_settings",
        "real_sampler_logprobs",
        "real_fast_settings",
        "real_long_tail",
        "real_long_prompt",
    ),
}


def test_the_groups_hold_every_scenario_once():
    """A scenario added to the registry joins a group, or no test runs it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from scenarios.registry import SCENARIOS

    names = [name for group in GROUPS.values() for name in group]
    assert sorted(names) == sorted(SCENARIOS) and len(names) == len(set(names))


@pytest.mark.parametrize("group", list(GROUPS))
def test_tiny_run_writes_one_file_per_scenario(tmp_path, group):
    """Every scenario end to end, a group per test. `demo` trains the real model (SmolLM2-135M-Instruct, prepared by
    make test) for two steps because that scenario is `make demo` as typed: that model, torch's own thread count, every
    core, which its record must say; the `real_*` scenarios run SmolLM2's tokenizer, template and vocabulary on a
    shrunk random model."""
    from trl_gspo.forward import fused_head

    names = set(GROUPS[group])
    proc = _run("--reps", "2", "--results-dir", str(tmp_path), "--scenarios", ",".join(GROUPS[group]))
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    padding_path = fused_head.available()  # TRL < 1.15: padding removal is off, so the layout scenarios are skipped
    layouts = {"long_tail", "long_prompt"} if padding_path else set()
    expected = {"demo", "demo_copy", "loss_path", "equal_settings", "equal_settings_no_diagnostics", "sampler_logprobs"}
    expected |= {"logprob_memory", "async"} | layouts
    real = _real_model_scenarios(padding_path)  # SmolLM2 where it is prepared (make test prepares it), else skipped
    expected = (expected | real) & names
    assert {os.path.basename(p) for p in summary["written"]} == {f"{name}.json" for name in expected}
    assert set(summary["skipped"]) >= {"demo_vllm", "demo_real_vllm", "vllm_generation"} & names  # vLLM's CPU build
    files = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in expected}
    for name, record in files.items():
        assert record["scenario"] == name and record["what"] and record["date"].startswith("20")
        assert record["command"].startswith("python benchmarks/run.py --tiny")
        assert len(record["commit"]) == 40 and isinstance(record["uncommitted_changes"], bool)
        machine = record["machine"]
        assert machine["cpu_count"] > 0 and len(machine["load_average_before"]) == 3 and machine["omp_num_threads"]
        assert record["versions"]["trl"] and record["settings"]["tiny"] is True and _positive(record["wall_seconds"])
    report = {name: record["result"] for name, record in files.items()}
    if group == "demo":
        _check_demo(report)
    elif group == "tiny":
        _check_tiny_models(report, proc.stderr, padding_path)
    else:
        _check_real(report, summary["skipped"], real)


def _check_demo(report: dict) -> None:
    demo = report["demo"]  # the real model as typed: torch's threads, every core
    assert demo["seeds"] == [0] and demo["runs"][0]["steps"] == 2 and demo["runs"][0]["eval_prompts"] == 4
    assert demo["runs"][0]["threads_from"] == "torch's default"  # no thread count imposed on a real model
    assert 0 <= demo["after_min"] <= 1 and _positive(demo["median_end_to_end_seconds"])


def _check_tiny_models(report: dict, log: str, padding_path: bool) -> None:
    from trl_gspo.forward import fused_head

    copy = report["demo_copy"]  # the demo's settings on a tiny copy of the model, its own thread choice
    assert copy["seeds"] == [0] and copy["runs"][0]["steps"] == 4 and copy["runs"][0]["eval_prompts"] == 8
    assert copy["runs"][0]["threads"] == 1 and "the demo's choice" in copy["runs"][0]["threads_from"]  # as typed
    assert 0 <= copy["after_min"] <= 1 and _positive(copy["median_end_to_end_seconds"])
    lp = report["loss_path"]
    assert lp["iters"] > 0 and _positive(lp["ratio_seconds"]) and _positive(lp["ratio_cpu_seconds"])
    assert _positive(lp["ratio_seconds_no_diagnostics"]) and _positive(lp["ratio_cpu_seconds_no_diagnostics"])
    assert _positive(lp["ratio_untrimmed_cpu_seconds"])
    assert {kind: len(times) for kind, times in lp["runs"].items()} == dict.fromkeys(
        ("stock", "ours", "ours_no_diagnostics", "ours_untrimmed"), lp["iters"]
    )  # every repetition, not only the medians
    runs = (
        ("equal_settings", "recompute", True),
        ("equal_settings_no_diagnostics", "recompute", False),
        ("sampler_logprobs", "sampler", True),
    )
    for name, source, diagnostics in runs:
        sc = report[name]
        assert sc["old_logprobs_source"] == source and sc["diagnostics"] is diagnostics
        for side in ("stock", "ours"):
            assert _positive(sc[side]["seconds_per_step"]) and _positive(sc[side]["completion_tokens_per_s"])
            assert _positive(sc[side]["cpu_seconds_per_step"])
            assert sc[side]["completion_tokens"] > 0 and sc[side]["peak_memory_bytes"] >= 0
            assert len(sc["runs"][side]) == 2
        assert sc["stock"]["old_logprob_pass_seconds_per_step"] > 0  # stock always recomputes pi_old here
        assert 0 < sc["stock_old_logprob_pass_share"] < 1
        assert _positive(sc["ratio_seconds_per_step"]) and _positive(sc["ratio_completion_tokens_per_s"])
        ratio = sc["ours"]["seconds_per_step"] / sc["stock"]["seconds_per_step"]
        assert math.isclose(sc["ratio_seconds_per_step"], ratio)
    mem = report["logprob_memory"]
    chunked = {"ours_chunked"} if fused_head.available() else set()  # TRL < 1.15: no fused head to tile
    assert set(mem["peak_memory_bytes"]) == {"stock", "ours", "naive"} | chunked
    assert all(v >= 0 for v in mem["peak_memory_bytes"].values())  # tiny sizes may fit in freed heap
    assert mem["full_fp32_logits_bytes"] == mem["vocab"] * mem["completion_tokens"] * 4
    _check_async(report["async"])
    if not padding_path:
        assert "long_tail skipped" in log
        return
    shapes = {"long_tail": ("long_tail", "long_tail_one_micro_batch"), "long_prompt": ("long_prompt",)}
    variants = {
        "long_tail": {"defaults", "trim_sort", "packed", "no_sharing"},
        "long_prompt": {"shared", "group_minibatches", "no_sharing"},
    }
    for scenario, keys in shapes.items():
        assert set(report[scenario]) == set(keys)
        for key in keys:
            lt = report[scenario][key]
            assert set(lt["runs"]) == {"stock"} | variants[scenario]
            assert all(len(v) == 2 for v in lt["runs"].values())
            for variant in variants[scenario]:
                sc = lt[variant]
                assert _positive(sc["ratio_seconds_per_step"]) and _positive(sc["ratio_cpu_seconds_per_step"])
                assert 0 < sc["stock_padding_fraction"] < 1  # the long-tailed rollouts do pad
                assert 0 < sc["ratio_positions"] < 1  # and the variant ran on fewer positions than stock
                assert sc["prompt_tokens_saved_per_step"] >= 0
                assert _positive(lt["median"][variant]["train_tokens_per_s"])
                ratio = lt["median"][variant]["seconds_per_step"] / lt["median"]["stock"]["seconds_per_step"]
                assert math.isclose(sc["ratio_seconds_per_step"], ratio)
            # identical rollouts: every run of every trainer saw the same completion tokens
            assert len({(r["completion_tokens"], r["train_tokens"]) for runs in lt["runs"].values() for r in runs}) == 1
        if scenario == "long_prompt":  # the no-grad pass shares each group's prompt; with sharing off nothing is saved
            assert (
                lt["shared"]["prompt_tokens_saved_per_step"] > 0
                and lt["no_sharing"]["prompt_tokens_saved_per_step"] == 0
            )


def _real_model_scenarios(padding_path: bool) -> set[str]:
    """The real-model scenarios this machine runs: none without the model, the layout ones only with padding removal."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from scenarios import real_model

    if real_model.unavailable() is not None:
        return set()
    return {"real_equal_settings", "real_sampler_logprobs", "real_fast_settings"} | (
        {"real_long_tail", "real_long_prompt"} if padding_path else set()
    )


def _check_real(report: dict, skipped: dict, real: set[str]) -> None:
    """The real-model scenarios name the copy measured, time generation in both trainers (a generation floor), and
    run the extra shared-prefill arm where it is one; without the model they are skipped with the reason."""
    if not real:
        assert {"real_equal_settings", "real_sampler_logprobs"} <= set(skipped)
        assert "trl-gspo models prepare" in skipped["real_equal_settings"]  # the one line that says how to get it
        return
    for name in ("real_equal_settings", "real_sampler_logprobs", "real_fast_settings"):
        sc = report[name]
        assert sc["model"].startswith("HuggingFaceTB/SmolLM2-135M-Instruct") and sc["model_shape"]["model"] == "smollm2"
        assert sc["stock"]["generation_cpu_seconds_per_step"] > 0 and sc["ours"]["generation_cpu_seconds_per_step"] > 0
        assert 0 < sc["stock_generation_share"] < 1 and 0 < sc["generation_floor"] < 2
        floor = sc["ours"]["generation_cpu_seconds_per_step"] / sc["stock"]["cpu_seconds_per_step"]
        assert math.isclose(sc["generation_floor"], floor)
    extra = report["real_equal_settings"]
    assert set(extra["runs"]) == {"stock", "ours", "shared_prefill"} and len(extra["runs"]["shared_prefill"]) == 2
    ratio = extra["shared_prefill"]["cpu_seconds_per_step"] / extra["stock"]["cpu_seconds_per_step"]
    assert math.isclose(extra["ratio_cpu_seconds_per_step_shared_prefill"], ratio)
    assert set(report["real_sampler_logprobs"]["runs"]) == {"stock", "ours"}
    fast = report["real_fast_settings"]  # ours with every speed option, against the same stock
    assert fast["ours_settings"] == {"group_minibatches": True, "shared_prefill": True}
    assert fast["old_logprobs_source"] == "sampler" and report["real_equal_settings"]["ours_settings"] == {}
    for name in real & {"real_long_tail", "real_long_prompt"}:
        key, variant = ("long_tail", "defaults") if name == "real_long_tail" else ("long_prompt", "shared")
        lt = report[name][key]
        assert _positive(lt[variant]["ratio_cpu_seconds_per_step"]) and 0 < lt[variant]["ratio_positions"] < 1
        assert lt[variant]["generation_floor"] == 0  # identical rollouts from a rollout_func: nothing generated
        # the rollouts carry the chat-templated prompts: the template's system prompt makes them tens of tokens
        assert min(r["mean_prompt_tokens"] for r in lt["runs"]["stock"]) > 20


def _check_async(sc: dict) -> None:
    assert set(sc["runs"]) == {"sync", "async_staleness1", "async_staleness2"}
    assert 0 < sc["generation_share"] < 1 and 0.5 <= sc["floor_ratio"] < 1
    assert sc["median"]["sync"]["generation_seconds_per_step"] > 0  # measured inside the synchronous step
    for kind in ("async_staleness1", "async_staleness2"):
        # generation left the main thread: TRL's generation call there only hands over the finished completions
        assert (
            sc["median"][kind]["generation_seconds_per_step"]
            < 0.1 * sc["median"]["sync"]["generation_seconds_per_step"]
        )
        assert _positive(sc[kind]["ratio_seconds_per_step"]) and _positive(sc[kind]["ratio_over_floor"])
        ratio = sc["median"][kind]["seconds_per_step"] / sc["median"]["sync"]["seconds_per_step"]
        assert math.isclose(sc[kind]["ratio_seconds_per_step"], ratio)


def test_out_writes_every_scenario_into_one_file_and_unknown_names_fail(tmp_path):
    """`--out FILE` (what make gpu-check reads): one file, the scenarios under "scenarios"."""
    out = tmp_path / "one.json"
    proc = _run("--scenarios", "logprob_memory", "--out", str(out))
    assert json.loads(proc.stdout.strip().splitlines()[-1])["written"] == []
    report = json.loads(out.read_text())
    assert set(report["scenarios"]) == {"logprob_memory"} and report["settings"]["tiny"] is True
    bad = subprocess.run([sys.executable, RUN_PY, "--scenarios", "equal_setings"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown ['equal_setings']" in bad.stderr


def test_mfu_peak_tells_form_factors_apart():
    """torch.cuda.get_device_name() of each part -> its dense bf16 peak: NVL and PCIe parts must not get the SXM one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    expected = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H200": 989e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA GeForce RTX 4090": None,
    }
    assert {name: run.bf16_peak_flops(name) for name in expected} == expected


def test_results_hold_one_file_per_scenario_and_nothing_else():
    """benchmarks/results/: `<scenario>.json` for every scenario of the registry (history is git's), each naming its
    scenario and carrying its date, commit and machine; gpu-check's and a GPU run's folders beside them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run_files", RUN_PY)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    results = os.path.join(ROOT, "benchmarks", "results")
    names = sorted(os.listdir(results))
    assert [n for n in names if n not in ("gpu-check", "cuda")] == sorted(f"{name}.json" for name in run.SCENARIOS)
    for name in run.SCENARIOS:
        with open(os.path.join(results, f"{name}.json")) as f:
            record = json.load(f)
        assert record["scenario"] == name and record["date"] and record["commit"] and record["machine"]["cpu_count"]
        assert record["settings"]["tiny"] is False and record["result"]
