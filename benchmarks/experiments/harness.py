"""What every experiment of this folder shares: the provenance a run file carries, the training-code grouping the
reports refuse to mix across, and the paired per-seed intervals the verdict words come from.

Provenance (`provenance`): the commit and whether the tree had changes, the versions of the packages a run imports,
the CPU and torch's CPU capability, threads, the run's full resolved config, the held-out set, wall and CPU time, and
`training_code`: a SHA-256 over the code (docstrings and comments left out) of every trl_gspo module loaded in the run's process when it ends (sorted
by name), less the modules that only locate the model (`LOCATING_MODULES`: their effect is the weights' hash,
`model_source`). Two runs with the same `training_code` ran the same training path, whatever else the commit changed.

Runs (`each_run`): a plan of runs (arm x seed x whatever a study varies), each stored as one JSON file; a file
that exists is read back instead of run again, so an interrupted study resumes where it stopped.

Verdicts (`paired`): for two arms of a study, the per-seed differences of one score over the seeds both ran, their
mean and a 95 % Student-t interval over seeds; the word is "ahead" or "behind" only where the interval excludes 0,
otherwise "level within ±x" (x the half-width).

What the two reports make of the runs (statistics over seeds, per-step bands, which runs may be paired, the verdicts'
table) is report_common.py.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "trl", "transformers", "accelerate", "datasets", "trl-gspo")
#: Modules that only find, fetch or convert the model: parallel work changes them without touching training, and
#: what they produced is recorded as the weights' hash (`model_source`).
LOCATING_MODULES = frozenset(
    {
        "trl_gspo.common.model_store",
        "trl_gspo.common.model_prepare",
        "trl_gspo.common.prepared_copy",
        "trl_gspo.common.hub_files",
        "trl_gspo.cli.models",
    }
)
#: A run file's value of `training_code` when it has no provenance (written by an older harness).
NOT_RECORDED = "not recorded"
#: Config fields that hold the run's own folders: machine paths, not settings (kept out of tracked run files).
PATH_FIELDS = ("output_dir", "logging_dir")
CONFIDENCE = 0.95
#: The half-width the short study plans its close pairs to reach (docs/real-model.md, the studies' design).
TARGET_HALF_WIDTH = 0.03


# ------------------------------------------------------------------------------------------------- provenance
def git_state(repo: Path = REPO_ROOT) -> dict:
    """{"commit", "dirty"} of the checkout `repo` is in; None values where git or the checkout is missing."""

    def git(*args):
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    except (OSError, subprocess.SubprocessError):  # no git on the machine
        commit = status = None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu() -> dict:
    """The CPU model (/proc/cpuinfo's `model name`, else the platform's word) and torch's CPU capability."""
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        capability = None
    return {"model": name or platform.processor() or None, "torch_capability": capability}


def code_text(source: str) -> str:
    """What a module's source runs: its syntax tree without docstrings, comments, layout or line numbers, so that a
    comment or docstring edit does not split a study's runs into two training-code versions."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def training_code(modules=None) -> dict:
    """{"sha256", "modules"}: the hash over the code (`code_text`) of the trl_gspo modules loaded (`modules`: name ->
    module, default `sys.modules`), sorted by name, less `LOCATING_MODULES`."""
    modules = sys.modules if modules is None else modules
    digest, names = hashlib.sha256(), []
    for name in sorted(modules):
        if not (name == "trl_gspo" or name.startswith("trl_gspo.")) or name in LOCATING_MODULES:
            continue
        path = getattr(modules[name], "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        digest.update(name.encode() + b"\0" + code_text(Path(path).read_text()).encode() + b"\0")
        names.append(name)
    return {"sha256": digest.hexdigest(), "modules": names}


def json_safe(value):
    """`value` with every leaf JSON can hold kept and the rest written as text (enums, dtypes, paths)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(getattr(value, "value", value))


