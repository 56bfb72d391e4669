"""GRPO and GSPO on a real model: SmolLM2-135M-Instruct learning two-digit addition on CPU, arms x seeds.

The regime studies (one training-code version each; every arm on trl_gspo.GSPOTrainer but stock TRL's GSPO, 1,000
held-out problems):

    python benchmarks/experiments/real_model_compare.py --study regime-short   # 48-token cap, 64 steps
    python benchmarks/experiments/real_model_compare.py --study regime-long    # answers with their working, 32 steps
    python benchmarks/experiments/real_model_compare.py --study regime-stale   # 16 updates per rollout batch
    python benchmarks/experiments/real_model_compare.py --study regime-short --replot   # the report from saved runs

Arms (`ARMS`), at the addition demo's settings (8 prompts x 8 completions per rollout batch, 4 optimizer steps per
rollout batch, constant learning rate, fp32, beta 0, the same seed, data and initial weights) with what the study
changes: TRL's default GRPO (token ratio, clip 0.2, loss_type "dapo") and GRPO with GSPO's aggregation (loss_type
"grpo"), both on GSPOTrainer at TRL's settings (tests/test_grpo_arms.py shows it draws stock TRL's rollouts one for
one); GSPO with the paper's band, with the band 1e-2 / 1.3e-2, and with the band set from each update's own spread
(`clip_spread_scale`, k = 1 and 2); at one seed each, unpaired, stock TRL's GSPO (`trl.GRPOTrainer`,
importance_sampling_level="sequence", the paper's band, loss_type "grpo") on the short task, checked for identity with
GSPOTrainer's paper band (the report's `parity`), and clip_target_fraction's controller on long answers and stale
rollouts (where its band goes). The studies hold out 1,000 problems (`held_out`): the score before training is the
same for every arm and seed (the same weights, greedy), so it is computed once per study into
`<output-dir>/before.json`; the points during training score the first 200, the final score all 1,000 (long answers:
500). Seeds, arms and held-out sizes per regime: docs/real-model.md, the studies' design; `--seeds`, `--arms` and
`--learning-rates` run other cells of the same study.

Every run file carries its provenance (harness.py: the commit, package versions, CPU, threads, the resolved config,
the held-out set, wall and CPU time, and the hash of the training code it ran).

Each run is a fresh process with one torch thread; `--jobs` runs that many at once (2 on a 2-core machine). A run
scores held-out problems greedily every `--eval-every` steps and at the end; evaluation
restores torch's random state, so it does not change what a run samples, and its time is kept out of the step
times. The model's source (the prepared GGUF copy or the Hub's) is decided once, before any run starts, and every
run is given it (`TRL_GSPO_MODEL_SOURCE`). Every run's logged metrics, curve, times and model source go to
`<output-dir>/runs/<arm>-lr<lr>-seed<seed>.json` (the output folder: the study's under results/); an existing file is
reused (delete it to rerun), so an interrupted study resumes where it stopped. The report (`real_model_report.py`)
writes `summary.json`, `comparison.md` and
the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trl_gspo.cli.demo import ADDITION_ARGS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (beside this file: provenance and paired intervals)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

GSPO_CLIP = dict(epsilon=3e-4, epsilon_high=4e-4)
#: TRL's GRPOConfig defaults for the algorithm, written out so GSPOConfig's own defaults do not apply.
GRPO_DEFAULTS = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.2)
#: name -> (trainer family, config overrides on top of the shared settings).
ARMS = {
    # stock TRL's own GSPO setting, for the parity check against GSPOTrainer's "GSPO paper band"
    "stock GSPO": ("stock", dict(importance_sampling_level="sequence", loss_type="grpo", **GSPO_CLIP)),
    # The regime studies' arms, all on GSPOTrainer (REGIME_ARMS).
    "GRPO dapo": ("ours", GRPO_DEFAULTS),
    "GRPO grpo": ("ours", {**GRPO_DEFAULTS, "loss_type": "grpo"}),  # GSPO's aggregation: only the ratio's level differs
    "GSPO paper band": ("ours", {}),
    "GSPO band 1e-2": ("ours", dict(epsilon=1e-2, epsilon_high=1.3e-2)),
    # the band set from each update's own spread of log s_i, k times it, the paper's band its floor (GSPOConfig)
    "GSPO spread k=1": ("ours", dict(clip_spread_scale=1.0)),
    "GSPO spread k=2": ("ours", dict(clip_spread_scale=2.0)),
    # clip_target_fraction's controller (GSPOConfig): where its band goes under stale rollouts and long answers
    "GSPO target 0.15": ("ours", dict(clip_target_fraction=0.15)),
}
REGIME_ARMS = ["GRPO dapo", "GRPO grpo", "GSPO paper band", "GSPO band 1e-2", "GSPO spread k=1", "GSPO spread k=2"]
#: The long and stale regimes: k = 2 runs on the short task only (docs/real-model.md, the studies' design).
REGIME_ARMS_K1 = REGIME_ARMS[:5]
#: What every arm shares: the addition demo's settings (cli/demo.py ADDITION_ARGS, the one place they are written),
#: less what each run sets itself (learning rate, steps, seed), logged every step.
SHARED = {
    **{k: v for k, v in ADDITION_ARGS.items() if k not in ("learning_rate", "max_steps", "seed", "logging_steps")},
    "logging_steps": 1,
    "disable_tqdm": True,
}
#: name -> arms, learning rates, the folder (under results/) its runs, summary and plots go to, and what the study
#: changes in every arm's settings (`settings`: config fields over SHARED; `prompt`: the question's form, `steps`: the
#: default number of optimizer steps).
STUDIES = {
    # The regime studies (docs/real-model.md has their design: arms, seeds, held-out size), 1,000 problems held out.
    # Short answers: a 48-token cap most answers end within (58 % of the base model's sampled answers end within 48
    # tokens, 42 % within 32; the old 16-token cap cut 68-80 % of the first rollout). Seeds 0-11 for the close pairs'
    # arms; `arm_seeds` holds the arms the design gives fewer (it applies where `--seeds` is not given).
    "regime-short": dict(
        arms=[*REGIME_ARMS, "stock GSPO"],  # stock GSPO: is GSPOTrainer's run of the paper's band TRL's own (parity)
        learning_rates=[5e-6],
        folder="smollm2-regime-short",
        settings=dict(max_completion_length=48),
        held_out=1000,
        eval_every=32,
        seeds=list(range(12)),
        arm_seeds={"GSPO paper band": list(range(8)), "GSPO spread k=2": list(range(4)), "stock GSPO": [0]},
    ),
    # Long answers: the working before the sum (~70 tokens, 128 at most), 32 steps; the final score on the first 500
    # held-out problems (1,000 at 128 tokens would cost ~13.5 CPU minutes a run).
    "regime-long": dict(
        arms=[*REGIME_ARMS_K1, "GSPO target 0.15"],
        learning_rates=[5e-6],
        folder="smollm2-regime-long",
        settings=dict(max_completion_length=128),
        prompt="WORKING_PROMPT",
        steps=32,
        held_out=1000,
        eval_prompts=500,
        seeds=list(range(4)),
        arm_seeds={"GSPO target 0.15": [0]},  # the controller's band, described from one run, not paired
    ),
    # Stale rollouts: the short regime with 16 optimizer steps per rollout batch.
    "regime-stale": dict(
        arms=[*REGIME_ARMS_K1, "GSPO target 0.15"],
        learning_rates=[5e-6],
        folder="smollm2-regime-stale",
        settings=dict(max_completion_length=48, steps_per_generation=16),
        held_out=1000,
        eval_every=32,
        seeds=list(range(6)),
        arm_seeds={"GSPO target 0.15": [0]},
    ),
}
NUM_TRAIN_PROMPTS = 2000
#: Held-out problems the points during training score (the first of the held-out set); the final score takes all.
CURVE_PROBLEMS = 200
#: Greedy evaluation's batch size (rows generated at once): the fastest measured on one thread. 1,000 problems, 32 new
#: tokens, fp32, CPU seconds: 266 at 100, 275 at 250, 284 at 500, 320 at 1,000 (the same scores at each); a batch
#: ends only when every row has, and a fifth of the greedy answers run to the cap, so every batch runs all 32 steps.
EVAL_BATCH = 100
BEFORE_FILE = "before.json"


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm.replace(' ', '_')}-lr{lr:g}-seed{seed}"


class StepTimer:
    """Wall and CPU seconds of each optimizer step (generation included, held-out evaluation not: this callback is
    added before the evaluation's)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.started = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                wall, cpu = timer.started
                timer.steps.append((time.perf_counter() - wall, time.process_time() - cpu))

        self.steps: list[tuple[float, float]] = []
        self.callback = Callback()


def held_out_set(study: str, size: int | None = None):
    """(the study's held-out problems, their record): the addition task's test split, in its fixed order."""
    from trl_gspo.cli import addition

    reserved = STUDIES[study].get("held_out", addition.NUM_HELD_OUT)
    prompt = getattr(addition, STUDIES[study].get("prompt", "PROMPT"))
    size = reserved if size is None else size
    data = addition.make_addition_dataset(size, split="test", prompt=prompt, held_out=reserved)
    record = dict(name="addition test split", shuffle_seed=4321, reserved=reserved, size=size, prompt=prompt)
    return data, record


def before_key(study: str, size: int) -> dict:
    """What the score before training depends on: the weights, the question, the problems, the decoding."""
    from trl_gspo.cli import addition, demo
    from trl_gspo.common.model_store import SMOLLM2, resolve_model

    _, record = held_out_set(study, size)
    tokens = {**SHARED, **STUDIES[study].get("settings", {})}["max_completion_length"]
    scoring = {module.__name__: module for module in (addition, demo)}  # the task and the greedy decoding
    return dict(
        model_source=resolve_model(SMOLLM2).record(),
        held_out=record,
        max_new_tokens=tokens,
        batch_size=EVAL_BATCH,
        versions=harness.versions(),
        scoring_code=harness.training_code(scoring)["sha256"],
    )


def score_before(study: str, size: int, path: Path) -> None:
    """The held-out scores of the initial weights, problem by problem, to `path` (one per study: every arm and seed
    starts from the same weights and decodes greedily)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_gspo.cli.addition import addition_reward
    from trl_gspo.cli.demo import greedy_scores
    from trl_gspo.common.model_store import SMOLLM2, resolve_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    clock, key = harness.Clock(), before_key(study, size)
    model = resolve_model(SMOLLM2)
    policy = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    data, _ = held_out_set(study, size)
    scores = greedy_scores(policy, tokenizer, data, addition_reward, key["max_new_tokens"], EVAL_BATCH)
    harness.write_json(path, {"key": key, "scores": scores, **clock.seconds()})


def cached_before(study: str, size: int, output_dir: Path) -> list[float] | None:
    """The study's scores before training from `before.json`, or None when missing or made for other settings."""
    path = output_dir / BEFORE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved["scores"] if saved["key"] == json.loads(json.dumps(before_key(study, size))) else None


def train_one(
    study: str, arm: str, seed: int, lr: float, max_steps: int, eval_every: int, eval_prompts: int, path: Path
) -> None:
    """One run of `study` in this process; writes its result file (with its provenance)."""
    clock = harness.Clock()
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli import addition
    from trl_gspo.cli.addition import addition_reward, make_addition_dataset
    from trl_gspo.cli.demo import HeldOutCurve, greedy_score, greedy_scores
    from trl_gspo.common.model_store import SMOLLM2, resolve_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    family, overrides = ARMS[arm]
    overrides = {**STUDIES[study].get("settings", {}), **overrides}
    shared = {**SHARED, **overrides}
    prompt = getattr(addition, STUDIES[study].get("prompt", "PROMPT"))
    reserved = STUDIES[study].get("held_out", addition.NUM_HELD_OUT)
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if family == "stock" else (GSPOConfig, GSPOTrainer)
    model = resolve_model(SMOLLM2)
    work = path.parent / f".{path.stem}"
    args = config_cls(output_dir=str(work), learning_rate=lr, max_steps=max_steps, seed=seed, **shared)
    train_set = make_addition_dataset(NUM_TRAIN_PROMPTS, seed=seed, prompt=prompt, held_out=reserved)
    eval_set, held_out = held_out_set(study, eval_prompts)
    # the points during training score the first CURVE_PROBLEMS problems when the final score takes more
    curve_set = eval_set.select(range(min(CURVE_PROBLEMS, len(eval_set))))
    trainer = trainer_cls(model.path, addition_reward, args=args, train_dataset=train_set)
    tokenizer = trainer.processing_class
    tokens = shared["max_completion_length"]

    def score(data=curve_set):
        return greedy_score(trainer.model, tokenizer, data, addition_reward, tokens, EVAL_BATCH)

    timer = StepTimer()
    trainer.add_callback(timer.callback)
    curve = HeldOutCurve(score, eval_every, "held-out accuracy", printer=lambda *a, **k: None)
    before = cached_before(study, eval_prompts, path.parent.parent) if len(eval_set) > len(curve_set) else None
    if before is None:
        before = greedy_scores(trainer.model, tokenizer, eval_set, addition_reward, tokens, EVAL_BATCH)
    curve.points.append((0, statistics.fmean(before[: len(curve_set)])))
    trainer.add_callback(curve)
    started, evaluated_before = time.perf_counter(), curve.seconds
    trainer.train()
    train_wall = time.perf_counter() - started - (curve.seconds - evaluated_before)  # evaluation left out
    final_started = time.perf_counter()
    after = greedy_scores(trainer.model, tokenizer, eval_set, addition_reward, tokens, EVAL_BATCH)
    curve.seconds += time.perf_counter() - final_started
    curve.points.append((trainer.state.global_step, statistics.fmean(after[: len(curve_set)])))
    rows = [dict(row) for row in trainer.state.log_history if "loss" in row]
    result = {
        "arm": arm,
        "seed": seed,
        "learning_rate": lr,
        "model": re.sub(r" in /\S+", "", model.note),  # where it came from, not the machine's folder
        "model_source": model.record(),  # which copy: the report checks that every run of a comparison had one
        "study": study,
        "prompt": prompt,
        "settings": {**shared, "max_steps": max_steps, "trainer": trainer_cls.__name__},
        "held_out_before": statistics.fmean(before),
        "held_out_after": statistics.fmean(after),
        "held_out_scores_after": after,  # problem by problem, in the held-out set's order
        "curve": curve.points,  # on the first CURVE_PROBLEMS problems
        "curve_problems": len(curve_set),
        "eval_seconds": curve.seconds,
        "step_seconds": [wall for wall, _ in timer.steps],
        "step_cpu_seconds": [cpu for _, cpu in timer.steps],
        "train_wall_seconds": train_wall,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    config = harness.resolved_config(trainer.args)
    result["provenance"] = harness.provenance(config, held_out, clock, torch.get_num_threads())
    harness.write_json(path, result)


def study_plan(study: dict, arms, learning_rates=None, seeds=None) -> list[tuple]:
    """The (arm, lr, seed) runs of a study, seed by seed (so a study stopped early holds whole seeds): `seeds` as
    asked, else the study's, each arm at the seeds its `arm_seeds` gives it where the design gives it fewer."""
    arm_seeds = {} if seeds else study.get("arm_seeds", {})
    seeds = seeds or study.get("seeds", [0, 1, 2])
    return [
        (arm, lr, seed)
        for seed in seeds
        for lr in (learning_rates or study["learning_rates"])
        for arm in arms
        if seed in arm_seeds.get(arm, seeds)
    ]


def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch(study: str, arm: str, seed: int, lr: float, steps: int, every: int, prompts: int, path: Path, log) -> None:
    """`train_one` in a fresh one-thread process, which writes the run file `path`."""
    command = [
        sys.executable,
        __file__,
        "--one",
        study,
        arm,
        *(str(x) for x in (seed, lr, steps, every, prompts, path)),
    ]
    started, console = time.perf_counter(), path.with_suffix(".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(console, "w") as out:  # a file, not a pipe: the run outlives an interrupted driver
        code = subprocess.run(command, env=child_env(), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{path.stem} failed ({code}); its console: {console}")
    log(f"{path.stem}: {time.perf_counter() - started:.0f} s")


def launch_before(study: str, prompts: int, output_dir: Path, log) -> None:
    """`score_before` in a fresh one-thread process, unless `before.json` holds it for these settings."""
    if cached_before(study, prompts, output_dir) is not None:
        return
    path, started = output_dir / BEFORE_FILE, time.perf_counter()
    command = [sys.executable, __file__, "--before", study, str(prompts), str(path)]
    console = path.with_suffix(".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(console, "w") as out:
        code = subprocess.run(command, env=child_env(), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the score before training failed ({code}); its console: {console}")
    log(f"before training: {time.perf_counter() - started:.0f} s")


def missing_fields(arms) -> list[str]:
    """The config fields the arms set that their config class does not have (a field not landed yet)."""
    import dataclasses

    from trl import GRPOConfig

    from trl_gspo import GSPOConfig

    out = []
    for arm in arms:
        family, overrides = ARMS[arm]
        known = {f.name for f in dataclasses.fields(GRPOConfig if family == "stock" else GSPOConfig)}
        out += [f"{arm!r}: {name}" for name in overrides if name not in known]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=list(STUDIES), default="regime-short")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: results/<the study's folder>")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="default: the study's (0 1 2 unless it says)"
    )
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="default: the study's")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None, help="default: the study's")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the study's (64 unless it says)")
    parser.add_argument("--eval-every", type=int, default=None, help="default: the study's (16 unless it says)")
    parser.add_argument(
        "--eval-prompts", type=int, default=None, help="held-out problems scored after training (default: the study's)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--replot", action="store_true", help="only the report, from the saved runs")
    parser.add_argument(
        "--allow-mixed-code", action="store_true", help="report runs of different training code side by side"
    )
    parser.add_argument("--one", nargs=8, help=argparse.SUPPRESS)  # a single run, in the child process
    parser.add_argument("--before", nargs=3, help=argparse.SUPPRESS)  # the score before training, in a child
    options = parser.parse_args(argv)
    if options.one:
        study, arm, seed, lr, steps, every, prompts, path = options.one
        train_one(study, arm, int(seed), float(lr), int(steps), int(every), int(prompts), Path(path))
        return
    if options.before:
        study, prompts, path = options.before
        score_before(study, int(prompts), Path(path))
        return
    import real_model_report

    study = STUDIES[options.study]
    options.output_dir = options.output_dir or RESULTS / study["folder"]
    options.max_steps = options.max_steps or study.get("steps", 64)
    options.eval_prompts = options.eval_prompts or study.get("eval_prompts", study.get("held_out", 200))
    options.eval_every = options.eval_every if options.eval_every is not None else study.get("eval_every", 16)
    if not options.replot:
        from trl_gspo.common.model_store import SMOLLM2, SOURCE_VARIABLE, resolve_model

        arms = options.arms or study["arms"]
        missing = missing_fields(arms)
        if missing:
            raise SystemExit(f"real_model_compare: config fields this trl-gspo does not have: {'; '.join(missing)}")
        # one source for every run, decided here: each child would otherwise ask the network on its own
        os.environ[SOURCE_VARIABLE] = resolve_model(SMOLLM2).source
        plan = study_plan(study, arms, options.learning_rates, options.seeds)
        runs = options.output_dir / "runs"
        if options.eval_prompts > CURVE_PROBLEMS:  # one score before training for the whole study
            launch_before(options.study, options.eval_prompts, options.output_dir, print)

        def produce(item, path):
            arm, lr, seed = item
            settings = (options.max_steps, options.eval_every, options.eval_prompts)
            launch(options.study, arm, seed, lr, *settings, path, print)

        harness.each_run(plan, lambda item: runs / f"{run_name(*item)}.json", produce, jobs=options.jobs)
    real_model_report.report(options.output_dir, allow_mixed=options.allow_mixed_code)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
