"""MoE routers: find them, record the experts they pick, and replay recorded experts (routing replay).

transformers declares, per MoE architecture, the router module whose output holds the router logits
(`_can_record_outputs["router_logits"]`). :class:`RouterHooks` puts one forward hook on each of those modules. The
hooks do nothing unless a :meth:`RouterHooks.forward_pass` is open, and the trainer opens one explicitly around each
log-prob forward it wants to observe or replay, never by matching shapes (``generate()``'s prefill has the same shape
as a training forward). Inside a pass, each router call

- **records** the top-k expert ids the router itself picked (its *native* routes), and
- **replays**, when the pass was given a :class:`RouteTable`, the recorded ids instead: the hook returns
  ``(logits, gate weights recomputed from the current logits at the forced ids, forced ids)``, so the experts run on
  the recorded routes while the router keeps its gradient through the weights. Rows marked invalid in the table
  (padding, the last sampled token, prefix-cache hits) keep their native routes.

Router-level replay is independent of the experts kernel: every ``experts_implementation`` (eager, grouped_mm,
batched_mm, ...) takes the indices and weights the router returned. The weight functions in :data:`GATE_WEIGHTS`
reproduce each supported router's own arithmetic, so replaying a router's own choices is bit-identical.

Token bookkeeping: a pass covers a ``[B, W]`` batch (``W`` positions per row). By default the model calls inside it
are consecutive row chunks of that batch at full width (TRL's chunked log-prob loop), so the ``n``-th token a router
sees is flat position ``n`` of the batch. A caller that feeds the model another layout (trimmed or packed rows) says
where each model-input position comes from with :meth:`RouterPass.set_call_positions` before the call. Every router
must see every position exactly once per pass; anything else (a fused kernel that bypasses the router module, a
router that drops tokens) raises in replay and skips the routing metrics otherwise.

Gradient checkpointing re-runs each decoder layer, router included, in the backward. A pass opened with
``keep_for_recompute=True`` leaves its replay targets in place after the forward, so the recompute sees the same
routes; :meth:`RouterHooks.release` drops them once the backward is done.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass

import torch

from ..common.model_config import text_config

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- gate weights per router
def _softmax_topk_weights(router, logits, ids):
    """Qwen2-MoE / Qwen3-MoE: fp32 softmax over all experts, gathered, renormalised if `norm_topk_prob`."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _mixtral_weights(router, logits, ids):
    """Mixtral: fp32 softmax over all experts, gathered, always renormalised (returned in fp32)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def _deepseek_v3_weights(router, logits, ids):
    """DeepSeek-V3: sigmoid scores (the correction bias and group limits only steer selection), gathered,
    renormalised if `norm_topk_prob`, times `routed_scaling_factor`."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def _gpt_oss_weights(router, logits, ids):
    """gpt-oss: softmax over the chosen experts' (biased) logits only."""
    chosen = logits.gather(-1, ids)
    return torch.softmax(chosen, dim=1, dtype=chosen.dtype)


#: Router class name -> ``fn(router, logits, ids) -> gate weights``: the router's own weights at forced ids. Each
#: router returns ``(logits, weights, ids)``. Replay is refused for other routers (their arithmetic is unknown).
GATE_WEIGHTS = {
    "Qwen3MoeTopKRouter": _softmax_topk_weights,
    "Qwen2MoeTopKRouter": _softmax_topk_weights,
    "MixtralTopKRouter": _mixtral_weights,
    "DeepseekV3TopkRouter": _deepseek_v3_weights,
    "GptOssTopKRouter": _gpt_oss_weights,
}
#: Model types whose routers are in GATE_WEIGHTS, for error messages.
REPLAY_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss")


