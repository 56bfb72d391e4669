"""Asynchronous generation: a generator thread works on rollout batch k+1 (up to k + `max_staleness`) while the
trainer trains on batch k, and the loss corrects for the staleness with GSPO's decoupled objective.

`AsyncRollouts` is the `RolloutSource` (rollout.py) that `async_generation=True` selects. At the start of every rollout
batch k, on each process's main thread, at a point fixed by the step count:

    wait until batch k is generated                  the trainer's only wait (`async/trainer_wait_s`); a vLLM server
                                                     also waits for every request in flight (weights change only
                                                     between requests)
    push the trainer's weights to the generator      a sync point: they sample every batch sent from now on
    send the requests of batches up to k + max_staleness
                                                     TRL's prompt preparation, on the main thread; each request goes to
                                                     the generator thread, in order
    score batch k                                    TRL's `_generate_and_score_completions` now (rewards, advantages,
                                                     the pi_old pass at the current weights = the proximal policy), with
                                                     its generation call answered by the generated completions
    ... train on batch k while the generator thread generates ...

So weights reach the generator only at sync points and only between requests (never mid-request), every completion
carries the optimizer step of the weights that sampled it (`sampled_at`, per row in the batch), and a run is as
reproducible from its seed as a synchronous one: with `max_staleness >= 1` the transformers generator draws its
sampling noise from a generator seeded per (seed, rollout, process), not from the global RNG the trainer uses at the
same time; with `max_staleness=0` the trainer waits for every batch, so the generator draws from the global RNG
exactly as the synchronous trainer does (same completions, same weights). A checkpoint waits for the batches in
flight and saves them (plain lists and tensors), so a resumed run consumes the same batches as an uninterrupted one.

Only the blocking call runs in the generator thread. Collectives (the vLLM server's prompt gather and result
broadcast, the weight sync and ZeRO-3 gathers, reward gathers) stay on the main thread in the same order on every
process. Backends (the generator side):
- `TransformersGenerator`: a separate copy of the policy (`generation_device`, default the trainer's device) that
  runs transformers `generate` with a forward hook recording the sampler's log-probs (sampler_logprobs.py) and, under
  R3, its routes. Pushing weights copies the trainable parameters into it (all of them the first time; LoRA: only the
  adapters), gathered under ZeRO-3; when the generator is busy (`max_staleness >= 2`) a snapshot is queued and loaded
  between requests.
- `VLLMServerGenerator` (`vllm_mode="server"`): TRL's server path, split. When a request is sent, the prompts are
  gathered from every process and the main process hands the HTTP request TRL's client would send to the generator
  thread; when the batch is scored, TRL's own path runs (gather, broadcast, parsing, R3's route watcher) and its
  client's `session.post` is answered with that response. Weights go through TRL's `sync_weights`.
- `RolloutFuncGenerator`: the `rollout_func` is called in the generator thread and must be thread-safe (it must not
  use the trainer's model, which changes while it runs).
- vLLM colocate is refused (config): the same GPUs generate and train, so there is nothing to overlap.

With dynamic sampling (`dynamic_sampling=True` too) the jobs are sampling rounds (positions of the prompt stream)
instead of rollout batches, and the main thread fills each batch from them (`_next_filled_batch`).

The decoupled objective (`decoupled_behaviour_weight`, the loss's hook 3): the clipped ratio stays current / proximal
(TRL's pi_old pass, recomputed when training on the batch starts; without off-policy mini-batches pi_old is the
current policy itself), and a detached behaviour weight proximal / sampler multiplies the loss: length-normalised
per sequence for `sequence` / `sequence_token`, per token for `token`, bounded by TRL's `vllm_importance_sampling_*`
fields (`_correction` switches it, `_mode`'s suffix chooses truncate or mask, `_clip_min` / `_clip_max`). The weight
before bounds is logged as `async/behaviour_weight/{mean,std,min,max,p5,p95}`, the share changed by the bounds as
`async/behaviour_weight/outside_frac`.
"""

from __future__ import annotations

import copy
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin TimeoutError from Python 3.11
from dataclasses import dataclass, field

import torch

