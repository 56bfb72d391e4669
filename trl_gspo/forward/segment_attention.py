"""Attention for packed and shared-prefix model calls, through transformers' attention registry.

A *segment layout* (forward/padding.py: `packed_layout`, `shared_layout`) lays several sequences end to end in each model
row. Its unit is a prompt group: the prompt's tokens but the last (the shared *prefix*), then one *segment* per
completion of that prompt (the prompt's last token followed by the completion). A plain packed sequence is a unit
with one segment. Every query attends to at most two key ranges of its row:

    prefix token:   its unit's prefix, causally                  [unit start, itself]
    segment token:  its unit's whole prefix, then its segment    [unit start, prefix end) + [segment start, itself]

so a completion sees its prompt exactly as in its own padded row and never a sibling completion. Filler at a row's
end attends to itself only. `SegmentPlan` holds that structure per position (`own_start`, `ctx_start`, `ctx_end`)
and, built once per model call, the blocks every layer runs:

- **SDPA blocks** (CPU, and CUDA without a fused varlen kernel): query columns in blocks of `block` positions (one of
  `BLOCKS`, the planner's choice for the call); each block
  attends to the key columns its queries can reach (the prefix range and the local range, gathered when far
  apart) through `scaled_dot_product_attention` with a boolean mask. Causality and the block ranges skip most
  of the masked pairs, which a dense `[W, W]` mask would compute.
- **a fused varlen kernel** (CUDA, half precision; not yet run on a GPU): each run of queries with the same ranges
  is one varlen sequence whose keys are gathered ([prefix] + [own segment]); causal alignment is bottom-right, so
  query `i` of a segment sees the prefix and its segment's first `i + 1` keys. One kernel per layer, where the SDPA
  blocks make one masked call per block (on CUDA, PyTorch serves a masked GQA call with its math backend).
  `varlen_kernel` picks the kernel, in one place: torch's own `varlen_attn` (torch >= 2.10, whatever attention the
  model was loaded with), else flash-attention's `flash_attn_varlen_func` when installed. torch's signature moved
  between releases (`is_causal`, later `window_size=(-1, 0)`, `scale`, `enable_gqa`): it is read, not pinned.

How it reaches the model without patching it: transformers picks the attention function by
`config._attn_implementation`. `arm(configs)` switches those configs to `"trl_gspo_segments:<original>"`, a name
registered in `AttentionInterface` and `AttentionMaskInterface`. Its attention function runs the original
implementation unchanged for every call that carries no `segment_plan` (trimmed calls, generation) and the
segment attention for calls that do; its mask function returns the original's mask. During a segment call
(`segment_call`) the configs hold a second name, `"trl_gspo_segment_call:<original>"`, registered for the attention
only: transformers then builds no mask at all (as for any attention without a mask function; the plan is the mask),
which also skips its packed-sequence detection and the host sync that comes with it. The plan travels as a model
keyword argument (`segment_plan=`), which transformers passes through to every attention call, so gradient
checkpointing's recompute (under the armed name) sees it again. `disarm` restores the original names; the trainer
arms before its first segment call and disarms when the training or evaluation step is over (after the backward and
its recompute). A segment call counts its attention calls and
`check_served` raises if the model never ran the segment attention (e.g. a model whose attention does not go
through the registry): a silently causal attention would let completions see each other.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field

import torch

from ..common.model_config import text_config

#: Name prefix of the registered wrapper: `"trl_gspo_segments:sdpa"` wraps sdpa. Substring checks such as
#: transformers' `"flash" in config._attn_implementation` keep answering for the original implementation.
PREFIX = "trl_gspo_segments:"
#: Name the configs hold during a segment call: registered for the attention only, so transformers builds no mask.
CALL_PREFIX = "trl_gspo_segment_call:"
#: Query positions per SDPA block: the default, and the sizes the planner chooses from per call (forward/planner.py).
#: Smaller blocks reach back over fewer keys (short units), larger ones make fewer calls (long units).
BLOCK = 256
BLOCKS = (64, 128, 256)


# ------------------------------------------------------------------------------------------------ the plan
def _fill(values: list, lo: int, hi: int, value) -> None:
    """`values[lo:hi] = value`, as on a tensor: the slice keeps its length (a list would grow past its end)."""
    values[lo:hi] = [value] * len(range(*slice(lo, hi).indices(len(values))))


@dataclass
class SdpaBlock:
    q0: int
    q1: int
    keys: torch.Tensor | tuple[int, int]  # key columns (gathered) or one contiguous range (sliced)
    mask: torch.Tensor  # [rows, 1, q1 - q0, n_keys] bool: True = attend


@dataclass
class SegmentPlan:
    """Attention structure of one segment-layout model call (see the module docstring). Per position `[rows, W]`:
    `own_start` (first key of its own causal range), `ctx_start`/`ctx_end` (its unit's prefix, empty for prefix
    tokens and filler). `calls` counts attention calls served (forward and recompute)."""

    own_start: torch.Tensor
    ctx_start: torch.Tensor
    ctx_end: torch.Tensor
    blocks: list[SdpaBlock] | None = None
    varlen: dict | None = None
    calls: int = field(default=0)
    block: int = BLOCK  # query positions per SDPA block, as the planner chose

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.own_start.shape)

    @classmethod
    def from_units(cls, rows: list[list[tuple[int, list[int]]]], width: int, block: int = BLOCK) -> SegmentPlan:
        """`rows[r]` lists the units of model row `r` in order, each `(prefix_len, [segment_len, ...])`; positions
        after the last unit are filler. `block`: query positions per SDPA block (`build_blocks`)."""
        # Python lists filled unit by unit and made tensors once (a slice assignment on a tensor per segment costs
        # more); `_fill` keeps slice semantics, so a unit reaching past `width` is cut there as on a tensor.
        own_start, ctx_start, ctx_end = [], [], []
        for units in rows:
            own, c0, c1 = list(range(width)), [0] * width, [0] * width
            at = 0
            for prefix, segments in units:
                _fill(own, at, at + prefix, at)
                end_prefix = at + prefix
                start = end_prefix
                for length in segments:
                    _fill(own, start, start + length, start)
                    _fill(c0, start, start + length, at)
                    _fill(c1, start, start + length, end_prefix)
                    start += length
                at = start
            own_start.append(own), ctx_start.append(c0), ctx_end.append(c1)
        own_start, ctx_start, ctx_end = (
            torch.tensor(x, dtype=torch.long).reshape(len(rows), width) for x in (own_start, ctx_start, ctx_end)
        )
        return cls(own_start, ctx_start, ctx_end, block=block)

    def visible(self, queries: torch.Tensor, keys: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        """`[rows, len(queries), len(keys)]` bool: which key columns each query column attends to."""
        q = queries[None, :, None]
        k = keys[None, None, :]
        own = (k >= self.own_start[rows][:, queries, None]) & (k <= q)
        ctx = (k >= self.ctx_start[rows][:, queries, None]) & (k < self.ctx_end[rows][:, queries, None])
        return own | ctx

    def dense_mask(self) -> torch.Tensor:
        """The whole `[rows, W, W]` mask (tests and references; the attention never builds it)."""
        w = self.shape[1]
        return self.visible(torch.arange(w), torch.arange(w))

    def build_blocks(self, block: int | None = None) -> SegmentPlan:
        """Query blocks of `block` positions (default: the plan's `block`) and the key columns each reaches (see the
        module docstring)."""
        block = block or self.block
        w = self.shape[1]
        self.blocks = []
        for q0 in range(0, w, block):
            q1 = min(q0 + block, w)
            own_min = int(self.own_start[:, q0:q1].min())
            has_ctx = self.ctx_end[:, q0:q1] > self.ctx_start[:, q0:q1]
            ranges = [(own_min, q1)]
            if bool(has_ctx.any()):
                c0, c1 = int(self.ctx_start[:, q0:q1][has_ctx].min()), int(self.ctx_end[:, q0:q1][has_ctx].max())
                # Far apart: gather both ranges (a copy of the keys); close: one slice with a few masked keys.
                ranges = [(c0, c1), (own_min, q1)] if own_min - c1 > block // 2 else [(min(c0, own_min), q1)]
            cols = torch.cat([torch.arange(a, b) for a, b in ranges])
            keys = ranges[0] if len(ranges) == 1 else cols
            mask = self.visible(torch.arange(q0, q1), cols)[:, None]
            self.blocks.append(SdpaBlock(q0, q1, keys, mask))
        return self

    def build_varlen(self, kernel: str = None) -> SegmentPlan:
        """Varlen arguments for a one-row plan, run by `kernel` (`TORCH_VARLEN` or `FLASH_ATTN`, see
        `varlen_kernel`; default flash-attention's): each run of queries sharing `own_start` is a sequence whose
        keys are `[ctx_start, ctx_end) + [own_start, end of the run)`. Built on the host; the maxima are ints."""
        if self.shape[0] != 1:
            raise ValueError("flash-attention segment calls hold one packed row.")
        own, c0, c1 = self.own_start[0], self.ctx_start[0], self.ctx_end[0]
        starts = torch.nonzero(torch.cat([torch.tensor([True]), own[1:] != own[:-1]]))[:, 0].tolist()
        ends = starts[1:] + [len(own)]
        key_cols, q_lens, k_lens = [], [], []
        for s, e in zip(starts, ends):
            ctx = torch.arange(int(c0[s]), int(c1[s]))
            key_cols += [ctx, torch.arange(s, e)]
            q_lens.append(e - s), k_lens.append(len(ctx) + e - s)

        def cu(lens):  # cumulative sequence lengths from 0, as flash-attention's varlen kernels take them
            return torch.nn.functional.pad(torch.tensor(lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))

        self.varlen = {
            "key_index": torch.cat(key_cols),
            "cu_seqlens_q": cu(q_lens),
            "cu_seqlens_k": cu(k_lens),
            "max_seqlen_q": max(q_lens),
            "max_seqlen_k": max(k_lens),
            "kernel": kernel or FLASH_ATTN,
        }
        return self

    def to(self, device) -> SegmentPlan:
        """The plan's tensors on `device`, copied without a host sync (`to_device`)."""
        move = lambda x: to_device(x, device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        blocks = (
            None if self.blocks is None else [SdpaBlock(b.q0, b.q1, move(b.keys), move(b.mask)) for b in self.blocks]
        )
        varlen = None if self.varlen is None else {k: move(v) for k, v in self.varlen.items()}
        return SegmentPlan(self.own_start, self.ctx_start, self.ctx_end, blocks, varlen, block=self.block)

    def pairs(self) -> int:
        """(query, key) pairs the SDPA blocks compute, for the layout cost model."""
        return sum(b.mask.shape[0] * b.mask.shape[2] * b.mask.shape[3] for b in self.blocks or [])


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for it: on CUDA through pinned memory and a non-blocking copy (the
    caching host allocator keeps the pinned buffer until the copy has run), elsewhere a plain `.to`."""
    device = torch.device(device)
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# ------------------------------------------------------------------------------------------- the attention
def _original_name(config_name: str | None) -> str:
    name = config_name or "eager"
    for prefix in (PREFIX, CALL_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _original_attention(module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # each modeling file has its own eager function (the registry has none)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward to run unsegmented calls with.")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def segment_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, segment_plan=None, **kwargs
):
    """Registered attention function: the original implementation without a plan, the segment attention with one."""
    if segment_plan is None:
        original = _original_attention(module, _original_name(module.config._attn_implementation))
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = [k for k in ("sliding_window", "s_aux", "sinks", "softcap") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} passes {unsupported} to its attention, which packed / shared-prefix calls do not "
            "support; set shared_prefix=False and padding_free=False for this model."
        )
    segment_plan.calls += 1
    if segment_plan.varlen is not None:
        out = _varlen(query, key, value, segment_plan.varlen, dropout, scaling)
    else:
        out = _sdpa_blocks(query, key, value, segment_plan.blocks, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


class _BlockKeys(torch.autograd.Function):
    """The key (or value) columns of every SDPA block in one autograd node. Sliced or gathered one block at a time,
    each block's backward would build a zero gradient the size of the whole row and the engine would add those up:
    work in blocks x row width, which made long one-row calls slower than their arithmetic. Here the backward adds
    each block's gradient into one buffer, in place: work in the keys the blocks read."""

    @staticmethod
    def forward(ctx, x, blocks):
        ctx.layout = blocks, x.shape  # what the backward needs: no tensor of the graph, so not save_for_backward
        return tuple(
            x[:, :, b.keys[0] : b.keys[1]] if isinstance(b.keys, tuple) else x.index_select(2, b.keys) for b in blocks
        )

    @staticmethod
    def backward(ctx, *grads):
        blocks, shape = ctx.layout
        out = grads[0].new_zeros(shape)
        for b, g in zip(blocks, grads):
            if isinstance(b.keys, tuple):
                out[:, :, b.keys[0] : b.keys[1]] += g
            else:
                out.index_add_(2, b.keys, g)
        return out, None


def _sdpa_blocks(query, key, value, blocks, dropout, scaling):
    gqa = {"enable_gqa": True} if key.size(1) != query.size(1) else {}
    # The blocks tile the query columns in order, so one split (whose backward is one concatenation) serves them.
    queries = query.split([b.q1 - b.q0 for b in blocks], 2)
    keys, values = _BlockKeys.apply(key, blocks), _BlockKeys.apply(value, blocks)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=dropout, scale=scaling, **gqa)
    outs = [sdpa(q, k, v, attn_mask=b.mask) for q, k, v, b in zip(queries, keys, values, blocks)]
    return torch.cat(outs, 2) if len(outs) > 1 else outs[0]


# ---------------------------------------------------------------------------------------- the varlen kernels
TORCH_VARLEN, FLASH_ATTN = "torch varlen_attn", "flash-attn flash_attn_varlen_func"


def _torch_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn as kernel
    except ImportError:  # torch < 2.10
        return None
    return kernel


#: torch's fused varlen attention (None before torch 2.10). The CPU build has it too, but it runs on CUDA only; tests
#: replace this name with a CPU stand-in of the same signature.
varlen_attn = _torch_varlen_attn()


def flash_attn_varlen_func(*args, **kwargs):
    """flash-attention's varlen kernel (imported on first use; tests replace this name with a CPU stand-in)."""
    from flash_attn import flash_attn_varlen_func as kernel

    return kernel(*args, **kwargs)


def varlen_kernel(device_type: str, dtype, dropout: bool = False, *, torch_kernel=None, flash=None) -> str | None:
    """The fused varlen kernel that serves segment calls (`TORCH_VARLEN`, `FLASH_ATTN`), or None for the SDPA blocks.

    Only on CUDA and in half precision (both kernels take fp16 / bf16 only): torch's `varlen_attn` where it exists,
    flash-attention's kernel where it is installed and torch's is missing or the call needs attention dropout
    (torch's kernel has none). `torch_kernel` / `flash`: whether each is available (default: this environment), so
    the question can be asked for a CUDA machine from a CPU one."""
    torch_kernel = varlen_attn is not None if torch_kernel is None else torch_kernel
    flash = importlib.util.find_spec("flash_attn") is not None if flash is None else flash
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if torch_kernel and not dropout:
        return TORCH_VARLEN
    return FLASH_ATTN if flash else None


@functools.lru_cache(maxsize=None)
def torch_varlen_options(kernel) -> tuple[dict, bool, bool]:
    """How to ask `kernel` (torch's `varlen_attn` of the installed release) for bottom-right causal attention:
    (causal keywords, takes `scale`, takes `enable_gqa`), read from its signature."""
    params = inspect.signature(kernel).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}  # later releases (2.13 among them): a window with no keys to the right
    elif "is_causal" in params:
        causal = {"is_causal": True}  # torch 2.10
    else:
        raise RuntimeError(
            f"torch's varlen_attn{inspect.signature(kernel)} takes neither window_size nor is_causal, so causal "
            "attention cannot be asked of it. Set shared_prefix=False and padding_free=False, or use another torch."
        )
    return causal, "scale" in params, "enable_gqa" in params


