"""vLLM server mode, before the first step: is the server serving the trainer's model?

TRL's client asks the server only for its model's name. A server started with another model (another size, family or
tokenizer) would then generate every completion of the run: rewarded, trained on and logged as the policy's, with
token ids that mean other words, until the first weight push fails or never notices. `check_served_model` compares,
on the main process, right after TRL has connected to the server:

1. the served model's config, read where the trainer runs (the served name is a local folder or a Hub id in the local
   cache; nothing is downloaded): every field of `SHAPE_FIELDS` (common/model_config.py) both configs set must be equal;
2. the server's tokenizer, through vLLM's `/tokenize`: a probe text made of tokens spread over the trainer's whole
   vocabulary must give the same ids as the trainer's tokenizer.

A mismatch raises `ServedModelMismatch` naming the server URL, the served model, what differs and both values. Where
the served config cannot be read here (a server on another machine), (1) is skipped with a logged warning; where the
server has no `/tokenize`, (2) is. Only the main process holds TRL's client, so the error is raised there.
"""

from __future__ import annotations

import logging

from ..common.model_config import shape_differences, text_config

logger = logging.getLogger(__name__)

#: Tokens of the trainer's vocabulary in the probe text (evenly spaced ids, special tokens left out).
PROBE_TOKENS = 48


class ServedModelMismatch(ValueError):
    """The vLLM server serves a model other than the trainer's."""


def check_served_model(trainer) -> None:
    """Refuse a vLLM server whose model differs from `trainer`'s (module docstring). No-op outside server mode and on
    processes without TRL's client (it lives on the main process)."""
    if not (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "server"):
        return
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
    if client is None:
        return
    url, served = getattr(client, "base_url", "the vLLM server"), getattr(client, "model", None)
    if served is None:  # TRL's clients before 1.14.2 talk to `trl vllm-serve`'s own endpoints and read no model name
        logger.warning(
            "vLLM server at %s: this TRL's client does not read the served model's name; the served model is "
            "not compared with the trainer's.",
            url,
        )
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    theirs = _served_config(served)
    if theirs is None:
        logger.warning(
            "vLLM server at %s serves %r, whose config cannot be read here (not a local folder or a Hub id "
            "in the local cache): its architecture is not compared with the trainer's model; its tokenizer "
            "is.",
            url,
            served,
        )
    else:
        _compare_configs(text_config(model.config), text_config(theirs), url, served)
    _compare_tokenizers(client, trainer._tokenizer, url, served)


def _served_config(name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as error:
        logger.debug("Reading the served model's config %r failed: %s", name, error)
        return None


def _compare_configs(ours, theirs, url: str, served: str) -> None:
    differences = shape_differences(ours, theirs)
    if differences:
        field, mine, served_value = differences[0]
        raise ServedModelMismatch(
            f"The vLLM server at {url} serves {served!r}, whose {field} is {served_value!r}; the trainer's model "
            f"({getattr(ours, '_name_or_path', '') or type(ours).__name__}) has {field}={mine!r}. Its completions "
            "would not be the policy's, and weight updates could not load. Start the server with the trainer's "
            "model (`vllm serve <the trainer's model> ...`, docs/vllm.md), or point vllm_server_base_url at one that "
            "serves it."
        )


def probe_text(tokenizer) -> str:
    """Text made of `PROBE_TOKENS` tokens spread evenly over the tokenizer's vocabulary, special tokens left out."""
    size, special = len(tokenizer), set(tokenizer.all_special_ids)
    step = max(size // PROBE_TOKENS, 1)
    ids = [i for i in range(size - 1, -1, -step) if i not in special][::-1]
    return tokenizer.decode(ids)


def _compare_tokenizers(client, tokenizer, url: str, served: str) -> None:
    text = probe_text(tokenizer)
    response = client.session.post(
        f"{url}/tokenize", json={"model": served, "prompt": text, "add_special_tokens": False}, timeout=60
    )
    if response.status_code != 200:  # 404: a server without vLLM's /tokenize
        logger.warning(
            "vLLM server at %s answered /tokenize with %s: its tokenizer is not compared with the trainer's.",
            url,
            response.status_code,
        )
        return
    theirs = response.json()["tokens"]
    mine = tokenizer(text, add_special_tokens=False)["input_ids"]
    if theirs != mine:
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise ServedModelMismatch(
            f"The vLLM server at {url} serves {served!r}, whose tokenizer differs from the trainer's: a probe text of "
            f"{len(mine)} trainer tokens gives ids {theirs[at : at + 5]} there and {mine[at : at + 5]} here (from "
            f"position {at}; {len(theirs)} vs {len(mine)} ids in all). The ids of its completions would mean other "
            "text to the trainer. Start the server with the trainer's model and tokenizer."
        )
