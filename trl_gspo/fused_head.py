"""Memory knob for TRL's fused log-prob head (`GSPOConfig.logprob_vocab_chunk_size`).

TRL 1.16 never materialises `(tokens, vocab)` logits: `add_fused_lm_head` projects hidden states through the LM
head in `[<=4096 tokens, 32768 vocab]` tiles and folds each into an online log-sum-exp. With Triton (CUDA) the
fold runs in place on the tile. Without it (CPU), the torch fallback keeps several tile-sized fp32 temporaries
alive (about 8 in the backward), so a 32768-column tile costs more than the full fp32 logits at a 2k-token
batch. A narrower tile bounds that, at the price of more, smaller matmuls.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def vocab_chunk(chunk_size: int | None):
    """Run TRL's fused log-prob head with `chunk_size` vocabulary columns per tile (None: leave TRL's default).

    TRL reads the module constant when the forward runs and stores it for the backward, so setting it around
    the forward call is enough. It is a private name: fail loudly if a TRL upgrade moves it.
    """
    if chunk_size is None:
        yield
        return
    from trl.trainer import utils as trl_utils

    if not hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"):
        raise RuntimeError(
            "logprob_vocab_chunk_size is set but this TRL version has no "
            "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE; unset it (None) or pin trl 1.16.x."
        )
    previous = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = chunk_size
    try:
        yield
    finally:
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = previous
