"""What the parts of `make gpu-quick` share (quick.py's `probe` and `attention`, passes.py's `passes` and `loss`):
their time budgets and repetitions, the result file each rewrites after every step, the device and timer, the kernel
segment calls get (in `--tiny` a CPU stand-in of torch's `varlen_attn`) and the guard that fails on a host sync. The
bottom of the quick profile: it imports none of the folder's modules.
"""

from __future__ import annotations

import contextlib
import json
import time

#: Seconds each part may take (the driver stops it there); a part starts no new shape past 80 % of it.
BUDGETS = {"probe": 60, "attention": 100, "passes": 150, "loss": 150}
WARMUPS, REPS = 2, 5
TINY_WARMUPS, TINY_REPS = 1, 2  # `--tiny` runs the code, not a measurement


class Result:
    """The part's result, rewritten to `path` after every `set`."""

    def __init__(self, path: str | None):
        self.path, self.data = path, {"status": "ok", "problems": []}

    def set(self, *keys, value):
        node = self.data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        self.save()

    def problem(self, text: str):
        self.data["status"] = "failed"
        self.data["problems"].append(text)
        self.save()

    def save(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=2, default=str)


def device_of(tiny: bool):
    import torch

    device = "cpu" if tiny else "cuda"
    return torch.device(device), (torch.float32 if tiny else torch.bfloat16)


def timer(device):
    """`time(fn)` -> milliseconds of one call: CUDA events on the GPU, the wall clock elsewhere."""
    import torch

    def timed(fn):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return timed


def cpu_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
    """CPU stand-in of torch's `varlen_attn` (`--tiny`): each sequence with a dense masked softmax, causal
    bottom-right aligned for `window_size=(-1, 0)`, key/value heads repeated for GQA."""
    import torch

    rep = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out = []
    for i in range(len(cu_seq_q) - 1):
        q, k, v = (x[c[i] : c[i + 1]] for x, c in ((query, cu_seq_q), (key, cu_seq_k), (value, cu_seq_k)))
        allowed = torch.ones(len(q), len(k), dtype=torch.bool)
        if tuple(window_size) == (-1, 0) or kw.get("is_causal"):
            allowed = allowed.tril(len(k) - len(q))
        s = torch.einsum("qhd,khd->hqk", q, k) * (q.size(-1) ** -0.5 if scale is None else scale)
        out.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v))
    return torch.cat(out)


@contextlib.contextmanager
def kernels(tiny: bool):
    """The varlen kernel segment calls use: torch's own, or in `--tiny` the CPU stand-in, which the forward pipeline
    is told is there (`LogprobForward.varlen_kernel`) as on CUDA."""
    from trl_gspo.forward import pipeline, segment_attention

    if not tiny:
        yield
        return
    saved = segment_attention.varlen_attn, pipeline.LogprobForward.varlen_kernel
    segment_attention.varlen_attn = cpu_varlen
    pipeline.LogprobForward.varlen_kernel = lambda self, support, device: tiny_kernel.get("kernel")
    try:
        yield
    finally:
        segment_attention.varlen_attn, pipeline.LogprobForward.varlen_kernel = saved


tiny_kernel: dict = {"kernel": None}  # what `--tiny` tells the pipeline (set per arm)


@contextlib.contextmanager
def no_sync(device):
    """Around the model calls of one forward: a host sync raises. On CUDA torch's sync debug mode; on the CPU
    (`--tiny`) a dispatch mode that raises on every operator that reads a value back."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}

    class NoSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in syncing:
                raise RuntimeError(f"host sync: {func}")
            return func(*args, **(kwargs or {}))

    with NoSync():
        yield
