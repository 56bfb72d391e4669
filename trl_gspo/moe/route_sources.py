"""Expert routes from the sampler (R3): read them from each engine's output, then place them in TRL's batch layout.

Every source is turned into one tensor per completion, ``[prompt_len + completion_len, L, k]`` int64, row ``t`` the
top-k experts each of the ``L`` MoE layers chose for token ``t`` of prompt + completion, and -1 rows where the
sampler has no route (the last sampled token, which no forward ever saw; vLLM prefix-cache hits). Then
:func:`place_routes` lays these out like TRL's rollout batch: prompts left-padded to ``P``, completions right-padded
to ``C``, so position ``(i, t)`` of the table is position ``(i, t)`` of ``cat(prompt_ids, completion_ids)``.

Sources:
- transformers ``generate``: :func:`routes_from_generate` reads a :class:`routing.CallLog` of the prefill call and one
  call per decoding step (only its newest position counts: with a KV cache the step sees one token per row).
- vLLM (``enable_return_routed_experts``) and ``rollout_func`` outputs: :func:`routes_from_engine` accepts the layouts
  seen across vLLM releases, listed in its docstring, and fails loudly on anything else. The raw routes are read from
  the engine's outputs (colocate, :func:`vllm_routes_from_outputs`) or from the server's replies (:class:`ServerResponses`),
  and :func:`server_returns_routes` asks a server whether it returns them at all.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from .routing import CallLog, RouteTable


def routes_from_generate(log: CallLog, batch: int, prompt_lens: list[int], completion_lens: list[int]):
    """Per-completion routes from one ``generate()`` call over ``batch`` left-padded prompts.

    ``log.calls[0]`` is the prefill over ``[batch, P]``; each later call is a decoding step whose last position per row
    is the token fed back at that step (completion token ``j`` is fed at step ``j``; the final sampled token never is).
    """
    error = log.check()
    if error is not None or not log.calls:
        raise RuntimeError(
            f"routing_replay='R3': could not record the routes of generate(): {error or 'no forward ran'}."
        )

    def per_row(call):  # [tokens, k] per layer -> [batch, positions, L, k]
        stacked = torch.stack(call, dim=1)
        if stacked.size(0) % batch:
            raise RuntimeError(
                f"routing_replay='R3': a generate() step routed {stacked.size(0)} tokens for {batch} rows."
            )
        return stacked.view(batch, stacked.size(0) // batch, *stacked.shape[1:])

    prefill = per_row(log.calls[0]).long()
    steps = [per_row(call)[:, -1].long() for call in log.calls[1:]]
    decoded = torch.stack(steps, dim=1) if steps else prefill.new_empty(batch, 0, *prefill.shape[2:])
    width = prefill.size(1)
    routes = []
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens, strict=True)):
        if p > width:
            raise RuntimeError(f"routing_replay='R3': prompt {i} has {p} tokens but generate() saw {width} positions.")
        fed = decoded[i, : min(c, decoded.size(1))]
        missing = fed.new_full((c - fed.size(0), *fed.shape[1:]), -1)
        routes.append(torch.cat([prefill[i, width - p :], fed, missing]).cpu())
    return routes


def _as_array(raw, where: str) -> np.ndarray:
    if isinstance(raw, str):  # vLLM's OpenAI server: base64 of an .npy file
        try:
            return np.load(io.BytesIO(base64.b64decode(raw)), allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the same user-facing problem
            raise ValueError(f"{where}: routed_experts is a string but not base64 .npy ({exc}).") from exc
    if isinstance(raw, torch.Tensor):
        return raw.detach().cpu().numpy()
    return np.asarray(raw)


def routes_from_engine(
    raw,
    prompt_len: int,
    completion_len: int,
    moe_layers: list[int | None],
    num_decoder_layers: int,
    top_k: int,
    num_experts: int,
    where: str = "sampler",
) -> torch.Tensor:
    """One completion's routes from an inference engine, as ``[prompt_len + completion_len, L, k]`` int64 (-1: none).

    Accepted layouts of ``raw`` (anything else raises, naming what was received):
    - one array ``[rows, layers, k]`` (vLLM ``CompletionOutput.routed_experts``; any integer dtype: int32 in early
      releases, int16/uint8 later), or the same as a base64 ``.npy`` string (vLLM's OpenAI server) or nested lists;
    - a pair ``(prompt_part, completion_part)`` or a dict ``{"prompt": ..., "completion": ...}`` of such arrays
      (releases that return the prompt's routes separately), concatenated along rows;
    - ``rows`` = prompt + completion tokens, or one less (the last sampled token was never forwarded: it gets -1);
    - ``layers`` = the MoE layers, or every decoder layer (engines number layers by decoder layer, so dense layers
      are included and skipped here using each router's decoder-layer index);
    - -1 marks a token without a route (prefix-cache hit); it is replayed natively.
    Expert ids must lie in ``[0, num_experts)`` (physical ids from expert-parallel load balancing do not) and be distinct
    within a row (early releases returned all zeros).
    """
    if isinstance(raw, dict):
        if set(raw) != {"prompt", "completion"}:
            raise ValueError(
                f"{where}: routed_experts dict must have keys 'prompt' and 'completion', got {sorted(raw)}."
            )
        raw = (raw["prompt"], raw["completion"])
    if isinstance(raw, (tuple, list)) and len(raw) == 2 and not isinstance(raw[0], (int, float, np.integer)):
        parts = [_as_array(part, where) for part in raw]
        if all(part.ndim == 3 for part in parts):
            array = np.concatenate(parts, axis=0)
        else:
            array = np.asarray(raw)  # a two-token nested list, not a pair
    else:
        array = _as_array(raw, where)
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{where}: routed_experts must be an integer array [tokens, layers, top_k]; got shape {array.shape}, "
            f"dtype {array.dtype}."
        )
    rows, layers, k = array.shape
    num_moe = len(moe_layers)
    if k != top_k:
        raise ValueError(f"{where}: routed_experts has top_k={k}, the model routes to {top_k} experts per token.")
    if layers == num_decoder_layers and layers != num_moe:
        if any(index is None for index in moe_layers):
            raise ValueError(
                f"{where}: routed_experts covers {layers} decoder layers, but the MoE layers' indices are unknown."
            )
        array = array[:, moe_layers]
    elif layers != num_moe:
        raise ValueError(
            f"{where}: routed_experts has {layers} layers; expected the {num_moe} MoE layers or all "
            f"{num_decoder_layers} decoder layers."
        )
    total = prompt_len + completion_len
    if rows == total - 1:
        array = np.concatenate([array, np.full((1, *array.shape[1:]), -1, dtype=array.dtype)])
    elif rows != total:
        raise ValueError(
            f"{where}: routed_experts has {rows} rows for {prompt_len} prompt + {completion_len} completion tokens "
            f"(expected {total} or {total - 1}); the engine's layout is not one trl-gspo knows."
        )
    routes = torch.from_numpy(array.astype(np.int64))
    missing = (routes < 0).any(-1, keepdim=True)
    if (routes >= num_experts).any():
        raise ValueError(
            f"{where}: routed_experts holds expert id {int(routes.max())} >= num_experts={num_experts} (physical ids "
            "from expert-parallel load balancing?); logical ids are needed."
        )
    ordered = routes.sort(dim=-1).values
    duplicate = ((ordered[..., 1:] == ordered[..., :-1]) & ~missing).any()
    if k > 1 and duplicate:
        raise ValueError(
            f"{where}: routed_experts repeats an expert within one token's top-{k} (an engine that returns zeros "
            "instead of routes?)."
        )
    return routes.masked_fill(missing, -1)


def place_routes(
    routes: list[torch.Tensor],
    prompt_lens: list[int],
    completion_lens: list[int],
    prompt_width: int,
    completion_width: int,
    dtype: torch.dtype,
) -> RouteTable:
    """Lay per-completion routes out like TRL's rollout batch ``cat(left-padded prompts, right-padded completions)``.

    A position is valid when its route has no -1; padding positions are invalid (the router decides natively).
    """
    batch, layers, k = len(routes), routes[0].size(1), routes[0].size(2)
    ids = torch.zeros(batch, prompt_width + completion_width, layers, k, dtype=dtype)
    valid = torch.zeros(batch, prompt_width + completion_width, dtype=torch.bool)
    for i, (row, p, c) in enumerate(zip(routes, prompt_lens, completion_lens, strict=True)):
        if p > prompt_width or c > completion_width or row.size(0) != p + c:
            raise ValueError(
                f"routing replay: completion {i} has {row.size(0)} routes for {p} prompt + {c} completion tokens in a "
                f"batch of {prompt_width} + {completion_width} positions."
            )
        span = slice(prompt_width - p, prompt_width + c)
        ids[i, span] = row.clamp(min=0).to(dtype)
        valid[i, span] = (row >= 0).all(-1).all(-1)
    return RouteTable(ids, valid)


# ---------------------------------------------------------------------------------------- vLLM
def vllm_routes_from_outputs(request_outputs) -> list:
    """Raw routes of every completion in vLLM `RequestOutput`s (colocate): `CompletionOutput.routed_experts`, with the
    prompt's part prepended when the release returns it separately (`RequestOutput.prompt_routed_experts`)."""
    raw = []
    for request in request_outputs:
        prompt_part = getattr(request, "prompt_routed_experts", None)
        for completion in request.outputs:
            routes = getattr(completion, "routed_experts", None)
            raw.append(routes if prompt_part is None or routes is None else (prompt_part, routes))
    return raw


def vllm_routes_from_choices(choices: list[dict]) -> list:
    """Raw routes of every completion in a vLLM OpenAI-server response (server mode): `choices[i]["routed_experts"]`."""
    return [choice.get("routed_experts") for choice in choices]


class ServerResponses:
    """The routes in the responses TRL's vLLM client receives during one `client.generate` call (server mode, main
    process only), in the order of TRL's completions. TRL 1.16 sends either one `/v1/completions` request for every
    prompt (its choices are prompt-major: the n completions of prompt 0, then of prompt 1, ...) or, with images, one
    request per prompt from a thread pool, whose replies arrive in any order; those are put back in prompt order by
    the prompt each request carried (the same list object TRL passed to `generate`, or failing that equal ids)."""

    def __init__(self):
        self.prompts, self.batch, self.per_prompt = None, None, {}

    def start(self, prompts):
        self.prompts, self.batch, self.per_prompt = list(prompts or []), None, {}

    def keep(self, url, payload, response):
        if not isinstance(response, dict) or "choices" not in response:
            return
        token_ids = payload.get("token_ids") if isinstance(payload, dict) else None
        if token_ids is None:  # one request for the whole batch
            self.batch = vllm_routes_from_choices(response["choices"])
            return
        index = next((i for i, p in enumerate(self.prompts) if p is token_ids), None)
        if index is None:  # the client copied the ids: the first prompt with these ids not yet answered
            index = next(
                (i for i, p in enumerate(self.prompts) if list(p) == list(token_ids) and i not in self.per_prompt), None
            )
        if index is not None:
            self.per_prompt[index] = vllm_routes_from_choices(response["choices"])

    def routes(self) -> list | None:
        if self.per_prompt:
            if sorted(self.per_prompt) != list(range(len(self.prompts))):
                return None  # some prompt got no reply with routes: reported as missing routes below
            return [routes for i in range(len(self.prompts)) for routes in self.per_prompt[i]]
        return self.batch


def server_returns_routes(client) -> bool | None:
    """Whether the vLLM server behind TRL's `client` returns routed experts, from its `/server_info` (served by
    `trl vllm-serve`, which turns on vLLM's development endpoints): None where that cannot be told (an older client or
    vLLM, a server without those endpoints); the first generation then checks the replies themselves."""
    try:
        info = client.get_server_info()
    except Exception:  # noqa: BLE001 - TRL's client raises a bare Exception for an unexpected status
        return None
    flags = [
        section.get("enable_return_routed_experts")
        for section in (info.get("aux_output_config"), info.get("model_config"))
        if isinstance(section, dict)
    ]
    flags = [flag for flag in flags if isinstance(flag, bool)]
    return any(flags) if flags else None
