"""Asynchronous generation: a generator thread works on rollout batch k+1 (up to k + `max_staleness`) while the
trainer trains on batch k, and the loss corrects for the staleness with GSPO's decoupled objective.

`AsyncRollouts` is the `RolloutSource` (pipeline.py) that `async_generation=True` selects. At the start of every rollout
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
process. Backends (the generator side, async_backends.py):
- `TransformersGenerator`: a separate copy of the policy (`generation_device`, default the trainer's device) that
  runs transformers `generate` with a forward hook recording the sampler's log-probs (rollout/sampler_logprobs.py) and, under
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

The decoupled objective (`DecoupledBehaviourWeight`, the loss's hook 3): the clipped ratio stays current / proximal
(TRL's pi_old pass, recomputed when training on the batch starts; without off-policy mini-batches pi_old is the
current policy itself), and a detached behaviour weight proximal / sampler multiplies the loss: length-normalised
per sequence for `sequence` / `sequence_token`, per token for `token`, bounded by TRL's `vllm_importance_sampling_*`
fields (`_correction` switches it, `_mode`'s suffix chooses truncate or mask, `_clip_min` / `_clip_max`). The weight
before bounds is logged as `async/behaviour_weight/{mean,std,min,max,p5,p95}`, the share changed by the bounds as
`async/behaviour_weight/outside_frac`.

The `GSPOConfig` fields are `AsyncOptions` (async_options.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin TimeoutError from Python 3.11
from dataclasses import dataclass

import torch

from .. import losses
from .async_backends import GenerationWorker, GeneratorThreadError, generation_backend
from .dynamic_sampling import DynamicSampling
from .prompt_stream import PromptStream

logger = logging.getLogger(__name__)

#: Seconds `close()` waits for the generator thread (a transformers generation stops at its next token).
CLOSE_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------------- the decoupled objective
class DecoupledBehaviourWeight:
    """The loss's hook 3 under asynchronous generation: the behaviour weight `pi_prox / mu` of one training
    micro-batch, bounded as the config says (module docstring), its statistics added to `window` (the diagnostics'
    training window, reduced across processes at log time, whatever `diagnostics` says)."""

    def __init__(self, args, window):
        self.args, self.window = args, window
        self.per_sequence = args.importance_sampling_level in losses.SEQUENCE_LEVELS
        self._warned = False

    def __call__(self, inputs: dict, proximal_logps, mask) -> torch.Tensor | None:
        """The weight, or None when the correction is off or the sampler returned no log-probs (logged once)."""
        args = self.args
        if not args.vllm_importance_sampling_correction:
            return None
        behaviour = inputs.get("sampling_per_token_logps")
        if behaviour is None:
            if not self._warned:
                logger.warning(
                    "async_generation: this generation path returned no sampler log-probs (a rollout_func "
                    "without 'logprobs'?), so stale samples are trained without the behaviour weight."
                )
                self._warned = True
            return None
        log_w = losses.behaviour_log_weights(
            proximal_logps, behaviour, mask, self.per_sequence, args.vllm_importance_sampling_length_normalized
        )
        bound = "truncate" if args.vllm_importance_sampling_mode.endswith("truncate") else "mask"
        low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        weights, outside = losses.bounded_behaviour_weights(log_w, bound, low, high, args.max_log_ratio)
        valid = (mask.sum(-1, keepdim=True) > 0) if self.per_sequence else mask.bool()
        self.window.add_values("async/behaviour_weight", losses.importance_ratio(log_w, args.max_log_ratio), valid)
        outside_frac = torch.stack([(outside & valid).sum(), valid.sum()]).float()
        self.window.add_means({"async/behaviour_weight/outside_frac": outside_frac})
        return weights


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

    def __init__(self, trainer, pipeline):
        self.trainer, self.pipeline = trainer, pipeline  # TRL's trainer; rollout/pipeline.py's steps over its code
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
            self.filler = DynamicSampling(trainer, pipeline)
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
            return self.pipeline.sample(inputs, completions)

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
            logger.warning(
                "The generator thread is still waiting for %s after %.0f s; it is a daemon thread and ends "
                "with its request or with the process.",
                getattr(self.backend, "where", "a request"),
                CLOSE_TIMEOUT_S,
            )
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
        request = self.pipeline.request(self.stream.batch(rollout))
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
        completions = self.backend.completions(job.result)
        completions.sampled_at = job.sampled_at
        with self.backend.answering(job.result):
            batch = self.pipeline.score_completions(generation_batch, completions)
        rows = batch["completion_ids"].size(0)
        batch["sampled_at"] = torch.full(
            (rows,), job.sampled_at, dtype=torch.long, device=batch["completion_ids"].device
        )
        self._sampled_at = job.sampled_at
        return batch
