"""Stand-ins for the model store's tests (test_model_store.py, test_model_store_faults.py): caches of their own, a
prepared copy without a model, and the Hub cache as huggingface_hub lays it out, holding a tiny repository."""

import hashlib
import json
from pathlib import Path

from trl_gspo.common import hub_files, model_store, prepared_copy
from trl_gspo.common.model_store import SMOLLM2


def empty_caches(tmp_path: Path, monkeypatch) -> Path:
    """An empty cache, an empty Hub cache of its own, and no Hub (HF_HUB_OFFLINE); returns the cache."""
    import huggingface_hub

    monkeypatch.setenv("TRL_GSPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRL_GSPO_MODEL_SOURCE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "cache"


def fake_prepared(cache: Path) -> Path:
    """A prepared copy as `prepare` records it (each file's size and SHA-256), holding a config file only."""
    folder = model_store.prepared_folder(SMOLLM2, cache)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    record = {"source": "a test's stand-in", "gguf_sha256": "ab", "files": prepared_copy.record_files(folder)}
    (folder / model_store.PROVENANCE).write_text(json.dumps(record))
    return folder


def safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"weight": torch.ones(4, 4)})


#: A model repository as the Hub holds it: what transformers loads, and an export it does not.
REPO = {  # each file's content its own (the Hub cache stores equal contents once)
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
    "model.safetensors": safetensors_bytes(),
    "onnx/model.onnx": b"x" * 5000,
}
REVISION = "a" * 40


def fill_hub_cache(files: dict[str, bytes], hub_id: str = SMOLLM2, revision: str = REVISION, ref: str = "main") -> Path:
    """Write `files` into the Hub cache as huggingface_hub lays them out (blobs, a snapshot of links at `revision`,
    refs/`ref` naming it)."""
    repo = hub_files.repo_cache(hub_id)
    snapshot = repo / "snapshots" / revision
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).unlink(missing_ok=True)
        (snapshot / name).symlink_to(blob)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(revision)
    return snapshot
