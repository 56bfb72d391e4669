"""`trl-gspo check`: run after installing or upgrading TRL (or anything around it).

It prints the installed versions that decide how training behaves, then runs the parity cases of `cli/parity.py`
against the installed stock `trl.GRPOTrainer` on a tiny model built in code (offline, CPU, well under a minute): for
each level and loss type, our loss, every parameter gradient and TRL's metrics must equal stock TRL's. It exits 0
when all agree and 1 when any differs, naming the case and the quantity (loss, the gradient of a named parameter, a
metric), which means the installed TRL changed semantics under `GSPOTrainer._compute_loss`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import time
import warnings
from importlib import metadata

from ..common import trl_compat
from ..testing import build_tiny_model, build_tokenizer
from . import parity

#: Distribution names whose versions change training behaviour (missing optional ones print as "not installed").
PACKAGES = (
    "trl-gspo",
    "torch",
    "trl",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "deepspeed",
    "vllm",
    "flash-attn",
    "liger-kernel",
)


def installed_versions() -> dict[str, str]:
    """{distribution: version or "not installed"}, plus the CUDA build and whether a GPU is visible."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    import torch

    found["CUDA"] = (
        f"{torch.version.cuda} (GPU visible: {torch.cuda.is_available()})" if torch.version.cuda else "none (CPU build)"
    )
    return found


def run_parity(log=print) -> dict[str, list[str]]:
    """Every parity case -> its differences (empty list: equal to stock TRL)."""
    tokenizer = build_tokenizer()
    results = {}
    with tempfile.TemporaryDirectory(prefix="trl-gspo-check-") as workdir:
        for moe, cases in ((False, parity.CASES), (True, parity.MOE_CASES)):
            # A saved model, loaded from its folder: with beta > 0 TRL loads the reference model from that path.
            path = f"{workdir}/model-{'moe' if moe else 'dense'}"
            build_tiny_model(tokenizer, moe=moe, seed=0).save_pretrained(path)
            model = type(build_tiny_model(tokenizer, moe=moe)).from_pretrained(path)
            for name, settings in cases.items():
                results[name] = parity.compare_with_stock(settings, model, tokenizer, f"{workdir}/{name}")
                log(_line(name, results[name]))
        model = type(build_tiny_model(tokenizer)).from_pretrained(f"{workdir}/model-dense")
        for base in parity.GSPO_TOKEN_BASES:
            name = f"{base}: {parity.GSPO_TOKEN_CASE[0]} == {parity.GSPO_TOKEN_CASE[1]}"
            results[name] = parity.compare_gspo_token(base, model, tokenizer, f"{workdir}/gspo-token-{len(results)}")
            log(_line(name, results[name]))
    return results


@contextlib.contextmanager
def _quiet():
    """Silence the libraries' notes about the toy settings and their progress bars, restoring both afterwards."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in ("transformers", "trl", "trl_gspo", "accelerate", "datasets")]
    levels = [logger.level for logger in loggers]
    bars = hf_logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def quiet_deepspeed_without_gpu() -> None:
    """The parity cases run on CPU. Where torch sees no GPU, tell DeepSpeed (when installed) so before transformers
    imports it during the first case: otherwise it prints that it found no accelerator in the middle of the report."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _line(name: str, found: list[str]) -> str:
    if not found:
        return f"  ok       {name}"
    return (
        f"  DIFFERS  {name}: " + "; ".join(found[:4]) + (f"; ... ({len(found)} differences)" if len(found) > 4 else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-gspo check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    quiet_deepspeed_without_gpu()
    start = time.perf_counter()
    print("Installed versions:")
    for name, version in installed_versions().items():
        print(f"  {name:<13} {version}")
    print(
        f"Supported TRL: {trl_compat.SUPPORTED_TRL} (tested {trl_compat.MIN_TRL} to {trl_compat.NEWEST_TESTED_TRL}.x)"
    )
    print("Parity with the installed stock trl.GRPOTrainer (loss, every gradient, TRL's metrics), tiny model on CPU:")
    with _quiet():
        results = run_parity()
    failed = [name for name, found in results.items() if found]
    seconds = time.perf_counter() - start
    if failed:
        print(
            f"FAILED: {len(failed)} of {len(results)} cases differ ({', '.join(failed)}) in {seconds:.0f} s. The "
            "installed TRL computes the GRPO loss differently from what GSPOTrainer rebuilds: install a supported "
            f"TRL (pip install 'trl{trl_compat.SUPPORTED_TRL}') or report the difference."
        )
        return 1
    print(f"OK: all {len(results)} cases match stock TRL in {seconds:.0f} s.")
    return 0
