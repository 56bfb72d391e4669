"""GRPO vs GSPO vs GSPO-token on one task and the same seeds: every diagnostic per step, and plots.

    python benchmarks/compare.py --output-dir outputs/compare                 # offline demo task, dense + MoE
    python benchmarks/compare.py --output-dir /tmp/c --seeds 0 --max-steps 8 --tiny   # seconds, for tests

Each variant trains from the same initial weights and data for each seed; only the importance-ratio level and
the clip range differ (GRPO: token ratio, clip 0.2 / 0.27 as in the paper's baseline; GSPO and GSPO-token:
sequence ratio, clip 3e-4 / 4e-4). Everything else (loss_type="grpo", beta=0, 4 mini-batches per rollout batch,
learning rate) is the task's config. Writes to `--output-dir`:

    metrics.csv / metrics.json   one row per (model, variant, seed, logged step): every metric TRL logged
    runs.json                    per run: held-out reward and wall time (with metrics.json, enough for --replot)
    summary.json                 per (model, variant): means over steps and seeds, final and held-out reward
    reward.png                   training reward vs step (mean over seeds, band = min..max)
    clip_fraction.png            token-level clip fraction vs step, log scale
    ratio_dispersion.png         token log-ratio spread, |sum log-ratio| and |GSPO log-ratio| vs response length
    routing_shift.png            MoE: fraction of (token, layer) routings changed since the rollout, vs step

Another task: `--task module:attr` naming an object with the demo module's functions (`make_demo_dataset`,
`demo_reward`, `demo_config`, `build_demo_model`, optional `evaluate`).

Dynamic sampling experiment (`--experiment dynamic-sampling`): GSPO with and without dynamic sampling on the demo
task and a five-digit copy task, 5 seeds, held-out reward vs optimizer steps and vs training seconds, generated
tokens per trained token; the whole specification is in `dynamic_sampling_experiment.py`.

Asynchronous generation experiment (`--experiment async`): GRPO and GSPO, synchronous vs `async_generation` at
staleness 1, 2 and 4, with and without the behaviour correction, 5 seeds, on the demo task; the regime and what counts
as degradation are declared in `async_experiment.py`. Writes `async.md` (table), `async.png`, `async_summary.json`.

MoE routing replay experiment (`--experiment routing-replay`): arms GRPO, GRPO+R2, GRPO+R3, GSPO, GSPO+R3 on a tiny
Qwen3-MoE only, in a regime fixed before any result was looked at, to expose routing volatility (ROUTING_EXPERIMENT:
16 experts top-2, 8 mini-batches per rollout, an 8-digit copy task so completions are 8 tokens, the learning rate
picked from a pilot that measured only the routing shift after one update, aiming at the paper's ~10%, 600 steps),
5 seeds per arm. A run *collapses* (COLLAPSE) if an optimizer step was skipped for a non-finite gradient, or if its training reward
averaged over the last 20% of steps ends below its average over the first 20 steps. Adds to summary.json per arm:
collapse count, routing shift, token clip fraction, replay coverage and, for R3, the sampler/trainer route mismatch;
`routing_replay.md` holds the table and `routing_replay.png` the reward and shift curves.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import async_experiment  # noqa: E402  (beside this file: the asynchronous-generation experiment's arms and report)

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
COLORS = {"GRPO": "tab:red", "GSPO": "tab:blue", "GSPO-token": "tab:green", "GRPO+R2": "tab:orange",
          "GRPO+R3": "tab:purple", "GSPO+R3": "tab:cyan"}  # fmt: skip
CLIP_KEY = "clip_fraction/token/total"
UPDATES_KEY = "updates_since_rollout"
SHIFT_KEY = "moe/routing_shift"
#: Where a band whose lowest seed is 0 ends on the log-scale clip plot (below the axis' bottom).
LOG_FLOOR = 1e-5
BUCKET_RE = re.compile(r"^logratio_by_len/(\d+)-(\d+)/(\w+)$")


#: The routing-replay experiment's regime (see the module docstring). Fixed before looking at any reward or collapse.
ROUTING_EXPERIMENT = dict(
    variants=("GRPO", "GRPO+R2", "GRPO+R3", "GSPO", "GSPO+R3"),
    seeds=(0, 1, 2, 3, 4),
    num_digits=8,
    moe=dict(num_experts=16, num_experts_per_tok=2),
    num_prompts=2000,
    # learning_rate from the pilot (GSPO, seed 0, 48 steps, routing metrics only): share of activated experts replaced
    # one update after the rollout (moe/expert_change) 0.016 at 1e-4, 0.037 at 3e-4, 0.109 at 1e-3 -> 1e-3 (paper: ~10%).
    # 600 steps: ~2 minutes per run on this 2-core CPU.
    overrides=dict(steps_per_generation=8, max_completion_length=8, per_device_train_batch_size=16, num_generations=8,
                   learning_rate=1e-3),
    max_steps=600,
)
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


class CopyTask:
    """The demo's copy task with `num_digits` digits per prompt (longer completions) and MoE config overrides, in the
    task interface `run` expects. Held-out prompts are digit strings whose digit sum is a multiple of 7; training
    never draws them."""

    def __init__(self, num_digits: int, moe_overrides: dict | None = None):
        self.num_digits, self.moe_overrides = num_digits, moe_overrides or {}
        from trl_gspo.cli import demo

        self.demo = demo
        self.demo_reward, self.demo_config = demo.demo_reward, demo.demo_config

    def make_demo_dataset(self, num_prompts: int, seed: int = 0, split: str = "train"):
        import random

        from datasets import Dataset

        rng, rows = random.Random(f"{split}-{seed}"), []
        while len(rows) < num_prompts:
            digits = [str(rng.randrange(10)) for _ in range(self.num_digits)]
            if (sum(map(int, digits)) % 7 == 0) == (split == "test"):
                rows.append(digits)
        return Dataset.from_dict({"prompt": [f"copy {' '.join(d)} :" for d in rows], "target": [" ".join(d) for d in rows]})

    def build_demo_model(self, seed: int = 0, moe: bool = False):
        from trl_gspo.cli.tiny import build_tiny_model, build_tokenizer

        tokenizer = build_tokenizer()
        return build_tiny_model(tokenizer, moe=moe, seed=seed, **(self.moe_overrides if moe else {})), tokenizer

    def evaluate(self, model, tokenizer, dataset, batch_size: int = 100) -> float:
        import torch

        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        scores = []
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                batch = dataset[start : start + batch_size]
                enc = tokenizer(batch["prompt"], return_tensors="pt", padding=True).to(model.device)
                out = model.generate(**enc, do_sample=False, max_new_tokens=self.num_digits,
                                     pad_token_id=tokenizer.pad_token_id)  # fmt: skip
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
                scores += self.demo_reward(texts, batch["target"])
        model.train(was_training)
        return sum(scores) / len(scores)


def load_task(spec: str | None):
    if spec is None:
        return importlib.import_module("trl_gspo.cli.demo")
    module, _, attr = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def train_one(task, variant: str, seed: int, moe: bool, output_dir: str, num_prompts: int, eval_prompts: int,
              overrides: dict):  # fmt: skip
    """Train one (variant, seed, model) run; returns (rows of logged metrics, held-out reward after and before
    training, or None)."""
    from trl_gspo import GSPOTrainer

    args = task.demo_config(output_dir, seed=seed, report_to="none", save_strategy="no", logging_steps=1,
                            **{**overrides, **VARIANTS[variant]})  # fmt: skip
    model, tokenizer = task.build_demo_model(seed=seed, moe=moe)
    dataset = task.make_demo_dataset(num_prompts, seed=seed)
    trainer = GSPOTrainer(model, task.demo_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    held_out = held_out_before = None
    if eval_prompts and hasattr(task, "evaluate"):
        held_out_set = task.make_demo_dataset(eval_prompts, seed=seed, split="test")
        held_out_before = task.evaluate(trainer.model, tokenizer, held_out_set)
    trainer.train()
    if eval_prompts and hasattr(task, "evaluate"):
        held_out = task.evaluate(trainer.model, tokenizer, held_out_set)
    rows = [dict(row) for row in trainer.state.log_history if "step" in row and "train_runtime" not in row]
    spg, ga = trainer.args.steps_per_generation * trainer.args.num_iterations, trainer.args.gradient_accumulation_steps
    for row in rows:  # 0: the rollout's first mini-batch, trained on-policy (ratio 1); n: n optimizer steps later
        row[UPDATES_KEY] = ((row["step"] - 1) * ga % spg) // ga
    return rows, held_out, held_out_before


def _by_step(rows, key):
    """{step: [values over seeds]} for one metric."""
    out = defaultdict(list)
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not math.isnan(value):
            out[row["step"]].append(value)
    return dict(sorted(out.items()))


def _min_max(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return [min(values), max(values)] if values else None


def _mean(values):
    values = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def by_updates_since_rollout(runs, key) -> dict:
    """{n: mean of `key` over mini-batches trained n optimizer steps after their rollout} (n = 0 is on-policy)."""
    acc = defaultdict(list)
    for row in (row for run in runs for row in run["rows"]):
        if isinstance(row.get(key), (int, float)):
            acc[row[UPDATES_KEY]].append(row[key])
    return {n: statistics.fmean(v) for n, v in sorted(acc.items())}


def summarize(results: dict) -> dict:
    """Per (model, variant): metric means over all logged steps and seeds, plus rewards."""
    summary = {}
    for (model, variant), runs in results.items():
        rows = [row for run in runs for row in run["rows"]]
        on_policy_free = [row for row in rows if row[UPDATES_KEY] > 0]  # skip each rollout's on-policy mini-batch
        reward_steps = _by_step(rows, "reward")
        last = list(reward_steps)[-max(1, len(reward_steps) // 10):]  # last 10% of generation steps
        summary[f"{model}/{variant}"] = {
            "seeds": [run["seed"] for run in runs],
            "clip_fraction_token_mean": _mean(r.get(CLIP_KEY) for r in rows),
            "clip_fraction_token_mean_off_policy": _mean(r.get(CLIP_KEY) for r in on_policy_free),
            "clip_fraction_sequence_mean": _mean(r.get("clip_fraction/sequence/total") for r in rows),
            "seq_ratio_std_mean": _mean(r.get("seq_ratio/std") for r in on_policy_free),
            "token_logratio_std_mean": _mean(r.get("ratio_dispersion/token_logratio_std") for r in on_policy_free),
            "seq_logratio_abs_mean": _mean(r.get("ratio_dispersion/seq_logratio_abs") for r in on_policy_free),
            "routing_shift_mean_off_policy": _mean(r.get(SHIFT_KEY) for r in on_policy_free),
            "expert_change_mean_off_policy": _mean(r.get("moe/expert_change") for r in on_policy_free),
            "clip_fraction_token_by_updates_since_rollout": by_updates_since_rollout(runs, CLIP_KEY),
            "routing_shift_by_updates_since_rollout": by_updates_since_rollout(runs, SHIFT_KEY),
            "expert_change_by_updates_since_rollout": by_updates_since_rollout(runs, "moe/expert_change"),
            "train_reward_first": _mean(next(iter(reward_steps.values()), [])),
            "train_reward_last10pct": _mean([v for s in last for v in reward_steps[s]]),
            "held_out_reward": _mean(run["held_out"] for run in runs),
            "held_out_reward_before": _mean(run.get("held_out_before") for run in runs),
            "held_out_reward_min_max": _min_max(run["held_out"] for run in runs),
            "collapsed": sum(collapsed(run["rows"]) for run in runs),
            "replay_coverage_mean": _mean(r.get("moe/replay/coverage") for r in rows),
            "r3_sampler_mismatch_mean": _mean(r.get("moe/r3/sampler_mismatch") for r in rows),
            "r3_sampler_mismatch_any_layer_mean": _mean(r.get("moe/r3/sampler_mismatch_any_layer") for r in rows),
            "train_seconds_mean": _mean(run["seconds"] for run in runs),
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
        """Mean over seeds of each seed's block average (blocks of `block` steps), band = min..max over seeds.
        `off_policy` drops each rollout's first mini-batch, where the policy still equals the rollout policy."""
        per_seed = []
        for run in runs:
            blocks = defaultdict(list)
            rows = [r for r in run["rows"] if r[UPDATES_KEY]] if off_policy else run["rows"]
            for step, values in _by_step(rows, key).items():
                blocks[(step - 1) // block].extend(values)
            per_seed.append({b: statistics.fmean(v) for b, v in blocks.items()})
        xs = sorted({b for seed in per_seed for b in seed})
        values = [[seed[b] for seed in per_seed if b in seed] for b in xs]
        if log:  # a block where nothing clipped in any seed has no place on a log axis; a zero seed runs off the bottom
            keep = [i for i, v in enumerate(values) if statistics.fmean(v) > 0]
            xs, values = [xs[i] for i in keep], [values[i] for i in keep]
        if not xs:
            return
        steps = [b * block + (block + 1) / 2 for b in xs]
        lower = [min(v) if min(v) > 0 or not log else LOG_FLOOR for v in values]
        ax.plot(steps, [statistics.fmean(v) for v in values], color=colors.get(variant), label=label or variant, lw=1.2)
        ax.fill_between(steps, lower, [max(v) for v in values], color=colors.get(variant), alpha=0.2)

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
        ax.set(xlabel="optimizer step", ylabel="train reward",
               title=f"training reward ({model})\n{smoothed}mean, band = min..max of {nseeds} seeds")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "reward.png")

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for variant in VARIANTS:
            if (model, variant) in rows_of:
                rows = rows_of[(model, variant)]
                mean = _mean(r.get(CLIP_KEY) for r in rows)
                label = f"{variant} (mean {mean:.2g})" if mean is not None else variant
                band(ax, results[(model, variant)], CLIP_KEY, variant, log=True, label=label)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10 * LOG_FLOOR)
        ax.set(xlabel="optimizer step", ylabel="fraction of tokens clipped",
               title=f"token clip fraction ({model})\n{smoothed}mean, band = min..max of {nseeds} seeds")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save(fig, "clip_fraction.png")

    stats = (("token_std", "std of token log-ratios\nwithin a sequence"),
             ("sum_abs", "|sum_t log-ratio|\n(token-level product)"),
             ("seq_abs", "|GSPO sequence log-ratio|\n(length-normalised)"))  # fmt: skip
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
        ax.set(xlabel="optimizer step", ylabel="token x layer top-k sets changed",
               title=f"MoE routing shift since the rollout (mini-batches 2-4)\n{smoothed}{nseeds} seeds")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "routing_shift.png")
    return written


