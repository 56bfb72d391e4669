"""Record which experts an MoE model's routers pick, during forward passes TRL already runs.

transformers declares, per MoE architecture, the router module whose output holds the router logits
(`_can_record_outputs["router_logits"]`, used for `output_router_logits`). :class:`RouterRecorder` hooks those
modules once; while armed (:meth:`RouterRecorder.recording`), each router call stores the top-k expert ids of its
tokens. Top-k of the logits equals top-k of the routing probabilities (softmax is monotonic), so this works
whether or not the model is asked for router logits or aux loss, and adds no forward pass. Outside
:meth:`recording` the hooks return at once (generation, reference model, gradient-checkpointing recomputation).
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


def find_routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The router modules of ``model`` in forward order, each with the index of the router logits in its output.

    Empty for dense models (no submodule declares ``router_logits`` among its recordable outputs).
    """
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
    routers = []
    for module in model.modules():
        for cls, class_name, index in targets:
            if (cls is not None and isinstance(module, cls)) or (
                class_name is not None and type(module).__name__.endswith(class_name)
            ):
                routers.append((module, index))
                break
    return routers


class RouterRecorder:
    """Forward hooks on an MoE model's routers that keep each token's top-k expert ids while armed."""

    def __init__(self, routers: list[tuple[torch.nn.Module, int]], top_k: int, num_experts: int):
        self.top_k, self.num_experts, self.num_layers = top_k, num_experts, len(routers)
        self._captured: list[list[torch.Tensor]] | None = None
        self._layouts: list | None = None  # one padding.ForwardLayout per model call of the armed block, if noted
        self._id_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self._handles = [module.register_forward_hook(self._hook(i, idx)) for i, (module, idx) in enumerate(routers)]

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RouterRecorder | None:
        """A recorder for ``model``'s routers, or ``None`` for a dense model."""
        routers = find_routers(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        top_k = getattr(config, "num_experts_per_tok", None)
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not routers or not top_k or not num_experts:
            return None
        return cls(routers, int(top_k), int(num_experts))

    def _hook(self, layer: int, index: int):
        def hook(module, args, output):
            if self._captured is None:
                return
            logits = output[index] if isinstance(output, (tuple, list)) else output
            ids = logits.detach().topk(self.top_k, dim=-1).indices.to(self._id_dtype)
            self._captured[layer].append(ids.reshape(-1, self.top_k))

        return hook

    @contextlib.contextmanager
    def recording(self):
        """Arm the hooks for the forward passes inside the block; read the result with :meth:`completion_topk`."""
        self._captured, self._layouts = [[] for _ in range(self.num_layers)], []
        try:
            yield self
        finally:
            self._last, self._last_layouts, self._captured, self._layouts = self._captured, self._layouts, None, None

    def note_layout(self, layout):
        """While armed: the next model call's input has this `padding.ForwardLayout` (trimmed, sorted or packed)."""
        if self._layouts is not None:
            self._layouts.append(layout)

    def completion_topk(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """Top-k expert ids of the last ``logits_to_keep`` positions (the completion), ``(B, T, L, k)``, from the
        forward passes of the last :meth:`recording` block over ``input_ids`` ``(B, S)`` (in chunks or not)."""
        captured, self._last = getattr(self, "_last", None), None
        layouts, self._last_layouts = getattr(self, "_last_layouts", None), None
        if not captured or any(not layer for layer in captured):
            return None
        batch, seq = input_ids.shape
        if layouts:
            return self._topk_through_layouts(captured, layouts, seq - logits_to_keep)
        layers = []
        for parts in captured:
            ids = torch.cat(parts)
            if ids.size(0) != batch * seq:  # e.g. a router that drops padding tokens: shapes no longer line up
                logger.warning("Router saw %d tokens for a %dx%d batch; MoE routing metrics skipped.", len(ids), batch,
                               seq)  # fmt: skip
                return None
            layers.append(ids.view(batch, seq, self.top_k)[:, -logits_to_keep:])
        return torch.stack(layers, dim=2)

    def _topk_through_layouts(self, captured, layouts, prompt_width):
        """Per-call router ids `[rows * width, k]` back to the batch's completion positions, `(B, T, L, k)`.
        Positions no call ran (trimmed padding) hold expert 0; every consumer masks them out."""
        from .padding import layouts_to_batch

        layers = []
        for parts in captured:
            if len(parts) != len(layouts) or any(p.size(0) != l.source.numel() for p, l in zip(parts, layouts)):
                logger.warning("Router calls do not match the %d model calls; MoE routing metrics skipped.", len(layouts))
                return None
            parts = [p.view(*l.shape, self.top_k) for p, l in zip(parts, layouts)]
            layers.append(layouts_to_batch(layouts, parts, 0, columns_from=prompt_width))
        return torch.stack(layers, dim=2)

    def remove(self):
        for handle in self._handles:
            handle.remove()
