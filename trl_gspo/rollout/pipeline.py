"""How a rollout batch is produced, in one place: the trainer's rollout buffer, its `RolloutSource` and the
`RolloutPipeline` part that steers TRL's rollout code.

TRL's `GRPOTrainer` makes rollout batches in `_prepare_inputs`: every `steps_per_generation * num_iterations`
micro-steps it calls `_generate_and_score_completions` on the local generation batch the dataloader handed it,
shuffles the result and splits it into `steps_per_generation` micro-batches that it buffers. Several features act on
that path (sampler log-probs, MoE routes, length-sorted micro-batches, and producing batches ahead of time or
refilling them). The trainer overrides the path's TRL methods in `trainer.py`, each delegating here, and every
feature's step is called by name:

    GSPOTrainer._prepare_inputs(generation_batch)   training: every micro-step; evaluation: every batch
      evaluation -> source.pause(), _generate_and_score_completions(generation_batch)       (synchronous)
      a new rollout batch is due (TRL's schedule, or a resume left no buffer):
        batch = source.next_batch(generation_batch)              RolloutSource: how a scored batch is obtained
        micro_batches = split_rollout(batch, steps_per_generation)   TRL's shuffle and split
        micro_batches = padding.arrange(micro_batches, step)     forward/padding.py: length sort per optimizer step
      source.poll()
      return micro_batches[step % steps_per_generation]

    RolloutPipeline.generate_and_score(inputs)      one scored rollout batch from these prompts, now
      sampler.begin_rollout, routes.begin_rollout     rollout/sampler_logprobs.py, moe/routing_replay.py
      TRL: generation (below), rewards, advantages, pi_old and reference passes
      routes.attach, sampler.finish_rollout           routes into the batch, length-normalised vLLM correction
      stamp: the optimizer step whose weights sampled this batch (`sampled_at`)

    RolloutPipeline.generate(prompts)               TRL's `_generate`, then sampler.keep, routes.keep_rollout_func_routes
    RolloutPipeline.generate_single_turn(...)       TRL's `_generate_single_turn` inside prefill.sharing,
                                                    sampler.recording and routes.recording_sampler_routes, then
                                                    routes.keep_sampler_routes

A `RolloutSource` decides how `next_batch` obtains a scored batch. `SynchronousRollouts` (the default) is TRL's
behaviour: generate and score the dataloader's batch now. `DynamicSampling` (rollout/dynamic_sampling.py,
`dynamic_sampling=True`) samples rounds of prompts until the batch is filled with groups that carry signal, then
scores the kept ones. `AsyncRollouts` (rollout/async_rollouts.py, `async_generation=True`) generates later rollout
batches on a generator thread while the trainer trains. `rollout_source` (sources.py, the registry above the sources;
this module never imports them) picks the source from the config. The trainer also calls its `poll` on every
training micro-step (background failures, per-step metrics), its `pause` before evaluation generates and its `close`
when `train()` returns; its `state_dict` is saved with each checkpoint next to TRL's rollout buffer
(guards/checkpointing.py) and handed back on resume.

Sampling apart from scoring. A source that generates at another time than it scores (ahead of time, or in rounds
before deciding what to keep) splits the batch in two steps with the same result as the one-call path:

    generation = pipeline.sample(inputs)                TRL's prompt preparation and `_generate` only, with what
                                                        the features record while sampling (a `Generation`)
    batch = pipeline.score(inputs, generation[, rewards])   TRL's scoring of exactly that generation: `_generate`
                                                        returns it instead of sampling, `_calculate_rewards` returns
                                                        `rewards` (the gathered reward matrix) when given

A `Generation` is per completion, so rows can be selected and merged (`Generation.take`, `gather_rows`: every
per-row output, the prompts and the R3 routes move with their row), e.g. to score the kept groups of several rounds
as one batch.

`sample` runs TRL's `_generate_and_score_completions` up to its `_generate` call and stops there, so prompts are
prepared by TRL's own code; `score` runs it again with the generation handed in. Both run on the calling thread
(TRL's vLLM paths make collectives inside `_generate`). TRL's prompt preparation runs in both steps, so a batch whose
preparation has side effects (an `environment_factory`'s `reset`) cannot be split this way.

Generating elsewhere (rollout/async_rollouts.py: a generator thread works on later rollout batches while the trainer
trains). Only the blocking generation call can leave the main thread, so the path is cut one level deeper:

    request = pipeline.request(inputs)               TRL's prompt preparation, stopped at its generation call: the
                                                     tokenized prompts (`_generate_single_turn`'s arguments) or, with
                                                     a `rollout_func`, the prompts it would be called with
    ... the request is generated elsewhere ...
    pipeline.score_completions(inputs, completions)  TRL's one-call path, its generation call answered by these
                                                     completions (or, `completion_ids=None`, generating through TRL,
                                                     whose vLLM client the source answers)
    generation = pipeline.sample(inputs, completions)   or the same answer, stopped after generation: a `Generation`
                                                     for dynamic sampling to filter (async and dynamic sampling)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from ..common import seam


@dataclass
class Generation:
    """What sampling one batch of prompts produced: everything scoring needs besides the prompts themselves."""

    outputs: (
        tuple  # TRL's `_generate` 8-tuple (prompt ids, completion ids, tool mask, completions, sampler log-probs, ...)
    )
    sampler_routes: tuple | None  # R3: the sampler's routes of these completions (moe/routing_replay.py), else None
    sampled_at: int  # optimizer step whose weights sampled them
    prompts: list | None = None  # the prompts TRL handed `_generate` (prepared: what reward functions receive)
    # per completion, when rows sampled by different weights were merged (async dynamic sampling); then `sampled_at`
    # is the oldest of them. None: every row was sampled at `sampled_at`.
    row_sampled_at: list[int] | None = None

    def __len__(self) -> int:
        return len(self.outputs[1])

    def sampled_at_rows(self) -> list[int]:
        """The optimizer step whose weights sampled each completion."""
        return list(self.row_sampled_at) if self.row_sampled_at is not None else [self.sampled_at] * len(self)

    def take(self, rows: list[int]) -> Generation:
        """The generation of these rows only, in this order."""
        return gather_rows([(self, i) for i in rows])


def gather_rows(rows: list[tuple[Generation, int]]) -> Generation:
    """One `Generation` made of row `i` of each `(generation, i)`: the per-completion parts of TRL's `_generate` tuple,
    the prompts and the R3 routes follow their rows; values that are not per row (a `rollout_func`'s extra field
    holding one value for the batch) come from the first generation. Dynamic sampling merges the kept groups of
    several sampling rounds (and of other processes) with it."""
    first = rows[0][0]

    def column(values_of):  # per-row values, or None where the generations hold none
        present = [values_of(g) is not None for g, _ in rows]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(
                "gather_rows: some generations carry a per-row output that others lack (tool mask, "
                "sampler log-probs or prompts); they cannot be merged."
            )
        return [values_of(g)[i] for g, i in rows]

    per_row = (column(lambda g, k=k: g.outputs[k]) for k in range(5))
    prompt_ids, completion_ids, tool_mask, completions, logprobs = per_row
    extra = {}
    for key, values in first.outputs[5].items():
        per_row = isinstance(values, list) and len(values) == len(first)
        extra[key] = [g.outputs[5][key][i] for g, i in rows] if per_row else values
    images = None  # TRL: None, or one entry (a list of images or None) per row
    if any(g.outputs[6] is not None for g, _ in rows):
        images = [None if g.outputs[6] is None else g.outputs[6][i] for g, i in rows]
    tool_images = [g.outputs[7][i] for g, i in rows] if first.outputs[7] else first.outputs[7]  # [] without tools
    routes = None
    if first.sampler_routes is not None:  # (per-row route tensors, prompt lengths, completion lengths)
        routes = tuple([g.sampler_routes[part][i] for g, i in rows] for part in range(3))
    outputs = (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images)
    stamps = [g.sampled_at if g.row_sampled_at is None else g.row_sampled_at[i] for g, i in rows]
    uniform = len(set(stamps)) == 1
    return Generation(outputs, routes, min(stamps), column(lambda g: g.prompts), None if uniform else stamps)


@dataclass
class GenerationRequest:
    """What TRL's generation call would be asked for one batch of prompts, captured without generating."""

    prompts: list | None = None  # the prompts TRL's `_generate` received (rollout_func path)
    prompt_ids: list | None = None  # TRL's tokenized prompts (`_generate_single_turn`'s first argument)
    single_turn_args: tuple = ()  # the rest of `_generate_single_turn`'s arguments (they vary across TRL releases)
    single_turn_kwargs: dict | None = None


