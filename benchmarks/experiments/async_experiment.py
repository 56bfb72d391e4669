"""Asynchronous GSPO experiment (`python benchmarks/compare.py --experiment async`): does training on stale samples
cost reward, and does the behaviour correction matter?

Regime, fixed before any result was looked at (ASYNC_EXPERIMENT): the offline demo task (copy three digits, tiny
dense Qwen3, the demo's settings: learning rate 3e-4, 16 rows x 4 mini-batches per rollout batch, 8 generations),
1000 optimizer steps, 5 seeds per arm. Arms, for GRPO (token ratio, clip 0.2 / 0.27) and GSPO (sequence ratio, clip
3e-4 / 4e-4): synchronous; `async_generation=True` with `max_staleness` 1, 2 and 4, each with the behaviour correction
(default: length-normalised per sequence for GSPO, per token for GRPO, TRL's mask bound 3.0) and without it
(`vllm_importance_sampling_correction=False`; the ratio stays anchored on the proximal policy).

DEGRADATION (declared up front): an asynchronous arm degrades when its mean held-out reward (greedy decoding, 200
prompts never trained on, after training) is more than 0.05 below the synchronous arm of the same method AND the gap
exceeds twice its standard error (Welch, 5 + 5 seeds). Everything else is reported beside it: training reward per
optimizer step and per second of training (TRL's `step_time`, which includes the trainer's waits for generation),
clip fractions, the behaviour weight's spread (p5..p95, before bounds) and the share it masked, staleness.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict

from report_common import mean, number  # beside this file (compare.py, which runs this experiment, puts it on sys.path)

GRPO = dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=0.27)
GSPO = dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
STALENESS = (1, 2, 4)


def _arms() -> dict:
    arms = {}
    for method, clip in (("GRPO", GRPO), ("GSPO", GSPO)):
        arms[f"{method} sync"] = dict(clip)
        for s in STALENESS:
            arms[f"{method} async s{s}"] = {**clip, "async_generation": True, "max_staleness": s}
            arms[f"{method} async s{s} no-corr"] = {
                **clip,
                "async_generation": True,
                "max_staleness": s,
                "vllm_importance_sampling_correction": False,
            }
    return arms


ARMS = _arms()
#: 1000 steps: the synchronous demo's published curve (docs/demo_reward_curve.png) is still near 0.15 at step 600 and
#: climbs through 0.5 around step 850, so 1000 steps cover the part of the curve where learning speed shows.
ASYNC_EXPERIMENT = dict(
    variants=tuple(ARMS),
    seeds=(0, 1, 2, 3, 4),
    max_steps=1000,
    num_prompts=2000,
    eval_prompts=200,
    overrides=dict(max_completion_length=3),
)
DEGRADATION = (
    "mean held-out reward more than 0.05 below the synchronous arm of the same method, and the gap larger than twice "
    "its standard error (Welch, seeds as samples)"
)
COLORS = {"sync": "black", "s1": "tab:blue", "s2": "tab:orange", "s4": "tab:red"}


def _moving_average(values, window=20):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def run_curve(rows) -> tuple[list, list, list]:
    """(steps, cumulative training seconds, training reward) of one run's logged rows (one per optimizer step)."""
    rows = [r for r in rows if isinstance(r.get("reward"), (int, float))]
    seconds, total = [], 0.0
    for r in rows:
        total += r.get("step_time") or 0.0
        seconds.append(total)
    return [r["step"] for r in rows], seconds, [r["reward"] for r in rows]


def _first_reaching(curve_x, rewards, level):
    smooth = _moving_average(rewards)
    return next((x for x, v in zip(curve_x, smooth) if v >= level), None)


