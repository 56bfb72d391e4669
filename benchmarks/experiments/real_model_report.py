"""The report of `real_model_compare.py`: per run and per (arm, learning rate) over seeds, `summary.json`,
`comparison.md` and the plots, from the run files in `<output-dir>/runs/`.

Per run: held-out accuracy before and after (greedy, the study's held-out set), the rollout reward (TRL's `reward`, the mean over
a rollout batch's 64 sampled completions) of the first rollout and averaged over the last quarter of the rollouts,
the token clip fraction (TRL's `clip_ratio/region_mean`, logged by every arm), trl-gspo's sequence-ratio spread
(`seq_ratio/std`, trl-gspo's arms only: stock TRL has no such metric), the completion length, and the median
seconds and CPU seconds of an optimizer step (generation included, evaluation not). Over seeds: mean, min and max
(report_common.py, shared with compare_report.py, as are the per-step bands of the plots and the verdicts' checks).
Runs that trained different copies of the model (`model_source`: the prepared GGUF copy or the Hub's, with its SHA-256
or revision) are refused: arms compared must start from the same weights.

The truncated fraction (TRL's `completions/clipped_ratio`: completions that hit the length cap) of the first rollout
and over the last quarter of the rollouts, per run and per arm.

Parity (`parity`): stock TRL's arm of `PARITY` against the trl-gspo arm that runs the same algorithm at the same
settings, seed by seed: the same per-step logs and held-out answers, or the largest difference; that arm is left out
of the paired verdicts.

Verdicts (harness.py `paired`): for every two arms at one learning rate, the paired per-seed differences of held-out
accuracy after training, their mean and 95 % Student-t interval over seeds, and the word the interval supports
("ahead", "behind", or "level within ±x"), in `summary.json` under `pairs` ("<arm A> vs <arm B>", A minus B; " at lr<lr>"
appended when the study ran several rates) and in `comparison.md`. They are computed only among runs of one training
code (`provenance.training_code`); runs of different code, or written without provenance (the studies before the
regime studies), are refused in one line unless `allow_mixed` (`--allow-mixed-code`). Each pair lists its seeds
whose two runs ran on different CPUs or torch CPU kernels (`seeds_on_two_cpus`, from `provenance.cpu`), and those
whose two runs ran with different package versions (`seeds_on_two_package_sets`, from `provenance.versions`): the
same seed may draw different rollouts there, so that seed pairs less tightly.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (beside this file)
import report_common  # noqa: E402  (beside this file: statistics over seeds, bands, verdicts)
from report_common import mean, spread_text  # noqa: E402

CLIP = "clip_ratio/region_mean"
BAND = "clip_band/epsilon_low"
SPREAD = "seq_ratio/std"
LENGTH = "completions/mean_length"
TRUNCATED = "completions/clipped_ratio"
COLORS = {
    # the regime studies' arms, in the order their pairs are formed
    "GRPO dapo": "tab:red",
    "GRPO grpo": "tab:orange",
    "GSPO paper band": "tab:blue",
    "GSPO band 1e-2": "tab:purple",
    "GSPO spread k=1": "tab:green",
    "GSPO spread k=2": "tab:olive",
    "GSPO target 0.15": "tab:brown",
    "stock GSPO": "tab:gray",
}
#: stock TRL's arm -> the trl-gspo arms that run the same algorithm at the same settings: each such pair is checked for
#: identity (`parity`: the same per-step logs, the same held-out answers scored alike) instead of paired for a gap.
PARITY = {"stock GSPO": ("GSPO paper band",)}
#: The per-step logs `parity` compares: what the rollouts scored and how long they were (the same rollouts give the
#: same values, exactly), then the loss and the gradient norm (the same math summed in another order differs by rounding).
ROLLOUT_KEYS = ("reward", "completions/mean_length")
PARITY_KEYS = (*ROLLOUT_KEYS, "loss", "grad_norm")
#: The line the report prints (and comparison.md holds) for runs written without provenance.
NO_PROVENANCE = (
    "These runs carry no provenance (an older harness: no commit, versions or training-code hash): "
    "no paired verdicts are computed from them, and none may be mixed with the regime studies'."
)


def values(rows, key):
    return [row[key] for row in rows if isinstance(row.get(key), (int, float))]


def last_quarter(xs):
    return mean(xs[-max(1, len(xs) // 4) :]) if xs else None


def run_summary(run: dict) -> dict:
    rows = run["rows"]
    rewards = values(rows, "reward")
    tail = rewards[-max(1, len(rewards) // 4) :]
    truncated = values(rows, TRUNCATED)  # logged at the steps that sampled a rollout batch
    # the whole held-out set's scores where the run kept them apart from the curve's (regime studies), else the curve's
    before = run.get("held_out_before", run["curve"][0][1])
    after = run.get("held_out_after", run["curve"][-1][1])
    return {
        "seed": run["seed"],
        "held_out_before": before,
        "held_out_after": after,
        "held_out_gain": after - before,
        "truncated_first_rollout": truncated[0] if truncated else None,
        "truncated_last_quarter": last_quarter(truncated),
        "reward_first_rollout": rewards[0] if rewards else None,
        "reward_last_quarter": mean(tail),
        "reward_best_rollout": max(rewards) if rewards else None,
        "clip_fraction_tokens": mean(values(rows, CLIP)),
        "seq_ratio_std": mean(values(rows, SPREAD)),
        "completion_length": mean(values(rows, LENGTH)),
        # clip_target_fraction's band (clip_band.py) over the last quarter of the steps; None with a fixed band
        "epsilon_low_last_quarter": mean(values(rows, BAND)[-max(1, len(rows) // 4) :]),
        # how far a moving band went over the whole run (its narrowest and widest epsilon)
        "epsilon_low_min": min(values(rows, BAND), default=None),
        "epsilon_low_max": max(values(rows, BAND), default=None),
        "clip_band_fraction": mean(values(rows, "clip_band/fraction")),  # the off-policy steps' fractions it measured
        # the |log-ratio| spreads trl-gspo's diagnostics log by completion length (token std and sequence mean)
        **{
            key: mean(values(rows, key))
            for key in sorted({k for row in rows for k in row if k.startswith("logratio_by_len/")})
        },
        "seconds_per_step": statistics.median(run["step_seconds"]),
        "cpu_seconds_per_step": statistics.median(run["step_cpu_seconds"]),
        "load_average_end": run["load_average"][0],
        **{f"held_out_at_{step}": accuracy for step, accuracy in run["curve"]},
    }


def over_seeds(summaries: list[dict]) -> dict:
    """Each per-run number's mean, min and max over the seeds that have it (a length bucket may appear in some runs
    only), beside the per-run summaries."""
    out = {"seeds": [s["seed"] for s in summaries], "runs": summaries}
    for key in dict.fromkeys(key for s in summaries for key in s if key != "seed"):
        stat = report_common.spread(s.get(key) for s in summaries)
        if stat:
            out[key] = stat
    return out


def check_one_source(groups: dict) -> None:
    """Every run of the report trained one copy of the model (the same source and revision or SHA-256); a run
    without the record (written before it was kept) counts as its own copy."""
    sources = defaultdict(list)
    for runs in groups.values():
        for run in runs:
            key = json.dumps(run.get("model_source", "not recorded"), sort_keys=True)
            sources[key].append(f"{run['arm']} lr{run['learning_rate']:g} seed {run['seed']}")
    if len(sources) > 1:
        listed = "; ".join(f"{key}: {', '.join(names)}" for key, names in sources.items())
        raise SystemExit(f"real_model_report: the runs trained different copies of the model ({listed}); rerun them")


def run_label(run: dict) -> str:
    return f"{run['arm']} lr{run['learning_rate']:g} seed {run['seed']}"


def study_pairs(groups: dict) -> dict:
    """harness.pairs of held-out accuracy after training, per learning rate, the arms in COLORS' order, with the seeds
    whose two runs ran on different CPUs or package versions."""
    by_lr, by_seed = defaultdict(dict), defaultdict(dict)
    for (arm, lr), runs in groups.items():
        if arm in PARITY and any((ours, lr) in groups for ours in PARITY[arm]):
            continue  # checked for identity by `parity`, not paired for a gap
        by_lr[lr][arm] = {run["seed"]: run_summary(run)["held_out_after"] for run in runs}
        by_seed[lr][arm] = {run["seed"]: run for run in runs}
    order = sorted({arm for arm, _ in groups}, key=lambda arm: (list(COLORS).index(arm) if arm in COLORS else 99, arm))
    out = {}
    for lr, scores in sorted(by_lr.items()):
        suffix = f" at lr{lr:g}" if len(by_lr) > 1 else ""
        out.update({f"{name}{suffix}": p for name, p in harness.pairs(scores, order, by_seed[lr]).items()})
    return out


def step_gap(a, b) -> float:
    """|a - b| of one logged value in two runs; 0 where neither logged it, infinite where one did not."""
    if a is None and b is None:
        return 0.0
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return abs(a - b) if numbers else float("inf")


def parity(groups: dict) -> dict:
    """{"<ours> vs <stock> at lr<lr>": ...} for each trl-gspo arm and the stock arm of `PARITY` that ran it, over the
    seeds both ran: whether every step's rollouts scored the same (`ROLLOUT_KEYS` equal, exactly), whether the final
    held-out answers scored the same, the largest per-step difference of each of `PARITY_KEYS` (infinite where a step
    is missing from one) beside the median |loss| it compares with, and ours' CPU seconds per step over stock's (the mean over seeds of each run's median; the runs ran two
    at a time on a shared machine, so the speed to read is the benchmark's, docs/speed-and-memory.md)."""
    out = {}
    for (stock, lr), stock_runs in groups.items():
        for ours in PARITY.get(stock, ()):
            mine = {run["seed"]: run for run in groups.get((ours, lr), [])}
            theirs = {run["seed"]: run for run in stock_runs}
            seeds = sorted(set(mine) & set(theirs))
            if not seeds:
                continue
            largest, differing, ratios, losses = dict.fromkeys(PARITY_KEYS, 0.0), 0, [], []
            for seed in seeds:
                a_rows = {row["step"]: row for row in mine[seed]["rows"]}
                b_rows = {row["step"]: row for row in theirs[seed]["rows"]}
                for step in set(a_rows) | set(b_rows):
                    a, b = a_rows.get(step, {}), b_rows.get(step, {})
                    losses += [abs(a["loss"])] if isinstance(a.get("loss"), (int, float)) else []
                    for key in PARITY_KEYS:
                        largest[key] = max(largest[key], step_gap(a.get(key), b.get(key)))
                a, b = mine[seed].get("held_out_scores_after", []), theirs[seed].get("held_out_scores_after", [])
                differing += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
                cpu = [statistics.median(run["step_cpu_seconds"]) for run in (mine[seed], theirs[seed])]
                ratios.append(cpu[0] / cpu[1])
            out[f"{ours} vs {stock} at lr{lr:g}"] = {
                "seeds": seeds,
                "same_rollouts": not any(largest[key] for key in ROLLOUT_KEYS),
                "same_held_out_scores": differing == 0,
                "steps_compared": sum(len(mine[seed]["rows"]) for seed in seeds),
                "largest_step_difference": {key: harness.json_safe(gap) for key, gap in largest.items()},
                "median_abs_loss": statistics.median(losses) if losses else None,
                "held_out_problems_scored_differently": differing,
                "cpu_seconds_per_step_ratio": statistics.fmean(ratios),
            }
    return out


def parity_text(found: dict) -> str:
    if not found:
        return ""
    lines = [
        "\ntrl-gspo's arm against stock TRL's at the same settings, step by step:\n",
        "| pair | seeds | same rollouts | largest per-step difference | median abs loss | held-out problems scored "
        "differently | CPU s / step, ours over stock |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in found.items():
        gaps = ", ".join(
            f"{key} {gap:.3g}" if isinstance(gap, float) else f"{key} {gap}"
            for key, gap in p["largest_step_difference"].items()
        )
        lines.append(
            f"| {name} | {', '.join(map(str, p['seeds']))} | {'yes' if p['same_rollouts'] else 'no'} | {gaps} | "
            f"{p['median_abs_loss']:.3g} | {p['held_out_problems_scored_differently']} | "
            f"{p['cpu_seconds_per_step_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def load_runs(output_dir: Path) -> dict:
    groups = defaultdict(list)
    for path in sorted((output_dir / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        groups[(run["arm"], run["learning_rate"])].append(run)
    return groups


def per_rollout(run, key) -> dict:
    """{first step of a rollout batch: mean of `key` over the batch's optimizer steps}: the clip fraction and the
    ratio spread are 0 at a batch's first (on-policy) update and grow over the next ones, so a batch's mean is what
    compares across steps."""
    spg = run["settings"]["steps_per_generation"]
    groups = {}
    for row in run["rows"]:
        if isinstance(row.get(key), (int, float)):
            groups.setdefault((row["step"] - 1) // spg * spg + 1, []).append(row[key])
    return {step: statistics.fmean(values) for step, values in groups.items()}


def per_step(run, key, rollout_means: bool = False) -> dict:
    """{step: value of `key`} in one run: for `key` None, the held-out curve's points; with `rollout_means`, each
    rollout batch's mean (`per_rollout`)."""
    if key is None:
        return dict(run["curve"])
    if rollout_means:
        return per_rollout(run, key)
    return {row["step"]: row[key] for row in run["rows"] if isinstance(row.get(key), (int, float))}


def plot(groups: dict, path: Path, label_of, color_of, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("held-out accuracy (greedy, 200 problems)", None),
        ("rollout reward (mean of 64 samples)", "reward"),
        ("clip fraction, tokens (TRL's clip_ratio/region_mean),\nmean over each rollout batch's 4 updates", CLIP),
        ("sequence-ratio std (trl-gspo arms),\nmean over each rollout batch's 4 updates", SPREAD),
        ("completion length (tokens)", LENGTH),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    axes = axes.ravel()
    for ax, (name, key) in zip(axes, panels):
        for group, runs in groups.items():
            stats = report_common.by_step([per_step(run, key, key in (CLIP, SPREAD)) for run in runs])
            if not stats[0]:
                continue
            wide = group == "stock GSPO"  # drawn wide underneath: trl-gspo GSPO retraces it rollout for rollout
            line = dict(lw=4, alpha=0.45) if wide else dict(lw=1.5)
            marker = "o-" if key is None else "-"
            report_common.band(ax, *stats, color_of(group), label_of(group), marker, ms=3, **line)
        ax.set(title=name, xlabel="optimizer step")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    seconds = axes[-1]  # CPU seconds per optimizer step, each seed a dot
    for index, (group, runs) in enumerate(groups.items()):
        values = [statistics.median(run["step_cpu_seconds"]) for run in runs]
        seconds.bar(index, statistics.fmean(values), color=color_of(group), alpha=0.6)
        seconds.plot([index] * len(values), values, "k.", ms=4)
    seconds.set_xticks(range(len(groups)), [label_of(g) for g in groups], rotation=20, fontsize=7, ha="right")
    seconds.set(title="CPU seconds per optimizer step (median per run; dots: seeds)")
    seconds.title.set_fontsize(9)
    seconds.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{title} (lines: mean over seeds; bands: min..max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summary: dict) -> str:
    head = (
        "| arm | lr | seeds | held-out before | held-out after | gain | rollout reward, first -> last quarter | "
        "truncated, first rollout -> last quarter | "
        "clip fraction (tokens) | seq-ratio std | completion length | s / step | CPU s / step |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for name, s in summary.items():
        lines.append(
            f"| {s['arm']} | {s['learning_rate']:g} | {len(s['seeds'])} | {spread_text(s.get('held_out_before'))} | "
            f"{spread_text(s.get('held_out_after'))} | {spread_text(s.get('held_out_gain'))} | "
            f"{spread_text(s.get('reward_first_rollout'))} -> {spread_text(s.get('reward_last_quarter'))} | "
            f"{spread_text(s.get('truncated_first_rollout'))} -> {spread_text(s.get('truncated_last_quarter'))} | "
            f"{spread_text(s.get('clip_fraction_tokens'), 4)} | {spread_text(s.get('seq_ratio_std'), 5)} | "
            f"{spread_text(s.get('completion_length'), 1)} | {spread_text(s.get('seconds_per_step'), 2)} | "
            f"{spread_text(s.get('cpu_seconds_per_step'), 2)} |"
        )
    return head + "\n".join(lines) + "\n"


def curve_table(summary: dict) -> str:
    """Held-out accuracy at each evaluated step, mean over seeds [min, max]."""
    steps = sorted(
        {int(key.rsplit("_", 1)[1]) for s in summary.values() for key in s if key.startswith("held_out_at_")}
    )
    head = "| arm | lr | " + " | ".join(f"step {step}" for step in steps) + " |\n"
    head += "| --- | --- | " + " | ".join("---" for _ in steps) + " |\n"
    lines = [
        f"| {s['arm']} | {s['learning_rate']:g} | "
        + " | ".join(spread_text(s.get(f"held_out_at_{step}")) for step in steps)
        + " |"
        for s in summary.values()
    ]
    return head + "\n".join(lines) + "\n"


def band_table(summary: dict) -> str:
    """Where a moving band (clip_target_fraction's, clip_spread_scale's) ended (epsilon, the last quarter of the
    steps), its narrowest and widest over the run, and what it clipped."""
    lines = [
        f"| {s['arm']} | {s['learning_rate']:g} | {spread_text(s['epsilon_low_last_quarter'], 4)} | "
        f"{spread_text(s.get('epsilon_low_min'), 5)} | {spread_text(s.get('epsilon_low_max'), 4)} | "
        f"{spread_text(s.get('clip_band_fraction'), 3)} | {spread_text(s.get('clip_fraction_tokens'), 3)} |"
        for s in summary.values()
        if s.get("epsilon_low_last_quarter")
    ]
    if not lines:
        return ""
    head = (
        "| arm | lr | epsilon (low), last quarter | narrowest | widest | clip fraction of the off-policy steps (what "
        "it steers) | clip fraction, every step |\n| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    return "\nWhere the moving bands went (the paper's epsilon: 0.0003):\n\n" + head + "\n".join(lines) + "\n"


def report(output_dir: Path, allow_mixed: bool = False) -> dict:
    """Summary, tables and plots of the runs in `output_dir/runs`; `allow_mixed`: compare arms run by different
    training code (or without provenance) all the same."""
    groups = load_runs(output_dir)
    check_one_source(groups)
    everything = [run for runs in groups.values() for run in runs]
    code, pairable = report_common.checked_code(everything, run_label, allow_mixed, what="real_model_report")
    note = NO_PROVENANCE if code == harness.NOT_RECORDED else ""
    if note:
        print(note)
    pairs = study_pairs(groups) if pairable else {}
    commits = sorted({str((run.get("provenance") or {}).get("git", {}).get("commit")) for run in everything})
    summary = {}
    for (arm, lr), runs in sorted(
        groups.items(),
        key=lambda item: (
            item[0][1],
            list(COLORS).index(item[0][0]) if item[0][0] in COLORS else len(COLORS),
            item[0][0],
        ),
    ):
        summary[f"{arm} lr{lr:g}"] = {"arm": arm, "learning_rate": lr, **over_seeds([run_summary(r) for r in runs])}
    arms = dict(summary)
    same = parity(groups) if pairable else {}
    if code != harness.NOT_RECORDED:
        by_code = defaultdict(list)  # which runs ran which training code (one entry unless --allow-mixed-code)
        for run in everything:
            by_code[harness.code_of(run)].append(run_label(run))
        summary["provenance"] = {"training_code": code, "commits": commits, "runs_by_training_code": by_code}
    if pairs:
        summary["pairs"] = pairs
    if same:
        summary["parity"] = same
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "comparison.md").write_text(
        (f"{note}\n\n" if note else f"Training code {code[:12]} (commits {', '.join(commits)}).\n\n")
        + "Mean over seeds [min, max]; every run in summary.json.\n\n"
        + table(arms)
        + "\nHeld-out accuracy (greedy, 200 problems) by optimizer step:\n\n"
        + curve_table(arms)
        + band_table(arms)
        + report_common.pairs_text(pairs, "held-out accuracy after training")
        + parity_text(same)
    )
    at = defaultdict(dict)
    for (arm, lr), runs in groups.items():
        at[lr][arm] = runs
    lrs = sorted(at)
    main_lr = 5e-6 if 5e-6 in at else lrs[0]
    plot(
        at[main_lr], output_dir / "comparison.png", str, COLORS.get, f"SmolLM2-135M-Instruct, addition, lr {main_lr:g}"
    )
    print(table(arms))
    if pairs:
        print(harness.pairs_table(pairs))
    return summary