from .. import losses
from ..common import trl_compat
from .prompt_stream import PromptStream
from .pipeline import Completions, GenerationRequest
from ..common.validation import check_bool, check_int

logger = logging.getLogger(__name__)

#: Seconds `close()` waits for the generator thread (a transformers generation stops at its next token).
CLOSE_TIMEOUT_S = 10.0


@dataclass
class AsyncOptions:
    r"""
    `GSPOConfig` fields of asynchronous generation (this module).

    Parameters:
        async_generation (`bool`, *optional*, defaults to `False`):
            Generate the next rollout batches in a generator thread while the trainer trains on the current one. Pays
            when generation and training use different devices: vLLM server mode (`trl vllm-serve` on other GPUs), or
            transformers `generate` on a spare device (`generation_device`); refused with vLLM colocate. Samples are
            trained `max_staleness` rollout batches after the weights that generated them, with the decoupled
            objective correcting for it.
        max_staleness (`int`, *optional*, defaults to `1`):
            How many rollout batches ahead the generator works: batch k + `max_staleness` is generated with the weights
            of the start of batch k. `0` generates each batch when it is due (no overlap; same weights as the
            synchronous trainer). Larger values queue more batches (absorbing uneven generation times) at the cost of
            more staleness.
        generation_device (`str` or `None`, *optional*, defaults to `None`):
            Device of the transformers generator's copy of the policy (e.g. `"cuda:1"`); `None`: the trainer's device.
            Only with `async_generation=True` and without vLLM.
        async_generation_timeout (`float`, *optional*, defaults to `1800.0`):
            Seconds the trainer waits for one rollout batch (or one checkpoint's batches in flight) before raising,
            e.g. when a vLLM server stopped answering.
    """

    async_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate the next rollout batches in a background thread while training on the current one "
            "(vLLM server mode or a spare generation_device), so the step costs max(generation, training) instead of "
            "their sum. Stale samples are corrected by the decoupled objective (behaviour weight pi_prox / pi_sampler)."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "Rollout batches the generator works ahead (async_generation). 1: one-step off-policy, the usual "
            "choice. 0: no overlap (matches the synchronous trainer). More queues more batches and adds staleness."
        },
    )
    generation_device: str | None = field(
        default=None,
        metadata={
            "help": "Device of the async transformers generator's copy of the policy (e.g. 'cuda:1'); default: the "
            "trainer's device. Generating on another device is what lets generation and training overlap."
        },
    )
    async_generation_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds the trainer waits for one rollout batch from the generator before raising (a vLLM server "
            "that stopped answering gives an error instead of a hang)."
        },
    )

    def _validate_options(self):
        check_bool("async_generation", self.async_generation)
        check_int("max_staleness", self.max_staleness, 0, "rollout batches the generator works ahead")
        timeout = self.async_generation_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"async_generation_timeout={timeout!r} must be a number of seconds > 0.")
        if self.generation_device is not None:
            if not self.async_generation or self.use_vllm:
                raise ValueError(
                    f"generation_device={self.generation_device!r} places the asynchronous transformers generator; it "
                    "needs async_generation=True and use_vllm=False (vLLM places its own engine)."
                )
            try:
                torch.device(self.generation_device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"generation_device={self.generation_device!r} is not a torch device ({exc}).") from None
        if not self.async_generation:
            return
        if self.use_vllm and self.vllm_mode == "colocate":
            raise ValueError(
                "async_generation=True with vllm_mode='colocate': colocated vLLM generates on the training GPUs, so "
                "generation and training cannot overlap. Run `trl vllm-serve` on other GPUs with vllm_mode='server', "
                "or use transformers generation on a spare device (use_vllm=False, generation_device='cuda:N')."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "async_generation=True with use_transformers_continuous_batching=True is not supported: continuous "
                "batching returns no sampler log-probs for the behaviour correction. Use regular generate or vLLM server."
            )
        if self.old_logprobs_source == "sampler":
            logger.warning(
                "async_generation with old_logprobs_source='sampler': GSPO's clipped ratio is anchored on the sampler's "
                "log-probs of weights up to max_staleness rollout batches old, so most sequences start outside the "
                "3e-4/4e-4 clip range (a clip fraction near 0.4 is reported with such setups). The default "
                "'recompute' anchors it on the proximal policy and corrects the staleness with a behaviour weight."
            )
        if not self.vllm_importance_sampling_correction:
            logger.warning(
                "async_generation with vllm_importance_sampling_correction=False: stale samples are trained without the "
                "behaviour weight pi_prox / pi_sampler (the ratio is still anchored on the proximal policy)."
            )


