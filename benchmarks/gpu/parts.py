"""The parts of `make gpu-check` implemented here rather than by another script: bf16 parity against stock TRL,
the demo on a GPU, colocated sampling with the no-grad forward count (`vllm_colocate`), and 2-GPU ZeRO-2 / ZeRO-3
demo runs. Each runs in a child process of the driver (check.py, `run_part`), which records its result. It imports no
other module of this folder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------ parity, bf16
#: Parity cases run in bf16 (names from `trl_gspo.cli.parity`). Clip ranges are widened to 0.2 in the clipped ones:
#: bf16 rounding moves ratios by ~1e-3, which at GSPO's 3e-4 range would flip clip decisions and turn rounding into
#: O(1) differences. The clipping logic itself is checked exactly in fp32 by `trl-gspo check`.
BF16_CASES = ("sequence-grpo (GSPO)", "token-grpo", "sequence-grpo-kl", "sequence-sapo", "token-sapo")
BF16_MOE_CASES = ("sequence-grpo-moe-aux",)
WIDE_CLIP = dict(epsilon=0.2, epsilon_high=0.2)
#: ours must be as close to the fp32 result as stock is: error(ours) <= SLACK * error(stock) + floor.
SLACK, LOSS_FLOOR, GRAD_FLOOR = 2.0, 1e-3, 1e-2


def _errors(result, reference) -> tuple[float, float]:
    """(|loss - reference loss|, global relative L2 error of the gradients) against the fp32 reference."""
    (loss, grads, _), (ref_loss, ref_grads, _) = result, reference
    if grads.keys() != ref_grads.keys():
        return float("inf"), float("inf")
    diff = sum(float(((grads[n].double().cpu() - g.double().cpu()) ** 2).sum()) for n, g in ref_grads.items())
    norm = sum(float((g.double().cpu() ** 2).sum()) for g in ref_grads.values())
    return abs(float(loss) - float(ref_loss)), (diff / max(norm, 1e-300)) ** 0.5


def _bf16_case(settings: dict, fp32, tokenizer, workdir: str, device: str) -> dict:
    """One case three times on `device`, from the same weights and batch: stock in fp32 (the reference), stock in
    bf16 and ours in bf16. Passes when ours is not meaningfully farther from the fp32 result than stock is."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli import parity

    inputs = parity.make_inputs(fp32, seed=2, beta=settings.get("beta", 0) > 0)
    runs = {}
    for label, cls, config_cls, dtype in (
        ("reference", GRPOTrainer, GRPOConfig, torch.float32),
        ("stock", GRPOTrainer, GRPOConfig, torch.bfloat16),
        ("ours", GSPOTrainer, GSPOConfig, torch.bfloat16),
    ):
        model = copy.deepcopy(fp32).to(device=device, dtype=dtype)
        runs[label] = parity.loss_and_grads(cls, config_cls, model, settings, inputs, f"{workdir}/{label}", tokenizer)
    (loss_stock, grad_stock), (loss_ours, grad_ours) = (_errors(runs[k], runs["reference"]) for k in ("stock", "ours"))
    passed = (
        bool(torch.isfinite(runs["ours"][0]))
        and loss_ours <= SLACK * loss_stock + LOSS_FLOOR
        and grad_ours <= SLACK * grad_stock + GRAD_FLOOR
    )
    return {
        "passed": passed,
        "loss_fp32": float(runs["reference"][0]),
        "loss_error_stock": loss_stock,
        "loss_error_ours": loss_ours,
        "grad_error_stock": grad_stock,
        "grad_error_ours": grad_ours,
        "loss_ours_minus_stock": float(runs["ours"][0]) - float(runs["stock"][0]),
    }


def parity_bf16(device: str = "cuda") -> dict:
    """`BF16_CASES` on a dense tiny Qwen3 and `BF16_MOE_CASES` on a tiny Qwen3-MoE (hidden 256), in bf16 on `device`."""
    from transformers import AutoModelForCausalLM

    from trl_gspo.cli import parity
    from trl_gspo.testing import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    cases = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-parity-") as work:
        for moe, names in ((False, BF16_CASES), (True, BF16_MOE_CASES)):
            path = f"{work}/model-{'moe' if moe else 'dense'}"  # saved: with beta > 0 TRL loads the reference from it
            build_tiny_model(tokenizer, moe=moe, seed=0, hidden_size=256, num_layers=2).save_pretrained(path)
            fp32 = AutoModelForCausalLM.from_pretrained(path)
            for name in names:
                settings = dict(parity.CASES.get(name) or parity.MOE_CASES[name])
                settings.update(WIDE_CLIP if "epsilon" in settings else {})
                cases[name] = _bf16_case(settings, fp32, tokenizer, f"{work}/{len(cases)}", device)
    problems = [
        f"{name}: loss error {c['loss_error_ours']:.3g} (stock {c['loss_error_stock']:.3g}), gradient error "
        f"{c['grad_error_ours']:.3g} (stock {c['grad_error_stock']:.3g})"
        for name, c in cases.items()
        if not c["passed"]
    ]
    worst = {who: max(c[f"grad_error_{who}"] for c in cases.values()) for who in ("ours", "stock")}
    return {
        "status": "failed" if problems else "ok",
        "problems": problems,
        "passed": len(cases) - len(problems),
        "cases": cases,
        "worst": worst,
        "wide_clip": WIDE_CLIP,
        "device": device,
        "rule": f"error(ours) <= {SLACK} * error(stock) + {LOSS_FLOOR} (loss) / {GRAD_FLOOR} (gradient, relative)",
    }


