"""`make gpu-check`: every GPU check of trl-gspo in one go, on whatever GPUs are present (docs/gpu-check.md).

    python benchmarks/gpu_check.py                                  # every part that can run here
    python benchmarks/gpu_check.py --parts parity_bf16,demo_cuda    # some parts; the other parts' results are kept
    python benchmarks/gpu_check.py --dry-run                        # list the parts and why each would skip

Each part runs in a fresh process with its own time budget. A part whose GPU or package is missing is skipped with
the reason; a part that fails, crashes or runs out of time records that (with the end of its log) and the next part
starts. Results go to `benchmarks/results/gpu-check.json` (every number each part reported) and `gpu-check.md`
(one table), rewritten after every part; each part's log to `benchmarks/results/gpu-check-logs/`. A run of some
parts keeps the other parts' entries, so the check can also be run in pieces. The budgets of the parts that run on
one GPU add up to 28 minutes, and `--max-minutes` (30) caps the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
RESULTS = os.path.join(BENCHMARKS, "results")
JSON_NAME, TABLE_NAME, LOG_DIR = "gpu-check.json", "gpu-check.md", "gpu-check-logs"


# ------------------------------------------------------------------------------------------------ environment
def environment() -> dict:
    """GPUs and the packages the parts need; nothing here imports TRL (a missing TRL must not stop the check)."""
    from importlib import metadata

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    versions = {}
    for name in ("torch", "trl", "transformers", "accelerate", "peft", "datasets", "deepspeed", "vllm", "flash-attn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    modules = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "flash_attn", "deepspeed")}
    return {"gpus": gpus, "cuda": torch.version.cuda, "versions": versions, "supported": _supported_ranges(),
            "modules": modules, "python": platform.python_version()}


#: Packages every part imports, checked against trl-gspo's supported ranges (pyproject.toml's dependencies).
CORE = ("torch", "trl", "transformers", "accelerate", "datasets")


def _supported_ranges() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library; the ranges go unchecked
        return {}
    from packaging.requirements import Requirement

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        requirements = [Requirement(line) for line in tomllib.load(f)["project"]["dependencies"]]
    order = {">": 0, "!": 1, "<": 2}  # lower bound first, as pyproject.toml writes them
    return {req.name: ",".join(sorted(map(str, req.specifier), key=lambda spec: order.get(spec[0], 1)))
            for req in requirements if req.name in CORE}  # fmt: skip


def _core(env) -> list[str]:
    """A missing core package, or one outside the supported range (e.g. an image's older transformers)."""
    from packaging.specifiers import SpecifierSet

    reasons = []
    for name in CORE:
        version, wanted = env["versions"].get(name), env.get("supported", {}).get(name)
        if version is None:
            reasons.append(f"{name} not installed")
        elif wanted and not SpecifierSet(wanted).contains(version.split("+")[0], prereleases=True):
            reasons.append(f"{name} {version} outside the supported {wanted}")
    return reasons


def _cuda(env) -> list[str]:
    return [] if env["gpus"] else ["no CUDA GPU visible"]


def _modules(*names) -> Callable[[dict], list[str]]:
    return lambda env: [f"{name} not installed" for name in names if not env["modules"].get(name)]


def _needs(*checks) -> Callable[[dict], list[str]]:
    """Reasons a part cannot run here (all of them, so a dry run on CPU says everything a GPU machine must have)."""
    base = (_cuda, _core)
    return lambda env: [reason for check in (*base, *checks) for reason in check(env)]


def _two_gpus(env) -> list[str]:
    return [] if len(env["gpus"]) >= 2 else [f"needs 2 GPUs, {len(env['gpus'])} visible"]


# ------------------------------------------------------------------------------------------------ the parts
@dataclasses.dataclass
class Part:
    """One check: what it shows, its time budget, why it cannot run here, and the command that writes its result
    JSON to the path it is given."""

    name: str
    what: str
    budget_s: int
    missing: Callable[[dict], list[str]]
    command: Callable[[str], list[str]]
    headline: Callable[[dict], dict] = lambda result: {}
    note: Callable[[dict], str] = lambda env: ""


def _self(part: str) -> Callable[[str], list[str]]:
    """Command of a part implemented in this file (`run_part`)."""
    return lambda out: [sys.executable, os.path.abspath(__file__), "--part", part, "--result", out]


def _bench(*scenarios: str) -> Callable[[str], list[str]]:
    return lambda out: [sys.executable, os.path.join(BENCHMARKS, "run.py"), "--device", "cuda", "--reps", "1",
                        "--scenarios", ",".join(scenarios), "--out", out]  # fmt: skip


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


def _bench_headline(result: dict) -> dict:
    """ours/stock seconds per step (and MFU, peak memory) per scenario of `benchmarks/run.py`'s JSON, at any depth
    (a layout scenario nests shape -> variant), named by their path."""
    found = {}

    def walk(path: str, node: dict):
        for key in ("ratio_seconds_per_step", "ratio_seconds", "ratio_ours_over_stock"):  # wall time, memory
            if isinstance(node.get(key), float):
                found[f"{path} ours/stock"] = _round(node[key], 3)
        for kind, mfu in (node.get("mfu") or {}).items():
            if isinstance(mfu, float):
                found[f"{path} MFU {kind}"] = _round(mfu, 3)
        for key, value in node.items():
            if isinstance(value, dict) and key not in ("mfu", "median", "runs"):
                walk(f"{path}.{key}", value)

    for name, scenario in result.get("scenarios", {}).items():
        walk(name, scenario)
    if "attention" in result:
        found["attention"] = result["attention"]
    return found


def _packing_note(env) -> str:
    if env["modules"].get("flash_attn"):
        return "packed rows run flash-attention's varlen kernels"
    return "flash-attn not installed: packed rows run sdpa with a block-diagonal mask, not varlen kernels"


PARTS = [
    Part("parity_bf16", "bf16 loss and gradients of GSPOTrainer vs stock GRPOTrainer on the GPU, each against fp32",
         150, _needs(), _self("parity_bf16"),
         lambda r: {"cases passed": f"{r['passed']}/{len(r['cases'])}",
                    "worst grad error ours": r["worst"]["ours"], "stock": r["worst"]["stock"]}),
    Part("demo_cuda", "`trl-gspo demo` on one GPU in bf16, 300 steps: the held-out reward must rise as on CPU",
         120, _needs(), _self("demo_cuda"),
         lambda r: {"held-out": f"{r['before']:.3f} -> {r['after']:.3f}", "train s": round(r["train_seconds"], 1)}),
    Part("benchmark", "`benchmarks/run.py --device cuda`: ours vs stock seconds/step and MFU with equal settings and "
         "with sampler log-prob reuse, log-prob memory (Qwen3-0.6B shape, bf16, 1 repetition)", 480, _needs(),
         _bench("equal_settings", "sampler_logprobs", "logprob_memory"), _bench_headline),
    Part("loss_path", "`benchmarks/run.py --device cuda --scenarios loss_path`: _compute_loss + backward alone, ours "
         "vs stock (the loss pipeline's overhead)", 180, _needs(), _bench("loss_path"), _bench_headline),
    Part("packing", "layouts vs stock, training phase: long-tail rollouts at two batch shapes (the default layout, "
         "trim + sort, packing) and ~1024-token prompts (shared prefixes, whole-group mini-batches)",
         420, _needs(), _bench("long_tail", "long_prompt"), _bench_headline, _packing_note),
    Part("vllm_routes", "`benchmarks/vllm_routes_smoke.py`: vLLM returns MoE routes R3 can replay; sampler/trainer "
         "route mismatch", 120, _needs(_modules("vllm")),
         lambda out: [sys.executable, os.path.join(BENCHMARKS, "vllm_routes_smoke.py"), "--out", out],
         lambda r: {"vllm": r.get("engine"), "route mismatch (token, layer)": _round(r.get("mismatch_token_layer"))}),
    Part("vllm_colocate", "GSPO training with colocated vLLM, old_logprobs_source='sampler' and routing_replay='R3' "
         "on a tiny Qwen3-MoE", 210, _needs(_modules("vllm")), _self("vllm_colocate"),
         lambda r: {k: _round(r.get(k)) for k in ("pi_old_passes", "sampler_logp_abs_diff", "r3_sampler_mismatch",
                                                   "replay_coverage")}),  # fmt: skip
    Part("zero2", "2-GPU DeepSpeed ZeRO-2 demo (shipped accelerate config): trains, saves a full model",
         240, _needs(_two_gpus, _modules("deepspeed")), _self("zero2"),
         lambda r: {"held-out": r.get("held_out"), "steps": r.get("steps")}),
    Part("zero3", "2-GPU DeepSpeed ZeRO-3 demo (shipped accelerate config): trains, gathers and saves a full model",
         240, _needs(_two_gpus, _modules("deepspeed")), _self("zero3"),
         lambda r: {"held-out": r.get("held_out"), "steps": r.get("steps")}),
]  # fmt: skip


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
    for label, cls, config_cls, dtype in (("reference", GRPOTrainer, GRPOConfig, torch.float32),
                                          ("stock", GRPOTrainer, GRPOConfig, torch.bfloat16),
                                          ("ours", GSPOTrainer, GSPOConfig, torch.bfloat16)):  # fmt: skip
        model = copy.deepcopy(fp32).to(device=device, dtype=dtype)
        runs[label] = parity.loss_and_grads(cls, config_cls, model, settings, inputs, f"{workdir}/{label}", tokenizer)
    (loss_stock, grad_stock), (loss_ours, grad_ours) = (_errors(runs[k], runs["reference"]) for k in ("stock", "ours"))
    passed = (bool(torch.isfinite(runs["ours"][0])) and loss_ours <= SLACK * loss_stock + LOSS_FLOOR
              and grad_ours <= SLACK * grad_stock + GRAD_FLOOR)  # fmt: skip
    return {"passed": passed, "loss_fp32": float(runs["reference"][0]), "loss_error_stock": loss_stock,
            "loss_error_ours": loss_ours, "grad_error_stock": grad_stock, "grad_error_ours": grad_ours,
            "loss_ours_minus_stock": float(runs["ours"][0]) - float(runs["stock"][0])}  # fmt: skip


def parity_bf16(device: str = "cuda") -> dict:
    """`BF16_CASES` on a dense tiny Qwen3 and `BF16_MOE_CASES` on a tiny Qwen3-MoE (hidden 256), in bf16 on `device`."""
    from transformers import AutoModelForCausalLM

    from trl_gspo.cli import parity
    from trl_gspo.cli.tiny import build_tiny_model, build_tokenizer

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
    problems = [f"{name}: loss error {c['loss_error_ours']:.3g} (stock {c['loss_error_stock']:.3g}), gradient error "
                f"{c['grad_error_ours']:.3g} (stock {c['grad_error_stock']:.3g})"
                for name, c in cases.items() if not c["passed"]]  # fmt: skip
    worst = {who: max(c[f"grad_error_{who}"] for c in cases.values()) for who in ("ours", "stock")}
    return {"status": "failed" if problems else "ok", "problems": problems, "passed": len(cases) - len(problems),
            "cases": cases, "worst": worst, "wide_clip": WIDE_CLIP, "device": device,
            "rule": f"error(ours) <= {SLACK} * error(stock) + {LOSS_FLOOR} (loss) / {GRAD_FLOOR} (gradient, relative)"}


# ------------------------------------------------------------------------------------------------ demo and smoke runs
#: Held-out reward the CPU demo reaches after 300 steps (seeds 0-3: 0.23-0.31, tests/test_cli.py); a GPU run must too.
DEMO_STEPS, DEMO_MIN_AFTER = 300, 0.15


def demo_cuda() -> dict:
    from trl_gspo.cli.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as work:
        result = run_demo(work, use_cpu=False, bf16=True, max_steps=DEMO_STEPS, logging_steps=50)
    learned = result["after"] >= DEMO_MIN_AFTER
    return {"status": "ok" if learned else "failed", "before": result["before"], "after": result["after"],
            "train_seconds": result["train_seconds"], "steps": DEMO_STEPS,
            "expected": f"held-out reward after {DEMO_STEPS} steps >= {DEMO_MIN_AFTER} (CPU: 0.23-0.31)"}  # fmt: skip


@contextlib.contextmanager
def _count_no_grad_forwards():
    """Counts the log-prob forwards that run the model without gradient (beta = 0: TRL's pi_old pass, nothing else):
    the forward pipeline's model-running step (forward.py, after sampler reuse had its chance to answer) and TRL's
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
    from trl_gspo.cli.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as work:
        path = save_tiny_model(f"{work}/moe", moe=True)
        args = GSPOConfig(
            output_dir=f"{work}/out", use_cpu=device == "cpu", bf16=device == "cuda", learning_rate=1e-3,
            max_steps=max_steps, logging_steps=1, per_device_train_batch_size=8, num_generations=4,
            steps_per_generation=4, max_completion_length=8, report_to=[], save_strategy="no", disable_tqdm=True,
            old_logprobs_source="sampler", routing_replay="R3", use_vllm=use_vllm, vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
        )  # fmt: skip
        trainer = GSPOTrainer(path, demo_reward, args=args, train_dataset=make_demo_dataset(64))
        use_console(trainer)  # one line per step in the part's log
        with _count_no_grad_forwards() as passes:
            trainer.train()
        rows = [row for row in trainer.state.log_history if "loss" in row]

    def values(key):
        return [row[key] for row in rows if key in row]

    found = {"steps": len(rows), "pi_old_passes": passes[0],
             "sampler_logp_abs_diff": max(values("sampler/logp_abs_diff/mean"), default=None),
             "r3_sampler_mismatch": max(values("moe/r3/sampler_mismatch"), default=None),
             "replay_coverage": min(values("moe/replay/coverage"), default=None), "engine": "vllm" if use_vllm else
             "transformers generate"}  # fmt: skip
    problems = [f"{max_steps - len(rows)} steps not logged"] if len(rows) != max_steps else []
    problems += ["a loss is not finite"] if not all(math.isfinite(row["loss"]) for row in rows) else []
    problems += [f"TRL's pi_old pass ran {passes[0]} times (sampler log-probs not reused)"] if passes[0] else []
    problems += [f"{key} never logged" for key in ("sampler_logp_abs_diff", "r3_sampler_mismatch")
                 if found[key] is None]  # fmt: skip
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
    launch = ["--config_file", str(config), "--num_processes", str(num_processes), "--main_process_port",
              str(_free_port())]  # fmt: skip
    demo = ["--use_cpu", "false", "--bf16", "true", "--max_steps", str(ZERO_STEPS), "--logging_steps", "10",
            "--num_eval_prompts", "50", "--output_dir", output_dir]  # fmt: skip
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
        proc = subprocess.Popen(zero_command(stage, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO_ROOT)  # fmt: skip
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
    return {"status": "failed" if problems else "ok", "problems": problems, "steps": ZERO_STEPS, "exit_code": code,
            "held_out": f"{held_out[1]} -> {held_out[2]}" if held_out else None}  # fmt: skip


IN_PROCESS = {"parity_bf16": parity_bf16, "demo_cuda": demo_cuda, "vllm_colocate": vllm_colocate,
              "zero2": lambda: zero(2), "zero3": lambda: zero(3)}  # fmt: skip


def run_part(name: str, result_path: str) -> int:
    """Child process of one part: run it, write its result JSON; exit 1 when its check failed."""
    from trl_gspo.cli.console import quiet_library_deprecations

    quiet_library_deprecations()  # as the command line does: the part's log shows the warnings that matter
    result = IN_PROCESS[name]()
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result.get("status") == "ok" else 1


# ------------------------------------------------------------------------------------------------ the driver
def _kill(proc: subprocess.Popen) -> None:
    """Stop a part and everything it started (vLLM workers, accelerate ranks): its whole process group."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def _tail(path: str, lines: int = 30) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def execute(part: Part, budget_s: float, out_dir: str) -> dict:
    """Run one part in its own process group under `budget_s`; never raises."""
    os.makedirs(os.path.join(out_dir, LOG_DIR), exist_ok=True)
    log_rel = os.path.join(LOG_DIR, f"{part.name}.log")  # relative: the results hold no path of this machine
    entry = {"log": log_rel, "budget_s": round(budget_s)}
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part.name}-") as work:
        entry.update(_execute(part, budget_s, os.path.join(work, "result.json"), os.path.join(out_dir, log_rel)))
    if entry["status"] != "ok":
        entry["log_tail"] = _tail(os.path.join(out_dir, log_rel))
    return entry