# ------------------------------------------------------------------------------------- the decoupled objective
def decoupled_behaviour_weight(trainer, inputs: dict, proximal_logps, mask) -> torch.Tensor | None:
    """The behaviour weight `pi_prox / mu` of one training micro-batch, bounded as the config says (module docstring),
    with its statistics added to the logging window; None when the correction is off or the sampler returned no
    log-probs (logged once)."""
    args = trainer.args
    if not args.vllm_importance_sampling_correction:
        return None
    behaviour = inputs.get("sampling_per_token_logps")
    if behaviour is None:
        if not getattr(trainer, "_warned_no_behaviour_logps", False):
            logger.warning("async_generation: this generation path returned no sampler log-probs (a rollout_func "
                           "without 'logprobs'?), so stale samples are trained without the behaviour weight.")  # fmt: skip
            trainer._warned_no_behaviour_logps = True
        return None
    per_sequence = trainer.importance_sampling_level in losses.SEQUENCE_LEVELS
    log_w = losses.behaviour_log_weights(proximal_logps, behaviour, mask, per_sequence,
                                         args.vllm_importance_sampling_length_normalized)  # fmt: skip
    bound = "truncate" if args.vllm_importance_sampling_mode.endswith("truncate") else "mask"
    weights, outside = losses.bounded_behaviour_weights(
        log_w, bound, args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max, args.max_log_ratio
    )
    valid = (mask.sum(-1, keepdim=True) > 0) if per_sequence else mask.bool()
    window = trainer._diagnostics["train"]  # reduced across processes at log time (metrics.MetricWindow)
    window.add_values("async/behaviour_weight", losses.importance_ratio(log_w, args.max_log_ratio), valid)
    window.add_means({"async/behaviour_weight/outside_frac": torch.stack([(outside & valid).sum(), valid.sum()]).float()})
    return weights


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
        torch.set_num_threads(torch.get_num_threads())  # this thread's OpenMP team: the process's setting, not its default
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
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")  # fmt: skip


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
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(trainer.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3)


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
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    def cutoff(value):
        return value is not None and 0.0 < value < 1.0

    others = {"top_h": getattr(config, "top_h", None) is not None, "typical_p": cutoff(getattr(config, "typical_p", None)),
              "epsilon_cutoff": cutoff(getattr(config, "epsilon_cutoff", None)),
              "eta_cutoff": cutoff(getattr(config, "eta_cutoff", None))}  # fmt: skip
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
        from ..moe.routing import RouterHooks
        from .sampler_logprobs import SamplerLogprobRecorder

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
        self._routes = RouterHooks.for_model(self.model) if getattr(trainer, "_replay", "none") == "R3" else None
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
        images, fields, _ = trl_compat.single_turn_request(self.trainer, request.single_turn_args,
                                                           request.single_turn_kwargs or {})  # fmt: skip
        if images is not None or fields:
            raise ValueError("async_generation does not support image prompts yet; set async_generation=False.")
        return functools.partial(self._generate, request.prompt_ids, rollout, sampled_at)

    def completions(self, result: dict) -> Completions:
        return Completions(result["sampled_at"], result["prompt_ids"], result["completion_ids"], result["logprobs"],
                           result["routes"])  # fmt: skip

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
    def _generate(self, prompt_ids: list, rollout: int, sampled_at: int) -> dict:
        """TRL's transformers generation (left-padded prompts, `generate`, cut after the first EOS) on the copy."""
        from transformers import LogitsProcessorList, StoppingCriteriaList
        from trl.trainer.utils import pad

        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(rows, padding_value=self.pad_token_id, padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of)  # fmt: skip
        kwargs = {"generation_config": self.config}
        if self.sampling is not None:  # overlapping the trainer: noise from a generator of this rollout, not global
            greedy, warpers = self.sampling
            g = torch.Generator(device=self.device)
            g.manual_seed(((self.seed * 1_000_003 + rollout) * 1_009 + self.process_index) % 2**63)
            kwargs = {"generation_config": greedy, "logits_processor": LogitsProcessorList([*warpers, _GumbelMaxSampling(g)])}
        route_log = self._routes.log_calls() if self._routes is not None else _nothing()
        # synced_gpus=False: transformers turns it on under ZeRO-3 / FSDP (an all-reduce per token, a collective this
        # thread must not make); the copy holds full weights, so each process generates on its own.
        with self.autocast(), self._recorder() as recorder, route_log as log:
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                      stopping_criteria=StoppingCriteriaList([_StopWhenClosing(self.closing)]),
                                      synced_gpus=False, **kwargs)  # fmt: skip
        if self.closing.is_set():
            raise _Cancelled()
        completion = out[:, input_ids.size(1) :]
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=completion.device))
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.size(1))
        keep = torch.arange(completion.size(1), device=completion.device)[None] <= first_eos[:, None]
        completion_ids = [c[m].tolist() for c, m in zip(completion.cpu(), keep.cpu(), strict=True)]
        routes = None
        if log is not None:
            from ..moe.route_sources import routes_from_generate

            routes = routes_from_generate(log, len(prompt_ids), [len(p) for p in prompt_ids],
                                          [len(c) for c in completion_ids])  # fmt: skip
        return {"sampled_at": sampled_at, "prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": recorder.completion_logprobs(completion_ids), "routes": routes}  # fmt: skip


