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

Summaries, plots and paired verdicts are compare_report.py (on report_common.py, shared with real_model_report.py);
the longer copy task of the experiments is copy_task.py.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import async_experiment  # noqa: E402  (beside this file: the asynchronous-generation experiment's arms and report)
import dynamic_sampling_experiment  # noqa: E402  (beside this file)
import harness  # noqa: E402  (beside this file: provenance, the run store, paired intervals)
import report_common  # noqa: E402  (beside this file: statistics over seeds)
from compare_report import CLIP_KEY, DEFAULT_VARIANTS, UPDATES_KEY, VARIANTS, collapsed, report  # noqa: E402
from copy_task import CopyTask  # noqa: E402

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
    overrides=dict(
        steps_per_generation=8,
        max_completion_length=8,
        per_device_train_batch_size=16,
        num_generations=8,
        learning_rate=1e-3,
    ),
    max_steps=600,
)


def load_task(spec: str | None):
    if spec is None:
        return importlib.import_module("trl_gspo.cli.demo")
    module, _, attr = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def train_one(
    task, variant: str, seed: int, moe: bool, output_dir: str, num_prompts: int, eval_prompts: int, overrides: dict
):
    """Train one (variant, seed, model) run; returns (rows of logged metrics, held-out reward after and before
    training, or None, the run's provenance)."""
    import torch

    from trl_gspo import GSPOTrainer

    clock = harness.Clock()

    args = task.demo_config(
        output_dir,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        **{**overrides, **VARIANTS[variant]},
    )
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
    task_name = getattr(task, "__name__", type(task).__name__)
    held_out_record = {"name": f"{task_name} test split", "size": eval_prompts, "seed": seed}
    config = harness.resolved_config(trainer.args)
    return rows, held_out, held_out_before, harness.provenance(config, held_out_record, clock, torch.get_num_threads())


def write_data(results: dict, output_dir: str) -> tuple[str, str]:
    flat = [
        {"model": m, "variant": v, "seed": run["seed"], **row}
        for (m, v), runs in results.items()
        for run in runs
        for row in run["rows"]
    ]
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


