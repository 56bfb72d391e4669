"""What a recipe name resolves to before any parsing: the shipped recipes and accelerate configs (installed inside
the package, `SHIPPED`), `--config` / `--accelerate_config` by name or path, and a recipe's `extends` chain.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from .recipe_inputs import RecipeError

# ----------------------------------------------------------------------------------------- shipped files
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def _shipped_folder(name: str) -> Path:
    """The repository's top-level `name/` folder is the one copy of the shipped files; the wheel installs it as
    `trl_gspo/name/` (pyproject.toml's package-dir), so look inside the package first, then beside it."""
    installed = PACKAGE_DIR / name
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


SHIPPED = {"recipe": _shipped_folder("recipes"), "accelerate config": _shipped_folder("accelerate_configs")}


def shipped_names(kind: str) -> list[str]:
    return sorted(path.stem for path in SHIPPED[kind].glob("*.yaml"))


def is_shipped(path: Path) -> bool:
    """Whether `path` is one of the shipped files (installed inside the package), not a copy."""
    return path.resolve().parent in {folder.resolve() for folder in SHIPPED.values()}


def resolve_shipped(value: str, kind: str) -> Path:
    """`value` as a file, or a bare name (no folder, optional `.yaml`) looked up where `trl-gspo recipes` copies files
    to, then among the shipped `kind` ("recipe" / "accelerate config"): `NAME.yaml` in the working directory,
    `recipes/NAME.yaml` (`accelerate_configs/NAME.yaml`) below it, then the shipped file. So after `trl-gspo recipes
    DEST`, `--config demo` in DEST (or in DEST/recipes) runs the edited copy. A value with a folder part is a path and
    must exist: it never falls back to a shipped file of the same name.
    """
    path = Path(value).expanduser()
    if path.is_file():
        return path.resolve()
    folder = SHIPPED[kind]
    names = shipped_names(kind)
    stem = path.stem if path.suffix in (".yaml", ".yml") else path.name
    if path.parent == Path("."):
        for candidate in (Path(f"{stem}.yaml"), Path(folder.name) / f"{stem}.yaml", folder / f"{stem}.yaml"):
            if candidate.is_file():
                return candidate.resolve()
    elif stem in names:
        flag = "--config" if kind == "recipe" else "--accelerate_config"
        raise RecipeError(
            f"{kind} {value!r}: no such file in {Path.cwd()}. The shipped {kind} of that name is `{flag} {stem}`; "
            "`trl-gspo recipes DEST` copies the shipped files out for editing."
        )
    close = difflib.get_close_matches(stem, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RecipeError(
        f"{kind} {value!r}: no such file, and no shipped {kind} of that name.{hint} Shipped: "
        f"{', '.join(names)} (`trl-gspo recipes --list`)."
    )


def load_recipe(path: Path) -> dict:
    """A recipe file's keys; a YAML syntax error or a file that is no mapping is one `RecipeError` naming the file
    (and the line and column where the parser stopped)."""
    import yaml

    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = " ".join(str(part) for part in (err.context, err.problem) if part)
        raise RecipeError(f"{where}: not valid YAML ({problem}).") from err
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML ({err}).") from err
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise RecipeError(f"{path} is not a recipe (a YAML mapping of keys), it holds a {type(loaded).__name__}.")
    return loaded


def take_option(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove `--flag VALUE` / `--flag=VALUE` from argv; returns (VALUE or None, the rest)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            if i + 1 >= len(argv):
                raise RecipeError(f"{flag} needs a value.")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def resolve_config_argument(argv: list[str]) -> tuple[list[str], Path | None]:
    """Replace the value of `--config` by the recipe file it names; returns (argv, recipe path or None)."""
    value, rest = take_option(argv, "--config")
    if value is None:
        return argv, None
    recipe = resolve_shipped(value, "recipe")
    load_recipe(recipe)  # a broken file fails here, in one line, before any parser reads it
    return ["--config", str(recipe), *rest], recipe


#: Recipe key naming the recipe a variant starts from (see the module docstring).
EXTENDS = "extends"


def recipe_with_bases(config: dict, recipe_dir: Path | None, chain: tuple[str, ...] = ()) -> dict:
    """`config` (one recipe's keys) on top of the keys of the recipe it `extends`, recursively. A base is looked up
    next to the recipe that names it first (so copies made by `trl-gspo recipes` extend copies), then among the
    shipped recipes. A base's `env:` is exported like TRL's parser exports a recipe's."""
    config = dict(config)
    base = config.pop(EXTENDS, None)
    if base is None:
        return config
    if not isinstance(base, str):
        raise RecipeError(f"{EXTENDS}: expected a recipe name or path, got {base!r}.")
    local = [recipe_dir / base, recipe_dir / f"{base}.yaml"] if recipe_dir is not None else []
    path = next((c for c in local if c.is_file()), None) or resolve_shipped(base, "recipe")
    if str(path.resolve()) in chain:
        raise RecipeError(f"{EXTENDS}: recipes extend each other in a cycle ({' -> '.join(chain)} -> {path}).")
    loaded = load_recipe(path)
    for key, value in (loaded.pop("env", None) or {}).items():
        os.environ[key] = str(value)
    merged = recipe_with_bases(loaded, path.parent, (*chain, str(path.resolve())))
    return {**merged, **config}
