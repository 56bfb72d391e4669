"""What a comparison compares and reports: the variants (`VARIANTS`, GSPOConfig overrides per name), the collapse
rule, per-variant summaries (`summarize`), the log-ratio dispersion by length, the plots (`plot`, `plot_routing`),
the routing-replay table, and the paired verdicts of the held-out reward (`held_out_pairs`), from the per-run rows
`compare.py` collects; `report` writes them.

Statistics over seeds, the min..max bands and the training-code check are report_common.py's, shared with
real_model_report.py. Verdicts: per model, for every two variants run on the same seeds, the paired per-seed
differences of the held-out reward after training, their 95 % t interval and the word it supports (harness.py
`paired`), in `summary.json` under `pairs` (`{model: {"<A> vs <B>": ...}}`, A minus B, VARIANTS' order), printed, and
in `routing_replay.md` when replay arms ran. Runs of different training code are refused in one line, and runs
without provenance are not paired, unless `allow_mixed` (`--allow-mixed-code`).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import async_experiment  # noqa: E402  (beside this file: the asynchronous-generation experiment's arms and report)
import harness  # noqa: E402  (beside this file)
import report_common  # noqa: E402  (beside this file: statistics over seeds, bands, verdicts)
from report_common import mean, number  # noqa: E402

#: name -> GSPOConfig overrides. Clip ranges are the paper's for each method.
GRPO = dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=0.27)
GSPO = dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
VARIANTS = {
    "GRPO": GRPO,
    "GSPO": GSPO,
    "GSPO-token": dict(importance_sampling_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4),
    # MoE routing replay arms (MoE models only): the paper's GRPO baseline, and R3 for both methods
    "GRPO+R2": {**GRPO, "routing_replay": "R2"},
    "GRPO+R3": {**GRPO, "routing_replay": "R3"},
    "GSPO+R3": {**GSPO, "routing_replay": "R3"},
}
VARIANTS.update(async_experiment.ARMS)  # "GSPO async s2 no-corr", ...: `--experiment async`
DEFAULT_VARIANTS = ("GRPO", "GSPO", "GSPO-token")
COLORS = {
    "GRPO": "tab:red",
    "GSPO": "tab:blue",
    "GSPO-token": "tab:green",
    "GRPO+R2": "tab:orange",
    "GRPO+R3": "tab:purple",
    "GSPO+R3": "tab:cyan",
}
CLIP_KEY = "clip_fraction/token/total"
UPDATES_KEY = "updates_since_rollout"
SHIFT_KEY = "moe/routing_shift"
#: Where a band whose lowest seed is 0 ends on the log-scale clip plot (below the axis' bottom).
LOG_FLOOR = 1e-5
BUCKET_RE = re.compile(r"^logratio_by_len/(\d+)-(\d+)/(\w+)$")


COLLAPSE = "a non-finite (skipped) optimizer step, or mean training reward over the last 20% of steps below the mean over the first 20 steps"


def collapsed(rows) -> bool:
    """COLLAPSE applied to one run's logged rows."""
    if any((row.get("nonfinite/skipped_steps") or 0) > 0 for row in rows):
        return True
    rewards = [row["reward"] for row in rows if isinstance(row.get("reward"), (int, float))]
    if len(rewards) < 25:
        return False
    start, end = statistics.fmean(rewards[:20]), statistics.fmean(rewards[-max(1, len(rewards) // 5) :])
    return end < start


def _by_step(rows, key):
    """{step: [values]} of one metric in `rows` (one run's, or every seed's pooled)."""
    out = defaultdict(list)
    for row in rows:
        out[row["step"]].extend(report_common.numbers([row.get(key)]))
    return {step: values for step, values in sorted(out.items()) if values}


def block_means(run, key, block: int, off_policy: bool = False) -> dict:
    """{block index: the run's mean of `key` over the block's `block` steps}: hundreds of noisy steps read as a
    curve once averaged in blocks. `off_policy` drops each rollout's first mini-batch, where the policy still equals
    the rollout policy."""
    rows = [r for r in run["rows"] if r[UPDATES_KEY]] if off_policy else run["rows"]
    blocks = defaultdict(list)
    for step, values in _by_step(rows, key).items():
        blocks[(step - 1) // block].extend(values)
    return {b: statistics.fmean(v) for b, v in blocks.items()}


def block_band(ax, runs, key, block: int, color, label, log=False, off_policy=False, band_alpha=0.2) -> None:
    """Mean over seeds of each seed's block means (`block_means`), band = min..max over seeds, at each block's middle
    step. On a log axis a block where nothing clipped in any seed has no place, and a zero seed runs off the bottom
    (LOG_FLOOR)."""
    steps, mid, low, high = report_common.by_step([block_means(run, key, block, off_policy) for run in runs])
    if log:
        keep = [i for i, m in enumerate(mid) if m > 0]
        steps, mid, high = [steps[i] for i in keep], [mid[i] for i in keep], [high[i] for i in keep]
        low = [low[i] if low[i] > 0 else LOG_FLOOR for i in keep]
    if steps:
        middle = [b * block + (block + 1) / 2 for b in steps]
        report_common.band(ax, middle, mid, low, high, color, label, band_alpha=band_alpha, lw=1.2)


def by_updates_since_rollout(runs, key) -> dict:
    """{n: mean of `key` over mini-batches trained n optimizer steps after their rollout} (n = 0 is on-policy)."""
    acc = defaultdict(list)
    for row in (row for run in runs for row in run["rows"]):
        if isinstance(row.get(key), (int, float)):
            acc[row[UPDATES_KEY]].append(row[key])
    return {n: statistics.fmean(v) for n, v in sorted(acc.items())}


def min_max(values):
    """[min, max] of a `report_common.spread` (the summary's shape for the held-out reward); None without numbers."""
    stat = report_common.spread(values)
    return [stat["min"], stat["max"]] if stat else None


def summarize(results: dict) -> dict:
    """Per (model, variant): metric means over all logged steps and seeds, plus rewards."""
    summary = {}
    for (model, variant), runs in results.items():
        rows = [row for run in runs for row in run["rows"]]
        on_policy_free = [row for row in rows if row[UPDATES_KEY] > 0]  # skip each rollout's on-policy mini-batch
        reward_steps = _by_step(rows, "reward")
        last = list(reward_steps)[-max(1, len(reward_steps) // 10) :]  # last 10% of generation steps
        summary[f"{model}/{variant}"] = {
            "seeds": [run["seed"] for run in runs],
            "clip_fraction_token_mean": mean(r.get(CLIP_KEY) for r in rows),
            "clip_fraction_token_mean_off_policy": mean(r.get(CLIP_KEY) for r in on_policy_free),
            "clip_fraction_sequence_mean": mean(r.get("clip_fraction/sequence/total") for r in rows),
            "seq_ratio_std_mean": mean(r.get("seq_ratio/std") for r in on_policy_free),
            "token_logratio_std_mean": mean(r.get("ratio_dispersion/token_logratio_std") for r in on_policy_free),
            "seq_logratio_abs_mean": mean(r.get("ratio_dispersion/seq_logratio_abs") for r in on_policy_free),
            "routing_shift_mean_off_policy": mean(r.get(SHIFT_KEY) for r in on_policy_free),
            "expert_change_mean_off_policy": mean(r.get("moe/expert_change") for r in on_policy_free),
            "clip_fraction_token_by_updates_since_rollout": by_updates_since_rollout(runs, CLIP_KEY),
            "routing_shift_by_updates_since_rollout": by_updates_since_rollout(runs, SHIFT_KEY),
            "expert_change_by_updates_since_rollout": by_updates_since_rollout(runs, "moe/expert_change"),
            "train_reward_first": mean(next(iter(reward_steps.values()), [])),
            "train_reward_last10pct": mean([v for s in last for v in reward_steps[s]]),
            "held_out_reward": mean(run["held_out"] for run in runs),
            "held_out_reward_before": mean(run.get("held_out_before") for run in runs),
            "held_out_reward_min_max": min_max(run["held_out"] for run in runs),
            "collapsed": sum(collapsed(run["rows"]) for run in runs),
            "replay_coverage_mean": mean(r.get("moe/replay/coverage") for r in rows),
            "r3_sampler_mismatch_mean": mean(r.get("moe/r3/sampler_mismatch") for r in rows),
            "r3_sampler_mismatch_any_layer_mean": mean(r.get("moe/r3/sampler_mismatch_any_layer") for r in rows),
            "train_seconds_mean": mean(run["seconds"] for run in runs),
        }
    return summary


def dispersion_by_length(rows) -> dict:
    """{stat: {(lo, hi): mean over logged off-policy steps}} from the `logratio_by_len/...` metrics."""
    acc = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if not row[UPDATES_KEY]:
            continue  # on-policy mini-batch: every log-ratio is 0
        for key, value in row.items():
            m = BUCKET_RE.match(key)
            if m and isinstance(value, (int, float)):
                acc[m.group(3)][(int(m.group(1)), int(m.group(2)))].append(value)
    return {stat: {b: statistics.fmean(v) for b, v in sorted(d.items())} for stat, d in acc.items()}


def plot(results: dict, output_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = COLORS
    written = []

    def band(ax, runs, key, variant, log=False, label=None, off_policy=False):
        block_band(ax, runs, key, block, colors.get(variant), label or variant, log, off_policy)

    def save(fig, name):
        path = os.path.join(output_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    models = sorted({m for m, _ in results})
    base = "dense" if "dense" in models else models[0]
    rows_of = {key: [row for run in runs for row in run["rows"]] for key, runs in results.items()}
    nseeds = max(len(runs) for runs in results.values())
    block = max(1, max(len(run["rows"]) for runs in results.values() for run in runs) // 40)
    smoothed = f"{block}-step averages, " if block > 1 else ""

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for variant in VARIANTS:
            if (model, variant) in rows_of:
                band(ax, results[(model, variant)], "reward", variant)
        ax.set(
            xlabel="optimizer step",
            ylabel="train reward",
            title=f"training reward ({model})\n{smoothed}mean, band = min..max of {nseeds} seeds",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "reward.png")

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for variant in VARIANTS:
            if (model, variant) in rows_of:
                rows = rows_of[(model, variant)]
                clip = mean(r.get(CLIP_KEY) for r in rows)
                label = f"{variant} (mean {clip:.2g})" if clip is not None else variant
                band(ax, results[(model, variant)], CLIP_KEY, variant, log=True, label=label)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10 * LOG_FLOOR)
        ax.set(
            xlabel="optimizer step",
            ylabel="fraction of tokens clipped",
            title=f"token clip fraction ({model})\n{smoothed}mean, band = min..max of {nseeds} seeds",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save(fig, "clip_fraction.png")

    stats = (
        ("token_std", "std of token log-ratios\nwithin a sequence"),
        ("sum_abs", "|sum_t log-ratio|\n(token-level product)"),
        ("seq_abs", "|GSPO sequence log-ratio|\n(length-normalised)"),
    )
    fig, axes = plt.subplots(1, len(stats), figsize=(13, 3.6), sharey=True)
    for ax, (stat, title) in zip(axes, stats):
        for variant in VARIANTS:
            if (base, variant) not in rows_of:
                continue
            curve = dispersion_by_length(rows_of[(base, variant)]).get(stat, {})
            curve = {b: v for b, v in curve.items() if v > 0}  # length-1 responses have no within-sequence spread
            if curve:
                xs = [math.sqrt(lo * hi) for lo, hi in curve]  # geometric bucket centre on the log2 axis
                ax.plot(xs, list(curve.values()), "o-", color=colors[variant], label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="response length (tokens, bucket)", title=title)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"mean over off-policy steps ({base})")
    axes[0].legend(fontsize=8)
    save(fig, "ratio_dispersion.png")

    moe_rows = {v: rows_of[("moe", v)] for v in VARIANTS if ("moe", v) in rows_of}
    if moe_rows:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for variant in moe_rows:
            band(ax, results[("moe", variant)], SHIFT_KEY, variant, off_policy=True)
        ax.set(
            xlabel="optimizer step",
            ylabel="token x layer top-k sets changed",
            title=f"MoE routing shift since the rollout (mini-batches 2-4)\n{smoothed}{nseeds} seeds",
        )
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "routing_shift.png")
    return written


def routing_table(summary: dict, results: dict) -> str:
    """Markdown table of the routing-replay arms (MoE runs)."""
    fmt = number
    lines = [
        "| arm | seeds | collapsed | held-out reward before -> after (min..max) | train reward first -> last 10% "
        "| token clip fraction | routing shift (mini-batches 2-8) | shift 1 / 4 / 7 updates after rollout "
        "| replay coverage | R3 sampler/trainer mismatch (token x layer / any layer) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, variant), runs in results.items():
        if model != "moe":
            continue
        row = summary[f"{model}/{variant}"]
        shift = row["routing_shift_by_updates_since_rollout"]
        by_n = " / ".join(fmt(shift.get(n), 3) for n in (1, 4, 7))
        low_high = row["held_out_reward_min_max"] or [None, None]
        lines.append(
            f"| {variant} | {len(runs)} | {row['collapsed']}/{len(runs)} | {fmt(row['held_out_reward_before'])} -> "
            f"{fmt(row['held_out_reward'])} ({fmt(low_high[0])}..{fmt(low_high[1])}) | {fmt(row['train_reward_first'])} "
            f"-> {fmt(row['train_reward_last10pct'])} | {fmt(row['clip_fraction_token_mean_off_policy'], 4)} | "
            f"{fmt(row['routing_shift_mean_off_policy'])} | {by_n} | {fmt(row['replay_coverage_mean'])} | "
            f"{fmt(row['r3_sampler_mismatch_mean'], 4)} / {fmt(row['r3_sampler_mismatch_any_layer_mean'], 4)} |"
        )
    return "\n".join(lines) + f"\n\nCollapse: {COLLAPSE}.\n"


def plot_routing(results: dict, output_dir: str) -> str:
    """routing_replay.png: MoE training reward (mean, band = min..max over seeds) and routing shift per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    arms = [v for m, v in results if m == "moe"]
    nseeds = max(len(results[("moe", v)]) for v in arms)
    block = max(1, max(len(run["rows"]) for v in arms for run in results[("moe", v)]) // 40)
    for ax, key, label, off_policy in (
        (axes[0], "reward", "training reward", False),
        (axes[1], SHIFT_KEY, "routing shift vs pi_old's routes", True),
    ):
        for variant in arms:
            runs = results[("moe", variant)]
            block_band(ax, runs, key, block, COLORS[variant], variant, off_policy=off_policy, band_alpha=0.15)
        ax.set(
            xlabel="optimizer step",
            ylabel=label,
            title=f"{label} (MoE)\n{block}-step averages, mean, band = min..max of {nseeds} seeds",
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(output_dir, "routing_replay.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- verdicts
def run_label(run: dict) -> str:
    return f"{run['model']} {run['variant']} seed {run['seed']}"


def held_out_pairs(results: dict, allow_mixed: bool = False) -> dict:
    """{model: harness.pairs of the held-out reward after training between its variants, in VARIANTS' order}; {} for
    runs without provenance, and a one-line refusal for runs of different training code, unless `allow_mixed`
    (report_common.checked_code)."""
    runs = [dict(run, variant=v, model=m) for (m, v), group in results.items() for run in group]
    _, pairable = report_common.checked_code(runs, run_label, allow_mixed, "compare")
    if not pairable:
        print(report_common.NO_PROVENANCE)
        return {}
    scores, by_seed = defaultdict(dict), defaultdict(dict)
    for (model, variant), group in results.items():
        scores[model][variant] = {run["seed"]: run["held_out"] for run in group if run.get("held_out") is not None}
        by_seed[model][variant] = {run["seed"]: run for run in group}
    found = {model: harness.pairs(by_variant, list(VARIANTS), by_seed[model]) for model, by_variant in scores.items()}
    return {model: pairs for model, pairs in found.items() if pairs}


def pairs_markdown(pairs: dict) -> str:
    """Each model's paired intervals (report_common.pairs_text) under its name."""
    score = "the held-out reward after training"
    return "".join(f"\n{model}:\n" + report_common.pairs_text(found, score) for model, found in pairs.items())


def report(results: dict, output_dir: str, overrides: dict, allow_mixed: bool = False) -> dict:
    """summary.json and the plots from the per-run results (plus the routing-replay table when replay arms ran);
    summary.json's `pairs` hold the paired intervals of the held-out reward. The asynchronous-generation experiment's
    arms alone: its own report (async_experiment.py)."""
    if all(variant in async_experiment.ARMS for _, variant in results):
        return async_experiment.report(async_experiment.group_by_arm(results), output_dir)
    summary = summarize(results)
    pairs = held_out_pairs(results, allow_mixed)
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(
            {"variants": VARIANTS, "overrides": overrides, "collapse": COLLAPSE, "results": summary, "pairs": pairs},
            f,
            indent=2,
        )
    print(pairs_markdown(pairs), end="")
    plot(results, output_dir)
    if any("routing_replay" in VARIANTS[v] for _, v in results):
        with open(os.path.join(output_dir, "routing_replay.md"), "w") as f:
            f.write(routing_table(summary, results) + pairs_markdown({m: p for m, p in pairs.items() if m == "moe"}))
        plot_routing(results, output_dir)
    return summary
