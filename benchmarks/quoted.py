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

    python benchmarks/quoted.py            # list every quoted number that differs from its file (exit 1 if any)
    python benchmarks/quoted.py --write    # rewrite them from the files (after `python benchmarks/run.py`)

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


@dataclass
class Quote:
    doc: Path
    line: int
    number: str
    path: str
    key: str
    unit: str | None
    span: tuple[int, int]

    def file(self) -> Path:
        return (self.doc.parent / self.path).resolve()

    def value(self) -> float:
        """The value the quote stands for, in the quoted unit; raises (KeyError, ...) naming what is missing."""
        node = lookup(self.file(), self.key)
        if not isinstance(node, (int, float)) or isinstance(node, bool):
            raise TypeError(f"{self.key} is {node!r}, not a number")
        return node * UNITS[self.unit]

    def decimals(self) -> int:
        return len(self.number.split(".")[1]) if "." in self.number else 0

    def formatted(self) -> str:
        return f"{self.value():{',' if ',' in self.number else ''}.{self.decimals()}f}"

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


@dataclass
class VerdictQuote:
    doc: Path
    line: int
    word: str
    path: str
    key: str
    span: tuple[int, int]

    def file(self) -> Path:
        return (self.doc.parent / self.path).resolve()

    def value(self) -> str:
        """The report's word; raises (KeyError, ...) naming what is missing."""
        node = lookup(self.file(), self.key)
        if not isinstance(node, str):
            raise TypeError(f"{self.key} is {node!r}, not a verdict")
        return node

    def where(self) -> str:
        return where(self.doc, self.line)


def verdict_quotes(doc: Path) -> list[VerdictQuote]:
    text = doc.read_text()
    return [
        VerdictQuote(doc, text.count("\n", 0, m.start()) + 1, m["word"], m["path"], m["key"], m.span())
        for m in VERDICT.finditer(text)
    ]


def unlinked_verdicts(doc: Path) -> list[str]:
    """One line per "level within ±x" in `doc` that is not the text of a verdict link."""
    text = doc.read_text()
    linked = [q.span for q in verdict_quotes(doc)]
    return [
        f"{where(doc, text.count(chr(10), 0, m.start()) + 1)}: '{m[0]}' links to no report"
        for m in LEVEL_WORDS.finditer(text)
        if not any(start <= m.start() < end for start, end in linked)
    ]


def quotes(doc: Path) -> list[Quote]:
    text = doc.read_text()
    found = []
    for match in QUOTE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(Quote(doc, line, match["number"], match["path"], match["key"], match["unit"], match.span()))
    return found


def problems(docs) -> list[str]:
    """One line per quoted number that does not match its file (or whose file or key is missing)."""
    out = []
    for doc in docs:
        for quote in quotes(Path(doc)):
            try:
                shown = quote.formatted()
            except (OSError, KeyError, IndexError, TypeError, ValueError) as err:
                out.append(f"{quote.where()}: {quote.number} <- {quote.path} {quote.key}: {type(err).__name__} {err}")
                continue
            if shown != quote.number:
                out.append(f"{quote.where()}: quotes {quote.number}, {quote.path} {quote.key} gives {shown}")
        for quote in verdict_quotes(Path(doc)):
            try:
                word = quote.value()
            except (OSError, KeyError, IndexError, TypeError, ValueError) as err:
                out.append(f"{quote.where()}: '{quote.word}' <- {quote.path} {quote.key}: {type(err).__name__} {err}")
                continue
            if word != quote.word:
                out.append(f"{quote.where()}: says '{quote.word}', {quote.path} {quote.key} gives '{word}'")
        out += unlinked_verdicts(Path(doc))
    return out


def write(docs) -> int:
    """Rewrite every quoted number and verdict from its file; returns how many changed."""
    changed = 0
    for doc in map(Path, docs):
        text = doc.read_text()
        found = [(q.span, q.number, q.formatted()) for q in quotes(doc)]
        found += [(q.span, q.word, q.value()) for q in verdict_quotes(doc)]
        for (start, end), quoted, shown in sorted(found, reverse=True):  # from the end: earlier spans stay valid
            if shown != quoted:
                text = text[:start] + text[start:end].replace(f"[{quoted}]", f"[{shown}]", 1) + text[end:]
                changed += 1
        doc.write_text(text)
    return changed


def user_docs() -> list[Path]:
    """README.md, benchmarks/README.md and docs/*.md (docs/dev/ holds development notes, not quoted numbers)."""
    return [REPO_ROOT / "README.md", REPO_ROOT / "benchmarks" / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the quoted numbers from their files")
    parser.add_argument("docs", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    docs = args.docs or user_docs()
    if args.write:
        print(f"{write(docs)} quoted numbers rewritten")
    found = problems(docs)
    print("\n".join(found) or f"every quoted number matches its file ({sum(len(quotes(Path(d))) for d in docs)})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
