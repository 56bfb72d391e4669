"""Numbers the docs quote from benchmark results, checked (and refreshed) against the files they come from.

A quoted number is a Markdown link to its result file whose title names the JSON key, so a reader can follow it:

    equal settings cost [0.987](benchmarks/results/equal_settings.json "result.ratio_cpu_seconds_per_step") of stock's

The path is relative to the Markdown file; the key is a dotted path into the JSON (list items by index), optionally
followed by `|MiB` (bytes shown in MiB) or `|%` (a fraction shown in percent). The number shows as many decimals as it
is quoted with (thousands separated by commas if it is quoted so).

A verdict word is quoted the same way from an experiment report's paired intervals (its `summary.json`, key
`pairs.<arm A> vs <arm B>.verdict`); the link text must be the report's word exactly ("ahead", "behind" or
"level within ±x"), and the key must name a pair the report holds:

    GRPO is [level within ±0.028](benchmarks/experiments/results/s/summary.json "pairs.GRPO dapo vs GRPO grpo.verdict")

A "level within ±x" written anywhere in the docs without such a link is reported too: the word must come from a report.
In the docs that give verdicts (README.md and docs/choosing.md, `VERDICT_DOCS`) so is a bare "ahead", "behind" or
"level with".

    python benchmarks/quoted.py            # list every quoted number that differs from its file (exit 1 if any)
    python benchmarks/quoted.py --write    # rewrite them from the files (after `python benchmarks/run.py`)
    python benchmarks/quoted.py --write --flips   # a verdict word that changed too, once its sentence is reread

tests/test_quoted_numbers.py runs the check on README.md, benchmarks/README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: [number](path/to/file.json "key|unit")
QUOTE = re.compile(
    r"\[(?P<number>-?[\d,]*\d(?:\.\d+)?)\]\((?P<path>[^)\s]+\.json) \"(?P<key>[^\"|]+)(?:\|(?P<unit>MiB|%))?\"\)"
)
UNITS = {None: 1.0, "MiB": 1 / 2**20, "%": 100.0}
#: [verdict](path/to/summary.json "pairs.A vs B.verdict"): the words experiments/harness.py `verdict` writes.
VERDICT = re.compile(
    r"\[(?P<word>ahead|behind|level within ±\d+\.\d+)\]\((?P<path>[^)\s]+\.json) \"(?P<key>pairs\.[^\"|]+\.verdict)\"\)"
)
LEVEL_WORDS = re.compile(r"level within ±\d+(?:\.\d+)?")
#: In the docs that give verdicts, every comparative word must be a verdict link: "ahead" or "behind" written by hand
#: is a reading of means, not of an interval.
#: A word in quotation marks ("ahead") is named, not used; one inside a hyphenated name (an anchor) is not a word.
COMPARATIVE_WORDS = re.compile(r'(?<![-\w"])(?:ahead|behind|level with(?:in)?)(?![-\w"])', re.IGNORECASE)
VERDICT_DOCS = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "choosing.md")


@dataclass
class Quote:
    """One quote in a doc: a number (`kind` "number", with its `unit`) or a verdict word (`kind` "verdict")."""

    doc: Path
    line: int
    text: str  # as the doc shows it
    path: str
    key: str
    unit: str | None
    span: tuple[int, int]
    kind: str = "number"

    def file(self) -> Path:
        return (self.doc.parent / self.path).resolve()

    def value(self) -> float:
        """The value a number quote stands for, in the quoted unit; raises (KeyError, ...) naming what is missing."""
        node = lookup(self.file(), self.key)
        if not isinstance(node, (int, float)) or isinstance(node, bool):
            raise TypeError(f"{self.key} is {node!r}, not a number")
        return node * UNITS[self.unit]

    def shown(self) -> str:
        """What the doc should show: the number formatted as quoted, or the report's verdict word."""
        if self.kind == "number":
            decimals = len(self.text.split(".")[1]) if "." in self.text else 0
            return f"{self.value():{',' if ',' in self.text else ''}.{decimals}f}"
        word = lookup(self.file(), self.key)
        if not isinstance(word, str):
            raise TypeError(f"{self.key} is {word!r}, not a verdict")
        return word

    def where(self) -> str:
        return where(self.doc, self.line)


def where(doc: Path, line: int) -> str:
    return f"{doc.relative_to(REPO_ROOT) if doc.is_relative_to(REPO_ROOT) else doc}:{line}"


