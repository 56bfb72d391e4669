"""TRL's fused log-prob head as the forward pipeline runs it: labelled positions only, and its memory knob
(`GSPOConfig.logprob_vocab_chunk_size`).

TRL (from 1.15) never materialises `(tokens, vocab)` logits: its fused LM head projects hidden states through the LM
head in `[<=4096 tokens, 32768 vocab]` tiles and folds each into an online log-sum-exp. With Triton (CUDA) the
fold runs in place on the tile. Without it (CPU), the torch fallback keeps several tile-sized fp32 temporaries
alive (about 8 in the backward), so a 32768-column tile costs more than the full fp32 logits at a 2k-token
batch. A narrower tile bounds that, at the price of more, smaller matmuls. TRL 1.10 to 1.14 have no fused head
(they compute the completion logits in full), so there the knob does not exist: `GSPOConfig` refuses it.

Which positions the head scores: TRL scores only the positions with a label where Triton runs, and every position
elsewhere, so that tile shapes stay fixed for graph compilers. On the CPU nothing is compiled, and most positions of
a call are prompt tokens (their label is -100): at SmolLM2's 49,152-token vocabulary the head is about a sixth of a
token's forward and backward with gradient checkpointing, spent there on values that are thrown away. The
pipeline's forwards therefore score only labelled positions on the CPU too (`labelled_only`); each scored value is
the same computation on the same row, so only the matmuls' shapes change (fp32 rounding).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..common import seam, trl_compat


@dataclass
class FusedHeadOptions:
    r"""
    `GSPOConfig` field of the fused log-prob head's tile (this module).

    Parameters:
        logprob_vocab_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Vocabulary columns per tile of TRL's fused log-prob head (`None`: TRL's 32768). Without Triton (CPU),
            TRL folds each `[tokens, chunk]` fp32 tile with ~8 tile-sized temporaries in the backward, so at a 151k
            vocabulary x 2k tokens the log-prob path peaks above the size of the full fp32 logits; 4096 cuts that
            peak ~6x (see `benchmarks/run.py`). With Triton (CUDA) the fold is in place and the default is fine.
    """

    logprob_vocab_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Vocabulary columns per tile in TRL's fused log-prob head; None keeps TRL's 32768. On CPU "
            "(no Triton) a smaller tile, e.g. 4096, cuts the log-prob path's peak memory several-fold at large "
            "vocabularies, since TRL's torch fallback keeps several tile-sized fp32 temporaries."
        },
    )

    def _validate_options(self):
        chunk = self.logprob_vocab_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"logprob_vocab_chunk_size={chunk!r} must be a positive int, or None for TRL's default.")
        if chunk is not None and not available():
            raise ValueError(
                f"logprob_vocab_chunk_size={chunk!r} sets the tile of TRL's fused log-prob head, which the installed "
                "TRL does not have (it arrived in TRL 1.15; older releases compute the completion logits in full). "
                "Leave it None, or upgrade TRL."
            )


def available() -> bool:
    """Whether the installed TRL has the fused log-prob head whose tile size this module sets."""
    return trl_compat.fused_logprob_head_module() is not None


def vocab_chunk(chunk_size: int | None):
    """Run TRL's fused log-prob head with `chunk_size` vocabulary columns per tile (None: leave TRL's default).

    TRL reads the module constant when the forward runs and stores it for the backward, so setting it around
    the forward call is enough (common/seam.py: `fused_head_tile`).
    """
    if chunk_size is None:
        return contextlib.nullcontext()
    owner = trl_compat.fused_logprob_head_module()
    if owner is None:
        raise RuntimeError(
            f"logprob_vocab_chunk_size={chunk_size} needs TRL's fused log-prob head (TRL >= 1.15); the installed TRL "
            "computes full logits. Unset it (None)."
        )
    return seam.fused_head_tile(owner, chunk_size)


def labelled_only(device_type: str):
    """Run TRL's fused head on `device_type` scoring only the positions whose label is not -100, as TRL already does
    where Triton runs (common/seam.py: `fused_head_labelled_only`). CPU only: on CUDA without Triton the choice
    would add a boolean index, a host sync, to every model call (with Triton, TRL's own head already makes it)."""
    owner = trl_compat.fused_logprob_head_module()
    if owner is None or device_type != "cpu":
        return contextlib.nullcontext()
    return seam.fused_head_labelled_only(owner, device_type)
