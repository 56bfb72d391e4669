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


def resolve_shipped(value: str, kind: str) -> Path:
    """`value` as an existing file, else the shipped `kind` ("recipe" / "accelerate config") of that name.

    `zero2`, `zero2.yaml` and `accelerate_configs/zero2.yaml` all name the shipped ZeRO-2 config when no such file
    exists here: the last form is what `trl-gspo recipes` copies out, so a command works before and after copying.
    """
    path = Path(value).expanduser()
    if path.is_file():
        return path.resolve()
    folder = SHIPPED[kind]
    if path.parent in (Path("."), Path(folder.name)):
        candidate = folder / f"{path.stem if path.suffix in ('.yaml', '.yml') else path.name}.yaml"
        if candidate.is_file():
            return candidate
    close = difflib.get_close_matches(path.stem, shipped_names(kind), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RecipeError(
        f"{kind} {value!r}: no such file, and no shipped {kind} of that name.{hint} Shipped: "
        f"{', '.join(shipped_names(kind))} (`trl-gspo recipes --list`)."
    )


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
    return ["--config", str(recipe), *rest], recipe


#: Recipe key naming the recipe a variant starts from (see the module docstring).
EXTENDS = "extends"


def recipe_with_bases(config: dict, recipe_dir: Path | None, chain: tuple[str, ...] = ()) -> dict:
    """`config` (one recipe's keys) on top of the keys of the recipe it `extends`, recursively. A base is looked up
    next to the recipe that names it first (so copies made by `trl-gspo recipes` extend copies), then among the
    shipped recipes. A base's `env:` is exported like TRL's parser exports a recipe's."""
    import yaml

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
    with open(path) as f:
        loaded = yaml.safe_load(f) or {}
    if not isinstance(loaded, dict):
        raise RecipeError(f"{EXTENDS}: {path} is not a recipe (a YAML mapping of keys).")
    for key, value in (loaded.pop("env", None) or {}).items():
        os.environ[key] = str(value)
    merged = recipe_with_bases(loaded, path.parent, (*chain, str(path.resolve())))
    return {**merged, **config}