def write_data(results: dict, output_dir: str) -> tuple[str, str]:
    flat = [{"model": m, "variant": v, "seed": run["seed"], **row} for (m, v), runs in results.items() for run in runs
            for row in run["rows"]]  # fmt: skip
    keys = ["model", "variant", "seed", "step"]
    keys += sorted({k for row in flat for k in row} - set(keys))
    csv_path, json_path = os.path.join(output_dir, "metrics.csv"), os.path.join(output_dir, "metrics.json")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)
    with open(json_path, "w") as f:
        json.dump(flat, f)
    return csv_path, json_path


def run(output_dir: str, seeds=(0, 1, 2), moe_seeds=None, variants=DEFAULT_VARIANTS, task=None, max_steps=200,
        num_prompts=1000, eval_prompts=200, overrides=None, log=print, resume=False) -> dict:  # fmt: skip
    """Train every (model, variant, seed), write data and plots, return the summary. With `resume`, runs whose
    `runs/<name>/result.json` exists are read back instead of trained again."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    os.makedirs(output_dir, exist_ok=True)
    task = load_task(task) if task is None or isinstance(task, str) else task
    overrides = {"max_steps": max_steps, **(overrides or {})}
    plan = [("dense", s) for s in seeds] + [("moe", s) for s in (seeds if moe_seeds is None else moe_seeds)]
    results = defaultdict(list)
    for model, seed in plan:
        for variant in variants:
            if model == "dense" and "routing_replay" in VARIANTS[variant]:
                continue  # routing replay needs expert routers
            run_dir = os.path.join(output_dir, "runs", f"{model}-{variant}-{seed}")
            saved = os.path.join(run_dir, "result.json")
            if resume and os.path.exists(saved):
                with open(saved) as f:
                    result = json.load(f)
            else:
                start = time.perf_counter()
                rows, held_out, before = train_one(task, variant, seed, model == "moe", run_dir, num_prompts,
                                                   eval_prompts, overrides)  # fmt: skip
                result = {"seed": seed, "rows": rows, "held_out": held_out, "held_out_before": before,
                          "seconds": time.perf_counter() - start}  # fmt: skip
                os.makedirs(run_dir, exist_ok=True)
                with open(saved, "w") as f:
                    json.dump(result, f)
            results[(model, variant)].append(result)
            rows, held_out = result["rows"], result["held_out"]
            clip = _mean(r.get(CLIP_KEY) for r in rows)
            clip = "n/a" if clip is None else f"{clip:.4g}"
            held = "n/a" if held_out is None else f"{held_out:.3f}"
            log(f"{model:5s} {variant:10s} seed {seed}: {len(rows)} steps in {result['seconds']:.0f}s, mean token "
                f"clip fraction {clip}, held-out reward {held}, collapsed {collapsed(rows)}")
    write_data(results, output_dir)
    runs = [{"model": m, "variant": v, **{k: run[k] for k in ("seed", "held_out", "held_out_before", "seconds")}}
            for (m, v), group in results.items() for run in group]  # fmt: skip
    with open(os.path.join(output_dir, "runs.json"), "w") as f:
        json.dump({"overrides": overrides, "runs": runs}, f, indent=2)
    return report(results, output_dir, overrides)


def report(results: dict, output_dir: str, overrides: dict) -> dict:
    """summary.json and the plots from the per-run results (plus the routing-replay table when replay arms ran)."""
    if all(variant in async_experiment.ARMS for _, variant in results):
        return async_experiment.report(async_experiment.group_by_arm(results), output_dir)
    summary = summarize(results)
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump({"variants": VARIANTS, "overrides": overrides, "collapse": COLLAPSE, "results": summary}, f, indent=2)
    plot(results, output_dir)
    if any("routing_replay" in VARIANTS[v] for _, v in results):
        with open(os.path.join(output_dir, "routing_replay.md"), "w") as f:
            f.write(routing_table(summary, results))
        plot_routing(results, output_dir)
    return summary


def routing_table(summary: dict, results: dict) -> str:
    """Markdown table of the routing-replay arms (MoE runs)."""

    def fmt(value, digits=3):
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = ["| arm | seeds | collapsed | held-out reward before -> after (min..max) | train reward first -> last 10% "
             "| token clip fraction | routing shift (mini-batches 2-8) | shift 1 / 4 / 7 updates after rollout "
             "| replay coverage | R3 sampler/trainer mismatch (token x layer / any layer) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
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
    for ax, key, label, off_policy in ((axes[0], "reward", "training reward", False),
                                       (axes[1], SHIFT_KEY, "routing shift vs pi_old's routes", True)):  # fmt: skip
        for variant in arms:
            per_seed = []
            for run in results[("moe", variant)]:
                rows = [r for r in run["rows"] if r[UPDATES_KEY]] if off_policy else run["rows"]
                blocks = defaultdict(list)
                for step, values in _by_step(rows, key).items():
                    blocks[(step - 1) // block].extend(values)
                per_seed.append({b: statistics.fmean(v) for b, v in blocks.items()})
            xs = sorted({b for seed in per_seed for b in seed})
            if not xs:
                continue
            values = [[seed[b] for seed in per_seed if b in seed] for b in xs]
            steps = [b * block + (block + 1) / 2 for b in xs]
            ax.plot(steps, [statistics.fmean(v) for v in values], color=COLORS[variant], label=variant, lw=1.2)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=COLORS[variant], alpha=0.15)
        ax.set(xlabel="optimizer step", ylabel=label,
               title=f"{label} (MoE)\n{block}-step averages, mean, band = min..max of {nseeds} seeds")  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(output_dir, "routing_replay.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def replot(output_dir: str) -> dict:
    """Rebuild summary.json and the plots from a finished comparison's metrics.json and runs.json (no training)."""
    with open(os.path.join(output_dir, "runs.json")) as f:
        meta = json.load(f)
    with open(os.path.join(output_dir, "metrics.json")) as f:
        flat = json.load(f)
    results = defaultdict(list)
    for run in meta["runs"]:
        key = (run["model"], run["variant"], run["seed"])
        rows = [{k: v for k, v in row.items() if k not in ("model", "variant", "seed")} for row in flat
                if (row["model"], row["variant"], row["seed"]) == key]  # fmt: skip
        results[(run["model"], run["variant"])].append({**run, "rows": rows})
    return report(results, output_dir, meta["overrides"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/compare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--moe-seeds", type=int, nargs="*", default=None,
                        help="seeds for the MoE model (default: --seeds; the flag alone: no MoE runs)")  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--experiment", choices=["routing-replay", "dynamic-sampling", "async"], default=None,
                        help="routing-replay: the MoE routing replay experiment (ROUTING_EXPERIMENT; overrides "
                        "--seeds, --variants and the task, and --moe-seeds unless given). dynamic-sampling: GSPO with "
                        "and without dynamic sampling on two copy tasks (dynamic_sampling_experiment.py; --seeds and "
                        "--max-steps override its settings only when given). async: synchronous vs asynchronous "
                        "generation (async_experiment.py; overrides --variants, and --seeds and --max-steps unless "
                        "given)")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--resume", action="store_true", help="reuse finished runs found in --output-dir")
    parser.add_argument("--task", default=None, help="module[:attr] with the demo functions (default: trl_gspo.cli.demo); "
                        "with --experiment dynamic-sampling, one of its task names (copy3, copy5)")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--max-completion-length", type=int, default=8,
                        help="longer than the demo's answer so response lengths vary (for the length plot)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="smallest batches, for a smoke test")
    parser.add_argument("--replot", action="store_true", help="redo summary and plots of --output-dir, no training")
    args = parser.parse_args(argv)
    if args.experiment == "dynamic-sampling":
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:  # the experiment module sits next to this file
            sys.path.insert(0, here)
        import dynamic_sampling_experiment as experiment

        given = argv if argv is not None else sys.argv
        if args.replot:
            print(json.dumps(experiment.replot(args.output_dir), indent=2))
            return
        summary = experiment.run(args.output_dir, seeds=args.seeds if "--seeds" in given else None,
                                 max_steps=args.max_steps if "--max-steps" in given else None, tiny=args.tiny,
                                 resume=args.resume, tasks=[args.task] if args.task else None)  # fmt: skip
        print(json.dumps(summary, indent=2))
        return
    if args.replot:
        print(json.dumps(replot(args.output_dir), indent=2))
        return
    overrides = {"max_completion_length": args.max_completion_length}
    seeds, moe_seeds, variants, task = args.seeds, args.moe_seeds, args.variants, args.task
    if args.experiment == "routing-replay":
        spec = ROUTING_EXPERIMENT
        seeds, moe_seeds, variants = [], list(spec["seeds"]), list(spec["variants"])
        task = CopyTask(spec["num_digits"], spec["moe"])
        overrides, args.num_prompts = dict(spec["overrides"]), spec["num_prompts"]
        given = argv if argv is not None else sys.argv
        if "--max-steps" not in given:
            args.max_steps = spec["max_steps"]
        if "--moe-seeds" in given:  # fewer seeds (e.g. a smoke run); the pre-declared experiment uses all five
            moe_seeds = args.moe_seeds
    if args.experiment == "async":
        spec, given = async_experiment.ASYNC_EXPERIMENT, (argv if argv is not None else sys.argv)
        variants, moe_seeds, overrides = list(spec["variants"]), [], dict(spec["overrides"])
        args.num_prompts = spec["num_prompts"]
        if "--eval-prompts" not in given:
            args.eval_prompts = spec["eval_prompts"]
        if "--seeds" not in given:  # fewer seeds only for a smoke run; the declared experiment uses five
            seeds = list(spec["seeds"])
        if "--max-steps" not in given:
            args.max_steps = spec["max_steps"]
    if args.learning_rate is not None:
        overrides["learning_rate"] = args.learning_rate
    if args.tiny:
        overrides.update(per_device_train_batch_size=4, num_generations=4)
    summary = run(args.output_dir, seeds, moe_seeds, variants, task, args.max_steps, args.num_prompts,
                  args.eval_prompts, overrides, resume=args.resume)  # fmt: skip
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