@dataclass
class Completions:
    """Completions generated elsewhere for a `GenerationRequest` (rollout/async_rollouts.py), for TRL's generation call to
    return: single-turn ids with the sampler's log-probs and R3 routes, or a `rollout_func`'s output dict. With neither
    (`completion_ids` and `rollout_output` None) TRL's call runs and its engine client answers (vLLM server)."""

    sampled_at: int  # optimizer step whose weights sampled them
    prompt_ids: list | None = None  # the request's prompts, checked against the ones TRL prepares now
    completion_ids: list | None = None
    logprobs: list | None = None  # the sampler's log_softmax(logits / T) of each sampled token
    routes: list | None = None  # R3: one [prompt + completion, L, k] tensor per completion (moe/route_sources.py)
    rollout_output: dict | None = None  # what the rollout_func returned


class _Requested(Exception):
    """Raised at TRL's generation call to stop `_generate_and_score_completions` there (`RolloutPipeline.request`)."""

    def __init__(self, request: GenerationRequest):
        super().__init__("requested")
        self.request = request


class _Sampled(Exception):
    """Raised from `_generate` to stop TRL's `_generate_and_score_completions` right after generation
    (`RolloutPipeline.sample`)."""

    def __init__(self, generation: Generation):
        super().__init__("sampled")
        self.generation = generation