def summarize(results: dict) -> dict:
    """Per arm: rewards, speed, clip fractions, behaviour-weight spread, staleness; and the degradation verdict."""
    summary = {}
    for (_, arm), runs in results.items():
        rows = [row for run in runs for row in run["rows"]]
        curves = [run_curve(run["rows"]) for run in runs]
        last = [statistics.fmean(c[2][-max(1, len(c[2]) // 10) :]) for c in curves if c[2]]
        spreads = [
            r["async/behaviour_weight/p95"] - r["async/behaviour_weight/p5"]
            for r in rows
            if isinstance(r.get("async/behaviour_weight/p95"), (int, float))
        ]
        held = [run["held_out"] for run in runs]
        summary[arm] = {
            "seeds": [run["seed"] for run in runs],
            "held_out_reward": mean(held),
            "held_out_reward_all": held,
            "held_out_reward_before": mean(run.get("held_out_before") for run in runs),
            "train_reward_mean": mean(v for c in curves for v in c[2]),  # area under the per-step curve
            "train_reward_last10pct": mean(last),
            "steps_to_reward_0.5": mean(_first_reaching(c[0], c[2], 0.5) for c in curves),
            "seconds_to_reward_0.5": mean(_first_reaching(c[1], c[2], 0.5) for c in curves),
            "runs_reaching_0.5": sum(_first_reaching(c[0], c[2], 0.5) is not None for c in curves),
            "train_seconds_per_step": mean(c[1][-1] / len(c[1]) for c in curves if c[1]),
            "clip_fraction_token_mean": mean(r.get("clip_fraction/token/total") for r in rows),
            "clip_fraction_sequence_mean": mean(r.get("clip_fraction/sequence/total") for r in rows),
            "staleness_mean": mean(r.get("async/staleness/mean") for r in rows),
            "behaviour_weight_mean": mean(r.get("async/behaviour_weight/mean") for r in rows),
            "behaviour_weight_p5_p95_spread_mean": mean(spreads),
            "behaviour_weight_min": min(
                (r["async/behaviour_weight/min"] for r in rows if "async/behaviour_weight/min" in r), default=None
            ),
            "behaviour_weight_max": max(
                (r["async/behaviour_weight/max"] for r in rows if "async/behaviour_weight/max" in r), default=None
            ),
            "behaviour_weight_outside_frac_mean": mean(r.get("async/behaviour_weight/outside_frac") for r in rows),
            "nonfinite_skipped_steps": sum((r.get("nonfinite/skipped_steps") or 0) for r in rows),
            "run_seconds_mean": mean(run["seconds"] for run in runs),
        }
    for arm, row in summary.items():
        method = arm.split()[0]
        base = summary.get(f"{method} sync")
        if base is None or arm == f"{method} sync":
            continue
        a, b = row["held_out_reward_all"], base["held_out_reward_all"]
        gap = statistics.fmean(a) - statistics.fmean(b)
        se = math.sqrt(
            (statistics.variance(a) / len(a) if len(a) > 1 else 0)
            + (statistics.variance(b) / len(b) if len(b) > 1 else 0)
        )
        row["held_out_gap_vs_sync"], row["gap_standard_error"] = gap, se
        row["degraded"] = gap < -0.05 and -gap > 2 * se
    return summary


def table(summary: dict) -> str:
    fmt = number
    lines = [
        "| arm | held-out reward (mean over seeds) | gap vs sync (2 SE) | degraded | train reward: mean over steps "
        "/ last 10% | steps to 0.5 | training s to 0.5 | s/step | token clip fraction | staleness (steps) | "
        "behaviour weight mean, p5..p95 spread, min..max | masked share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, r in summary.items():
        gap = (
            "-"
            if "held_out_gap_vs_sync" not in r
            else f"{r['held_out_gap_vs_sync']:+.3f} ({2 * r['gap_standard_error']:.3f})"
        )
        degraded = "-" if "degraded" not in r else ("**yes**" if r["degraded"] else "no")
        weight = (
            "-"
            if r["behaviour_weight_mean"] is None
            else (
                f"{fmt(r['behaviour_weight_mean'])}, {fmt(r['behaviour_weight_p5_p95_spread_mean'])}, "
                f"{fmt(r['behaviour_weight_min'])}..{fmt(r['behaviour_weight_max'])}"
            )
        )
        lines.append(
            f"| {arm} | {fmt(r['held_out_reward'])} | {gap} | {degraded} | {fmt(r['train_reward_mean'])} / "
            f"{fmt(r['train_reward_last10pct'])} | {fmt(r['steps_to_reward_0.5'], 0)} ({r['runs_reaching_0.5']}/{len(r['seeds'])}) | "
            f"{fmt(r['seconds_to_reward_0.5'], 1)} | {fmt(r['train_seconds_per_step'], 4)} | "
            f"{fmt(r['clip_fraction_token_mean'], 4)} | {fmt(r['staleness_mean'], 2)} | {weight} | "
            f"{fmt(r['behaviour_weight_outside_frac_mean'], 4)} |"
        )
    return "\n".join(lines) + f"\n\nDegradation: {DEGRADATION}.\n"


def plot(results: dict, output_dir: str) -> str:
    """async.png: training reward vs optimizer step and vs training seconds, per method; mean over seeds (20-step
    moving average), solid with the behaviour correction, dashed without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    for row, method in enumerate(("GRPO", "GSPO")):
        for col, axis in enumerate(("optimizer step", "training seconds (TRL step_time, waits included)")):
            ax = axes[row, col]
            for (_, arm), runs in results.items():
                if not arm.startswith(method):
                    continue
                tag = "sync" if arm.endswith("sync") else arm.split()[2]
                curves = [run_curve(run["rows"]) for run in runs]
                n = min(len(c[2]) for c in curves)
                ys = [statistics.fmean(_moving_average(c[2])[i] for c in curves) for i in range(n)]
                xs = [statistics.fmean(c[col][i] for c in curves) for i in range(n)]
                ax.plot(xs, ys, color=COLORS[tag], lw=1.2, ls="--" if "no-corr" in arm else "-", label=arm)
            ax.set(
                xlabel=axis, ylabel="training reward (20-step mean)", title=f"{method}: reward vs {axis.split(' (')[0]}"
            )
            ax.grid(alpha=0.3)
        axes[row, 0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = os.path.join(output_dir, "async.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(results: dict, output_dir: str) -> dict:
    import json

    summary = summarize(results)
    with open(os.path.join(output_dir, "async_summary.json"), "w") as f:
        json.dump(
            {"arms": ARMS, "regime": ASYNC_EXPERIMENT, "degradation": DEGRADATION, "results": summary}, f, indent=2
        )
    with open(os.path.join(output_dir, "async.md"), "w") as f:
        f.write(table(summary))
    plot(results, output_dir)
    return summary


def group_by_arm(results: dict) -> dict:
    """compare.py's results keyed by (model, variant), restricted to this experiment's arms, in ARMS order."""
    grouped = defaultdict(list)
    for arm in ARMS:
        for key, runs in results.items():
            if key[1] == arm:
                grouped[key] = runs
    return dict(grouped)
