"""What both experiment reports share (real_model_report.py for the real model, compare_report.py for the tiny
built-in ones): arms x seeds, reported one way.

Over seeds (`spread`): the mean, min and max of a per-run number, shown as "mean [min, max]" (`spread_text`). Per step
(`by_step`): the same three at each step every run logged, drawn as a line with its min..max band (`band`). Verdicts
(`checked_code`, `pairs_text`): the training code the runs ran (harness.py `check_one_code`: runs of different code
are refused in one line), whether their paired intervals may be computed (not from runs without provenance, unless
asked), and the markdown of the intervals (harness.py `pairs`, `pairs_table`).

What is particular to one report stays in its module: compare_report's collapse rule, MoE routing table, dispersion
by length and block averages; real_model_report's held-out curve, clip band table and reference rows.
"""

from __future__ import annotations

import math
import statistics

import harness  # beside this file (each driver puts this folder on sys.path)

#: What a report says of runs written without provenance (an older harness): they are shown, never paired.
NO_PROVENANCE = (
    "These runs carry no provenance (an older harness: no commit, versions or training-code hash): "
    "no paired verdicts are computed from them."
)


# ------------------------------------------------------------------------------------------------- over seeds
def numbers(values) -> list:
    """The numbers of `values`; a metric a run did not log (None) or logged as NaN is left out."""
    return [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]


def mean(values):
    """Mean of the numbers of `values`; None when there are none."""
    found = numbers(values)
    return statistics.fmean(found) if found else None


def spread(values):
    """{"mean", "min", "max"} of the numbers of `values` (one per run); None when there are none."""
    found = numbers(values)
    return {"mean": statistics.fmean(found), "min": min(found), "max": max(found)} if found else None


def number(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def spread_text(stat, digits: int = 3) -> str:
    """A `spread` as "mean [min, max]"; "n/a" for None."""
    if stat is None:
        return "n/a"
    return f"{stat['mean']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"


# --------------------------------------------------------------------------------------------------- per step
def by_step(per_run: list[dict]) -> tuple[list, list, list, list]:
    """(steps, mean, min, max): from one {step: value} per run, the steps every run has and the three over runs at
    each. Steps only some seeds reached are left out, so a line never averages fewer seeds than its band claims."""
    steps = sorted(set.intersection(*(set(r) for r in per_run))) if per_run else []
    at = [[r[s] for r in per_run] for s in steps]
    return steps, [statistics.fmean(x) for x in at], [min(x) for x in at], [max(x) for x in at]


def band(ax, steps, mid, low, high, color, label=None, style: str = "-", band_alpha: float = 0.15, **line) -> None:
    """The mean over seeds as a line and min..max as a band around it, in one color."""
    ax.plot(steps, mid, style, color=color, label=label, **line)
    ax.fill_between(steps, low, high, color=color, alpha=band_alpha, lw=0)


# --------------------------------------------------------------------------------------------------- verdicts
def checked_code(runs, label_of, allow_mixed: bool = False, what: str = "report") -> tuple[str, bool]:
    """(the training code every run ran, whether paired verdicts may be computed). Runs of different code are refused
    in one line (harness.check_one_code) unless `allow_mixed`; runs without provenance are reported but not paired,
    since nothing says they ran the same training path, unless `allow_mixed`."""
    code = harness.check_one_code(runs, label_of, allow_mixed, what)
    return code, code != harness.NOT_RECORDED or allow_mixed


def pairs_text(pairs: dict, score: str) -> str:
    """Markdown: the paired intervals of `score` under one line saying what they are; "" without pairs."""
    if not pairs:
        return ""
    return (
        f"\nPaired per-seed differences of {score} (A minus B), 95 % t interval over seeds; the last column is the "
        f"seeds a pair would need for a half-width of ±{harness.TARGET_HALF_WIDTH} if its differences kept the SD "
        "seen so far (a rough plan where few seeds are in):\n\n" + harness.pairs_table(pairs)
    )