# ---------------------------------------------------------------------------------------------- finding routers
@dataclass
class Router:
    module: torch.nn.Module
    logits_index: int  # position of the router logits in the module's output
    decoder_layer: int | None  # index of its decoder layer (`...layers.<i>...` in the module name), for vLLM


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The router modules of ``model`` in forward order: those the model declares as recording ``router_logits``, or,
    where it declares none (DeepSeek-V3 before transformers 5.23), the modules of a router class in GATE_WEIGHTS.
    Empty for dense models."""
    targets = []
    for module in model.modules():
        recorder = getattr(module, "_can_record_outputs", None) or {}
        spec = recorder.get("router_logits") if isinstance(recorder, dict) else None
        if spec is None:
            continue
        if isinstance(spec, type):
            targets.append((spec, None, 0))
        else:
            targets.append((getattr(spec, "target_class", None), getattr(spec, "class_name", None), spec.index or 0))
    if not targets:
        targets = [(None, class_name, 0) for class_name in GATE_WEIGHTS]
    routers = []
    for name, module in model.named_modules():
        for cls, class_name, index in targets:
            if (cls is not None and isinstance(module, cls)) or (
                class_name is not None and type(module).__name__.endswith(class_name)
            ):
                match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
                routers.append(Router(module, index, int(match.group(1)) if match else None))
                break
    return routers


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype that holds expert ids: uint8 up to 256 experts, int16 beyond."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= torch.iinfo(torch.int16).max + 1:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} is more than routing replay can store (32768).")


# ------------------------------------------------------------------------------------------------- route tables
@dataclass
class RouteTable:
    """Expert ids per position of a ``[B, W]`` batch: ``ids`` ``[B, W, L, k]`` (compact dtype, any device) and
    ``valid`` ``[B, W]`` (False: no recorded route, the router decides natively)."""

    ids: torch.Tensor
    valid: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.valid.numel() * self.valid.element_size()

    def to(self, device) -> RouteTable:
        return RouteTable(self.ids.to(device), self.valid.to(device))

    def completion(self, width: int) -> RouteTable:
        """The last ``width`` positions of each row (the completion part of a prompt + completion batch)."""
        return RouteTable(self.ids[:, -width:], self.valid[:, -width:])


# ------------------------------------------------------------------------------------------------------- hooks
class RouterPass:
    """One observed (and possibly replayed) log-prob forward over a ``[B, W]`` batch; see :meth:`RouterHooks.forward_pass`."""

    def __init__(self, hooks: RouterHooks, batch: int, width: int, record: bool, replay: RouteTable | None):
        self.hooks, self.batch, self.width, self.total = hooks, batch, width, batch * width
        self.record, self.replay = record, replay
        if replay is not None and tuple(replay.ids.shape) != (batch, width, hooks.num_layers, hooks.top_k):
            raise ValueError(
                f"Routes to replay have shape {tuple(replay.ids.shape)}, but this forward needs "
                f"(batch, positions, MoE layers, top_k) = ({batch}, {width}, {hooks.num_layers}, {hooks.top_k})."
            )
        self.native: torch.Tensor | None = None  # [B*W, L, k] the routers' own picks, filled while recording
        self.seen: torch.Tensor | None = None  # [B*W] positions some call held, under explicit layouts only
        self.cursor = [0] * hooks.num_layers  # tokens seen per layer (default layout: consecutive row chunks)
        self.call: tuple[int, torch.Tensor] | None = None  # (call number, positions) of an explicit layout
        self.aliases: torch.Tensor | None = None  # [2, n] (call position, batch position) a shared position also fills
        self.calls_seen = [0] * hooks.num_layers  # fires per layer under explicit layouts
        self.last_span: list[tuple | None] = [None] * hooks.num_layers  # per layer: (key, index) of its last call
        self.recompute_fires = [0] * hooks.num_layers
        self.closed = False  # the forward is done; later fires are gradient-checkpointing recomputes
        self._targets_key, self._targets = None, None
        self.error: str | None = None

    def set_call_positions(self, positions: torch.Tensor, aliases: torch.Tensor | None = None) -> None:
        """Layout of the next model call: for each model-input position (row-major), its flat index ``row * W + col``
        in this pass's batch, or -1 for filler that belongs to no row (e.g. padding between packed sequences).
        ``aliases`` (``[2, n]``: model-input position, batch position): batch positions a model position also stands
        for (a prompt prefix shared by several rows): the route recorded there is recorded for them too, and a
        replayed route is the one of the position in ``positions`` (its rows' routes agree, see forward/shared_prefix.py)."""
        number = 1 if self.call is None else self.call[0] + 1
        self.call = (number, positions.reshape(-1))
        self.aliases = aliases

    # called by the hooks -------------------------------------------------------------------------------------
    def _span(self, layer: int, n_tokens: int):
        """(key, index) of the batch positions this router call covers: a slice for consecutive row chunks, a
        LongTensor (-1: filler) under an explicit layout; None after recording an error."""
        if self.closed:  # gradient-checkpointing recompute: the same positions as this layer's forward
            self.recompute_fires[layer] += 1
            return self.last_span[layer]
        if self.call is not None:
            number, positions = self.call
            self.calls_seen[layer] += 1
            if positions.numel() != n_tokens:
                self.error = (
                    f"a model call has {positions.numel()} positions but MoE layer {layer} saw {n_tokens} tokens"
                )
                return None
            span = (("call", number), positions)
        else:
            start = self.cursor[layer]
            self.cursor[layer] += n_tokens
            if self.cursor[layer] > self.total:
                self.error = (
                    f"MoE layer {layer}'s router saw more than the {self.batch}x{self.width} tokens of the batch"
                )
                return None
            span = (("rows", start, n_tokens), slice(start, start + n_tokens))
        self.last_span[layer] = span
        return span

    def _replay_targets(self, layer: int, span, device):
        """(ids [N, k] int64, valid [N] bool) to force at this layer; gathered once per model call for all layers."""
        key, index = span
        if key != self._targets_key:
            ids = self.replay.ids.reshape(self.total, self.hooks.num_layers, self.hooks.top_k)
            valid = self.replay.valid.reshape(self.total)
            if isinstance(index, slice):
                ids, valid = ids[index], valid[index]
            else:
                flat = index.to(ids.device)
                ids, valid = ids[flat.clamp(min=0)], valid[flat.clamp(min=0)] & (flat >= 0)
            self._targets_key, self._targets = key, (ids.to(device, torch.long), valid.to(device))
        ids, valid = self._targets
        return ids[:, layer], valid

    def _store(self, layer: int, span, native: torch.Tensor) -> None:
        if self.native is None:
            shape = (self.total, self.hooks.num_layers, self.hooks.top_k)
            self.native = torch.zeros(shape, dtype=self.hooks.id_dtype, device=native.device)
        _, index = span
        if isinstance(index, slice):
            self.native[index, layer] = native.to(self.hooks.id_dtype)
        else:
            index = index.to(native.device)
            keep = index >= 0
            self.native[index[keep], layer] = native[keep].to(self.hooks.id_dtype)
            aliases = None if self.aliases is None else self.aliases.to(native.device)
            if aliases is not None:  # a shared prompt prefix: the one route recorded is each sharing row's
                self.native[aliases[1], layer] = native[aliases[0]].to(self.hooks.id_dtype)
            if layer == 0:  # explicit layouts may skip positions (trimmed padding): note the ones some call held
                if self.seen is None:
                    self.seen = torch.zeros(self.total, dtype=torch.bool, device=native.device)
                self.seen[index[keep]] = True
                if aliases is not None:
                    self.seen[aliases[1]] = True

    # after the forward -----------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No model call reached the routers during the pass (e.g. pi_old came from the sampler's log-probs)."""
        return self.call is None and not any(self.cursor)

    def check(self) -> str | None:
        """Why the routers' view does not match the batch (None if every router saw every position once)."""
        if self.error is not None:
            return self.error
        layers = self.hooks.num_layers
        if self.call is not None:
            calls = self.call[0]
            bad = [i for i in range(layers) if self.calls_seen[i] != calls]
            if bad:
                return (
                    f"MoE layers {bad} fired {[self.calls_seen[i] for i in bad]} times for {calls} model calls (a fused "
                    "MoE kernel that bypasses the router module, or a router that drops tokens)"
                )
            return None
        bad = [i for i in range(layers) if self.cursor[i] != self.total]
        if bad:
            return (
                f"the routers of MoE layers {bad} saw {[self.cursor[i] for i in bad]} tokens for a {self.batch}x"
                f"{self.width} batch (a fused MoE kernel that bypasses the router module, or a router that drops tokens)"
            )
        return None

    def native_routes(self) -> torch.Tensor | None:
        """The routers' own top-k ids, ``[B, W, L, k]`` (None if nothing was recorded)."""
        if self.native is None:
            return None
        return self.native.view(self.batch, self.width, self.hooks.num_layers, self.hooks.top_k)

    def recorded_positions(self) -> torch.Tensor | None:
        """``[B, W]`` bool: the positions :meth:`native_routes` holds a route for (all, unless explicit layouts left
        some out, e.g. trimmed padding columns). None if nothing was recorded."""
        if self.native is None:
            return None
        if self.seen is None:
            return torch.ones(self.batch, self.width, dtype=torch.bool, device=self.native.device)
        return self.seen.view(self.batch, self.width)


class CallLog:
    """The routers' own top-k ids of every model call inside :meth:`RouterHooks.log_calls`, as they come: ``calls[n]``
    is a list over MoE layers of ``[tokens, k]`` ids. For ``generate()``, whose calls (prefill, then one per decoding
    step) are not known in advance."""

    def __init__(self, hooks: RouterHooks):
        self.hooks, self.calls = hooks, []
        self.error: str | None = None

    def _add(self, layer: int, ids: torch.Tensor) -> None:
        if layer == 0:
            self.calls.append([])
        if not self.calls or len(self.calls[-1]) != layer:
            self.error = f"MoE layer {layer}'s router fired out of order (a kernel bypassed a router module?)"
            return
        self.calls[-1].append(ids.to(self.hooks.id_dtype))

    def check(self) -> str | None:
        if self.error is None and any(len(call) != self.hooks.num_layers for call in self.calls):
            self.error = f"a model call did not run all {self.hooks.num_layers} MoE routers"
        return self.error


class RouterHooks:
    """Forward hooks on an MoE model's routers; idle unless a :meth:`forward_pass` is open."""

    def __init__(self, routers: list[Router], top_k: int, num_experts: int, model_type: str | None = None):
        self.routers, self.top_k, self.num_experts = routers, top_k, num_experts
        self.num_layers, self.model_type = len(routers), model_type
        self.id_dtype = route_dtype(num_experts)
        self.unsupported = sorted(
            {type(r.module).__name__ for r in routers if type(r.module).__name__ not in GATE_WEIGHTS}
        )
        self.active: RouterPass | CallLog | None = None
        self._handles = [r.module.register_forward_hook(self._hook(i, r)) for i, r in enumerate(routers)]

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RouterHooks | None:
        """Hooks for ``model``'s routers, or ``None`` for a dense model."""
        routers = find_routers(model)
        config = text_config(model.config)
        top_k = getattr(config, "num_experts_per_tok", None)
        num_experts = (
            getattr(config, "num_experts", None)
            or getattr(config, "num_local_experts", None)
            or getattr(config, "n_routed_experts", None)
        )
        if not routers or not top_k or not num_experts:
            return None
        return cls(routers, int(top_k), int(num_experts), getattr(config, "model_type", None))

    def check_replay_supported(self, field: str = "routing_replay", value: str = "") -> None:
        """Raise unless every router's gate arithmetic is known (see GATE_WEIGHTS)."""
        if self.unsupported:
            raise ValueError(
                f"{field}={value!r}: this model's routers ({', '.join(self.unsupported)}, model_type="
                f"{self.model_type!r}) are not supported for routing replay, which must recompute their gate weights "
                f"at forced experts. Supported: {', '.join(REPLAY_ARCHITECTURES)}. Use {field}='none'."
            )

    @contextlib.contextmanager
    def forward_pass(
        self,
        batch: int,
        width: int,
        record: bool = True,
        replay: RouteTable | None = None,
        keep_for_recompute: bool = False,
    ):
        """Observe (and with ``replay``, force) the routes of the model calls inside the block, over a ``[B, W]``
        batch. With ``keep_for_recompute`` the replay stays in place after the block for gradient checkpointing's
        recompute, until :meth:`release`. Yields the :class:`RouterPass` (read it after the block)."""
        if replay is not None:
            self.check_replay_supported()
        self.release()
        current = RouterPass(self, batch, width, record, replay)
        self.active = current
        try:
            yield current
        finally:
            current.closed = True
            if not (keep_for_recompute and replay is not None):
                self.active = None

    @contextlib.contextmanager
    def log_calls(self):
        """Record (never replay) the routers' own picks of every model call inside the block; yields a :class:`CallLog`."""
        self.release()
        self.active = log = CallLog(self)
        try:
            yield log
        finally:
            self.active = None

    def release(self) -> None:
        """Disarm: drop any replay kept for a backward recompute (call once the backward is done)."""
        self.active = None

    def _hook(self, layer: int, router: Router):
        gate_weights = GATE_WEIGHTS.get(type(router.module).__name__)

        def hook(module, args, output):
            current = self.active
            if current is None:
                return None
            logits = output[router.logits_index] if isinstance(output, (tuple, list)) else output
            if gate_weights is not None:
                native = output[2]
            else:  # unknown router: its native choice is the top-k of its logits (softmax/sigmoid are monotonic)
                native = logits.detach().topk(self.top_k, dim=-1).indices
            native = native.detach().reshape(-1, self.top_k)
            if isinstance(current, CallLog):
                current._add(layer, native)
                return None
            span = current._span(layer, native.size(0))
            if span is None:
                return None
            if current.record and not current.closed:
                current._store(layer, span, native)
            if current.replay is None:
                return None
            targets, valid = current._replay_targets(layer, span, native.device)
            used = torch.where(valid[:, None], targets, native)
            return (logits, gate_weights(module, logits, used), used)

        return hook

    def remove(self):
        for handle in self._handles:
            handle.remove()
