"""The numbers README.md and docs/ quote from benchmark results agree with the result files they link to
(benchmarks/quoted.py), and README's measured section quotes no number that does not link to its file."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import quoted  # noqa: E402


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_every_quoted_number_matches_its_result_file():
    docs = quoted.user_docs()
    assert quoted.problems(docs) == []
    files = {quote.file() for doc in docs for quote in quoted.quotes(doc)}
    results = ROOT / "benchmarks" / "results"  # one file per scenario, and the GPU check's (docs/gpu-check.md)
    experiments = ROOT / "benchmarks" / "experiments" / "results"  # docs/real-model.md, docs/choosing.md
    real_model = {experiments / f"smollm2-regime-{study}" for study in ("short", "stale", "long")}
    allowed = {results, results / "cuda", results / "gpu-check", *real_model}
    assert all(path.parent in allowed for path in files), files


def test_readme_measurements_all_come_from_result_files():
    readme = ROOT / "README.md"
    text = readme.read_text()
    measured = _section(text, "## Measured\n")
    in_section = [q for q in quoted.quotes(readme) if measured.find(text[q.span[0] : q.span[1]]) >= 0]
    assert len(in_section) >= 10
    bare = quoted.QUOTE.sub("", measured)
    assert re.findall(r"(?<![\w.])\d+\.\d+", bare) == [], "a number in README's measured section links to no result"
    demo = _section(text, "## Two commands\n")  # the demo's numbers quoted there too, each seed's
    demo_quotes = [q for q in quoted.quotes(readme) if demo.find(text[q.span[0] : q.span[1]]) >= 0]
    assert {"result.runs.0.after", "result.runs.1.after", "result.runs.2.after"} <= {q.key for q in demo_quotes}


def test_a_quote_that_differs_from_its_file_is_reported_and_rewritten(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "s.json").write_text(
        json.dumps({"result": {"ratio": 0.98765, "peak": 3 * 2**20, "share": 0.1234, "runs": [{"n": 12345.4}]}})
    )
    doc = tmp_path / "doc.md"
    doc.write_text(
        'ratio [0.988](results/s.json "result.ratio"), peak [3](results/s.json "result.peak|MiB"), '
        'share [12.3](results/s.json "result.share|%"), n [12,345](results/s.json "result.runs.0.n"), '
        'wrong [0.990](results/s.json "result.ratio"), missing [1.0](results/s.json "result.nope")\n'
    )
    found = quoted.problems([doc])
    assert len(found) == 2 and "quotes '0.990'" in found[0] and "gives '0.988'" in found[0], found
    assert "KeyError" in found[1]
    (results / "s.json").write_text(
        json.dumps({"result": {"ratio": 0.5, "peak": 2**20, "share": 0.5, "runs": [{"n": 1}], "nope": 2}})
    )
    assert quoted.write([doc]) == 6
    assert quoted.problems([doc]) == []
    assert "[0.500]" in doc.read_text() and "[50.0]" in doc.read_text() and "[1]" in doc.read_text()
