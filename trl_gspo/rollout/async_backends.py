"""The generator side of asynchronous generation: the generator thread (`GenerationWorker`) and the backends it
runs, one per generation path: `TransformersGenerator` (a separate copy of the policy running transformers
`generate`, seeded per rollout), `VLLMServerGenerator` (TRL's server path, split at its HTTP call) and
`RolloutFuncGenerator` (a thread-safe `rollout_func`). `generation_backend` picks one for a trainer.

The source that drives them, and what happens on the main thread, is rollout/async_rollouts.py (its docstring describes the
whole feature).
"""

from __future__ import annotations

import copy
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future

import torch

from ..common import engine, seam, trl_compat
from ..moe.route_sources import routes_from_generate
from ..moe.routing import RouterHooks
from .async_server import VLLMServerGenerator
from .pipeline import Completions, GenerationRequest
from .sampler_logprobs import SamplerLogprobRecorder

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- the worker thread
class GeneratorThreadError(RuntimeError):
    """Generation failed in the generator thread; the original exception (and its traceback) is the cause."""


class _Cancelled(Exception):
    """A generation stopped because the source was closing."""


class GenerationWorker:
    """One daemon thread running jobs in submission order. A job's result or exception lands in its `Future` (with
    `busy_s`, the seconds it ran); `idle_s` sums the time the thread waited for work."""

    def __init__(self, name: str = "gspo-generator"):
        self.closing = threading.Event()
        self.idle_s = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._free_since = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn) -> Future:
        future = Future()
        future.busy_s = 0.0
        self._queue.put((fn, future))
        return future

    def _run(self):
        torch.set_num_threads(
            torch.get_num_threads()
        )  # this thread's OpenMP team: the process's setting, not its default
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            self.idle_s += start - self._free_since
            try:
                result, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 - every failure is handed to the main thread
                result, error = None, exc
            self._free_since = time.perf_counter()
            future.busy_s = self._free_since - start
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float) -> bool:
        """Stop: queued jobs are cancelled, a running generation stops at its next token; True when the thread ended."""
        self.closing.set()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


# ---------------------------------------------------------------------------------------------------- backends
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def generator_copy(module: torch.nn.Module, device) -> torch.nn.Module:
    """A copy of `module` for generation: same structure and buffers, fresh parameters (uninitialised, full shape even
    when ZeRO-3 partitioned them; the first weight push fills them), no hooks (the trainer's router hooks, DeepSpeed's
    gather hooks, gradient-checkpointing input hooks stay on the original), no forward patched on the instance, no
    gradient checkpointing, no gradients, eval mode."""
    memo = {}
    for sub in module.modules():
        for name in _HOOK_DICTS:
            hooks = sub.__dict__.get(name)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    for param in module.parameters():
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps the full shape there
        memo[id(param)] = torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device), requires_grad=False)
    model = copy.deepcopy(module, memo)
    for sub in model.modules():
        # Instance-level forwards (TRL's fused log-prob head, accelerate's autocast wrapper) close over the original
        # module, so the copy would run the trainer's model: back to the class's own forward (autocast: `_generate`).
        sub.__dict__.pop("forward", None)
        if getattr(sub, "gradient_checkpointing", False):
            sub.gradient_checkpointing = False
    return model.to(device).eval()


def _is_zero3(trainer) -> bool:
    return bool(trainer.is_deepspeed_enabled and engine.zero_stage(trainer.accelerator) == 3)


class _StopWhenClosing:
    """`generate` stopping criterion: every row stops once the source is closing."""

    def __init__(self, closing: threading.Event):
        self.closing = closing

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.size(0),), self.closing.is_set(), dtype=torch.bool, device=input_ids.device)


