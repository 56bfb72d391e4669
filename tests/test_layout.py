"""The package's shape: no import circle (in the package and in benchmarks/, whose GPU checks import each other), no
function-level import inside the package, every public dotted path the docs and recipes name resolves, no long module
without a stated reason. The layer contracts themselves are import-linter's (`make lint`, pyproject.toml)."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
from pathlib import Path

import grimp
import pytest
import yaml

import trl_gspo
from trl_gspo.cli.commands import resolve_trainer_class
from trl_gspo.cli.rewards import resolve_reward

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trl_gspo"
RECIPES = ROOT / "recipes"
MAX_LINES = 500


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def _circles(package: str) -> list[list[str]]:
    graph = grimp.build_graph(package, cache_dir=None)  # module-level and function-level imports alike
    return _strongly_connected({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})


@pytest.mark.parametrize("package", ["trl_gspo", "benchmarks"])
def test_import_graph_has_no_circle(package, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ imports from the checkout's root, as `python -m` runs it
    assert _circles(package) == []


def test_a_circle_in_the_gpu_checks_is_found(tmp_path, monkeypatch):
    """The circle benchmarks/gpu/ once had (the passes importing the quick profile, inside a function, while the
    quick profile imports the passes), planted in a copy of the folder, is found."""
    shutil.copytree(ROOT / "benchmarks" / "gpu", tmp_path / "planted_circle" / "gpu")
    (tmp_path / "planted_circle" / "__init__.py").write_text("")
    passes = tmp_path / "planted_circle" / "gpu" / "passes.py"
    passes.write_text(passes.read_text() + "\n\ndef _planted():\n    from . import quick\n\n    return quick\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _circles("planted_circle") == [["planted_circle.gpu.passes", "planted_circle.gpu.quick"]]


def _function_level_imports(path: Path) -> list[int]:
    """Lines of `path` where a function imports from trl_gspo (relative or absolute)."""
    return [
        inner.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(node)
        if (isinstance(inner, ast.ImportFrom) and (inner.level > 0 or (inner.module or "").startswith("trl_gspo")))
        or (isinstance(inner, ast.Import) and any(a.name.startswith("trl_gspo") for a in inner.names))
    ]


def test_no_function_level_import_inside_the_package():
    found = [
        f"{p.relative_to(ROOT)}:{line}" for p in sorted(PACKAGE.rglob("*.py")) for line in _function_level_imports(p)
    ]
    assert found == [], "imports of trl_gspo inside functions (move them to the top, or the module down a layer)"


def test_function_level_import_detector_detects(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\n\n\ndef f():\n    from .x import y\n    import trl_gspo.cli\n    import json\n"
    )
    assert _function_level_imports(tmp_path / "m.py") == [5, 6]


# ---------------------------------------------------------------------------- public dotted paths
DOTTED = re.compile(r"\btrl_gspo(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (trl_gspo(?:\.\w+)*) import ([\w, ]+)", re.M)


def _doc_and_recipe_texts() -> dict[str, str]:
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(RECIPES.glob("*.yaml")),
        *sorted(RECIPES.glob("*.py")),
    ]
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


def _resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def public_dotted_paths() -> list[str]:
    paths = set()
    for text in _doc_and_recipe_texts().values():
        paths.update(m.group(0) for m in DOTTED.finditer(text))
        for module, names in FROM_IMPORT.findall(text):  # `from trl_gspo.x import a, b` in a code block
            paths.update(f"{module}.{n.split(' as ')[0].strip()}" for n in names.split(",") if n.strip())
    return sorted(paths)


def test_the_collector_finds_the_paths_users_type():
    paths = public_dotted_paths()
    for expected in ("trl_gspo.testing", "trl_gspo.cli.main", "trl_gspo.token_advantages"):
        assert any(p == expected or p.startswith(expected + ".") for p in paths), expected


@pytest.mark.parametrize("dotted", public_dotted_paths())
def test_public_dotted_path_resolves(dotted):
    _resolve(dotted)


def test_resolver_fails_on_a_missing_name():
    with pytest.raises(AttributeError):
        _resolve("trl_gspo.losses.no_such_function")


def _recipes() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) or {} for p in sorted(RECIPES.glob("*.yaml"))}


@pytest.mark.parametrize("name", sorted(_recipes()))
def test_recipe_names_resolve(name):
    """What a shipped recipe names by dotted path or registered name: trainer_class, reward functions, the
    dynamic-sampling filter."""
    recipe = _recipes()[name]
    if recipe.get("trainer_class"):
        assert issubclass(resolve_trainer_class(recipe["trainer_class"], (str(RECIPES),)), trl_gspo.GSPOTrainer)
    for reward in recipe.get("reward_funcs") or []:
        assert callable(resolve_reward(reward, (str(RECIPES),)))
    rule = recipe.get("dynamic_sampling_filter")
    if rule and rule != "reward_std":
        assert callable(_resolve(rule))


# ---------------------------------------------------------------------------- module length
def _long_modules_without_reason(roots) -> list[str]:
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > MAX_LINES:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if "Longer than 500 lines because" not in doc:
                    out.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    return out


def test_no_module_past_500_lines_without_a_reason():
    assert _long_modules_without_reason([PACKAGE, ROOT / "benchmarks"]) == []


def test_length_check_flags_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text('"""Short."""\n' + "x = 1\n" * 600)
    (tmp_path / "ok.py").write_text('"""Longer than 500 lines because it is a table."""\n' + "x = 1\n" * 600)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _long_modules_without_reason([tmp_path]) == ["long.py: 601 lines"]
    finally:
        ROOT = saved
