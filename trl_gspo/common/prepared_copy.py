"""A prepared model folder on disk: written durably, recorded file by file, and checked before use
(`model_prepare` writes it, `model_store` checks it before a run loads it).

Durable: every file and the folder itself are flushed to disk (fsync) before the folder is renamed into place, and
the folder holding it after the rename, so a power loss leaves either the earlier state or the whole new folder,
never a folder that looks prepared while its weights are zeros or cut short. Recorded: the provenance file lists
every file of the folder with its size and SHA-256. Checked: before a run uses the folder every recorded file must
be there with its size and its hash. The full hash is affordable: SmolLM2's 538 MB of fp32 weights hash in 0.33 s
from the page cache and 0.36 to 0.53 s from disk on a 2-core machine (SHA-256 at about 1.6 GB/s), and the model's
load reads the same bytes right after; reading only the safetensors header (under 1 ms) would miss weights changed
in place. A copy prepared before sizes were recorded is checked by the files such a conversion always wrote and its
recorded weights hash.

Permissions: what the store writes takes the permissions of the folder it is written in, never with write for
others, whatever the folder allows (a world-writable cache gives weights anybody can read but only their owner and
group can change); a group-shared cache stays writable to its group, so a second user of the group can take the
lock and prepare a damaged copy again.

Mechanics only: `model_store` turns what is found here into its one-line errors.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: What a conversion always wrote, before the provenance file listed each file: checked in such older copies.
EARLIER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_files(folder: Path, known: dict[str, str] | None = None) -> dict[str, dict]:
    """{name inside `folder`: {"bytes", "sha256"}} for every file in it; `known` gives hashes already taken."""
    known = known or {}
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        files[name] = {"bytes": path.stat().st_size, "sha256": known.get(name) or sha256_of(path)}
    return files


def earlier_files(record: dict) -> dict[str, dict]:
    """What a copy prepared before its files were recorded is checked by: the files such a conversion always wrote,
    its weights by their recorded SHA-256."""
    files: dict[str, dict] = {name: {} for name in EARLIER_FILES}
    if record.get("weights_sha256"):
        files["model.safetensors"] = {"sha256": record["weights_sha256"]}
    return files


def check(folder: Path, files: dict[str, dict]) -> str | None:
    """The first thing wrong with `folder` against its record `files` (a file missing, of another size, or another
    content), None when every recorded file is as it was written. Sizes first: a file cut short is said without
    hashing the others."""
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if "bytes" in want and size != want["bytes"]:
            return f"{name} is {size} bytes, {want['bytes']} when prepared"
    for name, want in files.items():
        if "sha256" in want and sha256_of(folder / name) != want["sha256"]:
            return f"{name} does not match the SHA-256 recorded when it was prepared"
    return None


def sync(path: Path) -> None:
    """Flush `path` (a file, or a folder's entries) to disk. Windows cannot open a folder to flush it (NTFS journals
    its entries): there only files are flushed."""
    if os.name == "nt" and path.is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """Flush every file in `folder`, then every folder in it, then `folder` itself: all of it on disk before a
    rename makes it visible."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            sync(Path(root, name))
        sync(Path(root))


def store_mode(parent: Path) -> int:
    """The permissions for a folder the store writes in `parent`: `parent`'s, without write for others (files take
    these without the execute bits)."""
    return parent.stat().st_mode & 0o777 & ~0o002
