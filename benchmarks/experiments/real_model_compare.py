"""Stock TRL vs trl-gspo on a real model: SmolLM2-135M-Instruct learning two-digit addition on CPU.

    python benchmarks/experiments/real_model_compare.py                  # the comparison: 4 arms x 3 seeds
    python benchmarks/experiments/real_model_compare.py --study lr       # GSPO's learning-rate study
    python benchmarks/experiments/real_model_compare.py --study band     # GSPO with wider clip bands
    python benchmarks/experiments/real_model_compare.py --study target   # the band following a clip fraction
    python benchmarks/experiments/real_model_compare.py --study target --arms "stock GRPO" --learning-rates 1e-5
    python benchmarks/experiments/real_model_compare.py --study stale    # 16 optimizer steps per rollout batch
    python benchmarks/experiments/real_model_compare.py --study long     # answers with their working, ~70 tokens
    python benchmarks/experiments/real_model_compare.py --replot         # summary and plots from saved runs

Arms, at equal settings (the addition demo's: 8 prompts x 8 completions per rollout batch, 4 optimizer steps per
rollout batch, 16-token completions, constant learning rate, fp32, beta 0, the same seed, data and initial weights):

    stock GRPO          trl.GRPOTrainer, TRL's defaults for the algorithm (token ratio, clip 0.2, loss_type "dapo")
    stock GSPO          trl.GRPOTrainer, TRL's GSPO setting: importance_sampling_level="sequence", the paper's clip
                        range 3e-4 / 4e-4, loss_type="grpo"
    trl-gspo GSPO       trl_gspo.GSPOTrainer with GSPOConfig's defaults (the paper's GSPO)
    trl-gspo GSPO-token trl_gspo.GSPOTrainer, importance_sampling_level="sequence_token"

Each run is a fresh process with one torch thread; `--jobs` runs that many at once (2 on a 2-core machine). A run
scores the 200 held-out problems greedily before training, every `--eval-every` steps and at the end; evaluation
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
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trl_gspo.cli.demo import ADDITION_ARGS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

GSPO_CLIP = dict(epsilon=3e-4, epsilon_high=4e-4)
#: name -> (trainer family, config overrides on top of the shared settings).
ARMS = {
    "stock GRPO": ("stock", {}),
    "stock GSPO": ("stock", dict(importance_sampling_level="sequence", loss_type="grpo", **GSPO_CLIP)),
    "trl-gspo GSPO": ("ours", {}),
    "trl-gspo GSPO-token": ("ours", dict(importance_sampling_level="sequence_token")),
    # The clip-band study: GSPOConfig's defaults with a wider (epsilon, epsilon_high), same 4:3 shape as the paper's.
    "trl-gspo GSPO band 1e-3": ("ours", dict(epsilon=1e-3, epsilon_high=1.3e-3)),
    "trl-gspo GSPO band 3e-3": ("ours", dict(epsilon=3e-3, epsilon_high=4e-3)),
    "trl-gspo GSPO band 1e-2": ("ours", dict(epsilon=1e-2, epsilon_high=1.3e-2)),
    # A band that follows a target clip fraction (clip_band.py), from the paper's band.
    "trl-gspo GSPO target 15%": ("ours", dict(clip_target_fraction=0.15)),
}
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
    "compare": dict(arms=list(ARMS)[:4], learning_rates=[5e-6], folder="smollm2-addition"),
    "lr": dict(arms=["trl-gspo GSPO"], learning_rates=[2e-6, 5e-6, 1e-5], folder="smollm2-addition"),
    "band": dict(arms=[arm for arm in ARMS if " band " in arm], learning_rates=[5e-6], folder="smollm2-band"),
    "target": dict(arms=["trl-gspo GSPO target 15%"], learning_rates=[5e-6, 1e-5], folder="smollm2-target"),
    # Stale rollouts: 16 optimizer steps per rollout batch (the same completions per step; 4x fewer, 4x larger
    # rollouts), the off-policy regime the paper's argument is about.
    "stale": dict(
        arms=["stock GRPO", "trl-gspo GSPO", "trl-gspo GSPO target 15%"],
        learning_rates=[5e-6],
        folder="smollm2-stale",
        settings=dict(steps_per_generation=16),
    ),
    # Long answers: the working before the sum, ~70 tokens on average (128 at most), 32 steps (a 64-step run would cost over
    # an hour of CPU); token ratios are noisier the longer the answer, which is where the paper puts GSPO's case.
    "long": dict(
        # the paper's band, the band that followed a target, and the best fixed band of the clip-band study
        arms=["stock GRPO", "trl-gspo GSPO", "trl-gspo GSPO target 15%", "trl-gspo GSPO band 1e-2"],
        learning_rates=[5e-6],
        folder="smollm2-long",
        settings=dict(max_completion_length=128),
        prompt="WORKING_PROMPT",
        steps=32,
    ),
}
NUM_TRAIN_PROMPTS = 2000


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


def train_one(
    study: str, arm: str, seed: int, lr: float, max_steps: int, eval_every: int, eval_prompts: int, path: Path
) -> None:
    """One run of `study` in this process; writes its result file."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli import addition
    from trl_gspo.cli.addition import addition_reward, make_addition_dataset
    from trl_gspo.cli.demo import HeldOutCurve, greedy_score
    from trl_gspo.common.model_store import SMOLLM2, resolve_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    family, overrides = ARMS[arm]
    overrides = {**STUDIES[study].get("settings", {}), **overrides}
    shared = {**SHARED, **overrides}
    prompt = getattr(addition, STUDIES[study].get("prompt", "PROMPT"))
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if family == "stock" else (GSPOConfig, GSPOTrainer)
    model = resolve_model(SMOLLM2)
    work = path.parent / f".{path.stem}"
    args = config_cls(output_dir=str(work), learning_rate=lr, max_steps=max_steps, seed=seed, **shared)
    train_set = make_addition_dataset(NUM_TRAIN_PROMPTS, seed=seed, prompt=prompt)
    eval_set = make_addition_dataset(eval_prompts, split="test", prompt=prompt)
    trainer = trainer_cls(model.path, addition_reward, args=args, train_dataset=train_set)
    tokenizer = trainer.processing_class

    def score():
        return greedy_score(trainer.model, tokenizer, eval_set, addition_reward, shared["max_completion_length"])

    timer = StepTimer()
    trainer.add_callback(timer.callback)
    curve = HeldOutCurve(score, eval_every, "held-out accuracy", printer=lambda *a, **k: None)
    curve.measure(0)
    trainer.add_callback(curve)
    started, evaluated_before = time.perf_counter(), curve.seconds
    trainer.train()
    train_wall = time.perf_counter() - started - (curve.seconds - evaluated_before)  # evaluation left out
    curve.measure(trainer.state.global_step)
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
        "curve": curve.points,
        "eval_seconds": curve.seconds,
        "step_seconds": [wall for wall, _ in timer.steps],
        "step_cpu_seconds": [cpu for _, cpu in timer.steps],
        "train_wall_seconds": train_wall,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def launch(study: str, arm: str, seed: int, lr: float, steps: int, every: int, prompts: int, path: Path, log) -> None:
    """`train_one` in a fresh one-thread process (skipped when its result file exists)."""
    if path.exists():
        return
    command = [
        sys.executable,
        __file__,
        "--one",
        study,
        arm,
        *(str(x) for x in (seed, lr, steps, every, prompts, path)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started, console = time.perf_counter(), path.with_suffix(".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(console, "w") as out:  # a file, not a pipe: the run outlives an interrupted driver
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{path.stem} failed ({code}); its console: {console}")
    log(f"{path.stem}: {time.perf_counter() - started:.0f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=list(STUDIES), default="compare")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: results/<the study's folder>")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="default: the study's")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None, help="default: the study's")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the study's (64 unless it says)")
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out problems (at most 200)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--replot", action="store_true", help="only the report, from the saved runs")
    parser.add_argument("--one", nargs=8, help=argparse.SUPPRESS)  # a single run, in the child process
    options = parser.parse_args(argv)
    if options.one:
        study, arm, seed, lr, steps, every, prompts, path = options.one
        train_one(study, arm, int(seed), float(lr), int(steps), int(every), int(prompts), Path(path))
        return
    import real_model_report

    study = STUDIES[options.study]
    options.output_dir = options.output_dir or RESULTS / study["folder"]
    options.max_steps = options.max_steps or study.get("steps", 64)
    if not options.replot:
        from trl_gspo.common.model_store import SMOLLM2, SOURCE_VARIABLE, resolve_model

        # one source for every run, decided here: each child would otherwise ask the network on its own
        os.environ[SOURCE_VARIABLE] = resolve_model(SMOLLM2).source
        plan = [
            (arm, seed, lr)
            for seed in options.seeds
            for lr in (options.learning_rates or study["learning_rates"])
            for arm in (options.arms or study["arms"])
        ]
        runs = options.output_dir / "runs"
        with ThreadPoolExecutor(options.jobs) as pool:
            jobs = [
                pool.submit(
                    launch,
                    *(options.study, arm, seed, lr, options.max_steps, options.eval_every, options.eval_prompts),
                    runs / f"{run_name(arm, lr, seed)}.json",
                    print,
                )
                for arm, seed, lr in plan
            ]
            for job in jobs:
                job.result()
    band_only = options.study != "compare" and not study.get("settings") and "prompt" not in study
    real_model_report.report(options.output_dir, with_references=band_only)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
