"""No host sync between the model calls of a forward (forward/pipeline.py `_run_calls`, forward/layouts.py `scatter`).

On CUDA a host sync (`.item()`, `.any()` as a bool, `nonzero`, boolean indexing, ...) stalls the CPU until the GPU
has caught up, so the launches of the next call wait. The forward plans on the host from CPU copies of the row spans,
then copies what the calls need ahead of them; from the first model call to the scatter back, only device work runs.

These tests check that structurally on the CPU, with the CPU standing for the device: the calls and the scatter run
under a dispatch mode that fails on every operator that reads a tensor's value back to the host. What the CPU cannot
show (a device-to-host copy is a no-op there) `make gpu-quick` checks with `torch.cuda.set_sync_debug_mode("error")`
around a pi_old forward. Trimmed calls pass an attention mask, and transformers' own mask code reads it back once per
call (`padding_mask.all()`, as in stock TRL's calls): allowed here only from transformers' masking_utils.
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback

import pytest
import torch
from helpers.smallest_bug import dropped_token_gap
from torch.utils._python_dispatch import TorchDispatchMode

from trl_gspo.forward import fused_head, pipeline, segment_attention
from trl_gspo.rounding import model_bound, relative_gap

pytestmark = pytest.mark.skipif(not fused_head.available(), reason="TRL < 1.15: no fused log-prob head")

#: Operators that read a tensor's value back to the host (a sync on CUDA).
SYNCING = {
    "aten._local_scalar_dense.default",  # .item(), bool(t), int(t), .tolist()
    "aten.nonzero.default",
    "aten.is_nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
    "aten.repeat_interleave.Tensor",
}


class NoSync(TorchDispatchMode):
    """Records every syncing operator (and indexing with a boolean tensor) with the frame that called it."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = [i for a in args if isinstance(a, (list, tuple)) for i in a]
        boolean = name.startswith(("aten.index.", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        )
        if name in SYNCING or boolean:
            frames = [f for f in traceback.extract_stack() if "torch/" not in f.filename]
            frames = [f for f in frames if f.name != "__torch_dispatch__"]
            self.found.append((name, f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}"))
        return func(*args, **(kwargs or {}))

    def ours(self):
        return [hit for hit in self.found if "transformers/masking_utils.py" not in hit[1]]


def test_the_check_can_fail():
    """Each way to read a value back is seen (`.tolist()` reads the storage without dispatching an operator: the
    GPU check's sync debug mode covers it)."""
    x = torch.tensor([0, 1, 2])
    with NoSync() as mode:
        bool(x.any()), x[x > 0], x.nonzero(), x[1].item()
    assert [name for name, _ in mode.found] == [
        "aten._local_scalar_dense.default",
        "aten.index.Tensor",
        "aten.nonzero.default",
        "aten._local_scalar_dense.default",
    ]
    assert all("test_the_check_can_fail" in where for _, where in mode.found)


def _batch(vocab):
    """Two prompts (left-padded) with three completions each (right-padded), rows interleaved."""
    g = torch.Generator().manual_seed(0)
    p, t = 7, 9
    group = torch.tensor([0, 1, 0, 1, 0, 1])
    prompt_len, completion_len = torch.tensor([7, 4])[group], torch.tensor([2, 5, 1, 3, 6, 4])
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    completion_mask = (torch.arange(t)[None] < completion_len[:, None]).long()
    ids = torch.cat(
        [
            torch.randint(4, vocab, (2, p), generator=g)[group] * prompt_mask,
            torch.randint(4, vocab, (6, t), generator=g) * completion_mask,
        ],
        1,
    )
    return ids, torch.cat([prompt_mask, completion_mask], 1), t


def _stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
    """CPU stand-in of torch's varlen_attn (bottom-right causal per sequence; tests/test_segment_kernels.py checks
    the kernel path against a dense reference). Python ints and host-free tensor ops only, as a kernel would."""
    key, value = (x.repeat_interleave(query.size(1) // x.size(1), 1) for x in (key, value))
    out = torch.empty_like(query)
    for i in range(len(cu_seq_q) - 1):  # the stand-in reads its offsets; torch's kernel reads them on the device
        q0, q1, k0, k1 = (int(x) for x in (cu_seq_q[i], cu_seq_q[i + 1], cu_seq_k[i], cu_seq_k[i + 1]))
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1), key[k0:k1].transpose(0, 1), value[k0:k1].transpose(0, 1), mask, scale=scale
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    "settings, kernel",
    [
        (dict(shared_prefix=True), None),
        (dict(padding_free=True, shared_prefix=False), None),
        (dict(shared_prefix=False, padding_free=False), None),
        (dict(shared_prefix=True), segment_attention.TORCH_VARLEN),
    ],
    ids=["shared, SDPA blocks", "packed, SDPA blocks", "trimmed", "shared, varlen kernel"],
)
def test_no_sync_between_the_model_calls(settings, kernel, trainer_factory, tmp_path, monkeypatch, caplog):
    """A pi_old-style pass (no grad, two chunks) and a loss forward and backward: from the first model call to the
    scatter back, no syncing operator runs in trl-gspo's code (nor anywhere, for segment calls); the log-probs equal
    the trimmed forward's."""
    trainer = trainer_factory(
        dict(reward=lambda completions, **kw: [0.0] * len(completions), prompts=["a b"] * 8),
        output_dir=tmp_path,
        **settings,
    )
    forward = trainer.logprob_forward
    # The CPU stands for CUDA, where the pipeline leaves TRL's head as it is (its labelled-only choice on the CPU is a
    # boolean index: forward/fused_head.py `labelled_only`).
    monkeypatch.setattr(fused_head, "labelled_only", lambda device_type: contextlib.nullcontext())
    if kernel is not None:  # the CPU standing for CUDA with torch's kernel (the stand-in reads its offsets: skipped)
        monkeypatch.setattr(forward, "varlen_kernel", lambda support, device: kernel)
        monkeypatch.setattr(segment_attention, "varlen_attn", _stand_in)
    ids, mask, t = _batch(trainer.model.config.vocab_size)
    mode = NoSync()
    run_calls, scatter = forward._run_calls, pipeline.scatter

    def guarded(*args, **kwargs):
        with mode:
            return run_calls(*args, **kwargs)

    def guarded_scatter(*args, **kwargs):
        with mode:
            return scatter(*args, **kwargs)

    monkeypatch.setattr(forward, "_run_calls", guarded)
    monkeypatch.setattr(pipeline, "scatter", guarded_scatter)
    if kernel is not None:
        segment_attention_varlen = segment_attention._varlen

        def kernel_unguarded(*args):  # the stand-in's own offset reads are not the forward's
            with torch.utils._python_dispatch._disable_current_modes():
                return segment_attention_varlen(*args)

        monkeypatch.setattr(segment_attention, "_varlen", kernel_unguarded)
    with caplog.at_level(logging.INFO, logger="trl_gspo"):
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, t, batch_size=3)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, t)
        logps.sum().backward()
        forward.release()
    assert mode.ours() == []
    if settings.get("shared_prefix") is True or settings.get("padding_free") is True:
        assert mode.found == []  # segment calls: transformers builds no mask either
        said = [r.getMessage() for r in caplog.records if "calls on cpu run" in r.getMessage()]
        assert len(said) == 1 and (kernel or "SDPA blocks") in said[0]  # once, naming what serves them
    monkeypatch.undo()
    trimmed = trainer_factory(
        dict(reward=lambda completions, **kw: [0.0] * len(completions), prompts=["a b"] * 8),
        output_dir=tmp_path / "trimmed",
        model=trainer.model,
        shared_prefix=False,
        padding_free=False,
    )
    with torch.no_grad():
        expected, _, _ = trimmed._get_per_token_logps_and_entropies(trimmed.model, ids, mask, t)
    bound = model_bound(torch.float32, trainer.model.config, ids.size(1))  # one forward's fp32 rounding, every token
    assert relative_gap(old, expected, math.inf) <= bound
    assert relative_gap(logps.detach(), expected, math.inf) <= bound
    assert dropped_token_gap(expected, mask[:, -t:]) > bound  # companion: one token mis-masked lands outside it
