"""`make gpu-check`: every GPU check of trl-gspo in one go, on whatever GPUs are present (docs/gpu-check.md).

    python -m benchmarks.gpu                                  # every part that can run here
    python -m benchmarks.gpu --parts parity_bf16,demo_cuda    # some parts; the other parts' results are kept
    python -m benchmarks.gpu --dry-run                        # list the parts and why each would skip
    python -m benchmarks.gpu --profile quick                  # `make gpu-quick`: the forward path, 8 minutes
    python -m benchmarks.gpu --profile quick --tiny           # its code on the CPU at toy shapes (no timings)
    python -m benchmarks.gpu routes --dry-run                 # the vllm_routes part alone, with its own options

(from the checkout's root; `make gpu-check` and `make gpu-quick` run it from anywhere.) Each part runs in a fresh
process with its own time budget. A part whose GPU or package is missing is skipped with the reason; a part that
fails, crashes or runs out of time records that (with the end of its log) and the next part starts. Results go to
`benchmarks/results/gpu-check/gpu-check.json` (every number each part reported) and `gpu-check.md` (one table),
rewritten after every part; each part's log to `benchmarks/results/gpu-check/gpu-check-logs/`. A run of some parts
keeps the other parts' entries, so the check can also be run in pieces. The budgets of the parts that run on one GPU
add up to 39 minutes, and `--max-minutes` (45) caps the whole run.

The parts run in-process by this driver (bf16 parity, the demo, colocated sampling, ZeRO runs) are parts.py; the
vLLM route check, routes.py; what the machine has, and why a part cannot run on it, env.py. The quick profile
(`make gpu-quick`: probe, attention, passes, loss; quick.py) fits 8 minutes on one GPU and writes `gpu-quick.json` /
`gpu-quick.md` beside the full run's files. How the folder's modules import each other: __init__.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("WANDB_DISABLED", "true")

from . import quick, routes  # noqa: E402  (the quick profile's parts; the vllm_routes part)
from .env import core, environment, modules, needs, two_gpus  # noqa: E402  (what the machine has)
from .parts import run_part  # noqa: E402  (the parts this driver runs in child processes)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
RESULTS = os.path.join(BENCHMARKS, "results", "gpu-check")  # beside the benchmark's one file per scenario
LOG_DIR = "gpu-check-logs"
#: How a child process runs this driver: as the package, from the checkout's root (its cwd; REPO_ROOT on PYTHONPATH).
ENTRY = [sys.executable, "-m", "benchmarks.gpu"]


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
    """Command of a part this driver runs in its child process (`run_part` of parts.py or quick.py)."""
    return lambda out: [*ENTRY, "--part", part, "--result", out]


def _bench(*scenarios: str) -> Callable[[str], list[str]]:
    return lambda out: [
        sys.executable,
        os.path.join(BENCHMARKS, "run.py"),
        "--device",
        "cuda",
        "--reps",
        "1",
        "--scenarios",
        ",".join(scenarios),
        "--out",
        out,
    ]


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
    if "attention" in result.get("machine", {}):
        found["attention"] = result["machine"]["attention"]
    return found


def _packing_note(env) -> str:
    """Which kernel serves packed and shared calls here (segment_attention.varlen_kernel's rule, in bf16)."""
    if env["modules"].get("torch_varlen"):
        return "packed and shared calls run torch's varlen_attn"
    if env["modules"].get("flash_attn"):
        return "packed and shared calls run flash-attn's varlen kernel"
    return "no fused varlen kernel (torch < 2.10, no flash-attn): 'auto' keeps calls trimmed, explicit settings run SDPA blocks"


PARTS = [
    Part(
        "parity_bf16",
        "bf16 loss and gradients of GSPOTrainer vs stock GRPOTrainer on the GPU, each against fp32",
        150,
        needs(),
        _self("parity_bf16"),
        lambda r: {
            "cases passed": f"{r['passed']}/{len(r['cases'])}",
            "worst grad error ours": r["worst"]["ours"],
            "stock": r["worst"]["stock"],
        },
    ),
    Part(
        "demo_cuda",
        "`trl-gspo demo` on one GPU in bf16, 300 steps: the held-out reward must rise as on CPU",
        120,
        needs(),
        _self("demo_cuda"),
        lambda r: {"held-out": f"{r['before']:.3f} -> {r['after']:.3f}", "train s": round(r["train_seconds"], 1)},
    ),
    Part(
        "benchmark",
        "`benchmarks/run.py --device cuda`: ours vs stock seconds/step and MFU with equal settings and "
        "with sampler log-prob reuse, log-prob memory (Qwen3-0.6B shape, bf16, 1 repetition)",
        900,  # measured on an H100: ~160 s per trainer process, 4 of them, then logprob_memory
        needs(),
        _bench("equal_settings", "sampler_logprobs", "logprob_memory"),
        _bench_headline,
    ),
    Part(
        "loss_path",
        "`benchmarks/run.py --device cuda --scenarios loss_path`: _compute_loss + backward alone, ours "
        "vs stock (the loss pipeline's overhead)",
        420,  # did not finish in 180 s on an H100 (200 alternations of 4 loss passes at the 0.6B shape)
        needs(),
        _bench("loss_path"),
        _bench_headline,
    ),
    Part(
        "packing",
        "layouts vs stock, training phase: long-tail rollouts at two batch shapes (the default layout, "
        "trim + sort, packing) and ~1024-token prompts (shared prefixes, whole-group mini-batches)",
        420,
        needs(),
        _bench("long_tail", "long_prompt"),
        _bench_headline,
        _packing_note,
    ),
    Part(
        "vllm_routes",
        "`python -m benchmarks.gpu routes`: vLLM returns MoE routes R3 can replay; sampler/trainer route mismatch",
        120,
        needs(modules("vllm")),
        lambda out: [*ENTRY, "routes", "--out", out],
        lambda r: {"vllm": r.get("engine"), "route mismatch (token, layer)": _round(r.get("mismatch_token_layer"))},
    ),
    Part(
        "vllm_colocate",
        "GSPO training with colocated vLLM, old_logprobs_source='sampler' and routing_replay='R3' on a tiny Qwen3-MoE",
        210,
        needs(modules("vllm")),
        _self("vllm_colocate"),
        lambda r: {
            k: _round(r.get(k))
            for k in ("pi_old_passes", "sampler_logp_abs_diff", "r3_sampler_mismatch", "replay_coverage")
        },
    ),
    Part(
        "zero2",
        "2-GPU DeepSpeed ZeRO-2 demo (shipped accelerate config): trains, saves a full model",
        240,
        needs(two_gpus, modules("deepspeed")),
        _self("zero2"),
        lambda r: {"held-out": r.get("held_out"), "steps": r.get("steps")},
    ),
    Part(
        "zero3",
        "2-GPU DeepSpeed ZeRO-3 demo (shipped accelerate config): trains, gathers and saves a full model",
        240,
        needs(two_gpus, modules("deepspeed")),
        _self("zero3"),
        lambda r: {"held-out": r.get("held_out"), "steps": r.get("steps")},
    ),
]


def _quick(part: str, tiny: bool) -> Callable[[str], list[str]]:
    return lambda out: [*_self(part)(out), *(["--tiny"] if tiny else [])]


def quick_parts(tiny: bool = False) -> list[Part]:
    """`make gpu-quick` (quick.py, passes.py). `tiny`: on the CPU at toy shapes, a stand-in varlen kernel."""
    missing = core if tiny else needs()
    return [
        Part(
            name,
            what,
            quick.BUDGETS[name],
            missing,
            _quick(name, tiny),
            functools.partial(quick.headline, name),
        )
        for name, what in quick.WHAT.items()
    ]


QUICK = quick_parts()


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
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                part.command(result_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
                start_new_session=True,
            )
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
        entry.update(
            status="timeout",
            error=f"stopped after its {round(budget_s)} s budget ({'partial result kept' if result else 'no result'})",
        )
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
    lines = [
        f"# `make {report.get('target', 'gpu-check')}`, {report['updated']}",
        "",
        f"GPUs: {gpus} (CUDA {env['cuda']}). {versions}.",
        "",
        "| part | checks | status | time (budget) | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for part in PARTS + QUICK:
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


def _names(report: dict) -> tuple[str, str]:
    """The result files of the report's target: gpu-check.json/.md, or gpu-quick.json/.md."""
    target = report.get("target", "gpu-check")
    return f"{target}.json", f"{target}.md"


def save(report: dict, out_dir: str) -> None:
    """gpu-check.json and gpu-check.md, or gpu-quick's (the logs stay beside them, unscrubbed and git-ignored)."""
    os.makedirs(out_dir, exist_ok=True)
    json_name, table_name = _names(report)
    with open(os.path.join(out_dir, json_name), "w") as f:
        f.write(scrub(json.dumps(report, indent=2)))
    with open(os.path.join(out_dir, table_name), "w") as f:
        f.write(scrub(markdown(report)))


def _print(message: str) -> None:
    print(message, flush=True)  # flushed: under make or a pipe the progress would otherwise arrive at the end


def run(
    parts: list[Part],
    env: dict,
    out_dir: str | None,
    dry_run: bool = False,
    max_seconds: float = 1800,
    keep: dict | None = None,
    log=_print,
    target: str = "gpu-check",
) -> dict:
    """Run (or, with `dry_run`, only plan) `parts` in order; results are saved after each part when `out_dir` is set.
    `keep`: entries of parts not run this time (from an earlier report), kept in the new one; each entry says when
    and on which GPUs it ran."""
    report = {
        "target": target,
        "updated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "environment": env,
        "max_minutes": max_seconds / 60,
        "parts": dict(keep or {}),
    }
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
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--profile",
        choices=("full", "quick"),
        default="full",
        help="full: every part (`make gpu-check`); quick: the forward path in 8 minutes (`make gpu-quick`)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="quick profile only: run its parts on the CPU at toy shapes with a stand-in varlen kernel (their code, "
        "not their timings)",
    )
    parser.add_argument("--parts", default=None, help="comma-separated subset of the profile's parts")
    parser.add_argument("--dry-run", action="store_true", help="list every part and why it would skip; run nothing")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="where gpu-check.json/.md and the logs go (default: benchmarks/results/gpu-check; a dry run writes "
        "nothing unless given one)",
    )
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="cap on the whole run (default 45; quick profile 8)"
    )
    parser.add_argument("--fresh", action="store_true", help="drop the results of parts not run this time")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["routes"]:  # the vllm_routes part's own tool and options (routes.py)
        routes.main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    if args.part is not None:
        if args.part in quick.WHAT:
            return quick.run_part(args.part, args.result, args.tiny)
        return run_part(args.part, args.result)
    if args.tiny and args.profile != "quick":
        parser.error("--tiny runs the quick profile's parts on the CPU: add --profile quick")

    parts = quick_parts(args.tiny) if args.profile == "quick" else PARTS
    target = "gpu-quick" if args.profile == "quick" else "gpu-check"
    names = [part.name for part in parts]
    wanted = args.parts.split(",") if args.parts else names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    max_minutes = args.max_minutes or (8 if args.profile == "quick" else 45)
    out_dir = args.out_dir or (None if args.dry_run else RESULTS)
    keep = {}
    json_name = f"{target}.json"
    if out_dir is not None and not args.fresh and os.path.exists(os.path.join(out_dir, json_name)):
        with open(os.path.join(out_dir, json_name)) as f:
            keep = {k: v for k, v in json.load(f).get("parts", {}).items() if k not in wanted}
    env = environment()
    print(
        f"gpu-check: GPUs {env['gpus'] or 'none'}, CUDA {env['cuda'] or 'none'}; "
        + ", ".join(f"{k} {v or 'not installed'}" for k, v in env["versions"].items()),
        flush=True,
    )
    chosen = [p for p in parts if p.name in wanted]
    report = run(chosen, env, out_dir, args.dry_run, max_minutes * 60, keep, target=target)
    if out_dir is not None:
        print(f"gpu-check: results in {os.path.relpath(os.path.join(out_dir, json_name))} and {target}.md")
    bad = [
        name
        for name, entry in report["parts"].items()
        if name in wanted and entry["status"] in ("failed", "error", "timeout")
    ]
    return 1 if bad else 0