# ------------------------------------------------------------------------------------------------ demo and smoke runs
#: Held-out reward the CPU demo reaches after 300 steps (seeds 0-3: 0.23-0.31, tests/test_cli.py); a GPU run must too.
DEMO_STEPS, DEMO_MIN_AFTER = 300, 0.15


def demo_cuda() -> dict:
    from trl_gspo.cli.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as work:
        result = run_demo(work, use_cpu=False, bf16=True, max_steps=DEMO_STEPS, logging_steps=50)
    learned = result["after"] >= DEMO_MIN_AFTER
    return {
        "status": "ok" if learned else "failed",
        "before": result["before"],
        "after": result["after"],
        "train_seconds": result["train_seconds"],
        "steps": DEMO_STEPS,
        "expected": f"held-out reward after {DEMO_STEPS} steps >= {DEMO_MIN_AFTER} (CPU: 0.23-0.31)",
    }


@contextlib.contextmanager
def _count_no_grad_forwards():
    """Counts the log-prob forwards that run the model without gradient (beta = 0: TRL's pi_old pass, nothing else):
    the forward pipeline's model-running step (forward/pipeline.py, after sampler reuse had its chance to answer) and TRL's
    own padded loop, which the pipeline falls back to for multimodal inputs."""
    import torch
    from trl import GRPOTrainer

    from trl_gspo.forward.pipeline import LogprobForward

    targets = [(LogprobForward, "_planned_forward"), (GRPOTrainer, "_get_per_token_logps_and_entropies")]
    originals, passes = [vars(cls)[name] for cls, name in targets], [0]

    def counting(original):
        def counted(self, *args, **kwargs):
            passes[0] += not torch.is_grad_enabled()
            return original(self, *args, **kwargs)

        return counted

    for (cls, name), original in zip(targets, originals):
        setattr(cls, name, counting(original))
    try:
        yield passes
    finally:
        for (cls, name), original in zip(targets, originals):
            setattr(cls, name, original)


def vllm_colocate(use_vllm: bool = True, device: str = "cuda", max_steps: int = 8) -> dict:
    """Train a tiny Qwen3-MoE with the sampler's log-probs as pi_old and the sampler's routes replayed (R3).

    Checks that TRL's pi_old pass never ran (reuse), that the sampler/trainer log-prob gap and route mismatch were
    logged, that replay covered completion tokens and that every loss is finite. `use_vllm=False` samples with
    transformers `generate` instead (the same features on CPU: how the test suite runs this function)."""
    import math

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.cli.console import use_console
    from trl_gspo.cli.demo import demo_reward, make_demo_dataset
    from trl_gspo.testing import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as work:
        path = save_tiny_model(f"{work}/moe", moe=True)
        args = GSPOConfig(
            output_dir=f"{work}/out",
            use_cpu=device == "cpu",
            bf16=device == "cuda",
            learning_rate=1e-3,
            max_steps=max_steps,
            logging_steps=1,
            per_device_train_batch_size=8,
            num_generations=4,
            steps_per_generation=4,
            max_completion_length=8,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            old_logprobs_source="sampler",
            routing_replay="R3",
            use_vllm=use_vllm,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
        )
        trainer = GSPOTrainer(path, demo_reward, args=args, train_dataset=make_demo_dataset(64))
        use_console(trainer)  # one line per step in the part's log
        with _count_no_grad_forwards() as passes:
            trainer.train()
        rows = [row for row in trainer.state.log_history if "loss" in row]
        last = trainer._buffered_inputs[0]  # the last rollout: the size of its log-probs and of its rows

    def values(key):
        return [row[key] for row in rows if key in row]

    found = {
        "steps": len(rows),
        "pi_old_passes": passes[0],
        "sampler_logp_abs_diff": max(values("sampler/logp_abs_diff/mean"), default=None),
        "logp_scale": last["old_per_token_logps"].abs().max().item(),
        "positions": last["prompt_ids"].size(1) + last["completion_ids"].size(1),
        "r3_sampler_mismatch": max(values("moe/r3/sampler_mismatch"), default=None),
        "replay_coverage": min(values("moe/replay/coverage"), default=None),
        "engine": "vllm" if use_vllm else "transformers generate",
    }
    problems = [f"{max_steps - len(rows)} steps not logged"] if len(rows) != max_steps else []
    problems += ["a loss is not finite"] if not all(math.isfinite(row["loss"]) for row in rows) else []
    problems += [f"TRL's pi_old pass ran {passes[0]} times (sampler log-probs not reused)"] if passes[0] else []
    problems += [
        f"{key} never logged" for key in ("sampler_logp_abs_diff", "r3_sampler_mismatch") if found[key] is None
    ]
    problems += ["routing replay covered no completion token"] if not found["replay_coverage"] else []
    return {"status": "failed" if problems else "ok", "problems": problems, **found}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ZERO_STEPS = 30