class SynchronousRollouts:
    """TRL's rollout schedule: the rollout batch is generated and scored from the dataloader's batch when it is due."""

    def __init__(self, trainer):
        self.trainer = trainer

    def next_batch(self, generation_batch: list[dict]) -> dict:
        """The scored rollout batch to train on next (TRL's `_generate_and_score_completions` output)."""
        return self.trainer._generate_and_score_completions(generation_batch)

    def state_dict(self) -> dict:
        """What a checkpoint must keep for a resumed run to produce the same batches (tensors and plain values)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def poll(self) -> None:
        """Called on every training micro-step: raise what went wrong in background work, record per-step metrics."""

    def pause(self) -> None:
        """Called before evaluation uses the generation engine on the main thread: let background generation finish."""

    def close(self) -> None:
        """Called when `train()` returns or raises: release threads, clients, buffers."""


def split_rollout(batch: dict, steps_per_generation: int) -> list[dict]:
    """TRL's shuffle and split of a scored rollout batch into `steps_per_generation` micro-batches (its own helpers,
    making the same random draws, so the micro-batches are TRL's)."""
    batch = shuffle_sequence_dict(split_pixel_values_by_grid(batch))
    return [unsplit_pixel_values_by_grid(part) for part in split_tensor_dict(batch, steps_per_generation)]


class VLLMServerError(RuntimeError):
    """The vLLM server a run generates with stopped answering."""