class _nothing:
    """A context manager doing nothing that yields None (`contextlib.nullcontext` without the import)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _Captured(Exception):
    def __init__(self, url, kwargs):
        super().__init__("captured")
        self.url, self.kwargs = url, kwargs


class _ServerRequests:
    """Wraps the main process's TRL vLLM client `session.post`: capture the request TRL's client would send (to send it
    from the generator thread), and answer TRL's own call with that response when the batch is scored. Other requests
    (weight updates, cache resets, evaluation) pass through."""

    def __init__(self, client):
        self.client, self.post = client, client.session.post
        self._capturing, self._answer = False, None
        client.session.post = self._post

    def capture(self, call):
        self._capturing = True
        try:
            call()
        except _Captured as captured:
            return captured.url, captured.kwargs
        finally:
            self._capturing = False
        raise RuntimeError("TRL's vLLM client returned without sending a generation request.")

    def send(self, url: str, kwargs: dict, timeout: float) -> dict:
        """Generator thread: the request, as TRL's client would send it; the response as plain values."""
        import requests

        try:
            response = self.post(url, timeout=timeout, **kwargs)
        except requests.exceptions.Timeout as exc:
            raise TimeoutError(f"The vLLM server at {url} did not answer within {timeout:g} s.") from exc
        if response.status_code != 200:
            raise RuntimeError(f"The vLLM server at {url} answered {response.status_code}: {response.text[:2000]}")
        return {"url": url, "json": kwargs.get("json"), "text": response.text}

    def answer(self, result: dict | None):
        self._answer = result

    def _post(self, url, **kwargs):
        if self._capturing:
            raise _Captured(url, kwargs)
        answer, self._answer = self._answer, None
        if answer is None:
            return self.post(url, **kwargs)
        if url != answer["url"] or kwargs.get("json") != answer["json"]:
            raise RuntimeError(
                "async_generation: the request TRL's vLLM client makes now differs from the one sent ahead of time "
                "(trl_compat.vllm_server_sampling_params is out of date for this TRL?); use async_generation=False."
            )
        import requests

        response = requests.models.Response()
        response.status_code, response._content, response.encoding, response.url = 200, answer["text"].encode(), "utf-8", url
        return response

    def close(self):
        self.client.session.__dict__.pop("post", None)