def _execute(part: Part, budget_s: float, result_path: str, log_path: str) -> dict:
    entry = {}
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")  # fmt: skip
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(part.command(result_path), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                    env=env, start_new_session=True)  # fmt: skip
            try:
                code = proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                code = None
    except Exception as err:  # noqa: BLE001 - the driver goes on to the next part whatever happened here
        entry.update(status="error", error=f"{type(err).__name__}: {err}")
        entry["seconds"] = round(time.perf_counter() - start, 1)
        return entry
    entry["seconds"] = round(time.perf_counter() - start, 1)
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            with contextlib.suppress(ValueError):
                result = json.load(f)
    if result is not None:
        entry["result"] = result
        try:
            entry["headline"] = part.headline(result)
        except Exception as err:  # noqa: BLE001 - a result without the expected numbers is still kept whole
            entry["headline"] = {"unreadable": f"{type(err).__name__}: {err}"}
    if code is None:
        entry.update(status="timeout", error=f"stopped after its {round(budget_s)} s budget "
                     f"({'partial result kept' if result else 'no result'})")  # fmt: skip
    elif code == 0 and result is not None:
        entry["status"] = result.get("status", "ok")
    elif result is not None and result.get("status") == "failed":
        entry.update(status="failed", error="; ".join(result.get("problems", [])) or "see result")
    else:
        entry.update(status="error", error=f"exit code {code}" + ("" if result else ", no result"))
    return entry