def run(
    output_dir: str,
    seeds=(0, 1, 2),
    moe_seeds=None,
    variants=DEFAULT_VARIANTS,
    task=None,
    max_steps=200,
    num_prompts=1000,
    eval_prompts=200,
    overrides=None,
    log=print,
    resume=False,
    allow_mixed=False,
) -> dict:
    """Train every (model, variant, seed), write data and plots, return the summary. With `resume`, runs whose
    `runs/<name>/result.json` exists are read back instead of trained again."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    os.makedirs(output_dir, exist_ok=True)
    task = load_task(task) if task is None or isinstance(task, str) else task
    overrides = {"max_steps": max_steps, **(overrides or {})}
    models = [("dense", s) for s in seeds] + [("moe", s) for s in (seeds if moe_seeds is None else moe_seeds)]
    plan = [  # routing replay needs expert routers: no dense runs of its variants
        (model, variant, seed)
        for model, seed in models
        for variant in variants
        if not (model == "dense" and "routing_replay" in VARIANTS[variant])
    ]

    def produce(item, path):
        model, variant, seed = item
        start = time.perf_counter()
        rows, held_out, before, provenance = train_one(
            task, variant, seed, model == "moe", str(path.parent), num_prompts, eval_prompts, overrides
        )
        seconds = time.perf_counter() - start
        log(f"{model} {variant} seed {seed}: trained in {seconds:.0f}s")
        return dict(
            seed=seed, rows=rows, held_out=held_out, held_out_before=before, seconds=seconds, provenance=provenance
        )

    def path_of(item):
        model, variant, seed = item
        return Path(output_dir) / "runs" / f"{model}-{variant}-{seed}" / "result.json"

    results = defaultdict(list)
    for (model, variant, seed), result in zip(plan, harness.each_run(plan, path_of, produce, reuse=resume)):
        results[(model, variant)].append(result)
        rows, held_out = result["rows"], result["held_out"]
        clip = report_common.mean(r.get(CLIP_KEY) for r in rows)
        clip = "n/a" if clip is None else f"{clip:.4g}"
        held = "n/a" if held_out is None else f"{held_out:.3f}"
        log(
            f"{model:5s} {variant:10s} seed {seed}: {len(rows)} steps in {result['seconds']:.0f}s, mean token "
            f"clip fraction {clip}, held-out reward {held}, collapsed {collapsed(rows)}"
        )
    write_data(results, output_dir)
    runs = [
        {
            "model": m,
            "variant": v,
            **{k: run[k] for k in ("seed", "held_out", "held_out_before", "seconds")},
            "provenance": run.get("provenance"),
        }
        for (m, v), group in results.items()
        for run in group
    ]
    with open(os.path.join(output_dir, "runs.json"), "w") as f:
        json.dump({"overrides": overrides, "runs": runs}, f, indent=2)
    return report(results, output_dir, overrides, allow_mixed)


def replot(output_dir: str, allow_mixed: bool = False) -> dict:
    """Rebuild summary.json and the plots from a finished comparison's metrics.json and runs.json (no training)."""
    with open(os.path.join(output_dir, "runs.json")) as f:
        meta = json.load(f)
    with open(os.path.join(output_dir, "metrics.json")) as f:
        flat = json.load(f)
    results = defaultdict(list)
    for run in meta["runs"]:
        key = (run["model"], run["variant"], run["seed"])
        rows = [
            {k: v for k, v in row.items() if k not in ("model", "variant", "seed")}
            for row in flat
            if (row["model"], row["variant"], row["seed"]) == key
        ]
        results[(run["model"], run["variant"])].append({**run, "rows": rows})
    return report(results, output_dir, meta["overrides"], allow_mixed)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/compare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--moe-seeds",
        type=int,
        nargs="*",
        default=None,
        help="seeds for the MoE model (default: --seeds; the flag alone: no MoE runs)",
    )
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--experiment",
        choices=["routing-replay", "dynamic-sampling", "async"],
        default=None,
        help="routing-replay: the MoE routing replay experiment (ROUTING_EXPERIMENT; overrides "
        "--seeds, --variants and the task, and --moe-seeds unless given). dynamic-sampling: GSPO with "
        "and without dynamic sampling on two copy tasks (dynamic_sampling_experiment.py; --seeds and "
        "--max-steps override its settings only when given). async: synchronous vs asynchronous "
        "generation (async_experiment.py; overrides --variants, and --seeds and --max-steps unless "
        "given)",
    )
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--resume", action="store_true", help="reuse finished runs found in --output-dir")
    parser.add_argument(
        "--task",
        default=None,
        help="module[:attr] with the demo functions (default: trl_gspo.cli.demo); "
        "with --experiment dynamic-sampling, one of its task names (copy3, copy5)",
    )
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument(
        "--max-completion-length",
        type=int,
        default=8,
        help="longer than the demo's answer so response lengths vary (for the length plot)",
    )
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="smallest batches, for a smoke test")
    parser.add_argument("--replot", action="store_true", help="redo summary and plots of --output-dir, no training")
    parser.add_argument(
        "--allow-mixed-code", action="store_true", help="pair runs of different training code all the same"
    )
    args = parser.parse_args(argv)
    if args.experiment == "dynamic-sampling":
        experiment = dynamic_sampling_experiment

        given = argv if argv is not None else sys.argv
        if args.replot:
            print(json.dumps(experiment.replot(args.output_dir), indent=2))
            return
        summary = experiment.run(
            args.output_dir,
            seeds=args.seeds if "--seeds" in given else None,
            max_steps=args.max_steps if "--max-steps" in given else None,
            tiny=args.tiny,
            resume=args.resume,
            tasks=[args.task] if args.task else None,
        )
        print(json.dumps(summary, indent=2))
        return
    if args.replot:
        print(json.dumps(replot(args.output_dir, args.allow_mixed_code), indent=2))
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
    summary = run(
        args.output_dir,
        seeds,
        moe_seeds,
        variants,
        task,
        args.max_steps,
        args.num_prompts,
        args.eval_prompts,
        overrides,
        resume=args.resume,
        allow_mixed=args.allow_mixed_code,
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
