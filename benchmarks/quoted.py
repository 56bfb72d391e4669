"""Numbers the docs quote from benchmark results, checked (and refreshed) against the files they come from.

A quoted number is a Markdown link to its result file whose title names the JSON key, so a reader can follow it:

    equal settings cost [0.987](benchmarks/results/equal_settings.json "result.ratio_cpu_seconds_per_step") of stock's

The path is relative to the Markdown file; the key is a dotted path into the JSON (list items by index), optionally
followed by `|MiB` (bytes shown in MiB) or `|%` (a fraction shown in percent). The number shows as many decimals as it
is quoted with (thousands separated by commas if it is quoted so).

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
        node = json.loads(self.file().read_text())
        for part in self.key.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        if not isinstance(node, (int, float)) or isinstance(node, bool):
            raise TypeError(f"{self.key} is {node!r}, not a number")
        return node * UNITS[self.unit]

    def decimals(self) -> int:
        return len(self.number.split(".")[1]) if "." in self.number else 0

    def formatted(self) -> str:
        return f"{self.value():{',' if ',' in self.number else ''}.{self.decimals()}f}"

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT) if self.doc.is_relative_to(REPO_ROOT) else self.doc}:{self.line}"


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
    return out


def write(docs) -> int:
    """Rewrite every quoted number from its file; returns how many changed."""
    changed = 0
    for doc in map(Path, docs):
        text = doc.read_text()
        for quote in reversed(quotes(doc)):  # from the end, so earlier spans stay valid
            shown = quote.formatted()
            if shown != quote.number:
                start, end = quote.span
                text = text[:start] + text[start:end].replace(f"[{quote.number}]", f"[{shown}]", 1) + text[end:]
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