def zero_command(stage: int, output_dir: str, num_processes: int = 2) -> list[str]:
    """`accelerate launch` of the demo on `num_processes` GPUs with the shipped ZeRO-`stage` config."""
    from trl_gspo.cli.shipped import resolve_shipped

    config = resolve_shipped(f"zero{stage}", "accelerate config")
    launch = [
        "--config_file",
        str(config),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(_free_port()),
    ]
    demo = [
        "--config",
        "demo",  # the copy task's tiny model: what check_saved_demo rebuilds and compares
        "--use_cpu",
        "false",
        "--bf16",
        "true",
        "--max_steps",
        str(ZERO_STEPS),
        "--logging_steps",
        "10",
        "--num_eval_prompts",
        "50",
        "--output_dir",
        output_dir,
    ]
    return [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "trl_gspo", "demo", *demo]


def check_saved_demo(output_dir: str, steps: int, moe: bool = False) -> list[str]:
    """Problems with a finished demo run's folder: logged steps, and a saved model with every weight at full shape
    (ZeRO-3 must gather its shards on save) that differs from the initial weights."""
    import csv

    import torch
    from transformers import AutoModelForCausalLM

    from trl_gspo.cli.demo import build_demo_model

    problems = []
    try:
        rows = list(csv.DictReader(open(os.path.join(output_dir, "metrics.csv"))))
        saved = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()
    except Exception as err:  # noqa: BLE001 - a missing or broken output is the finding
        return [f"output unreadable: {type(err).__name__}: {err}"]
    if not rows or int(rows[-1]["step"]) != steps:
        problems.append(f"metrics.csv ends at step {rows[-1]['step'] if rows else None}, expected {steps}")
    initial = build_demo_model(seed=0, moe=moe)[0].state_dict()
    if saved.keys() != initial.keys():
        return [*problems, "saved weights have other names than the model"]
    shapes = [name for name, tensor in saved.items() if tensor.shape != initial[name].shape]
    problems += [f"weights saved at the wrong shape (shards?): {', '.join(shapes[:3])}"] if shapes else []
    changed = sum(not torch.equal(saved[name].float(), initial[name].float()) for name in saved if name not in shapes)
    problems += ["the saved weights look untrained"] if changed <= len(saved) // 2 else []
    return problems


#: Seen on CPU runs (tests/test_multiprocess.py): a rank that finished everything can abort at interpreter exit.
TEARDOWN_ABORT = "terminate called without an active exception"


def zero(stage: int) -> dict:
    """The 2-GPU ZeRO demo; its output streams into the part's log while it runs."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-zero{stage}-") as work:
        out = os.path.join(work, "run")
        proc = subprocess.Popen(
            zero_command(stage, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT
        )
        lines = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        code = proc.wait()
        problems = check_saved_demo(out, ZERO_STEPS)
    log = "".join(lines)
    if code != 0 and (problems or TEARDOWN_ABORT not in log):  # a teardown abort after a complete run is tolerated
        problems.insert(0, f"launcher exited {code}")
    held_out = re.search(r"before (\S+) -> after (\S+)", log)
    return {
        "status": "failed" if problems else "ok",
        "problems": problems,
        "steps": ZERO_STEPS,
        "exit_code": code,
        "held_out": f"{held_out[1]} -> {held_out[2]}" if held_out else None,
    }


IN_PROCESS = {
    "parity_bf16": parity_bf16,
    "demo_cuda": demo_cuda,
    "vllm_colocate": vllm_colocate,
    "zero2": lambda: zero(2),
    "zero3": lambda: zero(3),
}


def run_part(name: str, result_path: str) -> int:
    """Child process of one part: run it, write its result JSON; exit 1 when its check failed."""
    from trl_gspo.cli.console import quiet_library_deprecations

    quiet_library_deprecations()  # as the command line does: the part's log shows the warnings that matter
    result = IN_PROCESS[name]()
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result.get("status") == "ok" else 1