class _GumbelMaxSampling:
    """Last logits processor of a greedy `generate`: draws the token `softmax(scores)` would sample, from its own
    `torch.Generator` (Gumbel-max: argmax(scores - log E), E ~ Exp(1), is an exact sample), and leaves only it."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids, scores):
        noise = torch.empty_like(scores).exponential_(generator=self.generator)
        choice = (scores - noise.log()).argmax(-1, keepdim=True)
        return torch.full_like(scores, -float("inf")).scatter_(-1, choice, 0.0)


def seeded_sampling(config):
    """`(greedy_config, warpers)`: `generate` with `greedy_config` and the logits processors `[*warpers,
    _GumbelMaxSampling(g)]` samples exactly as `config` does (same processors, same order: transformers applies custom
    processors after its own, and its sampling warpers only in sampling mode), but from `g` instead of the global RNG."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    def cutoff(value):
        return value is not None and 0.0 < value < 1.0

    others = {
        "top_h": getattr(config, "top_h", None) is not None,
        "typical_p": cutoff(getattr(config, "typical_p", None)),
        "epsilon_cutoff": cutoff(getattr(config, "epsilon_cutoff", None)),
        "eta_cutoff": cutoff(getattr(config, "eta_cutoff", None)),
    }
    for name in (name for name, active in others.items() if active):
        raise ValueError(
            f"async_generation with max_staleness >= 1 samples with its own seeded sampler, which rebuilds temperature, "
            f"top_k, top_p and min_p; generation_kwargs sets {name}={getattr(config, name)!r}. Remove it, or use "
            "max_staleness=0."
        )
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    greedy = copy.deepcopy(config)
    greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p, greedy.min_p = False, None, None, None, None
    return greedy, warpers


class TransformersGenerator:
    """transformers `generate` on a separate copy of the policy, in the generator thread (module docstring)."""

    needs_idle_sync = False  # weights wait in a snapshot until the running request is done

    def __init__(self, trainer, seeded: bool, closing: threading.Event):
        args = trainer.args
        self.trainer, self.closing = trainer, closing
        self.device = torch.device(args.generation_device) if args.generation_device else trainer.accelerator.device
        self.zero3 = _is_zero3(trainer)
        source = trainer.accelerator.unwrap_model(trainer.model)
        self.model = generator_copy(source, self.device)
        self._params = dict(self.model.named_parameters())
        self._trained = [name for name, p in source.named_parameters() if p.requires_grad]
        self._filled = False
        module = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._recorder = functools.partial(SamplerLogprobRecorder, module, trainer.temperature)
        self._routes = RouterHooks.for_model(self.model) if args.routing_replay == "R3" else None
        self.config = trainer.generation_config
        self.sampling = seeded_sampling(self.config) if seeded else None
        self.seed, self.process_index = args.seed, trainer.accelerator.process_index
        self.pad_token_id, self.pad_to_multiple_of = trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of
        self.eos_token_ids = trl_compat.eos_token_ids(trainer)
        self.autocast = trainer.accelerator.autocast  # mixed precision as the trainer's forward (thread-local state)

    # ----------------------------------------------------------------------------------------- main thread
    def push_weights(self, busy: bool):
        """The trainer's weights into the generator: copied now when it is idle, else a snapshot and the job that loads
        it before the next request. Every process gathers the same parameters in the same order (ZeRO-3)."""
        source = dict(self.trainer.accelerator.unwrap_model(self.trainer.model).named_parameters())
        names = self._trained if self._filled else list(self._params)
        self._filled = True
        snapshot = {}
        with torch.no_grad():
            for name in names:
                param = source[name]
                with self._gathered(param):
                    if busy:
                        snapshot[name] = param.detach().to(self.device, copy=True)
                    else:
                        self._params[name].copy_(param.detach())
        return functools.partial(self._load, snapshot) if busy else None

    def _gathered(self, param):
        if not self.zero3:
            return torch.no_grad()
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)

    def request(self, request: GenerationRequest, rollout: int, sampled_at: int):
        images, fields, _ = trl_compat.single_turn_request(
            self.trainer, request.single_turn_args, request.single_turn_kwargs or {}
        )
        if images is not None or fields:
            raise ValueError("async_generation does not support image prompts yet; set async_generation=False.")
        return functools.partial(self._generate_batch, request.prompt_ids, rollout, sampled_at)

    def completions(self, result: dict) -> Completions:
        return Completions(
            result["sampled_at"], result["prompt_ids"], result["completion_ids"], result["logprobs"], result["routes"]
        )

    def answering(self, result):
        return _nothing()

    def close(self):
        if self._routes is not None:
            self._routes.remove()

    # --------------------------------------------------------------------------------------- worker thread
    @torch.no_grad()
    def _load(self, snapshot: dict):
        for name, tensor in snapshot.items():
            self._params[name].copy_(tensor)

    @torch.no_grad()
    def _generate_batch(self, prompt_ids: list, rollout: int, sampled_at: int) -> dict:
        """TRL's transformers generation (left-padded prompts, `generate`, cut after the first EOS) on the copy."""
        from transformers import LogitsProcessorList, StoppingCriteriaList
        from trl.trainer.utils import pad

        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(
            rows, padding_value=self.pad_token_id, padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of
        )
        attention_mask = pad(
            [torch.ones_like(r) for r in rows],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        kwargs = {"generation_config": self.config}
        if self.sampling is not None:  # overlapping the trainer: noise from a generator of this rollout, not global
            greedy, warpers = self.sampling
            g = torch.Generator(device=self.device)
            g.manual_seed(((self.seed * 1_000_003 + rollout) * 1_009 + self.process_index) % 2**63)
            kwargs = {
                "generation_config": greedy,
                "logits_processor": LogitsProcessorList([*warpers, _GumbelMaxSampling(g)]),
            }
        route_log = self._routes.log_calls() if self._routes is not None else _nothing()
        # synced_gpus=False: transformers turns it on under ZeRO-3 / FSDP (an all-reduce per token, a collective this
        # thread must not make); the copy holds full weights, so each process generates on its own.
        with self.autocast(), self._recorder() as recorder, route_log as log:
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                stopping_criteria=StoppingCriteriaList([_StopWhenClosing(self.closing)]),
                synced_gpus=False,
                **kwargs,
            )
        if self.closing.is_set():
            raise _Cancelled()
        completion = out[:, input_ids.size(1) :]
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=completion.device))
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.size(1))
        keep = torch.arange(completion.size(1), device=completion.device)[None] <= first_eos[:, None]
        completion_ids = [c[m].tolist() for c, m in zip(completion.cpu(), keep.cpu(), strict=True)]
        routes = None
        if log is not None:
            routes = routes_from_generate(
                log, len(prompt_ids), [len(p) for p in prompt_ids], [len(c) for c in completion_ids]
            )
        return {
            "sampled_at": sampled_at,
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": recorder.completion_logprobs(completion_ids),
            "routes": routes,
        }


