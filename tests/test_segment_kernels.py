"""The fused varlen kernels of segment calls (forward/segment_attention.py: `varlen_kernel`, `_varlen`), on CPU.

torch's `varlen_attn` runs on CUDA only, so these tests replace it with a CPU stand-in of the installed torch's exact
signature (checked against it) and of the older `is_causal` form, each computing every sequence with a dense masked
softmax. The segment attention's output and its gradients (query, key, value) are compared with an independent
dense reference whose mask is written out position by position from the units, never from `SegmentPlan`. Not a GPU
run: `make gpu-quick` (`python -m benchmarks.gpu`) checks the real kernels against the same kind of reference.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from trl_gspo.forward import segment_attention
from trl_gspo.forward.segment_attention import FLASH_ATTN, TORCH_VARLEN, SegmentPlan, varlen_kernel

#: One row: a group (3-token prefix, segments of 2 and 4), a plain sequence of 3, a group (prefix 2, segments 1, 2, 2),
#: then 2 filler positions.
UNITS = [[(3, [2, 4]), (0, [3]), (2, [1, 2, 2])]]
WIDTH = 21


def _dense_mask(rows, width):
    """`[rows, W, W]` who attends to whom, written out from the units: a prefix token sees its prefix causally, a
    segment token the whole prefix and its own segment causally, a filler token itself."""
    mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
    for r, units in enumerate(rows):
        at = 0
        for prefix, segments in units:
            for i in range(at, at + prefix):
                mask[r, i, at : i + 1] = True
            start = at + prefix
            for n in segments:
                for i in range(start, start + n):
                    mask[r, i, at : at + prefix] = True
                    mask[r, i, start : i + 1] = True
                start += n
            at = start
        for i in range(at, width):
            mask[r, i, i] = True
    return mask


def test_plan_from_units_matches_the_mask_written_out_from_the_units():
    """`SegmentPlan.from_units` (filled as Python lists, made tensors once) on random rows of units and filler: its
    mask is `_dense_mask`'s, position by position, and a plan of no rows is `[0, W]`."""
    rng = random.Random(0)
    for _ in range(100):
        rows = []
        for _ in range(rng.randint(1, 3)):
            units = [(rng.choice([0, rng.randint(1, 6)]), [rng.randint(1, 5) for _ in range(rng.randint(1, 3))])]
            units += [(0, [rng.randint(1, 5)]) for _ in range(rng.randint(0, 2))]
            rows.append(units)
        width = max(sum(p + sum(seg) for p, seg in units) for units in rows) + rng.randint(0, 3)
        assert torch.equal(SegmentPlan.from_units(rows, width).dense_mask(), _dense_mask(rows, width))
    assert SegmentPlan.from_units([], 5).shape == (0, 5)


def _dense_attention(q, k, v, mask, scale):
    """`[B, H, W, D]` queries, `[B, H_kv, W, D]` keys/values: softmax(q k^T * scale, masked) v, heads repeated."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


def _per_sequence(query, key, value, cu_q, cu_k, causal, scale):
    """Shared body of the stand-ins: each sequence alone, bottom-right aligned causal (query i of nq sees keys
    j <= i + nk - nq), as flash-attention's varlen kernels align it."""
    if key.size(1) != query.size(1):
        raise ValueError(f"{query.size(1)} query heads, {key.size(1)} key heads without enable_gqa")
    scale = query.size(-1) ** -0.5 if scale is None else scale
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = query[cu_q[i] : cu_q[i + 1]], key[cu_k[i] : cu_k[i + 1]], value[cu_k[i] : cu_k[i + 1]]
        nq, nk = len(qs), len(ks)
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            allowed = allowed.tril(nk - nq)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vs))
    return torch.cat(outs)


