"""Tracked text speaks to users: no absolute path of one developer's machine, no first-person notes, no remarks about
how the work was done (who ran what, in which session, on which lent machine). Raw results are held to it too: their
writers record no machine paths (benchmarks/gpu/check.py scrubs them)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: An absolute path that exists on one machine only: a home or work folder (root's, a user's under home or Users).
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+)/|\b[A-Za-z]:\\Users\\")
#: First person singular or plural ("our"/"ours" stay: they name this project's code next to stock TRL's).
FIRST_PERSON = re.compile(r"\b(?:I|I'm|I've|I'd|I'll|[Mm]y|[Ww]e|[Ww]e're|[Ww]e've|[Ww]e'd|[Ww]e'll)\b")
#: Remarks about the sessions, helpers and machines the work was done with.
SESSION_NOTE = re.compile(
    r"\b(?:this|that|the|my|our|no|any|every|one|each|previous|earlier|later) sessions?\b"
    r"|\bsessions? (?:that|which|who) \w+|\b(?:my|our|this|that) helpers?\b|\b(?:was|were|been|is|are|be) lent\b",
    re.IGNORECASE,
)
PATTERNS = {"machine path": MACHINE_PATH, "first person": FIRST_PERSON, "session note": SESSION_NOTE}
#: This file: it holds the patterns themselves and the examples they are tested on.
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()


def _tracked_text_files() -> list[str]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = []
    for name in filter(None, names.decode().split("\0")):
        data = (ROOT / name).read_bytes() if (ROOT / name).is_file() else b""
        if b"\0" not in data[:8192]:  # text, as git and grep -I tell it
            files.append(name)
    return files


def findings(text: str) -> list[str]:
    """`kind: 'match'` for every pattern hit in `text`."""
    return [f"{kind}: {m.group(0)!r}" for kind, pattern in PATTERNS.items() for m in pattern.finditer(text)]


def _scan(names) -> list[str]:
    hits = []
    for name in names:
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            hits += [f"{name}:{number}: {found}: {line.strip()[:160]}" for found in findings(line)]
    return hits


def test_patterns_catch_what_they_are_for():
    home = "/" + "home"  # spelled in pieces, so this file passes its own scan
    assert findings(f"run {home}/alice/bin/quiet python x.py") == [f"machine path: '{home}/alice/'"]
    assert findings("see /" + "root/.cache or /" + "work/bin/x")[0].startswith("machine path")
    assert findings("C:" + "\\Users\\bob\\x")[0].startswith("machine path")
    assert findings("I ran it twice") == ["first person: 'I'"]
    assert findings("W" + "e measured 0.5") == ["first person: 'We'"]
    assert findings("No GPU was available to the sess" + "ions that wrote this")[0].startswith("session note")
    assert findings("it was stopped by my 30-minute limit")[0] == "first person: 'my'"
    lent = "l" + "ent"
    assert findings(f"when a GPU was {lent}") == [f"session note: 'was {lent}'"]
    for fine in (
        "/tmp/demo",
        "outputs/demo",
        "https://example.com/root/x",
        "ours / stock",
        "our loss",
        'scope="session"',
        "my_pkg.rewards.my_reward",
        "The helpers here are pure functions",
        "~/" + "work/ and $HOME/" + "work/",
        "the Qwen team",
        "Stock is `trl.GRPOTrainer`",
    ):
        assert findings(fine) == [], fine


def test_tracked_text_has_no_machine_paths_or_session_notes():
    names = _tracked_text_files()
    assert SELF in names and "benchmarks/results/equal_settings.json" in names  # raw results are scanned too
    assert "README.md" in names  # the README is held to it like every other tracked file
    hits = _scan(name for name in names if name != SELF)
    assert not hits, "rewrite these for a user:\n" + "\n".join(hits)


def test_readme_stays_within_its_line_budget():
    """The README is the first page a user reads: detail goes to docs/, and the page stays at 250 lines or fewer."""
    lines = len((Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"