def resolved_config(args) -> dict:
    """A trainer config's every field (`args.to_dict()`), JSON-safe, the run's own folders left out."""
    fields = args.to_dict() if hasattr(args, "to_dict") else dict(args)
    return json_safe({k: v for k, v in fields.items() if k not in PATH_FIELDS})


class Clock:
    """Wall and CPU seconds since it was made (the run's process, evaluation included)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def seconds(self) -> dict:
        return {"wall_seconds": time.perf_counter() - self.wall, "cpu_seconds": time.process_time() - self.cpu}


def provenance(config: dict, held_out: dict, clock: Clock, threads: int) -> dict:
    """Everything a run file records about where and how it ran; call it when the run ends (the training code is
    what the process loaded by then)."""
    code = training_code()
    return {
        "git": git_state(),
        "versions": versions(),
        "cpu": cpu(),
        "threads": threads,
        "config": config,
        "held_out": held_out,
        **clock.seconds(),
        "training_code": code["sha256"],
        "training_modules": code["modules"],
    }


def code_of(run: dict) -> str:
    return (run.get("provenance") or {}).get("training_code") or NOT_RECORDED


def check_one_code(runs, name_of, allow_mixed: bool = False, what: str = "report") -> str:
    """The training code every run of `runs` ran (its `training_code`, or `NOT_RECORDED`); SystemExit in one line when
    they ran different code (or some have no provenance), unless `allow_mixed`, which returns "mixed"."""
    codes = {}
    for run in runs:
        codes.setdefault(code_of(run), []).append(name_of(run))
    if len(codes) <= 1:
        return next(iter(codes), NOT_RECORDED)
    if allow_mixed:
        return "mixed"
    listed = "; ".join(f"{code[:12]}: {len(names)} runs ({names[0]}, ...)" for code, names in codes.items())
    raise SystemExit(
        f"{what}: the runs ran different training code ({listed}); rerun them at one commit, or pass --allow-mixed-code"
    )


# ------------------------------------------------------------------------------------------------------- runs
def each_run(plan, path_of, produce, jobs: int = 1, reuse: bool = True) -> list[dict]:
    """The run file of every item of `plan`, in plan order: `produce(item, path)` makes the ones missing (it writes
    `path` itself, as a child process does, or returns the run for this function to write), `jobs` at once; with
    `reuse`, an existing file is read back instead."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        path = Path(path_of(item))
        if not (reuse and path.exists()):
            made = produce(item, path)
            if made is not None:
                write_json(path, made)
        return json.loads(path.read_text()) if path.exists() else None

    if jobs <= 1:
        return [one(item) for item in plan]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, plan))


# ---------------------------------------------------------------------------------------------- paired verdicts
def verdict(low: float, high: float, half_width: float) -> str:
    """The word an interval supports: ahead / behind only where it excludes 0."""
    if low > 0:
        return "ahead"
    if high < 0:
        return "behind"
    return f"level within ±{half_width:.3f}"


def paired(a: dict, b: dict, confidence: float = CONFIDENCE) -> dict:
    """`a` against `b` (seed -> score each): the differences a - b over the seeds both have, their mean, the
    Student-t interval over seeds, its half-width, n and the verdict word, the differences' SD and the seeds that SD
    would need for TARGET_HALF_WIDTH (`seeds_needed`). With fewer than two seeds there is no interval: low, high and
    half_width are None and the verdict says so."""
    import numpy as np
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    diffs = np.array([a[s] - b[s] for s in seeds], dtype=float)
    out = {"n": len(seeds), "seeds": seeds, "differences": diffs.tolist()}
    if len(seeds) < 2:
        return {
            **out,
            "mean": float(diffs.mean()) if len(seeds) else None,
            "low": None,
            "high": None,
            "half_width": None,
            "verdict": f"no interval ({len(seeds)} paired seed{'s' * (len(seeds) != 1)})",
        }
    mean, sd = float(diffs.mean()), float(diffs.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, len(seeds) - 1) * sd / math.sqrt(len(seeds)))
    low, high = mean - half, mean + half
    return {
        **out,
        "mean": mean,
        "low": low,
        "high": high,
        "half_width": half,
        "verdict": verdict(low, high, half),
        "sd": sd,
        "seeds_for_target": seeds_needed(sd, TARGET_HALF_WIDTH, confidence),
    }


