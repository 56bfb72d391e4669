"""Every scenario of `benchmarks/run.py`, in the order a bare `run.py` runs them: its name, what it measures (one line,
as in benchmarks/README.md), what it needs, and how it runs from the invocation's `Context`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from scenarios import driver, real_model
from scenarios.asynchronous import async_scenario
from scenarios.demo import demo_scenario
from scenarios.loss import memory_scenario
from scenarios.real_model import REAL_SHAPES
from scenarios.training import LAYOUT_SHAPES, LAYOUT_VARIANTS, compare, layout_scenario
from scenarios.workload import ASYNC_SHAPES, rollout_steps


@dataclass
class Context:
    """What every scenario of one invocation shares."""

    device: str
    tiny: bool
    shape: dict  # SHAPES entry of the device (or `tiny`)
    reps: int | None  # --reps; None: each scenario's default
    work_dir: str
    log: Callable[[str], None]
    gradient_checkpointing: bool = True
    variants: list[str] | None = None  # --variants: a subset of the layout scenarios' variants

    def reps_for(self, shape: dict) -> int:
        return self.reps or shape["reps"]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    run: Callable[[Context], dict]
    #: Why it cannot run here (None: it can): a missing package, a TRL without the fused head, ...
    unavailable: Callable[[Context], str | None] = lambda ctx: None


def _loss_path(ctx: Context) -> dict:
    spec = dict(task="loss_path", shape=ctx.shape, device=ctx.device, iters=5 if ctx.tiny else 200)
    result = driver.run_worker(spec)
    ctx.log(
        f"  ratio ours/stock (CPU time): {result['ratio_cpu_seconds']:.4f}, diagnostics off "
        f"{result['ratio_cpu_seconds_no_diagnostics']:.4f}, untrimmed {result['ratio_untrimmed_cpu_seconds']:.4f}"
    )
    return result


def _base_shape(ctx: Context, real: bool) -> dict:
    """The invocation's shape, or the real model's (real_model.REAL_SHAPES; CPU only)."""
    return REAL_SHAPES["tiny" if ctx.tiny else "cpu"] if real else ctx.shape


def _with_model(result: dict, shape: dict, real: bool) -> dict:
    """A real-model result names the copy measured and its shape (the record's `settings.shape` is the tiny models')."""
    return {"model": real_model.model_source(), "model_shape": shape, **result} if real else result


#: Extra arms of a training scenario: ours with settings other than the defaults. `real_equal_settings` adds
#: `shared_prefill` (off by default), whose generation floor is lower than the defaults' (rollout/shared_prefill.py).
EXTRA_ARMS = {"real_equal_settings": {"shared_prefill": {"shared_prefill": True}}}
#: Ours' settings where a scenario measures other than the defaults: `real_fast_settings` turns on every option
#: that gives up stock's exact rollouts or step contents for speed (with `old_logprobs_source="sampler"`): whole
#: groups in each optimizer step (forward/shared_prefix.py) and each prompt prefilled once in generation.
OURS_SETTINGS = {"real_fast_settings": {"group_minibatches": True, "shared_prefill": True}}


def _training(name: str, source: str, diagnostics: bool = True, real: bool = False) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        shape = _base_shape(ctx, real)
        reps, gc = ctx.reps_for(shape), ctx.gradient_checkpointing
        extra, settings = EXTRA_ARMS.get(name), OURS_SETTINGS.get(name)
        result = compare(name, source, shape, ctx.device, reps, ctx.work_dir, ctx.log, gc, diagnostics, extra, settings)
        return _with_model(result, shape, real)

    return run


def _layouts(name: str, real: bool = False) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        base, result = _base_shape(ctx, real), {}
        for key in LAYOUT_SHAPES[name]:
            shape = {**base, **base["long_tail"], **base[key]}  # long_tail's entry is every one's base
            prompts = f"{shape['prompt']} prompts" if real else f"prompts of {shape['prompt_range']} tokens"
            ctx.log(
                f"  {key}: {prompts}, completions lognormal up to {shape['completion']}; {shape['batch']} rows x "
                f"{shape['accumulation']} micro-batches per optimizer step, {rollout_steps(shape)} optimizer steps "
                "per rollout"
            )
            variants = {k: v for k, v in LAYOUT_VARIANTS[name].items() if ctx.variants is None or k in ctx.variants}
            gc = ctx.gradient_checkpointing
            result[key] = layout_scenario(
                key, shape, ctx.device, ctx.reps_for(shape), ctx.work_dir, ctx.log, gc, variants
            )
        return _with_model(result, base, real)

    return run


def _no_fused_head(ctx: Context) -> str | None:
    from trl_gspo.forward import fused_head

    if fused_head.available():
        return None
    return "this TRL has no fused log-prob head, so padding removal is off (forward/padding.py)"


def _real_model(ctx: Context) -> str | None:
    if ctx.device != "cpu":
        return "the real-model scenarios are CPU benchmarks (the real model in fp32 on one thread)"
    return real_model.unavailable()


def _real_model_fused_head(ctx: Context) -> str | None:
    return _real_model(ctx) or _no_fused_head(ctx)


def _async(ctx: Context) -> dict:
    shape = dict(ASYNC_SHAPES["tiny" if ctx.tiny else ctx.device])
    return async_scenario(shape, ctx.device, ctx.reps_for(shape), ctx.work_dir, ctx.log)


def _logprob_memory(ctx: Context) -> dict:
    # Peak memory is deterministic here (same shapes, same allocations): two repetitions confirm it.
    return memory_scenario(ctx.shape, ctx.device, min(ctx.reps_for(ctx.shape), 2), ctx.log)


def _needs_vllm(ctx: Context) -> str | None:
    if ctx.device != "cpu" or ctx.tiny:
        return "measured on vLLM's CPU build only (not in --tiny or --device cuda runs)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here: run it with .venv-vllm/bin/python (make .venv-vllm/.installed)"
    return None


def _cpu_only(ctx: Context) -> str | None:
    return "the demo's numbers are CPU numbers (make gpu-check runs it on a GPU)" if ctx.device != "cpu" else None


def _vllm_generation(ctx: Context) -> dict:
    from scenarios.vllm_generation import vllm_generation_scenario

    return vllm_generation_scenario(ctx.reps or 4, rollouts=2, log=ctx.log)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "demo",
            "`make demo` (SmolLM2-135M-Instruct, addition) end to end for seeds 0-2: held-out accuracy before and "
            "after, training and total seconds",
            lambda ctx: demo_scenario(False, False, ctx.tiny, ctx.work_dir, ctx.log),
            _cpu_only,
        ),
        Scenario(
            "demo_copy",
            "`trl-gspo demo --config demo` (the tiny model's copy task) end to end for seeds 0-2: held-out reward "
            "before and after, training and total seconds",
            lambda ctx: demo_scenario(True, False, ctx.tiny, ctx.work_dir, ctx.log),
            _cpu_only,
        ),
        Scenario(
            "loss_path",
            "`_compute_loss` + backward alone, stock vs ours alternating in one process: the loss pipeline's overhead",
            _loss_path,
        ),
        Scenario(
            "equal_settings",
            "training steps, stock vs ours at stock's settings (pi_old recomputed): what ours costs on top",
            _training("equal_settings", "recompute"),
        ),
        Scenario(
            "equal_settings_no_diagnostics",
            "the same with GSPO's diagnostics off (diagnostics=False)",
            _training("equal_settings_no_diagnostics", "recompute", diagnostics=False),
        ),
        Scenario(
            "sampler_logprobs",
            "training steps, stock vs ours with old_logprobs_source='sampler' (no pi_old pass)",
            _training("sampler_logprobs", "sampler"),
        ),
        Scenario(
            "logprob_memory",
            "peak memory of one loss forward + backward at Qwen3's vocabulary x 2,048 tokens, stock vs ours",
            _logprob_memory,
        ),
        Scenario(
            "long_tail",
            "training phase on identical long-tailed rollouts, stock vs ours' layouts (trim, sort, pack) at two shapes",
            _layouts("long_tail"),
            _no_fused_head,
        ),
        Scenario(
            "long_prompt",
            "training phase with ~1024-token prompts, stock vs ours sharing each group's prompt",
            _layouts("long_prompt"),
            _no_fused_head,
        ),
        Scenario(
            "real_equal_settings",
            "equal_settings on SmolLM2-135M-Instruct (the demo's addition prompts and batch), with the generation floor",
            _training("real_equal_settings", "recompute", real=True),
            _real_model,
        ),
        Scenario(
            "real_sampler_logprobs",
            "sampler_logprobs on SmolLM2-135M-Instruct (the demo's addition prompts and batch), with the generation floor",
            _training("real_sampler_logprobs", "sampler", real=True),
            _real_model,
        ),
        Scenario(
            "real_fast_settings",
            "real_sampler_logprobs with group_minibatches and shared_prefill: every speed option on SmolLM2",
            _training("real_fast_settings", "sampler", real=True),
            _real_model,
        ),
        Scenario(
            "real_long_tail",
            "long_tail on SmolLM2-135M-Instruct: chat-templated addition prompts, completions up to 128 tokens",
            _layouts("real_long_tail", real=True),
            _real_model_fused_head,
        ),
        Scenario(
            "real_long_prompt",
            "long_prompt on SmolLM2-135M-Instruct: ~1,000-token few-shot addition prompts, one per group of 8",
            _layouts("real_long_prompt", real=True),
            _real_model_fused_head,
        ),
        Scenario(
            "async",
            "seconds per step, synchronous vs async_generation (staleness 1 and 2), ours only, beside the floor",
            _async,
        ),
        Scenario(
            "demo_vllm",
            "`trl-gspo demo --config demo --use_vllm true --vllm_mode colocate` end to end on vLLM's CPU build, seeds 0-2",
            lambda ctx: demo_scenario(True, True, ctx.tiny, ctx.work_dir, ctx.log),
            _needs_vllm,
        ),
        Scenario(
            "demo_real_vllm",
            "`trl-gspo demo --use_vllm true --vllm_mode colocate` (SmolLM2-135M-Instruct, addition) end to end on "
            "vLLM's CPU build, seed 0 (a run costs about 18 minutes on 2 cores), beside `demo`'s transformers runs",
            lambda ctx: demo_scenario(False, True, ctx.tiny, ctx.work_dir, ctx.log, seeds=(0,)),
            _needs_vllm,
        ),
        Scenario(
            "vllm_generation",
            "step time generating with transformers, a vLLM server and colocated vLLM (CPU build), two shapes",
            _vllm_generation,
            _needs_vllm,
        ),
    )
}
