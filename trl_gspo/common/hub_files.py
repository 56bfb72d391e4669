"""A Hub model in the Hub cache: the files transformers loads, whether the cache holds all of them whole, and fetching
those files and no others.

A Hub cache left by an `AutoConfig` or `AutoTokenizer` call, or by a download stopped half way, holds a model's
config but not its weights, and a download interrupted half way (huggingface_hub fetches files in parallel) may hold
`tokenizer_config.json` without `tokenizer.json`, so a cached `config.json` does not mean the model loads offline.
`complete_snapshot` counts a cached model only when every file the model and its tokenizer load is there
(`missing_files`: the config, the tokenizer's settings and its vocabulary, every weights file) and each weights file
is whole (its safetensors header read and its size matching the header); huggingface_hub links a file into a
snapshot only once it is complete, but a file copied or cut short by hand is not. `download` fetches `LOADED` only:
a Hub repository may carry ONNX or GGUF exports several times the size of the weights transformers reads; run on a
partial cache, it fetches what the cache lacks.

Mechanics only: `model_store` turns what fails here into its one-line errors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

#: What `from_pretrained` reads of a model repository (model and tokenizer): the patterns `download` passes to
#: `snapshot_download(allow_patterns=...)`.
LOADED = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",  # the weights, one file or shards; not a subfolder's (a pattern matches from the root)
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
#: What `AutoTokenizer` reads for the models the store serves: the tokenizer's settings (chat template, special tokens)
#: and the fast tokenizer's vocabulary, each needed (without `tokenizer.json` transformers would rebuild the tokenizer
#: from other files, or fail offline).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def repo_cache(hub_id: str) -> Path:
    """The Hub cache's folder for `hub_id` (`HF_HUB_CACHE`), whether or not it exists."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=hub_id, repo_type="model")


def whole_safetensors(path: Path) -> bool:
    """Whether `path` is a readable safetensors file as long as its header says (not cut short, not empty)."""
    try:
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
        size = path.stat().st_size
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return False
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    return bool(ends) and size == 8 + header_size + max(ends)


def weights_files(snapshot: Path) -> list[Path]:
    """The safetensors files a snapshot's model loads: the single file, or the shards its index names ([] if the
    snapshot holds neither)."""
    if (snapshot / "model.safetensors").is_file():
        return [snapshot / "model.safetensors"]
    index = snapshot / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError):
        return []
    return [snapshot / name for name in shards]


def cached_snapshot(hub_id: str, revision: str | None = None) -> Path | None:
    """The Hub cache's snapshot folder of `hub_id` (the `main` ref, or `revision`: a ref or a commit), complete or
    not; None where the cache has none."""
    repo = repo_cache(hub_id)
    ref = repo / "refs" / (revision or "main")
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def snapshot_missing(snapshot: Path) -> list[str]:
    """The files the model and its tokenizer load that `snapshot` lacks or holds cut short ([] where it loads)."""
    missing = [name for name in ("config.json", *TOKENIZER_FILES) if not (snapshot / name).is_file()]
    weights = weights_files(snapshot)
    if not weights:
        index = snapshot / "model.safetensors.index.json"
        return [*missing, f"{index.name} (unreadable)" if index.is_file() else "model.safetensors"]
    for path in weights:
        if not path.is_file():
            missing.append(path.name)
        elif not whole_safetensors(path):
            missing.append(f"{path.name} (cut short)")
    return missing


def missing_files(hub_id: str, revision: str | None = None) -> str:
    """What the Hub cache lacks of `hub_id` for loading offline, for a message: "missing: tokenizer.json" (the
    `snapshot_missing` of its snapshot), "none of its files" where it holds no snapshot, "" where nothing is missing."""
    snapshot = cached_snapshot(hub_id, revision)
    if snapshot is None:
        return "none of its files"
    missing = snapshot_missing(snapshot)
    return f"missing: {', '.join(missing)}" if missing else ""


def complete_snapshot(hub_id: str, revision: str | None = None) -> Path | None:
    """The Hub cache's snapshot of `hub_id` (the `main` ref, or `revision`) if it holds every file the model and its
    tokenizer load, each weights file whole; else None."""
    snapshot = cached_snapshot(hub_id, revision)
    return snapshot if snapshot is not None and not snapshot_missing(snapshot) else None


def blob_sizes(hub_id: str) -> dict[str, int]:
    """{blob name: bytes} of the files the Hub cache holds whole for `hub_id` (downloads under way end in
    `.incomplete` and are left out)."""
    blobs = repo_cache(hub_id) / "blobs"
    if not blobs.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in blobs.iterdir() if p.is_file() and not p.name.endswith(".incomplete")}


def download(hub_id: str, revision: str | None = None) -> tuple[Path, int]:
    """Fetch `LOADED` of `hub_id` (at `revision`, else `main`) into the Hub cache: (the snapshot folder, the bytes this
    call downloaded, counted from the blobs that were not in the cache before). Raises what `snapshot_download`
    raises."""
    import huggingface_hub

    before = blob_sizes(hub_id)
    folder = huggingface_hub.snapshot_download(hub_id, revision=revision, allow_patterns=LOADED)
    fetched = sum(size for name, size in blob_sizes(hub_id).items() if name not in before)
    return Path(folder), fetched
