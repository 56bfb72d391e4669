"""`make gpu-quick`: the short GPU check of the forward path (`python -m benchmarks.gpu --profile quick`,
docs/gpu-check.md). Four parts, each one process that reuses its model across arms and rewrites its result JSON after
every step, so a part stopped at its budget keeps what it measured:

- `probe`: torch and CUDA versions, `varlen_attn`'s signature and the kernel segment calls get, whether a causal
  varlen call aligns bottom-right, which SDPA backends accept a masked GQA block (and a masked block with KV repeated).
- `attention`: one attention layer at Qwen3's shapes, forward and forward+backward timed with CUDA events: stock's
  causal flash call over padded rows, the SDPA blocks, torch's varlen kernel, flash-attn's if installed; each
  output and gradient checked against a dense masked reference on a small layout.
- `passes` (passes.py): the pi_old / reference pass, ours vs stock, at three shapes (`equal_settings`, `long_tail`,
  `long_prompt`): stock, ours with defaults, trimmed only, packed, shared; 2 warm-ups, 5 interleaved repetitions, the
  planner's choice logged. One pi_old forward's model calls run under `torch.cuda.set_sync_debug_mode("error")`.
- `loss` (passes.py): `_compute_loss` + backward with gradient checkpointing, the same arms and shapes.

`--tiny` runs every part on the CPU at toy shapes, with a CPU stand-in of torch's varlen kernel (its signature) and a
dispatch mode standing for the sync debug mode, so the code of every part runs in the test suite
(tests/test_gpu_check.py); its numbers say nothing about speed.

This module holds `probe` and `attention`, the profile's table (`WHAT`, `headline`) and `run_part`, which the driver
(check.py) calls in each part's process; it imports passes.py for the other two, and both build on measure.py.
"""

from __future__ import annotations

import inspect
import statistics
import time

from . import passes
from .measure import BUDGETS, REPS, TINY_REPS, TINY_WARMUPS, WARMUPS, Result, device_of, kernels, timer

#: Attention shapes (query heads, key/value heads, head dim) from the models' config.json. Qwen3-0.6B and -1.7B share
#: theirs (they differ in hidden size, which attention alone does not see), so one measurement stands for both.
ATTENTION_SHAPES = {"Qwen3-0.6B and Qwen3-1.7B": (16, 8, 128), "Qwen3-4B": (32, 8, 128)}


#: bf16 on the GPU: the fused attention kernels accumulate in fp32 and round to bf16 (eps 7.8e-3) only the few values
#: they store (inputs, probabilities, outputs, gradients); this allows a few of those roundings. fp32 (`--tiny`, on the
#: CPU) takes `attention_bound` instead. Not derived from a count: no GPU to measure the kernels' roundings on here.
BF16_ATTENTION_TOLERANCE = 2e-2


def attention_bound(dtype, dim: int, keys: int) -> float:
    """Relative bound of a fused attention's output and gradients against the dense fp32 reference on the same
    inputs: bf16, `BF16_ATTENTION_TOLERANCE`; fp32, the rounding of scores over the head size `dim`, and of the softmax
    and the value sum over `keys` keys, forward and backward (trl_gspo/rounding.py)."""
    import torch

    from trl_gspo.rounding import rounding_bound

    if dtype == torch.bfloat16:
        return BF16_ATTENTION_TOLERANCE
    return rounding_bound(dtype, 2 * (dim + 2 * keys))


def dense_mask(units, width):
    """`[W, W]` bool of a one-row segment layout, written out from its units `(prefix, [segment lengths])` (not from
    `SegmentPlan`): a prefix token sees its prefix causally, a segment token the prefix and its segment causally,
    filler itself."""
    import torch

    mask = torch.zeros(width, width, dtype=torch.bool)
    at = 0
    for prefix, segments in units:
        for i in range(at, at + prefix):
            mask[i, at : i + 1] = True
        start = at + prefix
        for n in segments:
            for i in range(start, start + n):
                mask[i, at : at + prefix] = True
                mask[i, start : i + 1] = True
            start += n
        at = start
    for i in range(at, width):
        mask[i, i] = True
    return mask


