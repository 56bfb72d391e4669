"""A Hub model in the Hub cache: the files transformers loads, whether the cache holds all of them whole, and fetching
those files and no others.

A Hub cache left by an `AutoConfig` or `AutoTokenizer` call, or by a download stopped half way, holds a model's
config but not its weights, so a cached `config.json` does not mean the model loads offline. `complete_snapshot`
counts a cached model only when its config, its tokenizer and every weights file are there and each weights file is
whole (its safetensors header read and its size matching the header); huggingface_hub links a file into a snapshot
only once it is complete, but a file copied or cut short by hand is not. `download` fetches `LOADED` only: a Hub
repository may carry ONNX or GGUF exports several times the size of the weights transformers reads.

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
#: One of these is enough for `AutoTokenizer`.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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


def complete_snapshot(hub_id: str, revision: str | None = None) -> Path | None:
    """The Hub cache's snapshot of `hub_id` (the `main` ref, or `revision`) if it holds everything `from_pretrained`
    loads, each weights file whole; else None."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    snapshot = Path(config).parent
    weights = weights_files(snapshot)
    if not weights or not all(whole_safetensors(path) for path in weights):
        return None
    if not any((snapshot / name).is_file() for name in TOKENIZER_FILES):
        return None
    return snapshot


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