class VLLMServerGenerator:
    """TRL's vLLM server path with only the HTTP request in the generator thread (module docstring)."""

    needs_idle_sync = True  # the server holds one set of weights: they change only when no request is in flight

    def __init__(self, trainer, timeout: float):
        self.trainer, self.generation, self.timeout = trainer, trainer.vllm_generation, timeout
        self.main = trainer.accelerator.is_main_process
        self.requests = _ServerRequests(self.generation.vllm_client) if self.main else None
        self.where = getattr(getattr(self.generation, "vllm_client", None), "base_url", "the vLLM server")

    def push_weights(self, busy: bool):
        self.generation.sync_weights()  # collective: every process, main thread
        self.trainer._last_loaded_step = self.trainer.state.global_step  # TRL's own call then finds them current
        return None

    def request(self, request: GenerationRequest, rollout: int, sampled_at: int):
        from accelerate.utils import gather_object

        images, fields, n = trl_compat.single_turn_request(self.trainer, request.single_turn_args,
                                                           request.single_turn_kwargs or {})  # fmt: skip
        if images is not None or fields:
            raise ValueError("async_generation does not support image prompts yet; set async_generation=False.")
        prompts = gather_object(request.prompt_ids)  # collective, as TRL's server path gathers them
        if not self.main:
            return None
        params = trl_compat.vllm_server_sampling_params(self.generation, n)
        client = self.generation.vllm_client
        url, kwargs = self.requests.capture(lambda: client.generate(prompts=prompts[::n], **params))
        return functools.partial(self.requests.send, url, kwargs, self.timeout)

    def completions(self, result) -> Completions:
        return Completions(sampled_at=-1)  # no ids: TRL's server path runs, `answering` makes its client answer

    def answering(self, result):
        requests = self.requests

        class _Answer:
            def __enter__(self):
                if requests is not None:
                    requests.answer(result)

            def __exit__(self, *exc):
                if requests is not None:
                    requests.answer(None)
                return False

        return _Answer()

    def close(self):
        if self.requests is not None:
            self.requests.close()


class RolloutFuncGenerator:
    """The `rollout_func`, called in the generator thread with the prompts TRL would pass it."""

    def __init__(self, trainer):
        self.trainer, self.rollout_func = trainer, trainer.rollout_func
        self.needs_idle_sync = bool(trainer.use_vllm)

    def push_weights(self, busy: bool):
        if self.trainer.use_vllm:  # TRL pushes weights before calling a rollout_func that relies on its vLLM
            self.trainer.vllm_generation.sync_weights()
            self.trainer._last_loaded_step = self.trainer.state.global_step
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


# ------------------------------------------------------------------------------------------------- the source
@dataclass
class _Job:
    """One rollout batch's generation: the weights' step, the generator thread's future (None when nothing runs on
    this process: restored from a checkpoint, or server mode on a process that does not talk to the server), and the
    result once known."""

    sampled_at: int
    future: Future | None = None
    result: object = None
    batch: int = -1  # rollout batch at whose sync point it was sent (dynamic sampling's staleness check)