# ------------------------------------------------------------------------------------------------ a. probe
def probe(path: str | None, tiny: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from trl_gspo.forward import segment_attention

    result = Result(path)
    device, dtype = device_of(tiny)
    kernel = segment_attention.varlen_attn
    result.set(
        "versions",
        value={
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "flash_attn": _version("flash-attn"),
        },
    )
    result.set("varlen_attn", "signature", value=None if kernel is None else str(inspect.signature(kernel)))
    result.set("varlen_kernel", value=segment_attention.varlen_kernel(device.type, dtype))
    if kernel is not None:
        causal, takes_scale, takes_gqa = segment_attention.torch_varlen_options(kernel)
        result.set("varlen_attn", "options", value={"causal": causal, "scale": takes_scale, "enable_gqa": takes_gqa})
        with kernels(tiny):  # bottom-right alignment: 3 queries against 5 keys, the last query sees all 5
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(n, 2, 64, generator=g).to(device, dtype) for n in (3, 5, 5))
            cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (3, 5))
            out = segment_attention.varlen_attn(q, k, v, cu_q, cu_k, 3, 5, **causal)
            mask = torch.ones(3, 5, dtype=torch.bool, device=device).tril(2)
            ref = F.scaled_dot_product_attention(*(x.float().transpose(0, 1) for x in (q, k, v)), attn_mask=mask)
            error = (out.float() - ref.transpose(0, 1)).abs().max().item()
            bound = attention_bound(dtype, 64, 5) * ref.abs().max().item()
        result.set("varlen_attn", "bottom_right_error", value=error)
        result.set("varlen_attn", "bottom_right_bound", value=bound)
        if error > bound:
            result.problem(f"torch's varlen_attn does not align a causal call bottom-right (error {error:.3g})")
    result.set("masked_gqa_block", value=_sdpa_backends(device, dtype, gqa=True))
    result.set("masked_block_kv_repeated", value=_sdpa_backends(device, dtype, gqa=False))
    return result.data


