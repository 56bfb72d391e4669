"""The seam between trl-gspo and TRL: every TRL / transformers `Trainer` method `GSPOTrainer` overrides, and every
runtime patch of a TRL or vLLM object, registered here with the part it serves and why no public seam does the job.

Overrides are defined in `trainer.py` only, each marked with `@override(part)`, its docstring saying why. Runtime patches are the
functions of this module marked with `@runtime_patch(target, part, why)`: each replaces one attribute of a TRL or
vLLM object and gives it back (a context manager), or wraps an engine or client method for the life of the trainer.
What a patch does besides calling the original comes in as a callable from the part it serves, so this module holds
the replacing and nothing else. `docs/design.md` renders both registries as one table; `tests/test_seam.py` builds
the table from the code (the trainer's methods against TRL's, and `PATCHES`) and fails when the two differ, and fails
on an override outside `trainer.py` or an attribute of a TRL or vLLM object assigned outside this module.

The releases each entry was checked on are `trl_compat.CHECKED_TRL_RELEASES`: `.ci/run` runs `trl-gspo check` and the
parity tests on every one of them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class SeamEntry:
    """One override or patch: the TRL (or vLLM) name it touches, the part it serves, why no public seam does it."""

    name: str
    part: str
    why: str
    checked: str = ""  # patches: the releases whose tests run it (overrides: trl_compat.CHECKED_TRL_RELEASES, all)


#: Runtime patches, by function name: what each replaces.
PATCHES: dict[str, SeamEntry] = {}


def override(part: str):
    """Mark a `GSPOTrainer` method overriding TRL's or transformers': the part it serves. Its docstring's first
    paragraph says why no public seam does the job (`overrides` reads it)."""

    def mark(method):
        method.__seam_part__ = part
        return method

    return mark


def overrides(cls, base) -> dict[str, SeamEntry]:
    """Every method `cls` defines that `base` (or a class above it) also defines, dunder methods aside: what `cls`
    overrides, with the part each serves (`@override`, None when unmarked) and why (its docstring's first paragraph)."""
    above = {name for klass in base.__mro__ for name in vars(klass)}
    found = {}
    for name, value in vars(cls).items():
        if name.startswith("__") or name not in above or not callable(value):
            continue
        why = " ".join((inspect.getdoc(value) or "").split("\n\n")[0].split())
        found[name] = SeamEntry(name, getattr(value, "__seam_part__", None), why)
    return found


def runtime_patch(target: str, part: str, why: str, checked: str):
    """Register a function of this module that replaces `target` (a TRL or vLLM attribute); `checked`: the TRL (and
    vLLM) releases whose tests run it."""

    def register(fn):
        PATCHES[fn.__name__] = SeamEntry(target, part, why, checked)
        return fn

    return register


class TRLCalls:
    """TRL's own implementation of any method `cls` overrides, for the parts that run TRL's code: `calls._generate(...)`
    is `super(cls, trainer)._generate(...)`, looked up at each call (so a method patched on TRL's class, as tests and
    benchmarks do, is the one that runs)."""

    def __init__(self, cls, trainer):
        self._cls, self._trainer = cls, trainer

    def __getattr__(self, name):
        return getattr(super(self._cls, self._trainer), name)


# ------------------------------------------------------------------------------------------------ TRL
@runtime_patch(
    "trl.generation.vllm_generation.LLM",
    "moe/routing_replay.py (R3 with vLLM colocate)",
    "TRL builds its colocated `vllm.LLM(...)` with a fixed argument list; R3 needs `enable_return_routed_experts=True`",
    "TRL 1.16.0 with vLLM 0.31.0 (CPU build: the engine is built with the flag and refuses it without Triton)",
)
@contextlib.contextmanager
def colocated_engine_with_routes(enabled: bool):
    """While TRL builds its colocated vLLM engine (the trainer's construction), build it returning routed experts.
    TRL looks the name `LLM` up in its module at that moment, so it is swapped for the construction only."""
    module = None
    if enabled:
        try:
            from trl.generation import vllm_generation as module
        except ImportError:
            module = None
    llm = getattr(module, "LLM", None)
    if llm is None:
        yield
        return

    def llm_with_routes(*args, **kwargs):
        return llm(*args, **{**kwargs, "enable_return_routed_experts": True})

    module.LLM = llm_with_routes
    try:
        yield
    finally:
        module.LLM = llm


@runtime_patch(
    "trl.trainer.utils._use_triton",
    "forward/fused_head.py (every forward of the pipeline on the CPU)",
    "TRL's fused log-prob head scores only the labelled positions where Triton runs and every position elsewhere "
    "(fixed tile shapes for graph compilers); the name is read once per forward to choose, so the CPU answer is "
    "swapped there",
    "TRL 1.16.0 (TRL 1.10 to 1.14 have no fused head: their own padded loop runs)",
)
@contextlib.contextmanager
def fused_head_labelled_only(module, device_type: str):
    """In the block, TRL's fused head scores only the positions whose label is not -100 on `device_type` too (besides
    the devices where TRL already does). The name only chooses that in `module` (trl.trainer.utils); the Triton
    kernels are chosen by TRL's kernel module, which keeps its own answer, so the CPU still runs TRL's torch tiles."""
    original = getattr(module, "_use_triton", None)
    if original is None:
        yield
        return
    module._use_triton = lambda device: device.type == device_type or original(device)
    try:
        yield
    finally:
        module._use_triton = original


@runtime_patch(
    "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE",
    "forward/fused_head.py (logprob_vocab_chunk_size)",
    "the tile width of TRL's fused log-prob head is a module constant, read when the forward runs",
    "TRL 1.16.0 (TRL 1.10 to 1.14 have no fused head: the setting is refused)",
)
@contextlib.contextmanager
def fused_head_tile(module, chunk_size: int):
    """TRL's fused log-prob head with `chunk_size` vocabulary columns per tile, for the forwards inside the block
    (`module` is TRL's module holding the constant: trl_compat.fused_logprob_head_module)."""
    previous = module._CHUNKED_LOGPROB_CHUNK_SIZE
    module._CHUNKED_LOGPROB_CHUNK_SIZE = chunk_size
    try:
        yield
    finally:
        module._CHUNKED_LOGPROB_CHUNK_SIZE = previous


@runtime_patch(
    "GRPOTrainer.rollout_func",
    "rollout/pipeline.py (asynchronous generation with a rollout_func)",
    "the rollout_func ran in the generator thread; TRL's `_generate` has no argument for an output computed earlier",
    "TRL 1.16.0",
)
@contextlib.contextmanager
def rollout_func_answering(trainer, output: dict):
    """Inside the block, the trainer's `rollout_func` returns `output` (computed elsewhere) instead of running, so TRL's
    `_generate` processes it as its own."""
    rollout_func = trainer.rollout_func
    trainer.rollout_func = lambda *args, **kwargs: output
    try:
        yield
    finally:
        trainer.rollout_func = rollout_func


@runtime_patch(
    "GRPOTrainer._last_loaded_step",
    "rollout/async_backends.py, rollout/async_server.py (asynchronous generation with vLLM)",
    "TRL pushes weights to vLLM when this step is behind; the async source pushes them itself at its sync points",
    "TRL 1.16.0 with vLLM 0.31.0 (CPU build) and a stand-in server",
)
def mark_weights_pushed(trainer) -> None:
    """Tell TRL that its vLLM engine holds the current weights (pushed by the caller), so its own generation call does
    not push them again."""
    trainer._last_loaded_step = trainer.state.global_step


# ------------------------------------------------------------------------------------------------ vLLM
@runtime_patch(
    "VLLMGeneration.sync_weights",
    "rollout/colocate_cpu_sync.py (vLLM colocate on its CPU build)",
    "TRL's weight sync must run inside vLLM's layer-wise reload on the CPU build; TRL has no hook around its sync",
    "TRL 1.16.0 with vLLM 0.31.0 and 0.32.0 (CPU build)",
)
def sync_weights_inside(generation, context) -> None:
    """Every call of TRL's `generation.sync_weights` runs inside `context()` (a context manager factory)."""
    trl_sync = generation.sync_weights

    @functools.wraps(trl_sync)
    def sync_weights(*args, **kwargs):
        with context():
            return trl_sync(*args, **kwargs)

    generation.sync_weights = sync_weights


@runtime_patch(
    "VLLMGeneration.generate",
    "moe/routing_replay.py (R3 with vLLM)",
    "TRL's vLLM generation returns no routed experts; the routes of each call are collected around it",
    "TRL 1.10.0 and 1.16.0 with stand-in engines (R3 with vLLM needs a CUDA build of vLLM)",
)
def around_vllm_generate(generation, before, after) -> None:
    """`before()` ahead of every TRL `generation.generate(prompts, ...)` call, `after(prompts)` once it returned."""
    generate = generation.generate

    @functools.wraps(generate)
    def generate_and_after(prompts, *args, **kwargs):
        before()
        out = generate(prompts, *args, **kwargs)
        after(prompts)
        return out

    generation.generate = generate_and_after


@runtime_patch(
    "VLLMGeneration.llm.generate",
    "moe/routing_replay.py (R3 with vLLM colocate)",
    "the engine's request outputs carry the routed experts, and TRL keeps only token ids and log-probs of them",
    "TRL 1.10.0 and 1.16.0 with a stand-in engine",
)
def on_engine_outputs(llm, keep) -> None:
    """`keep(outputs)` with every `llm.generate(...)` result (the colocated engine TRL calls), unchanged."""
    generate = llm.generate

    @functools.wraps(generate)
    def generate_and_keep(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        keep(outputs)
        return outputs

    llm.generate = generate_and_keep


@runtime_patch(
    "VLLMClient.generate, VLLMClient._post",
    "moe/routing_replay.py (R3 with a vLLM server)",
    "the server's JSON responses carry the routed experts, and TRL's client keeps only token ids and log-probs",
    "TRL 1.16.0 with a stand-in server (TRL 1.10's client talks to `trl vllm-serve`, which returns no routes)",
)
def on_server_responses(client, start, keep) -> None:
    """`start(prompts)` ahead of every `client.generate(prompts=...)`, and `keep(url, payload, response)` with every
    JSON response the client receives through `_post` (the main process's TRL client), unchanged."""
    generate, post = client.generate, client._post

    @functools.wraps(generate)
    def generate_and_start(*args, **kwargs):
        start(kwargs.get("prompts", args[0] if args else None))
        return generate(*args, **kwargs)

    @functools.wraps(post)
    def post_and_keep(url, *args, **kwargs):
        response = post(url, *args, **kwargs)
        keep(url, kwargs.get("json"), response)
        return response

    client.generate, client._post = generate_and_start, post_and_keep


@runtime_patch(
    "VLLMClient.session.post",
    "rollout/async_server.py (asynchronous generation against a vLLM server)",
    "the request TRL's client would send is captured to send it from the generator thread, and TRL's own call is "
    "answered with that response; the client takes no request or response from outside",
    "TRL 1.16.0 with vLLM 0.31.0 (CPU build) and a stand-in server",
)
def replace_session_post(client, post) -> callable:
    """Route the client's HTTP posts through `post(url, **kwargs)`; returns the original `session.post`. Undone by
    `restore_session_post`."""
    original = client.session.post
    client.session.post = post
    return original


def restore_session_post(client) -> None:
    """Undo `replace_session_post` (the original is the class's method again)."""
    client.session.__dict__.pop("post", None)