def _varlen(query, key, value, varlen, dropout, scaling):
    """One varlen kernel call for a one-row plan: queries in place, each sequence's keys gathered (`build_varlen`)."""
    q = query[0].transpose(0, 1)  # [W, H, D]
    index = varlen["key_index"]
    k, v = (x[0].transpose(0, 1).index_select(0, index) for x in (key, value))  # [keys, H_kv, D]
    lengths = (varlen["cu_seqlens_q"], varlen["cu_seqlens_k"], varlen["max_seqlen_q"], varlen["max_seqlen_k"])
    if varlen["kernel"] == FLASH_ATTN:  # takes fewer key/value heads as they are
        out = flash_attn_varlen_func(q, k, v, *lengths, dropout_p=dropout, softmax_scale=scaling, causal=True)
    else:
        if dropout:
            raise RuntimeError("torch's varlen_attn has no attention dropout; varlen_kernel should not have chosen it.")
        causal, takes_scale, takes_gqa = torch_varlen_options(varlen_attn)
        options = dict(causal)
        if k.size(1) != q.size(1):
            if takes_gqa:
                options["enable_gqa"] = True
            else:  # torch 2.10: every query head needs its own key/value head
                k, v = (x.repeat_interleave(q.size(1) // x.size(1), 1) for x in (k, v))
        if scaling is not None:
            if takes_scale:
                options["scale"] = scaling
            else:  # the kernel scales by 1 / sqrt(head_dim)
                q = q * (scaling * q.size(-1) ** 0.5)
        out = varlen_attn(q, k, v, *lengths, **options)
    return out.transpose(0, 1)[None]  # [1, H, W, D]


def segment_mask(*args, config=None, **kwargs):
    """Registered mask function of the armed name: the original's (calls without a plan). A segment call holds
    `CALL_PREFIX`'s name, which has no mask function, so transformers builds none (its plan is the mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[_original_name(config._attn_implementation)](*args, config=config, **kwargs)


# ----------------------------------------------------------------------------------------------- arming
def attention_configs(model) -> list:
    """The distinct configs the model's modules read their attention implementation from."""
    from transformers import PretrainedConfig

    seen = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


def register(original: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PREFIX + original
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, segment_attention)
        AttentionMaskInterface.register(name, segment_mask)
        AttentionInterface.register(CALL_PREFIX + original, segment_attention)  # no mask function: no mask built
    return name


def arm(configs) -> None:
    """Route the model's attention through `segment_attention` (calls without a plan run the original)."""
    for config in configs:
        current = config._attn_implementation
        if not (current or "").startswith(PREFIX):
            config._attn_implementation = register(_original_name(current))


def disarm(configs) -> None:
    for config in configs:
        current = config._attn_implementation
        if (current or "").startswith((PREFIX, CALL_PREFIX)):
            config._attn_implementation = _original_name(current)


@contextlib.contextmanager
def segment_call(configs):
    """Around one segment-layout model call: the armed ones of `configs` hold `CALL_PREFIX`'s name, so transformers
    builds no mask (the plan is the mask). A recompute in the backward runs the layers only, under the armed name,
    which serves the same `segment_attention`."""
    armed = [config for config in configs if (config._attn_implementation or "").startswith(PREFIX)]
    for config in armed:
        config._attn_implementation = CALL_PREFIX + _original_name(config._attn_implementation)
    try:
        yield
    finally:
        for config in armed:
            config._attn_implementation = PREFIX + _original_name(config._attn_implementation)


class NotServed(RuntimeError):
    """A segment-layout call whose model never ran the segment attention (its sequences could see each other)."""


def check_served(plan: SegmentPlan, model_name: str) -> None:
    if plan.calls == 0:
        raise NotServed(
            f"A packed / shared-prefix call to {model_name} never reached the segment attention (its attention does "
            "not go through transformers' AttentionInterface), so its sequences could see each other. Set "
            "shared_prefix=False and padding_free=False for this model."
        )


# ------------------------------------------------------------------------------------- which models it serves
#: Attention implementations the segment attention wraps, besides flash-attention: calls without a segment plan run
#: them unchanged.
WRAPS = ("sdpa", "eager", "flex_attention")


def base_model(model):
    """The model inside DDP / DeepSpeed wrappers (their `.module`); a PEFT model is kept as it is. Cheaper than
    `accelerator.unwrap_model`, which reads package metadata (milliseconds per call)."""
    from transformers import PreTrainedModel

    while isinstance(getattr(model, "module", None), torch.nn.Module) and not isinstance(model, PreTrainedModel):
        model = model.module
    return model


def attention_implementation(model) -> str:
    """The attention implementation `model` was loaded with (the original one while the segment attention is armed)."""
    return _original_name(getattr(base_model(model).config, "_attn_implementation", None))


def unsupported(model) -> str | None:
    """Why packed and shared-prefix calls cannot run on `model` (None if they can), as a clause that completes
    "<model> cannot take packed or shared-prefix layouts: ...". Decided from the model alone, before any call."""
    from transformers import PreTrainedModel

    model = base_model(model)
    implementation = attention_implementation(model)
    if "flash" not in implementation and implementation not in WRAPS:
        return (
            f"its attn_implementation={implementation!r} is not one the segment attention wraps "
            f"({', '.join(WRAPS)}, flash-attention)"
        )
    pretrained = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if pretrained is not None and not getattr(type(pretrained), "_supports_attention_backend", False):
        return (
            f"{type(pretrained).__name__} computes attention in its own code, not through transformers' "
            "AttentionInterface, where the segment attention is registered"
        )
    config = text_config(model.config)
    other = sorted({t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"})
    if other:
        return f"it has {other} layers, whose attention the segment attention does not reproduce"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "it uses sliding-window attention, which the segment attention does not reproduce"
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return (
            "a prompt-learning PEFT adapter is active: its virtual tokens come with an attention mask or a cache, "
            "which a packed row cannot have"
        )
    return None