@contextlib.contextmanager
def vllm_server_errors(trainer):
    """Around TRL's generation call: in vLLM server mode, a request the server no longer answers (its weight push, its
    prefix-cache reset, its generation) fails with one error naming the server, instead of the HTTP library's."""
    try:
        yield
    except OSError as error:  # requests' ConnectionError and Timeout are OSErrors
        if not (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "server"):
            raise
        url = (
            trainer.args.vllm_server_base_url
            or f"http://{trainer.args.vllm_server_host}:{trainer.args.vllm_server_port}"
        )
        raise VLLMServerError(
            f"The vLLM server at {url} stopped answering during rollout generation at optimizer step "
            f"{trainer.state.global_step} ({type(error).__name__}). Checkpoints saved so far are complete; restart the "
            "server and resume with resume_from_checkpoint=True."
        ) from error


class RolloutPipeline:
    """TRL's rollout code, steered (module docstring): the trainer's overrides of `_generate_and_score_completions`,
    `_generate`, `_generate_single_turn` and `_calculate_rewards` call the steps here, which call each feature's step
    around TRL's own implementation, and the rollout sources (`sample`, `request`, `score`) run TRL's code stopped
    early or answered with what they generated elsewhere.

    Collaborators: `trainer`, the `GRPOTrainer` whose rollout code runs (its TRL state, and its dispatching
    `_generate_and_score_completions`); `trl`, TRL's own implementations of the overridden methods, which the
    overrides bypass (common/seam.py `TRLCalls`);
    `sampler` (rollout/sampler_logprobs.py), `routes` (moe/routing_replay.py) and `prefill`
    (rollout/shared_prefill.py), whose steps run around TRL's.

    State the steps share, the pipeline's own: `stop_after` ("generate" while `sample` runs, "request" while `request`
    runs, else None: TRL runs to the end), `injected` (the `Generation` that `score` is scoring, or the `Completions`
    answering TRL's generation call, else None: generate now), `given_rewards` (the reward matrix `score` was given)
    `sampled_at` (the optimizer step whose weights sampled the rollout batch being trained on) and `pi_old_at` (the
    optimizer step whose weights computed its pi_old: the step it was scored at; None where pi_old came from the
    sampler, or is not known after a resume mid-batch, where it is older than the current step)."""

    def __init__(self, trainer, run, trl, *, sampler, routes, prefill):
        self.trainer, self.run, self.trl = trainer, run, trl  # run: trainer.RunView
        self.sampler, self.routes, self.prefill = sampler, routes, prefill
        self.stop_after = None
        self.injected = None
        self.given_rewards = None
        self.sampled_at = None
        self.pi_old_at = None

    # -------------------------------------------------------------------------------- one scored batch, now
    def generate_and_score(self, inputs) -> dict:
        """`_generate_and_score_completions`: TRL's, with the features' steps around it and the sampling stamp."""
        self.sampler.begin_rollout()
        self.routes.begin_rollout()
        try:
            output = self.trl._generate_and_score_completions(inputs)
        finally:
            self.sampler.end_rollout()
            self.routes.end_rollout()
        self.routes.attach(output)
        self.sampler.finish_rollout(output)
        if self.run.training:
            injected = self.injected
            sampled = isinstance(injected, (Generation, Completions))
            self.sampled_at = injected.sampled_at if sampled else self.run.global_step
            # TRL's pi_old pass ran now, at these weights, unless the sampler's log-probs answered it
            self.pi_old_at = None if self.sampler.supplied else self.run.global_step
        return output

    # ----------------------------------------------------------------------- sampling apart from scoring
    def sample(self, inputs, completions: Completions | None = None) -> Generation:
        """Generate for `inputs` (TRL's prompt preparation and `_generate`), without scoring (module docstring);
        `completions`: generated elsewhere for these prompts, returned by TRL's generation call instead."""
        self.stop_after, self.injected = "generate", completions
        self.routes.keep_earlier_routes(None)
        try:
            self.trl._generate_and_score_completions(inputs)
        except _Sampled as done:
            return done.generation
        finally:
            self.stop_after, self.injected = None, None
        raise RuntimeError("TRL's _generate_and_score_completions returned without calling _generate.")

    def request(self, inputs) -> GenerationRequest:
        """TRL's prompt preparation for `inputs`, stopped at its generation call: what would be generated (module
        docstring). Nothing is generated, scored or logged."""
        self.stop_after = "request"
        try:
            self.trl._generate_and_score_completions(inputs)
        except _Requested as requested:
            return requested.request
        finally:
            self.stop_after = None
        raise RuntimeError("TRL's _generate_and_score_completions returned without calling _generate.")

    def score(self, inputs, generation: Generation, rewards_per_func: torch.Tensor | None = None) -> dict:
        """Score `generation` (sampled for `inputs` by `sample`) as `_generate_and_score_completions` would have;
        `rewards_per_func`: TRL's reward matrix for these completions, gathered over processes, to use instead of
        calling the reward functions again."""
        self.injected, self.given_rewards = generation, rewards_per_func
        try:
            return self.trainer._generate_and_score_completions(inputs)
        finally:
            self.injected, self.given_rewards = None, None

    def score_completions(self, inputs, completions: Completions) -> dict:
        """TRL's one-call path for `inputs`, its generation call answered by `completions` (generated elsewhere)."""
        self.injected = completions
        try:
            return self.trainer._generate_and_score_completions(inputs)
        finally:
            self.injected = None

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, prompts):
        """`_generate`: TRL's, answered by an injected generation, stopped for a request or after sampling; the
        sampler's log-probs and a rollout_func's routes kept."""
        injected = self.injected
        if isinstance(injected, Generation):  # `score`: the completions were sampled earlier
            self.sampler.keep(injected.outputs)
            self.routes.keep_earlier_routes(injected.sampler_routes)
            return injected.outputs
        if self.trainer.rollout_func is not None and self.stop_after == "request":
            raise _Requested(GenerationRequest(prompts=prompts))
        if isinstance(injected, Completions) and injected.rollout_output is not None:  # the rollout_func ran elsewhere
            with seam.rollout_func_answering(self.trainer, injected.rollout_output):
                outputs = self.trl._generate(prompts)
        else:
            with vllm_server_errors(self.trainer):
                outputs = self.trl._generate(prompts)
        self.sampler.keep(outputs)
        self.routes.keep_rollout_func_routes(outputs)
        if self.stop_after == "generate":
            sampled_at = injected.sampled_at if isinstance(injected, Completions) else self.run.global_step
            raise _Sampled(Generation(outputs, self.routes.sampler_routes, sampled_at, prompts))
        return outputs

    def generate_single_turn(self, prompt_ids, args: tuple, kwargs: dict):
        """`_generate_single_turn` (its arguments vary across TRL releases: trl_compat): TRL's, with the sampler's
        log-probs and R3's routes recorded, or answered by completions generated elsewhere."""
        injected = self.injected
        if self.stop_after == "request":
            raise _Requested(GenerationRequest(None, [list(ids) for ids in prompt_ids], args, kwargs))
        if isinstance(injected, Completions) and injected.completion_ids is not None:  # generated elsewhere
            if injected.prompt_ids != [list(ids) for ids in prompt_ids]:
                raise RuntimeError("Completions generated ahead of time were for other prompts than this batch's.")
            self.routes.keep_generated_routes(prompt_ids, injected.completion_ids, injected.routes)
            return injected.completion_ids, injected.logprobs
        # shared prefill first: its hook hands the recorder the whole batch's logits
        with (
            self.prefill.sharing(self.run.model),
            self.sampler.recording(self.run.model) as recorder,
            self.routes.recording_sampler_routes() as route_log,
        ):
            completion_ids, logprobs = self.trl._generate_single_turn(prompt_ids, *args, **kwargs)
        if recorder is not None:  # raw log_softmax(logits / T) of each sampled token (rollout/sampler_logprobs.py)
            logprobs = recorder.completion_logprobs(completion_ids)
        self.routes.keep_sampler_routes(prompt_ids, completion_ids, route_log)
        return completion_ids, logprobs