class _nothing:
    """A context manager doing nothing that yields None (`contextlib.nullcontext` without the import)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class RolloutFuncGenerator:
    """The `rollout_func`, called in the generator thread with the prompts TRL would pass it."""

    def __init__(self, trainer):
        self.trainer, self.rollout_func = trainer, trainer.rollout_func
        self.needs_idle_sync = bool(trainer.use_vllm)

    def push_weights(self, busy: bool):
        if self.trainer.use_vllm:  # TRL pushes weights before calling a rollout_func that relies on its vLLM
            self.trainer.vllm_generation.sync_weights()
            seam.mark_weights_pushed(self.trainer)
        return None

    def request(self, request: GenerationRequest, rollout: int, sampled_at: int):
        return functools.partial(self._call, copy.deepcopy(request.prompts), sampled_at)

    def _call(self, prompts, sampled_at):
        return {"sampled_at": sampled_at, "output": self.rollout_func(prompts, self.trainer)}

    def completions(self, result: dict) -> Completions:
        return Completions(result["sampled_at"], rollout_output=result["output"])

    def answering(self, result):
        return _nothing()

    def close(self):
        pass


def generation_backend(trainer, seeded: bool, closing: threading.Event, timeout: float):
    """The backend that generates for `trainer`: its rollout_func, its vLLM server, or transformers `generate`."""
    if getattr(trainer, "rollout_func", None) is not None:
        return RolloutFuncGenerator(trainer)
    if trainer.use_vllm:
        if trainer.vllm_mode != "server":
            raise ValueError(f"async_generation needs vllm_mode='server', got {trainer.vllm_mode!r}.")
        return VLLMServerGenerator(trainer, timeout)
    return TransformersGenerator(trainer, seeded, closing)