def _version(name):
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _sdpa_backends(device, dtype, gqa: bool) -> dict:
    """Which SDPA backends accept a boolean-masked block of 256 queries (16 heads, 8 KV heads; GQA or KV repeated):
    torch takes the first that accepts it in its order (flash, memory-efficient, cuDNN, math)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 256, 128, generator=g).to(device, dtype)
    k = torch.randn(1, 8 if gqa else 16, 384, 128, generator=g).to(device, dtype)
    mask = torch.ones(256, 384, dtype=torch.bool, device=device).tril(128)
    accepted = {}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=gqa)
            accepted[backend] = True
        except Exception as err:  # noqa: BLE001 - a backend that refuses the call says why in its own exception type
            accepted[backend] = (str(err).splitlines() or [type(err).__name__])[0][:160]
    served = next((name for name, ok in accepted.items() if ok is True), None)
    return {"served_by": served, "accepted": accepted}


# ------------------------------------------------------------------------------------------------ b. attention
#: The timed layout: two prompt groups of 8 completions, prompts 1024 and 512 tokens, completions 64..448.
TIMED_UNITS = [[(1024, [64 + 48 * i for i in range(8)]), (512, [448 - 48 * i for i in range(8)])]]
#: The checked layout (small enough for a dense reference): prefixes with segments, a plain sequence, filler.
CHECKED_UNITS = [[(37, [5, 9, 1]), (0, [6]), (20, [3, 4])]]


def attention(path: str | None, tiny: bool = False) -> dict:
    import torch

    from trl_gspo.forward import segment_attention
    from trl_gspo.forward.segment_attention import FLASH_ATTN, TORCH_VARLEN, SegmentPlan

    result = Result(path)
    device, dtype = device_of(tiny)
    timed = timer(device)
    warmups, reps = (TINY_WARMUPS, TINY_REPS) if tiny else (WARMUPS, REPS)
    shapes = {"tiny": (4, 2, 8)} if tiny else ATTENTION_SHAPES
    timed_units = [[(12, [3, 5, 2]), (6, [4, 4])]] if tiny else TIMED_UNITS
    arms = {"sdpa_blocks": None, "torch_varlen": TORCH_VARLEN}
    if segment_attention.varlen_kernel("cuda", torch.bfloat16, torch_kernel=False) == FLASH_ATTN and not tiny:
        arms["flash_attn"] = FLASH_ATTN
    if segment_attention.varlen_attn is None:
        arms.pop("torch_varlen")
        result.set("skipped", "torch_varlen", value="this torch has no torch.nn.attention.varlen")
    start = time.perf_counter()
    module = type("Attention", (), {"config": None})()

    def run(kind, plan, q, k, v):
        if kind == "stock":  # as transformers' sdpa attention returns it: [B, W, H, D]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2)
        return segment_attention.segment_attention(module, q, k, v, None, segment_plan=plan)[0]

    with kernels(tiny):
        for name, (heads, kv, dim) in shapes.items():
            if time.perf_counter() - start > 0.8 * BUDGETS["attention"] and not tiny:
                result.set("skipped", name, value="out of the part's budget")
                continue
            # correctness: each arm on the small layout against the dense masked reference (fp32); stock's causal
            # call against the plain causal mask
            width = sum(p + sum(s) for p, s in CHECKED_UNITS[0]) + 2
            for arm, kernel in {"stock": None, **arms}.items():
                if arm == "stock":
                    plan, mask = None, torch.ones(width, width, dtype=torch.bool).tril()
                else:
                    plan, mask = SegmentPlan.from_units(CHECKED_UNITS, width), dense_mask(CHECKED_UNITS[0], width)
                    plan = (plan.build_varlen(kernel) if kernel else plan.build_blocks()).to(device)
                check = _check(_called(run, arm, plan), mask.to(device), heads, kv, dim, device, dtype)
                result.set(name, arm, "check", value=check)
                if check["status"] != "ok":
                    result.problem(f"{name} {arm}: output or gradient off the dense reference {check}")
            # timing: stock's causal call over the padded rows, each arm over the one-row layout
            width = sum(p + sum(s) for p, s in timed_units[0])
            rows = [p + n for p, segs in timed_units[0] for n in segs]
            padded = (len(rows), max(rows))
            result.set(name, "layout", value={"positions": width, "stock_rows": list(padded)})
            for arm, kernel in {"stock": None, **arms}.items():
                plan = None
                if arm != "stock":
                    plan = SegmentPlan.from_units(timed_units, width)
                    plan = (plan.build_varlen(kernel) if kernel else plan.build_blocks()).to(device)
                shape = (padded[0], padded[1]) if arm == "stock" else (1, width)
                q, k, v = (
                    torch.randn(shape[0], h, shape[1], dim, device=device, dtype=dtype, requires_grad=True)
                    for h in (heads, kv, kv)
                )
                call = _called(run, arm, plan)
                forward = lambda: call(q, k, v)  # noqa: E731
                both = lambda: call(q, k, v).sum().backward()  # noqa: E731
                for label, fn in (("forward_ms", forward), ("forward_backward_ms", both)):
                    for _ in range(warmups):
                        fn()
                    times = [timed(fn) for _ in range(reps)]
                    result.set(name, arm, label, value=round(statistics.median(times), 4))
    return result.data


def _called(run, arm, plan):
    return lambda q, k, v: run(arm, plan, q, k, v)


def _check(fn, mask, heads, kv, dim, device, dtype) -> dict:
    """`fn(q, k, v)` -> `[1, W, H, D]` against softmax(q k^T / sqrt(D), mask) v in fp32, output and gradients."""
    import torch

    g = torch.Generator().manual_seed(0)
    width = mask.size(0)
    leaves = [torch.randn(1, h, width, dim, generator=g).to(device) for h in (heads, kv, kv)]
    weights = torch.randn(1, width, heads, dim, generator=g).to(device)
    ins = [x.to(dtype).requires_grad_() for x in leaves]
    out = fn(*ins)
    got = [out.float()] + [g_.float() for g_ in torch.autograd.grad((out.float() * weights).sum(), ins)]
    ref_in = [x.clone().requires_grad_() for x in leaves]
    rep = heads // kv
    k, v = (x.repeat_interleave(rep, 1) for x in ref_in[1:])
    scores = (ref_in[0] @ k.transpose(-1, -2)) * dim**-0.5
    ref = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    want = [ref] + list(torch.autograd.grad((ref * weights).sum(), ref_in))
    errors = {
        name: ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        for name, a, b in zip(("output", "grad_q", "grad_k", "grad_v"), got, want)
    }
    tolerance = attention_bound(dtype, dim, width)
    return {
        "relative_errors": errors,
        "tolerance": tolerance,
        "status": "ok" if max(errors.values()) <= tolerance else "failed",
    }


#: What each part checks (the driver's table, check.py).
WHAT = {
    "probe": "torch / CUDA versions, varlen_attn's signature and alignment, the SDPA backend of a masked GQA block",
    "attention": "one attention layer at Qwen3 shapes, CUDA events: stock's causal call, SDPA blocks, torch varlen, "
    "flash-attn; outputs and gradients against a dense masked reference",
    "passes": "pi_old / reference pass, ours/stock (defaults, trimmed, packed, shared) at equal_settings, long_tail, "
    "long_prompt; a pi_old forward's model calls under the CUDA sync debug mode",
    "loss": "_compute_loss + backward with gradient checkpointing, ours/stock, same arms and shapes",
}


def headline(name: str, result: dict) -> dict:
    """The numbers of a part's result that the driver's table shows."""
    if name == "probe":
        return {
            "varlen kernel": result.get("varlen_kernel"),
            "bottom-right error": _rounded(result.get("varlen_attn", {}).get("bottom_right_error")),
            "masked GQA block": result.get("masked_gqa_block", {}).get("served_by"),
        }
    nodes = {key: node for key, node in result.items() if isinstance(node, dict) and "stock" in node}
    if name == "attention":
        return {
            f"{shape} fwd+bwd ms": ", ".join(
                f"{arm} {node[arm]['forward_backward_ms']}" for arm in node if "forward_backward_ms" in node[arm]
            )
            for shape, node in nodes.items()
        }
    return {  # passes, loss: ours/stock per shape and arm
        shape: ", ".join(f"{arm} {node[arm]['ratio_vs_stock']}" for arm in node if "ratio_vs_stock" in node[arm])
        for shape, node in nodes.items()
    }


def _rounded(value):
    return float(f"{value:.3g}") if isinstance(value, float) else value


def part(name: str):
    """The function of part `name` (`passes` and `loss` are in passes.py)."""
    return {"probe": probe, "attention": attention, "passes": passes.passes, "loss": passes.loss}[name]


def run_part(name: str, result_path: str, tiny: bool = False) -> int:
    """Child process of one quick part (check.py): its result JSON is rewritten after every step."""
    from trl_gspo.cli.console import quiet_library_deprecations

    quiet_library_deprecations()
    result = part(name)(result_path, tiny)
    return 0 if result.get("status") == "ok" else 1