def torch_2_13_stand_in(calls):
    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        assert isinstance(max_q, int) and isinstance(max_k, int)  # host ints: no device read
        assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
        calls.append({"kv_heads": key.size(1), "gqa": enable_gqa})
        if enable_gqa:
            key, value = (x.repeat_interleave(query.size(1) // x.size(1), 1) for x in (key, value))
        return _per_sequence(query, key, value, cu_seq_q, cu_seq_k, tuple(window_size) == (-1, 0), scale)

    return varlen_attn


def torch_is_causal_stand_in(calls):
    """The older form (torch 2.10): `is_causal`, no `scale`, no `enable_gqa`."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
        calls.append({"kv_heads": key.size(1)})
        return _per_sequence(query, key, value, cu_seq_q, cu_seq_k, is_causal, None)

    return varlen_attn


def _shape(signature):
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_the_stand_in_has_the_installed_torchs_signature():
    installed = segment_attention._torch_varlen_attn()
    if installed is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert _shape(inspect.signature(torch_2_13_stand_in([]))) == _shape(inspect.signature(installed))


def test_varlen_kernel_choice():
    """torch's kernel wherever it exists on CUDA in half precision, flash-attention's as the alternative (and for
    attention dropout, which torch's lacks), the SDPA blocks on the CPU, in fp32 and with neither kernel."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert varlen_kernel("cuda", bf16, torch_kernel=True, flash=True) == TORCH_VARLEN
    assert varlen_kernel("cuda", torch.float16, torch_kernel=True, flash=False) == TORCH_VARLEN
    assert varlen_kernel("cuda", bf16, torch_kernel=False, flash=True) == FLASH_ATTN
    assert varlen_kernel("cuda", bf16, True, torch_kernel=True, flash=True) == FLASH_ATTN  # dropout
    assert varlen_kernel("cuda", bf16, True, torch_kernel=True, flash=False) is None
    assert varlen_kernel("cuda", bf16, torch_kernel=False, flash=False) is None
    assert varlen_kernel("cuda", fp32, torch_kernel=True, flash=True) is None
    assert varlen_kernel("cpu", bf16, torch_kernel=True, flash=True) is None
    assert varlen_kernel("cpu", torch.float32) is None  # this machine, whatever is installed


@pytest.mark.parametrize("form", ["torch 2.13", "is_causal"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_torch_varlen_output_and_gradients_match_a_dense_reference(monkeypatch, form, scale):
    """GQA (4 query heads, 2 key/value heads), prefixes seen by their segments only, packed sequences apart, filler,
    bottom-right alignment: output and query/key/value gradients equal the dense masked attention. With the 2.13
    signature the kernel gets 2 key/value heads and `enable_gqa` (no repeat), `window_size=(-1, 0)` and the scale;
    with the older one, repeated heads, `is_causal` and the scale folded into the queries."""
    calls = []
    kernel = (torch_2_13_stand_in if form == "torch 2.13" else torch_is_causal_stand_in)(calls)
    monkeypatch.setattr(segment_attention, "varlen_attn", kernel)
    plan = SegmentPlan.from_units(UNITS, WIDTH).build_varlen(TORCH_VARLEN)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, WIDTH, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    weights = torch.randn(1, WIDTH, 4, 8, generator=g, dtype=torch.float64)
    module = type("Attention", (), {"config": None})()

    out, _ = segment_attention.segment_attention(module, q, k, v, None, scaling=scale, segment_plan=plan)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    reference = _dense_attention(q, k, v, _dense_mask(UNITS, WIDTH), 8**-0.5 if scale is None else scale)
    reference = reference.transpose(1, 2)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))

    torch.testing.assert_close(out, reference, atol=1e-10, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert plan.calls == 1 and len(calls) == 1
    assert calls[0]["kv_heads"] == (2 if form == "torch 2.13" else 4)
    if form == "torch 2.13":
        assert calls[0]["gqa"] is True


def test_the_dense_reference_can_fail(monkeypatch):
    """Top-left alignment (a kernel that aligns causal masks the other way) is caught by the same comparison."""
    calls = []

    def top_left(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        calls.append(is_causal)
        out = []
        for i in range(len(cu_seq_q) - 1):
            qs = query[cu_seq_q[i] : cu_seq_q[i + 1]]
            ks, vs = key[cu_seq_k[i] : cu_seq_k[i + 1]], value[cu_seq_k[i] : cu_seq_k[i + 1]]
            allowed = torch.ones(len(qs), len(ks), dtype=torch.bool).tril(0)  # query i sees keys 0..i
            scores = torch.einsum("qhd,khd->hqk", qs, ks).masked_fill(~allowed, float("-inf")) * qs.size(-1) ** -0.5
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        return torch.cat(out)

    monkeypatch.setattr(segment_attention, "varlen_attn", top_left)
    plan = SegmentPlan.from_units(UNITS, WIDTH).build_varlen(TORCH_VARLEN)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, WIDTH, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out, _ = segment_attention.segment_attention(type("A", (), {"config": None})(), q, k, v, None, segment_plan=plan)
    reference = _dense_attention(q, k, v, _dense_mask(UNITS, WIDTH), 8**-0.5).transpose(1, 2)
    assert calls and (out - reference).abs().max() > 1e-2


def test_a_torch_signature_without_a_causal_option_is_refused(monkeypatch):
    monkeypatch.setattr(segment_attention, "varlen_attn", lambda query, key, value, cu_q, cu_k, max_q, max_k: query)
    plan = SegmentPlan.from_units([[(0, [3])]], 3).build_varlen(TORCH_VARLEN)
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        segment_attention.segment_attention(type("A", (), {"config": None})(), q, q, q, None, segment_plan=plan)


@pytest.mark.parametrize("block", [3, 4, 8, segment_attention.BLOCK])
def test_sdpa_blocks_of_a_one_row_call_match_a_dense_reference(block):
    """The CPU's SDPA blocks on one row of several units (what the planner lays when one row costs less than rows of
    the longest unit): blocks that cut through units, prefixes gathered from far back, GQA and filler; output and
    query/key/value gradients equal the dense masked attention written out from the units, in float64."""
    rng = random.Random(block)
    units = [(rng.randint(2, 9), [rng.randint(1, 7) for _ in range(rng.randint(1, 4))]) for _ in range(5)]
    units.insert(2, (0, [6]))  # a plain packed sequence between groups
    rows = [units]
    width = sum(p + sum(seg) for p, seg in units) + 2
    plan = SegmentPlan.from_units(rows, width).build_blocks(block=block)
    assert (len(plan.blocks) > 1) == (block < width)
    g = torch.Generator().manual_seed(block)
    q, k, v = (torch.randn(1, h, width, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
    weights = torch.randn(1, width, 6, 8, generator=g, dtype=torch.float64)
    module = type("Attention", (), {"config": None})()

    out, _ = segment_attention.segment_attention(module, q, k, v, None, scaling=0.3, segment_plan=plan)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    reference = _dense_attention(q, k, v, _dense_mask(rows, width), 0.3).transpose(1, 2)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))

    torch.testing.assert_close(out, reference, atol=1e-10, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