def markdown(report: dict) -> str:
    env = report["environment"]
    gpus = ", ".join(env["gpus"]) or "none"
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines = [f"# `make gpu-check`, {report['updated']}", "", f"GPUs: {gpus} (CUDA {env['cuda']}). {versions}.", "",
             "| part | checks | status | time (budget) | result |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for part in PARTS:
        entry = report["parts"].get(part.name)
        if entry is None:
            continue
        if entry["status"] == "skipped":
            result, time_ = entry["reason"], "-"
        else:
            numbers = "; ".join(f"{k} {v}" for k, v in (entry.get("headline") or {}).items())
            result = "; ".join(filter(None, [numbers, entry.get("error"), entry.get("note")]))
            time_ = f"{entry.get('seconds', '-')} s ({entry.get('budget_s')} s)"
        lines.append(f"| {part.name} | {part.what} | {entry['status']} | {time_} | {result.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def scrub(text: str) -> str:
    """The results are committed: paths of this machine in error messages and log tails become placeholders."""
    text = text.replace(REPO_ROOT, "<repo>")
    text = re.sub(r"(?<![\w.<>])/[^\s'\"<>]*?/(?:site|dist)-packages/", "<site-packages>/", text)
    return re.sub(r"(?<![\w.~$<>-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+)/", "<home>/", text)


def save(report: dict, out_dir: str) -> None:
    """gpu-check.json and gpu-check.md (the logs stay beside them, unscrubbed and git-ignored)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, JSON_NAME), "w") as f:
        f.write(scrub(json.dumps(report, indent=2)))
    with open(os.path.join(out_dir, TABLE_NAME), "w") as f:
        f.write(scrub(markdown(report)))


def _print(message: str) -> None:
    print(message, flush=True)  # flushed: under make or a pipe the progress would otherwise arrive at the end


def run(parts: list[Part], env: dict, out_dir: str | None, dry_run: bool = False, max_seconds: float = 1800,
        keep: dict | None = None, log=_print) -> dict:  # fmt: skip
    """Run (or, with `dry_run`, only plan) `parts` in order; results are saved after each part when `out_dir` is set.
    `keep`: entries of parts not run this time (from an earlier report), kept in the new one; each entry says when
    and on which GPUs it ran."""
    report = {"updated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": env,
              "max_minutes": max_seconds / 60, "parts": dict(keep or {})}  # fmt: skip
    start = time.perf_counter()
    for part in parts:
        reasons = part.missing(env)
        left = max_seconds - (time.perf_counter() - start)
        if not reasons and left < 30:
            reasons = [f"only {left:.0f} s of the run's {max_seconds:.0f} s (--max-minutes) left"]
        if reasons:
            entry = {"status": "skipped", "reason": "; ".join(reasons)}
        elif dry_run:
            entry = {"status": "would run", "reason": f"budget {part.budget_s} s", "budget_s": part.budget_s}
        else:
            log(f"gpu-check: {part.name} (budget {min(part.budget_s, left):.0f} s) ...")
            entry = execute(part, min(part.budget_s, left), out_dir)
        if part.note(env) and entry["status"] != "skipped":
            entry["note"] = part.note(env)
        entry.update(ran_at=report["updated"], gpus=env["gpus"])
        report["parts"][part.name] = entry
        took = f" ({entry['seconds']} s)" if "seconds" in entry else ""
        log(f"  {part.name:<14} {entry['status']:<9} {entry.get('reason') or entry.get('error') or ''}{took}")
        if out_dir is not None:
            save(report, out_dir)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [part.name for part in PARTS]
    parser.add_argument("--parts", default=",".join(names), help=f"comma-separated subset of: {', '.join(names)}")
    parser.add_argument("--dry-run", action="store_true", help="list every part and why it would skip; run nothing")
    parser.add_argument("--out-dir", default=None,
                        help="where gpu-check.json/.md and the logs go (default: benchmarks/results; a dry run writes "
                             "nothing unless given one)")  # fmt: skip
    parser.add_argument("--max-minutes", type=float, default=30, help="cap on the whole run (default 30)")
    parser.add_argument("--fresh", action="store_true", help="drop the results of parts not run this time")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part is not None:
        return run_part(args.part, args.result)

    wanted = args.parts.split(",")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    out_dir = args.out_dir or (None if args.dry_run else RESULTS)
    keep = {}
    if out_dir is not None and not args.fresh and os.path.exists(os.path.join(out_dir, JSON_NAME)):
        with open(os.path.join(out_dir, JSON_NAME)) as f:
            keep = {k: v for k, v in json.load(f).get("parts", {}).items() if k not in wanted}
    env = environment()
    print(f"gpu-check: GPUs {env['gpus'] or 'none'}, CUDA {env['cuda'] or 'none'}; "
          + ", ".join(f"{k} {v or 'not installed'}" for k, v in env["versions"].items()), flush=True)  # fmt: skip
    report = run([p for p in PARTS if p.name in wanted], env, out_dir, args.dry_run, args.max_minutes * 60, keep)
    if out_dir is not None:
        print(f"gpu-check: results in {os.path.relpath(os.path.join(out_dir, JSON_NAME))} and {TABLE_NAME}")
    bad = [name for name, entry in report["parts"].items() if name in wanted and entry["status"] in
           ("failed", "error", "timeout")]  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