def seeds_needed(sd: float, target: float, confidence: float = CONFIDENCE, most: int = 1000) -> int | None:
    """The fewest seeds whose interval would have half-width <= `target` if the differences kept this SD: where
    to put the next seeds (an SD from few seeds is itself rough, so this is a plan, not a promise); None past `most`."""
    from scipy import stats

    for n in range(2, most + 1):
        if stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) <= target:
            return n
    return None


def cpu_label(run: dict) -> str | None:
    """The CPU a run file says it ran on, "model (torch's CPU capability)"; None where it carries no provenance."""
    found = (run.get("provenance") or {}).get("cpu")
    return f"{found.get('model')} ({found.get('torch_capability')})" if found else None


def versions_label(run: dict) -> str | None:
    """The package versions a run file says it ran with, "name version, ..." by name; None without provenance."""
    found = (run.get("provenance") or {}).get("versions")
    return ", ".join(f"{name} {version}" for name, version in sorted(found.items())) if found else None


#: What a pair checks, seed by seed, in its two runs' provenance: (key in the pair, the table column's words, label).
#: Two runs of one seed with different labels may draw different rollouts, so that seed pairs less tightly (its
#: difference is still an unbiased one; the interval carries it like any other).
SEED_MISMATCHES = (
    ("seeds_on_two_cpus", "CPUs", cpu_label),
    ("seeds_on_two_package_sets", "package sets", versions_label),
)


def pairs(scores: dict, order, runs: dict | None = None) -> dict:
    """{"A vs B": paired(scores[A], scores[B])} for every two arms of `order` (A before B) that have scores. With
    `runs` (arm -> seed -> run file), each pair also lists, per entry of SEED_MISMATCHES, its seeds whose two runs
    ran on different CPUs or kernels (`seeds_on_two_cpus`) and with different package versions
    (`seeds_on_two_package_sets`)."""
    arms = [arm for arm in order if arm in scores]
    found = {}
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            p = found[f"{a} vs {b}"] = paired(scores[a], scores[b])
            for key, _, label in SEED_MISMATCHES if runs is not None else ():
                p[key] = [s for s in p["seeds"] if label(runs[a].get(s, {})) != label(runs[b].get(s, {}))]
    return found


def pairs_table(found: dict) -> str:
    """Markdown: one row per pair, the mean difference, its 95 % interval, n, the verdict, the seeds the pair
    would need for a half-width of TARGET_HALF_WIDTH at its SD so far, and (where `pairs` was given the runs) a column
    per SEED_MISMATCHES entry: the seeds whose two runs ran on different CPUs, and with different package versions."""
    if not found:
        return ""
    columns = [(key, words) for key, words, _ in SEED_MISMATCHES if any(key in p for p in found.values())]
    lines = [
        f"| pair | mean difference | 95 % interval | n seeds | verdict | seeds for ±{TARGET_HALF_WIDTH} at this SD |"
        + "".join(f" seeds run on two {words} |" for _, words in columns),
        "| --- | --- | --- | --- | --- | --- |" + " --- |" * len(columns),
    ]
    for name, p in found.items():
        interval = "n/a" if p["low"] is None else f"[{p['low']:+.3f}, {p['high']:+.3f}]"
        mean = "n/a" if p["mean"] is None else f"{p['mean']:+.3f}"
        needed = p.get("seeds_for_target") or ("n/a" if p["low"] is None else "over 1000")
        row = f"| {name} | {mean} | {interval} | {p['n']} | {p['verdict']} | {needed} |"
        for key, _ in columns:
            row += f" {', '.join(map(str, p.get(key, []))) or 'none'} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def write_json(path: Path, value) -> None:
    """`value` to `path` through a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(value))
    partial.replace(path)
