"""GSPO with and without dynamic sampling (DAPO), same seeds, on two toy tasks fixed before any result was seen.

    python benchmarks/compare.py --experiment dynamic-sampling --output-dir outputs/dynamic-sampling
    python benchmarks/compare.py --experiment dynamic-sampling --output-dir /tmp/ds --seeds 0 --max-steps 8 --tiny

Tasks (EXPERIMENT, fixed in advance): `copy3`, the offline demo (trl_gspo.cli.demo: copy three digits, shaped reward,
its own config and held-out split), 1000 optimizer steps; `copy5`, the same task with five digits (compare.CopyTask:
held-out prompts are the digit strings whose digit sum is a multiple of 7), 1500 steps. Arms: `GSPO` (the demo
config) and `GSPO+DS` (the same plus `dynamic_sampling=True` with its defaults: `max_sampling_rounds=4`,
`dynamic_sampling_underfill="shrink"`). Seeds 0-4; both arms of a seed start from the same weights and data.

Measured per run: the held-out reward (greedy, 200 unseen prompts) every 100 optimizer steps, against the step and
against the training seconds so far (evaluation time excluded); completion tokens generated, trained on (what the
loss sees), and trained on in groups with reward spread ("signal": the only ones with a non-zero advantage); every
metric TRL logs. Writes to the output folder: `runs/<task>-<arm>-<seed>/result.json` (reused with `--resume`),
`runs.json`, `summary.json`, `dynamic_sampling.md` (the table) and `dynamic_sampling.png` (the curves). Arms of a
seed run back to back in one process, so a busy machine slows both about alike; wall-clock figures are still only
as good as the machine was quiet.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict

from copy_task import CopyTask  # beside this file (compare.py, which runs this experiment, puts it on sys.path)
from report_common import mean, number  # beside this file (statistics shared by the experiments' reports)

#: The experiment, fixed before any result was looked at.
EXPERIMENT = dict(
    arms={"GSPO": {}, "GSPO+DS": {"dynamic_sampling": True}},
    seeds=(0, 1, 2, 3, 4),
    tasks={"copy3": dict(digits=3, max_steps=1000), "copy5": dict(digits=5, max_steps=1500)},
    num_prompts=2000,
    eval_prompts=200,
    eval_every=100,
    thresholds=(0.5, 0.9),  # held-out reward levels for "steps / seconds to reach"
)
COLORS = {"GSPO": "tab:blue", "GSPO+DS": "tab:orange"}


def load_task(name: str, digits: int):
    if digits == 3:
        import trl_gspo.cli.demo as demo  # the demo itself: its dataset, held-out split, reward and evaluation

        return demo
    return CopyTask(digits)


class HeldOutCurve:
    """TrainerCallback: held-out reward at step 0 and every `every` optimizer steps (and the last), with the training
    seconds elapsed, wall clock and this process's CPU time (evaluation excluded from both). On a machine shared with
    other jobs the CPU time is the steadier measure of cost: waiting for a core does not count."""

    def __init__(self, evaluate, every: int):
        from transformers import TrainerCallback

        self.evaluate, self.every, self.points = evaluate, every, []
        self.start, self.excluded, self.cpu_start, self.cpu_excluded = None, 0.0, None, 0.0
        curve = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                curve.start, curve.cpu_start = time.perf_counter(), time.process_time()
                curve.point(0)

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % curve.every == 0 or state.global_step == state.max_steps:
                    curve.point(state.global_step)

        self.callback = Callback()

    def point(self, step: int) -> None:
        began, cpu_began = time.perf_counter(), time.process_time()
        seconds, cpu_seconds = began - self.start - self.excluded, cpu_began - self.cpu_start - self.cpu_excluded
        score = self.evaluate()
        self.excluded += time.perf_counter() - began
        self.cpu_excluded += time.process_time() - cpu_began
        self.points.append({"step": step, "seconds": seconds, "cpu_seconds": cpu_seconds, "held_out": score})

    @property
    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.excluded


class TokenCounter:
    """Completion tokens generated (every sampling call), trained on (every scored training batch), and trained on in
    groups whose advantages are not all zero."""

    def __init__(self, trainer):
        self.generated = self.trained = self.signal = 0
        generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions
        g = trainer.num_generations

        def counting_generate(*args, **kwargs):
            completion_ids, logprobs = generate(*args, **kwargs)
            if trainer.model.training:
                self.generated += sum(len(ids) for ids in completion_ids)
            return completion_ids, logprobs

        def counting_score(inputs):
            out = score(inputs)
            if trainer.model.training:
                mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
                tokens = mask.sum(1).float()
                spread = (out["advantages"].view(-1, g) != 0).any(1).repeat_interleave(g)
                self.trained += int(tokens.sum())
                self.signal += int(tokens[spread].sum())
            return out

        trainer._generate_single_turn, trainer._generate_and_score_completions = counting_generate, counting_score

    def totals(self) -> dict:
        return {"generated": self.generated, "trained": self.trained, "signal": self.signal}


def train_one(
    task, arm: str, seed: int, max_steps: int, completion_length: int, output_dir: str, tiny: bool, spec: dict
) -> dict:
    import torch

    from trl_gspo import GSPOTrainer

    torch.set_num_threads(1)
    overrides = dict(
        seed=seed,
        max_steps=max_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        max_completion_length=completion_length,
        **spec["arms"][arm],
    )
    if tiny:
        overrides.update(per_device_train_batch_size=4, num_generations=4)
    args = task.demo_config(output_dir, **overrides)
    model, tokenizer = task.build_demo_model(seed=seed)
    train_set = task.make_demo_dataset(spec["num_prompts"], seed=seed)
    held_out = task.make_demo_dataset(spec["eval_prompts"], seed=seed, split="test")
    trainer = GSPOTrainer(model, task.demo_reward, args=args, train_dataset=train_set, processing_class=tokenizer)
    tokens = TokenCounter(trainer)
    curve = HeldOutCurve(lambda: task.evaluate(trainer.model, tokenizer, held_out), spec["eval_every"])
    trainer.add_callback(curve.callback)
    trainer.train()
    rows = [dict(row) for row in trainer.state.log_history if "step" in row and "train_runtime" not in row]
    return {
        "arm": arm,
        "seed": seed,
        "points": curve.points,
        "train_seconds": curve.train_seconds,
        "tokens": tokens.totals(),
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- summary


def first_reaching(points, threshold: float, key: str):
    """First `key` (step or seconds) at which the held-out reward reached `threshold`, or None."""
    return next((p[key] for p in points if p["held_out"] >= threshold), None)


def held_out_at(points, seconds: float, clock: str = "seconds") -> float:
    """Held-out reward at `seconds` of training (`clock`: "seconds" wall, "cpu_seconds" CPU), linearly between
    evaluations (the last one if the run ended before)."""
    times, values = [p[clock] for p in points], [p["held_out"] for p in points]
    if seconds >= times[-1]:
        return values[-1]
    i = next(i for i, t in enumerate(times) if t >= seconds)
    if i == 0:
        return values[0]
    return values[i - 1] + (values[i] - values[i - 1]) * (seconds - times[i - 1]) / (times[i] - times[i - 1])


def summarize(runs: list[dict], thresholds, arms) -> dict:
    """Per arm of one task: held-out reward, time and steps to thresholds, token ratios, dynamic-sampling metrics.
    `held_out_at_baseline_seconds`: each run's held-out reward at the training seconds the first arm's run of the same
    seed took in all (arms of a seed ran back to back, so they saw about the same machine load)."""
    out = {}
    by_arm = {arm: [run for run in runs if run["arm"] == arm] for arm in arms}
    by_arm = {arm: group for arm, group in by_arm.items() if group}
    first = next(iter(by_arm.values()))
    baseline = {run["seed"]: run["points"][-1]["seconds"] for run in first}
    baseline_cpu = {run["seed"]: run["points"][-1].get("cpu_seconds") for run in first}
    for arm, group in by_arm.items():
        finals = [run["points"][-1]["held_out"] for run in group]
        rows = [row for run in group for row in run["rows"]]
        entry = {
            "seeds": [run["seed"] for run in group],
            "steps": mean(run["points"][-1]["step"] for run in group),
            "held_out_final": mean(finals),
            "held_out_final_min_max": [min(finals), max(finals)],
            "held_out_mean_over_run": mean(mean(p["held_out"] for p in run["points"][1:]) for run in group),
            "held_out_at_baseline_seconds": mean(
                held_out_at(run["points"], baseline[run["seed"]]) for run in group if run["seed"] in baseline
            ),
            "held_out_at_baseline_cpu_seconds": mean(
                held_out_at(run["points"], baseline_cpu[run["seed"]], "cpu_seconds")
                for run in group
                if baseline_cpu.get(run["seed"]) is not None and "cpu_seconds" in run["points"][-1]
            ),
            "cpu_seconds_per_step": mean(
                run["points"][-1].get("cpu_seconds", math.nan) / max(run["points"][-1]["step"], 1) for run in group
            ),
            "train_seconds": mean(run["train_seconds"] for run in group),
            "seconds_per_step": mean(run["train_seconds"] / max(run["points"][-1]["step"], 1) for run in group),
            "generated_per_trained_token": mean(
                r["tokens"]["generated"] / max(r["tokens"]["trained"], 1) for r in group
            ),
            "generated_per_signal_token": mean(r["tokens"]["generated"] / max(r["tokens"]["signal"], 1) for r in group),
            "frac_reward_zero_std": mean(row.get("frac_reward_zero_std") for row in rows),
            "rounds": mean(row.get("dynamic_sampling/rounds") for row in rows),
            "underfilled": mean(row.get("dynamic_sampling/underfilled") for row in rows),
            "batch_fill": mean(row.get("dynamic_sampling/batch_fill") for row in rows),
        }
        for threshold in thresholds:
            for key, name in (("step", "steps"), ("seconds", "seconds"), ("cpu_seconds", "cpu_seconds")):
                if not all(key in run["points"][-1] for run in group):
                    continue
                reached = [first_reaching(run["points"], threshold, key) for run in group]
                hit = [v for v in reached if v is not None]
                entry[f"{name}_to_{threshold}"] = {
                    "median_of_reached": statistics.median(hit) if hit else None,
                    "reached": f"{len(hit)}/{len(group)}",
                }
        out[arm] = entry
    return out


def table(summary: dict, thresholds) -> str:
    fmt = number
    head = [
        "task",
        "arm",
        "seeds",
        "held-out final (min..max)",
        "held-out mean over run",
        "held-out at the plain run's seconds",
        "... CPU seconds",
    ]
    head += [f"steps to {t} (reached)" for t in thresholds] + [f"CPU s to {t}" for t in thresholds]
    head += [
        "train s",
        "s/step",
        "CPU s/step",
        "generated / trained tokens",
        "generated / signal tokens",
        "frac_reward_zero_std",
        "rounds",
        "underfilled",
        "batch fill",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, arms in summary.items():
        for arm, s in arms.items():
            low, high = s["held_out_final_min_max"]
            cells = [
                task,
                arm,
                str(len(s["seeds"])),
                f"{fmt(s['held_out_final'])} ({fmt(low)}..{fmt(high)})",
                fmt(s["held_out_mean_over_run"]),
                fmt(s["held_out_at_baseline_seconds"]),
                fmt(s["held_out_at_baseline_cpu_seconds"]),
            ]
            for t in thresholds:
                v = s[f"steps_to_{t}"]
                cells.append(f"{fmt(v['median_of_reached'], 0)} ({v['reached']})")
            for t in thresholds:
                v = s.get(f"cpu_seconds_to_{t}", {"median_of_reached": None, "reached": "-"})
                cells.append(f"{fmt(v['median_of_reached'], 1)} ({v['reached']})")
            cells += [
                fmt(s["train_seconds"], 1),
                fmt(s["seconds_per_step"], 4),
                fmt(s["cpu_seconds_per_step"], 4),
                fmt(s["generated_per_trained_token"], 2),
                fmt(s["generated_per_signal_token"], 2),
                fmt(s["frac_reward_zero_std"]),
                fmt(s["rounds"], 2),
                fmt(s["underfilled"], 2),
                fmt(s["batch_fill"], 2),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> str:
    """Held-out reward vs step, vs training wall-clock seconds and vs training CPU seconds, and the pre-filter
    zero-spread fraction vs step, per task (mean over seeds, band = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(results)
    fig, axes = plt.subplots(len(tasks), 4, figsize=(20, 3.6 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        by_arm = {arm: [run for run in results[task] if run["arm"] == arm] for arm in EXPERIMENT["arms"]}
        by_arm = {arm: group for arm, group in by_arm.items() if group}
        for arm, group in by_arm.items():
            color = COLORS.get(arm)
            steps = [p["step"] for p in group[0]["points"]]
            values = np.array([[p["held_out"] for p in run["points"]] for run in group])
            row[0].plot(steps, values.mean(0), color=color, label=arm)
            row[0].fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
            for ax, clock in ((row[1], "seconds"), (row[2], "cpu_seconds")):
                if not all(clock in run["points"][-1] for run in group):
                    continue
                end = statistics.median(run["points"][-1][clock] for run in group)
                grid = np.linspace(0, end, 60)
                curves = np.array(
                    [
                        np.interp(grid, [p[clock] for p in run["points"]], [p["held_out"] for p in run["points"]])
                        for run in group
                    ]
                )
                ax.plot(grid, curves.mean(0), color=color, label=arm)
                ax.fill_between(grid, curves.min(0), curves.max(0), color=color, alpha=0.2)
            zero = defaultdict(list)
            for run in group:
                for r in run["rows"]:
                    if isinstance(r.get("frac_reward_zero_std"), (int, float)):
                        zero[(r["step"] - 1) // 50].append(r["frac_reward_zero_std"])
            xs = sorted(zero)
            row[3].plot([x * 50 + 25 for x in xs], [statistics.fmean(zero[x]) for x in xs], color=color, label=arm)
        n = len(next(iter(by_arm.values())))
        row[0].set(
            xlabel="optimizer step",
            ylabel="held-out reward (greedy)",
            title=f"{task}: held-out reward vs step\nmean, band = min..max of {n} seeds",
        )
        row[1].set(
            xlabel="training wall-clock seconds (evaluation excluded)",
            ylabel="held-out reward (greedy)",
            title=f"{task}: vs wall clock (to the median run end)\nshared 2-core machine: noisy",
        )
        row[2].set(
            xlabel="training CPU seconds (evaluation excluded)",
            ylabel="held-out reward (greedy)",
            title=f"{task}: vs CPU time (to the median run end)\nwaiting for a core not counted",
        )
        row[3].set(
            xlabel="optimizer step",
            ylabel="frac_reward_zero_std",
            ylim=(-0.02, 1.02),
            title=f"{task}: equal-reward groups (before filtering)\n50-step averages over seeds",
        )
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(results: dict, output_dir: str, spec: dict) -> dict:
    summary = {task: summarize(runs, spec["thresholds"], list(spec["arms"])) for task, runs in results.items()}
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump({"experiment": {k: v for k, v in spec.items()}, "results": summary}, f, indent=2)
    with open(os.path.join(output_dir, "dynamic_sampling.md"), "w") as f:
        f.write(table(summary, spec["thresholds"]))
    plot(results, os.path.join(output_dir, "dynamic_sampling.png"))
    return summary


def run(
    output_dir: str,
    seeds=None,
    max_steps: int | None = None,
    tiny: bool = False,
    resume: bool = False,
    tasks=None,
    log=print,
) -> dict:
    """Every (task, seed, arm), the arms of a seed back to back; then the summary, table and plot. `tasks`: a subset
    of the experiment's task names."""
    spec = dict(EXPERIMENT)
    if seeds is not None:
        spec["seeds"] = tuple(seeds)
    if tasks is not None:
        unknown = set(tasks) - set(spec["tasks"])
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; the experiment's tasks: {', '.join(spec['tasks'])}")
        spec["tasks"] = {name: spec["tasks"][name] for name in tasks}
    os.makedirs(output_dir, exist_ok=True)
    results = defaultdict(list)
    for task_name, task_spec in spec["tasks"].items():
        task = load_task(task_name, task_spec["digits"])
        steps = max_steps if max_steps is not None else task_spec["max_steps"]
        for seed in spec["seeds"]:
            for arm in spec["arms"]:
                run_dir = os.path.join(output_dir, "runs", f"{task_name}-{arm}-{seed}")
                saved = os.path.join(run_dir, "result.json")
                if resume and os.path.exists(saved):
                    with open(saved) as f:
                        result = json.load(f)
                else:
                    result = train_one(task, arm, seed, steps, task_spec["digits"], run_dir, tiny, spec)
                    os.makedirs(run_dir, exist_ok=True)
                    with open(saved, "w") as f:
                        json.dump(result, f)
                results[task_name].append(result)
                last, tokens = result["points"][-1], result["tokens"]
                log(
                    f"{task_name} {arm:8s} seed {seed}: held-out {result['points'][0]['held_out']:.3f} -> "
                    f"{last['held_out']:.3f} at step {last['step']}, {result['train_seconds']:.0f} s training, "
                    f"generated/trained tokens {tokens['generated'] / max(tokens['trained'], 1):.2f}"
                )
    runs = [
        {"task": t, **{k: r[k] for k in ("arm", "seed", "train_seconds", "tokens")}, "points": r["points"]}
        for t, group in results.items()
        for r in group
    ]
    with open(os.path.join(output_dir, "runs.json"), "w") as f:
        json.dump({"max_steps": max_steps, "tiny": tiny, "runs": runs}, f, indent=2)
    return report(results, output_dir, spec)


def replot(output_dir: str) -> dict:
    """summary.json, the table and the plot again from the saved per-run results (no training)."""
    results = defaultdict(list)
    runs_dir = os.path.join(output_dir, "runs")
    for task_name in EXPERIMENT["tasks"]:
        for name in sorted(os.listdir(runs_dir)):
            if name.startswith(f"{task_name}-"):
                with open(os.path.join(runs_dir, name, "result.json")) as f:
                    results[task_name].append(json.load(f))
    spec = dict(EXPERIMENT, tasks={name: EXPERIMENT["tasks"][name] for name in results})
    return report(results, output_dir, spec)
