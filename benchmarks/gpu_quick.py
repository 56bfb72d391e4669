"""`make gpu-quick`: the short GPU check of the forward path (`benchmarks/gpu_check.py --profile quick`,
docs/gpu-check.md). Four parts, each one process that reuses its model across arms and rewrites its result JSON after
every step, so a part stopped at its budget keeps what it measured:

- `probe`: torch and CUDA versions, `varlen_attn`'s signature and the kernel segment calls get, whether a causal
  varlen call aligns bottom-right, which SDPA backends accept a masked GQA block (and a masked block with KV repeated).
- `attention`: one attention layer at Qwen3's shapes, forward and forward+backward timed with CUDA events: stock's
  causal flash call over padded rows, the SDPA blocks, torch's varlen kernel, flash-attn's if installed; each
  output and gradient checked against a dense masked reference on a small layout.
- `passes`: the pi_old / reference pass, ours vs stock, at three shapes (`equal_settings`, `long_tail`,
  `long_prompt`): stock, ours with defaults, trimmed only, packed, shared; 2 warm-ups, 5 interleaved repetitions, the
  planner's choice logged. One pi_old forward's model calls run under `torch.cuda.set_sync_debug_mode("error")`.
- `loss`: `_compute_loss` + backward with gradient checkpointing, the same arms and shapes.

`--tiny` runs every part on the CPU at toy shapes, with a CPU stand-in of torch's varlen kernel (its signature) and a
dispatch mode standing for the sync debug mode, so the code of every part runs in the test suite
(tests/test_gpu_check.py); its numbers say nothing about speed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
import statistics
import time

#: Seconds each part may take (the driver stops it there); a part starts no new shape past 80 % of it.
BUDGETS = {"probe": 60, "attention": 100, "passes": 150, "loss": 150}
WARMUPS, REPS = 2, 5
TINY_WARMUPS, TINY_REPS = 1, 2  # `--tiny` runs the code, not a measurement
#: Attention shapes (query heads, key/value heads, head dim) from the models' config.json. Qwen3-0.6B and -1.7B share
#: theirs (they differ in hidden size, which attention alone does not see), so one measurement stands for both.
ATTENTION_SHAPES = {"Qwen3-0.6B and Qwen3-1.7B": (16, 8, 128), "Qwen3-4B": (32, 8, 128)}
#: Batches of the pass and loss parts: rows, rows per chunk (TRL's batch_size), completions per prompt, prompt tokens
#: (range), completion tokens (max) and how completion lengths spread ("uniform" up to max, or lognormal with this
#: median fraction and ~10 % truncated at max, as benchmarks/scenarios/workload.py's LongTailRollouts).
PASS_SHAPES = {
    "equal_settings": dict(rows=32, chunk=16, group=8, prompt=(120, 140), completion=512, spread="uniform"),
    "long_tail": dict(rows=32, chunk=16, group=8, prompt=(64, 256), completion=2048, spread=0.3),
    "long_prompt": dict(rows=32, chunk=16, group=8, prompt=(896, 1152), completion=384, spread=1 / 3),
}
TINY_PASS = dict(rows=8, chunk=4, group=4, prompt=(5, 9), completion=12)
#: The arms of `passes` and `loss`: GSPOConfig settings (None: stock TRL).
ARMS = {
    "stock": None,
    "ours": {},
    "trimmed": dict(padding_free=False, shared_prefix=False),
    "packed": dict(padding_free=True, shared_prefix=False),
    "shared": dict(shared_prefix=True),
}


# ------------------------------------------------------------------------------------------------ helpers
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


def _device(tiny: bool):
    import torch

    device = "cpu" if tiny else "cuda"
    return torch.device(device), (torch.float32 if tiny else torch.bfloat16)


def _timer(device):
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
def _kernels(tiny: bool):
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
    device, dtype = _device(tiny)
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
        with _kernels(tiny):  # bottom-right alignment: 3 queries against 5 keys, the last query sees all 5
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(n, 2, 64, generator=g).to(device, dtype) for n in (3, 5, 5))
            cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (3, 5))
            out = segment_attention.varlen_attn(q, k, v, cu_q, cu_k, 3, 5, **causal)
            mask = torch.ones(3, 5, dtype=torch.bool, device=device).tril(2)
            ref = F.scaled_dot_product_attention(*(x.float().transpose(0, 1) for x in (q, k, v)), attn_mask=mask)
            error = (out.float() - ref.transpose(0, 1)).abs().max().item()
        result.set("varlen_attn", "bottom_right_error", value=error)
        if error > (2e-2 if dtype == torch.bfloat16 else 1e-5):
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
    device, dtype = _device(tiny)
    timed = _timer(device)
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

    with _kernels(tiny):
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
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return {"relative_errors": errors, "status": "ok" if max(errors.values()) <= tolerance else "failed"}


# ------------------------------------------------------------------------------------------------ c, d. passes, loss
def _batch(spec: dict, vocab: int, device, seed: int = 0):
    """`(ids, mask, logits_to_keep, group_rows)`: prompts left-padded, completions right-padded, each prompt's
    `group` rows spread as after TRL's shuffle."""
    import math
    from statistics import NormalDist

    import torch

    rng = random.Random(seed)
    rows, group, top = spec["rows"], spec["group"], spec["completion"]
    prompts = [rng.randint(*spec["prompt"]) for _ in range(rows // group)]
    spread = spec.get("spread", "uniform")
    if spread == "uniform":
        lengths = [rng.randint(1, top) for _ in range(rows)]
    else:
        sigma = math.log(1 / spread) / NormalDist().inv_cdf(0.9)
        lengths = [
            min(top, max(1, round(math.exp(math.log(spread * top) + sigma * rng.gauss(0, 1))))) for _ in range(rows)
        ]
    owner = [r // group for r in range(rows)]
    rng.shuffle(owner)
    pw = max(prompts)
    g = torch.Generator().manual_seed(seed)
    prompt_tokens = torch.randint(4, vocab, (len(prompts), pw), generator=g)
    ids = torch.randint(4, vocab, (rows, pw + top), generator=g)
    mask = torch.zeros(rows, pw + top, dtype=torch.long)
    for r, (o, n) in enumerate(zip(owner, lengths)):
        ids[r, :pw] = prompt_tokens[o]
        mask[r, pw - prompts[o] : pw + n] = 1
    ids = ids * mask
    return ids.to(device), mask.to(device), top, owner


def _trainers(tiny: bool, device, dtype):
    """One model, a stock GRPOTrainer and a GSPOTrainer over it (arms switch the GSPOTrainer's settings)."""
    import torch
    from datasets import Dataset
    from scenarios.workload import LOSS_SETTINGS, QWEN3_VOCAB, SHAPES, make_model, make_tokenizer, zero_reward
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = make_tokenizer(None if tiny else QWEN3_VOCAB)
    model = make_model(tokenizer, SHAPES["tiny" if tiny else "cuda"], device.type).to(device)
    common = dict(
        output_dir="/tmp/trl-gspo-gpu-quick",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=64,
        **LOSS_SETTINGS,
    )
    dataset = Dataset.from_dict({"prompt": ["a"] * 8})
    stock = GRPOTrainer(
        model, zero_reward, args=GRPOConfig(**common), train_dataset=dataset, processing_class=tokenizer
    )
    ours = GSPOTrainer(model, zero_reward, args=GSPOConfig(**common), train_dataset=dataset, processing_class=tokenizer)
    for trainer in (stock, ours):
        trainer.current_gradient_accumulation_steps = 1
    return model, stock, ours


def _set_arm(ours, settings):
    defaults = dict(padding_free="auto", shared_prefix="auto")
    for key, value in {**defaults, **settings}.items():
        setattr(ours.args, key, value)
    tiny_kernel["kernel"] = None


@contextlib.contextmanager
def _recording_plans(log: dict):
    """Each forward's layouts, as the planner chose them: kind (t trimmed, p packed, s shared) and shape per call."""
    from trl_gspo.forward import pipeline

    plan_forward = pipeline.plan_forward

    def recording(*args, **kwargs):
        layouts = plan_forward(*args, **kwargs)
        kinds = ["t" if lay.columns is not None else "s" if lay.aliases is not None else "p" for lay in layouts]
        log["layouts"] = " ".join(f"{k}{lay.shape[0]}x{lay.shape[1]}" for k, lay in zip(kinds, layouts))
        log["kernel"] = kwargs.get("kernel")
        return layouts

    pipeline.plan_forward = recording
    try:
        yield
    finally:
        pipeline.plan_forward = plan_forward


def passes(path: str | None, tiny: bool = False) -> dict:
    return _measure("passes", path, tiny)


def loss(path: str | None, tiny: bool = False) -> dict:
    return _measure("loss", path, tiny)


def _measure(part: str, path: str | None, tiny: bool) -> dict:
    """`passes`: the no-grad log-prob pass over the batch in chunks; `loss`: `_compute_loss` + backward on one
    micro-batch of whole groups (as `group_minibatches=True` arranges it), gradient checkpointing on."""
    import torch

    result = Result(path)
    device, dtype = _device(tiny)
    timed = _timer(device)
    warmups, reps = (TINY_WARMUPS, TINY_REPS) if tiny else (WARMUPS, REPS)
    model, stock, ours = _trainers(tiny, device, dtype)
    vocab = model.config.vocab_size
    if part == "loss":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model.eval()
    start = time.perf_counter()
    with _kernels(tiny):
        for shape, spec in PASS_SHAPES.items():
            if not tiny and time.perf_counter() - start > 0.8 * BUDGETS[part]:
                result.set("skipped", shape, value="out of the part's budget")
                continue
            spec = {**spec, **TINY_PASS} if tiny else spec
            ids, mask, keep, owner = _batch(spec, vocab, device)
            if part == "loss":  # one micro-batch of whole groups
                rows = [r for r in range(len(owner)) if owner[r] < spec["chunk"] // spec["group"]] or [0]
                ids, mask = ids[rows], mask[rows]
                inputs = _loss_inputs(stock, ids, mask, keep)
            result.set(shape, "tokens", value={"real": int(mask.sum()), "padded": int(mask.numel())})
            plans = {}

            def call(arm):
                trainer = stock if ARMS[arm] is None else ours
                if trainer is ours:
                    _set_arm(ours, ARMS[arm])
                    if tiny:  # the stand-in kernel serves segment calls, as torch's would on CUDA
                        tiny_kernel["kernel"] = "torch varlen_attn"
                log = plans.setdefault(arm, {})
                with _recording_plans(log):
                    if part == "loss":
                        trainer._compute_loss(trainer.model, inputs).backward()
                        trainer.model.zero_grad(set_to_none=True)
                        if trainer is ours:
                            ours.logprob_forward.release()  # the step is over: disarm the segment attention
                        return None
                    with torch.no_grad():
                        forward = trainer._get_per_token_logps_and_entropies
                        return forward(trainer.model, ids, mask, keep, batch_size=spec["chunk"])[0]

            if part == "passes":  # ours against stock's log-probs (bf16 rounding apart)
                reference = call("stock")
                completion = mask[:, -keep:].bool()
                for arm in ARMS:
                    diff = (call(arm) - reference)[completion].abs().max().item()
                    result.set(shape, arm, "max_logp_diff_vs_stock", value=diff)
                    if diff > (0.5 if dtype == torch.bfloat16 else 1e-4):
                        result.problem(f"{part} {shape} {arm}: log-probs {diff:.3g} from stock's")
            times = {arm: [] for arm in ARMS}
            for rep in range(warmups + reps):
                for arm in list(ARMS) if rep % 2 == 0 else list(ARMS)[::-1]:
                    ms = timed(lambda: call(arm))
                    if rep >= warmups:
                        times[arm].append(ms)
            for arm, values in times.items():
                result.set(shape, arm, "median_ms", value=round(statistics.median(values), 3))
                result.set(shape, arm, "runs_ms", value=[round(t, 3) for t in values])
                result.set(shape, arm, "plan", value=plans.get(arm, {}))
                if arm != "stock":
                    ratio = statistics.median(values) / max(statistics.median(times["stock"]), 1e-9)
                    result.set(shape, arm, "ratio_vs_stock", value=round(ratio, 3))
            if part == "passes" and shape == "long_prompt":
                result.set("no_sync", value=_no_sync_forward(ours, ids, mask, keep, spec["chunk"], device, tiny))
                if result.data["no_sync"]["status"] != "ok":
                    result.problem(f"a host sync between the model calls of a pi_old forward: {result.data['no_sync']}")
    return result.data


def _loss_inputs(stock, ids, mask, keep):
    import torch

    g = torch.Generator().manual_seed(1)
    prompt_width = ids.size(1) - keep
    inputs = {
        "prompt_ids": ids[:, :prompt_width],
        "prompt_mask": mask[:, :prompt_width],
        "completion_ids": ids[:, prompt_width:],
        "completion_mask": mask[:, prompt_width:],
        "advantages": torch.randn(ids.size(0), generator=g).to(ids.device),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    with torch.no_grad():  # pi_old near pi_theta, so some sequence ratios clip as in training
        logps, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, keep)
    inputs["old_per_token_logps"] = logps + 1e-3 * torch.randn(logps.shape, generator=g).to(ids.device)
    return inputs


def _no_sync_forward(ours, ids, mask, keep, chunk, device, tiny) -> dict:
    """One pi_old forward with shared prompts (segment calls) whose model calls and scatter back run under `no_sync`
    (planning reads the row spans to the host once, before the first call)."""
    import torch

    from trl_gspo.forward import pipeline

    _set_arm(ours, ARMS["shared"])  # tiny: the SDPA blocks (the CPU stand-in kernel reads offsets itself)
    forward = ours.logprob_forward
    run_calls, scatter = forward._run_calls, pipeline.scatter

    def guarded(fn):
        def run(*args, **kwargs):
            with no_sync(device):
                return fn(*args, **kwargs)

        return run

    forward._run_calls, pipeline.scatter = guarded(run_calls), guarded(scatter)
    try:
        with torch.no_grad():
            ours._get_per_token_logps_and_entropies(ours.model, ids, mask, keep, batch_size=chunk)
        return {"status": "ok", "mode": "cuda sync debug mode 'error'" if device.type == "cuda" else "dispatch mode"}
    except RuntimeError as err:
        return {"status": "failed", "error": str(err).splitlines()[0][:300]}
    finally:
        del forward._run_calls
        pipeline.scatter = scatter


PARTS = {"probe": probe, "attention": attention, "passes": passes, "loss": loss}


def run_part(name: str, result_path: str, tiny: bool = False) -> int:
    """Child process of one quick part (gpu_check.py): its result JSON is rewritten after every step."""
    from trl_gspo.cli.console import quiet_library_deprecations

    quiet_library_deprecations()
    result = PARTS[name](result_path, tiny)
    return 0 if result.get("status") == "ok" else 1