class AsyncRollouts:
    """`RolloutSource` that generates rollout batches ahead of time in a generator thread (module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.staleness = trainer.args.max_staleness
        self.timeout = float(trainer.args.async_generation_timeout)
        for name in ("tools", "environment_factories"):
            if getattr(trainer, name, None):
                raise ValueError(
                    f"async_generation=True does not support {name} (multi-turn tool calls generate again on the "
                    "main thread between turns); set async_generation=False."
                )
        self.filler = None  # dynamic sampling: the filling policy, answered by the jobs (see `_next_filled_batch`)
        if trainer.args.dynamic_sampling:
            from .dynamic_sampling import DynamicSampling

            self.filler = DynamicSampling(trainer)
        self.worker = self.backend = self.stream = None
        # rollout index (with dynamic sampling: position of the generation round in the prompt stream) -> its
        # generation, sent and not yet consumed
        self.jobs: dict[int, _Job] = {}
        self.restored: dict[int, dict] = {}  # from a checkpoint: rollout index -> {"sampled_at", "result"}
        self.next_rollout = 0  # first rollout index not yet sent
        self._loads: list[Future] = []  # weight snapshots queued for the generator
        self._pushed_at = None  # optimizer step of the weights last pushed
        self._sampled_at = None  # of the rollout batch being trained on
        self._idle_logged = 0.0
        self._scored_at = None
        self._batch = -1  # rollout batch being produced (its sync point stamps the jobs sent)
        self._rounds_per_batch = 1  # dynamic sampling: rounds the previous batch took (the look-ahead estimate)
        self._regenerated = 0  # dynamic sampling: rounds generated again because they became too stale

    # ---------------------------------------------------------------------------------------- RolloutSource
    def next_batch(self, generation_batch: list) -> dict:
        if self.filler is not None:
            return self._next_filled_batch(generation_batch)
        trainer = self.trainer
        rollout = trainer._step // (trainer.args.steps_per_generation * trainer.num_iterations)
        started = time.perf_counter()
        self._start(rollout)
        self._batch = rollout
        waited = self._sync_point(rollout, rollout + self.staleness)
        job = self.jobs.pop(rollout)
        waited += self._wait(rollout, job)
        expected = self.stream.batch(rollout)
        if [x.get("prompt") for x in generation_batch] != [x.get("prompt") for x in expected]:
            raise RuntimeError(
                f"async_generation: the train dataloader's batch of rollout {rollout} differs from the one generated "
                "ahead of time (trl_gspo.rollout.prompt_stream reproduces TRL's RepeatSampler; a custom sampler or dataloader "
                "is not supported with async generation)."
            )
        batch = self._score(generation_batch, job)
        self._log_batch(started, waited, job.future.busy_s if job.future is not None else 0.0)
        return batch

    def _next_filled_batch(self, generation_batch: list) -> dict:
        """Dynamic sampling with asynchronous generation: the generator works on generation rounds (positions of the
        prompt stream) instead of whole rollout batches, and the filling runs on the main thread, consuming them.

        At the sync point of rollout batch k the rounds `cursor .. cursor + R * (max_staleness + 1) - 1` are sent
        (those not sent yet): `cursor` is the first round batch k may use and R the number of rounds the previous batch
        took, so the generator keeps working for the next batches while this one trains (with `max_staleness=0` only
        round `cursor`: generation then matches the synchronous trainer's). Filling consumes rounds in stream order: a
        round already sent is waited for; one not sent yet, or sent at a sync point more than `max_staleness` batches
        ago (the estimate R was short), is sent now, sampled by the weights just pushed, and waited for. So the bound
        holds exactly, no prompt is skipped, and which rounds are generated by which weights depends on the step count
        only (reproducible). Rounds sent and not consumed stay queued for the next batch (and in checkpoints)."""
        trainer, filler = self.trainer, self.filler
        if filler.cursor is None:
            filler.cursor = filler._starting_cursor()
        per_rollout = trainer.args.steps_per_generation * trainer.num_iterations
        rollout = trainer._step // per_rollout
        started = time.perf_counter()
        self._start(filler.cursor)
        first, self._batch = filler.cursor, rollout
        remaining = -(-trainer.state.max_steps * trainer.args.gradient_accumulation_steps // per_rollout) - rollout - 1
        batches_ahead = min(self.staleness, max(remaining, 0))  # none for batches that will not come
        window = self._rounds_per_batch * (batches_ahead + 1) if self.staleness else 1
        last = first + window - 1
        if filler.budget is not None:  # epoch-bounded: no rounds past the data (filling may still read on, on demand)
            last = min(last, max(filler.budget - 1, first))
        self._filled_wait, self._filled_generation_s = self._sync_point(first, last), 0.0
        batch = filler.next_batch(generation_batch, sample=self._sample_round)
        self._rounds_per_batch = filler.last.plan.rounds
        trainer._metrics["train"]["async/regenerated_rounds"].append(float(self._regenerated))
        self._regenerated = 0
        stamps = filler.last.generation.sampled_at_rows()
        batch["sampled_at"] = torch.tensor(stamps, dtype=torch.long, device=batch["completion_ids"].device)
        self._sampled_at = min(stamps)
        self._log_batch(started, self._filled_wait, self._filled_generation_s)
        return batch

    def _sample_round(self, position: int, inputs: list):
        """`DynamicSampling.fill`'s `sample`: round `position`'s completions, generated ahead or now, as a
        `Generation` (TRL's prompt preparation and generation call, answered by them)."""
        job = self.jobs.get(position)
        if job is not None and job.batch < self._batch - self.staleness:  # too stale for the bound: generate again
            self._wait(position, job)
            del self.jobs[position]
            self._send(position)
            self._regenerated += 1
        elif job is None:  # beyond the rounds sent ahead: send it now, at the weights just pushed
            self._send_through(position, bounded=False)
        job = self.jobs.pop(position)
        self._filled_wait += self._wait(position, job)
        self._filled_generation_s += job.future.busy_s if job.future is not None else 0.0
        completions = self.backend.completions(job.result)
        completions.sampled_at = job.sampled_at
        with self.backend.answering(job.result):
            return self.trainer._sample(inputs, completions)

    def _sync_point(self, first: int, last: int) -> float:
        """Wait as the backend needs, push the trainer's weights, send the requests through `last`; seconds waited."""
        waited = 0.0
        job = self.jobs.get(first)
        if job is not None:  # sent earlier: wait for it before the sync point (the generator is then free of it)
            waited += self._wait(first, job)
        if self.backend.needs_idle_sync:
            waited += self._wait_all()
        self._push_weights()
        self._send_through(last)
        return waited

    def _log_batch(self, started: float, waited: float, generation_s: float) -> None:
        now = time.perf_counter()
        metrics = self.trainer._metrics["train"]
        metrics["async/trainer_wait_s"].append(waited)
        metrics["async/generation_s"].append(generation_s)
        metrics["async/generator_idle_s"].append(self.worker.idle_s - self._idle_logged)
        if self._scored_at is not None:  # main-thread time since the previous batch was scored, less the waits
            metrics["async/training_s"].append(started - self._scored_at)
        self._idle_logged, self._scored_at = self.worker.idle_s, now

    def poll(self) -> None:
        """Every micro-step: raise a generator failure now, and log the staleness of the batch being trained on."""
        for rollout, job in self.jobs.items():
            if job.future is not None and job.future.done() and not job.future.cancelled() and job.future.exception():
                self._wait(rollout, job)  # raises it
        for future in self._loads:
            if future.done() and not future.cancelled() and future.exception():
                raise GeneratorThreadError("Loading weights into the generator failed.") from future.exception()
        if self._sampled_at is not None:
            staleness = self.trainer.state.global_step - self._sampled_at
            metrics = self.trainer._metrics["train"]
            metrics["async/staleness/mean"].append(float(staleness))
            peak = metrics["async/staleness/max"]  # TRL averages a metric's list at log time: keep one running max
            peak[:] = [max(peak[0], float(staleness))] if peak else [float(staleness)]

    def pause(self) -> None:
        """Before evaluation: a vLLM server must be free of our requests (TRL's evaluation pushes weights to it)."""
        if self.backend is not None and self.backend.needs_idle_sync:
            self._wait_all()

    def state_dict(self) -> dict:
        """The batches sent and not yet scored, waited for (a checkpoint saves them, so a resumed run trains on the same
        batches), and the stamp of the batch being trained on."""
        jobs = {}
        for rollout, job in sorted(self.jobs.items()):
            self._wait(rollout, job)
            jobs[rollout] = {"sampled_at": job.sampled_at, "result": job.result, "batch": job.batch}
        for rollout, saved in self.restored.items():
            jobs.setdefault(rollout, saved)
        state = {"jobs": jobs, "sampled_at": self._sampled_at}
        if self.filler is not None:
            state["filler"] = {**self.filler.state_dict(), "rounds_per_batch": self._rounds_per_batch}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.restored = dict(state.get("jobs", {}))
        self._sampled_at = state.get("sampled_at")
        if self.filler is not None:
            self.filler.load_state_dict(state.get("filler", {}))
            self._rounds_per_batch = int(state.get("filler", {}).get("rounds_per_batch", 1))

    def close(self) -> None:
        if self.worker is not None and not self.worker.close(CLOSE_TIMEOUT_S):
            logger.warning("The generator thread is still waiting for %s after %.0f s; it is a daemon thread and ends "
                           "with its request or with the process.", getattr(self.backend, "where", "a request"),
                           CLOSE_TIMEOUT_S)  # fmt: skip
        if self.backend is not None:
            self.backend.close()
        self.worker = self.backend = None
        self.jobs, self._loads, self._pushed_at, self._scored_at = {}, [], None, None

    # -------------------------------------------------------------------------------------------- internals
    def _start(self, rollout: int):
        if self.worker is not None:
            return
        trainer = self.trainer
        self.stream = self.filler.stream if self.filler is not None else PromptStream.for_trainer(trainer)
        self.worker = GenerationWorker()
        self.backend = generation_backend(trainer, self.staleness > 0, self.worker.closing, self.timeout)
        self.next_rollout, self._idle_logged = rollout, 0.0

    def _push_weights(self):
        step = self.trainer.state.global_step
        if step == self._pushed_at:  # no optimizer step since the last push: the generator already has them
            return
        busy = any(not f.done() for job in self.jobs.values() if (f := job.future) is not None) or any(
            not f.done() for f in self._loads
        )
        load = self.backend.push_weights(busy)
        self._loads = [f for f in self._loads if not f.done()]
        if load is not None:
            self._loads.append(self.worker.submit(load))
        self._pushed_at = step

    def _send_through(self, last: int, bounded: bool = True):
        """Send the requests of rollouts (rounds) `next_rollout .. last`; `bounded`: none for a rollout batch past the
        end of training (rounds of dynamic sampling are bounded by the caller)."""
        trainer = self.trainer
        per_rollout = trainer.args.steps_per_generation * trainer.num_iterations
        total = trainer.state.max_steps * trainer.args.gradient_accumulation_steps  # micro-steps in this run
        bounded = bounded and self.filler is None
        while self.next_rollout <= last and (not bounded or self.next_rollout * per_rollout < total):
            rollout = self.next_rollout
            saved = self.restored.pop(rollout, None)
            if saved is not None:
                self.jobs[rollout] = _Job(saved["sampled_at"], result=saved["result"], batch=saved.get("batch", -1))
            else:
                self._send(rollout)
            self.next_rollout += 1

    def _send(self, rollout: int):
        """TRL's prompt preparation for `rollout` (a collective on some backends), its request to the generator."""
        request = self.trainer._generation_request(self.stream.batch(rollout))
        fn = self.backend.request(request, rollout, self._pushed_at)
        future = self.worker.submit(fn) if fn is not None else None
        self.jobs[rollout] = _Job(self._pushed_at, future, batch=self._batch)

    def _wait(self, rollout: int, job: _Job) -> float:
        """Seconds waited for `job`'s result (kept in `job.result`); a generator failure or a timeout raises here."""
        if job.future is None or job.result is not None:
            return 0.0
        start = time.perf_counter()
        try:
            job.result = job.future.result(timeout=self.timeout)
        except FutureTimeout as exc:  # waited too long, or the request itself timed out in the generator thread
            raise TimeoutError(
                f"async_generation: rollout batch {rollout} was not generated within async_generation_timeout="
                f"{self.timeout:g} s by {getattr(self.backend, 'where', 'the generator thread')} (a vLLM server that "
                "stopped answering?)."
            ) from (exc if job.future.done() else None)
        except Exception as exc:
            raise GeneratorThreadError(
                f"Generating rollout batch {rollout} failed in the generator thread: {type(exc).__name__}: {exc} "
                "(its traceback is above)."
            ) from exc
        return time.perf_counter() - start

    def _wait_all(self) -> float:
        return sum(self._wait(rollout, job) for rollout, job in sorted(self.jobs.items()))

    def _score(self, generation_batch: list, job: _Job) -> dict:
        trainer = self.trainer
        completions = self.backend.completions(job.result)
        completions.sampled_at = job.sampled_at
        trainer._injected = completions
        try:
            with self.backend.answering(job.result):
                batch = trainer._generate_and_score_completions(generation_batch)
        finally:
            trainer._injected = None
        rows = batch["completion_ids"].size(0)
        batch["sampled_at"] = torch.full((rows,), job.sampled_at, dtype=torch.long, device=batch["completion_ids"].device)
        self._sampled_at = job.sampled_at
        return batch