def lookup(path: Path, key: str):
    """The value at dotted `key` of the JSON file `path`: list items by index; at a mapping, the longest run of the
    remaining parts that is one of its keys, so a key holding a dot (a pair at lr 1.5e-05) is still found."""
    node, parts, at = json.loads(path.read_text()), key.split("."), 0
    while at < len(parts):
        if isinstance(node, list):
            node, at = node[int(parts[at])], at + 1
            continue
        end = next((end for end in range(len(parts), at, -1) if ".".join(parts[at:end]) in node), None)
        if end is None:
            raise KeyError(parts[at])
        node, at = node[".".join(parts[at:end])], end
    return node


def quotes(doc: Path, kinds=("number", "verdict")) -> list[Quote]:
    """The quotes of `doc` of the given kinds, in the order they appear."""
    text = doc.read_text()
    patterns = {"number": (QUOTE, "number"), "verdict": (VERDICT, "word")}
    found = [
        Quote(
            doc,
            text.count("\n", 0, m.start()) + 1,
            m[group],
            m["path"],
            m["key"],
            m.groupdict().get("unit"),
            m.span(),
            kind,
        )
        for kind in kinds
        for pattern, group in [patterns[kind]]
        for m in pattern.finditer(text)
    ]
    return sorted(found, key=lambda q: q.span)


def unlinked_verdicts(doc: Path, strict: bool = False) -> list[str]:
    """One line per verdict word in `doc` that is not the text of a verdict link: "level within ±x" in any doc, and
    with `strict` (the docs that give verdicts, `VERDICT_DOCS`) also a bare "ahead", "behind" or "level with"."""
    text = doc.read_text()
    linked = [q.span for q in quotes(doc, kinds=("verdict",))]
    words = COMPARATIVE_WORDS if strict else LEVEL_WORDS
    return [
        f"{where(doc, text.count(chr(10), 0, m.start()) + 1)}: '{m[0]}' links to no report"
        for m in words.finditer(text)
        if not any(start <= m.start() < end for start, end in linked)
    ]


def problems(docs, verdict_docs=None) -> list[str]:
    """One line per quote that does not match its file (or whose file or key is missing), and per verdict word
    written without its link (bare comparative words too in `verdict_docs`, default `VERDICT_DOCS`)."""
    strict = {Path(d).resolve() for d in (VERDICT_DOCS if verdict_docs is None else verdict_docs)}
    out = []
    for doc in map(Path, docs):
        for quote in quotes(doc):
            try:
                shown = quote.shown()
            except (OSError, KeyError, IndexError, TypeError, ValueError) as err:
                out.append(f"{quote.where()}: '{quote.text}' <- {quote.path} {quote.key}: {type(err).__name__} {err}")
                continue
            if shown != quote.text:
                out.append(f"{quote.where()}: quotes '{quote.text}', {quote.path} {quote.key} gives '{shown}'")
        out += unlinked_verdicts(doc, strict=doc.resolve() in strict)
    return out


def write(docs, flips: bool = False) -> int:
    """Rewrite every quoted number and verdict from its file; returns how many changed.

    A verdict whose word changes ("ahead", "behind" or "level") is left as written unless `flips`: the sentence around
    it was written for the old word (what it counts, which arm it names first), so it needs rereading, and the check
    keeps reporting it until then. A "level within ±x" whose half-width alone changed is rewritten."""
    changed = 0
    for doc in map(Path, docs):
        text = doc.read_text()
        for quote in reversed(quotes(doc)):  # from the end: earlier spans stay valid
            shown = quote.shown()
            if shown == quote.text or (quote.kind == "verdict" and not flips and _word(shown) != _word(quote.text)):
                continue
            start, end = quote.span
            text = text[:start] + text[start:end].replace(f"[{quote.text}]", f"[{shown}]", 1) + text[end:]
            changed += 1
        doc.write_text(text)
    return changed


def _word(verdict: str) -> str:
    """The verdict's word: "ahead", "behind" or "level" (of "level within ±x")."""
    return verdict.split()[0]


def user_docs() -> list[Path]:
    """README.md, benchmarks/README.md and docs/*.md (docs/dev/ holds development notes, not quoted numbers)."""
    return [REPO_ROOT / "README.md", REPO_ROOT / "benchmarks" / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the quoted numbers from their files")
    parser.add_argument(
        "--flips",
        action="store_true",
        help="with --write, also rewrite a verdict whose word changed (ahead, behind, level): its sentence was written "
        "for the old word, so reread it first",
    )
    parser.add_argument("docs", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    docs = args.docs or user_docs()
    if args.write:
        print(f"{write(docs, flips=args.flips)} quoted numbers rewritten")
    found = problems(docs)
    print("\n".join(found) or f"every quoted number matches its file ({sum(len(quotes(Path(d))) for d in docs)})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
