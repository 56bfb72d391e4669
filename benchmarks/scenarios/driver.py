"""How scenarios run their measurements: each run in a fresh `run.py --worker` process (or in this process for the
`--tiny` smoke run), and the medians and ratios they report.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_PY = os.path.join(REPO_ROOT, "benchmarks", "run.py")  # `run.py --worker SPEC` runs one measurement

#: --tiny: run.py sets this to its worker function, and workers run in this process (import once; numbers are not
#: meant to be read). None: each run in a fresh `run.py --worker` process.
IN_PROCESS_WORKER = None


def run_worker(spec: dict) -> dict:
    """Each run in a fresh process: no allocator or autotuning state carried from one trainer to the other."""
    if IN_PROCESS_WORKER is not None:
        return json.loads(json.dumps(IN_PROCESS_WORKER(spec)))
    pythonpath = os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=pythonpath)
    proc = subprocess.run(
        [sys.executable, RUN_PY, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed ({spec}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ratio_of(a: float, b: float) -> float | None:
    return a / b if b else None
