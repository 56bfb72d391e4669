"""Asynchronous generation (rollout/async_rollouts.py) and the decoupled objective.

- The behaviour weight and the decoupled loss (value and every parameter gradient) against a naive reference with its
  own forward, for `token`, `sequence` and `sequence_token`, truncated and masked: the configured level is the one
  that runs; with proximal == behaviour the loss is the plain one.
- `max_staleness=0` ends at the synchronous trainer's weights; `max_staleness=1` twice gives the same weights.
- Every trained sample's weight version follows the schedule (within `max_staleness`), and at every sync point the
  generator's weights equal the trainer's (a probe in the generator thread); generation never runs the trainer's model.
- The overlap is real: with a slow generator, training steps run while a generation is in flight (event order).
- A generator failure reaches the main thread with its traceback at the next micro-step; no thread is left behind.
- Exact resume from a mid-rollout checkpoint with batches in flight; SIGTERM with a generation in flight (slow).
- vLLM server mode against a stand-in HTTP server speaking the endpoints TRL's client calls (generation, the weight
  update handshake, cache reset): weights only change between requests, and a server that stops answering times out.
- `rollout_func` runs in the generator thread; LoRA syncs adapters only; MoE R3 routes travel with the rollout;
  evaluation stays synchronous; configuration errors name the field.
"""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from datasets import Dataset
from helpers.fault_utils import PROMPTS, length_reward, make_trainer
from helpers.smallest_bug import (
    LastStepStart,
    dropped_token_mean_gap,
    last_step_learning_rate,
    last_step_start,
    one_token_margin,
    one_token_step_gap,
    trainer_loss,
)

from trl_gspo import GSPOConfig, GSPOTrainer, losses
from trl_gspo.guards import checkpointing
from trl_gspo.rollout.async_backends import GeneratorThreadError, TransformersGenerator
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, rounding_bound, sgd_weights_bound
from trl_gspo.testing import build_tiny_model

U = 2  # fault_utils: steps_per_generation=2, one micro-batch per optimizer step -> 2 optimizer steps per rollout


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _generator_threads():
    return [t for t in threading.enumerate() if t.name.startswith("gspo-generator")]


# ------------------------------------------------------------------------------------- the behaviour weight
def _bounded(w, bound, lo, hi):
    outside = (lo is not None and w < lo) or (hi is not None and w > hi)
    if bound == "mask":
        return 0.0 if outside else w
    return min(max(w, lo if lo is not None else -1e30), hi if hi is not None else 1e30)


@pytest.mark.parametrize("bound", ["truncate", "mask"])
def test_behaviour_weights_against_loops(bound):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 0, 3]
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).double()
    prox = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    mu = prox + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    mu[0, 2] = float("nan")  # a token the sampler could not score: left out of the mean, weight 1 at token level
    lo, hi = 0.8, 1.2
    for per_sequence, normalized in ((False, True), (True, True), (True, False)):
        log_w = losses.behaviour_log_weights(prox, mu, mask, per_sequence, normalized)
        weights, outside = losses.bounded_behaviour_weights(log_w, bound, lo, hi)
        for i, n in enumerate(lengths):
            valid = [t for t in range(n) if not torch.isnan(mu[i, t])]
            if per_sequence:
                total = sum((prox[i, t] - mu[i, t]).item() for t in valid)
                raw = math.exp(total / max(len(valid), 1) if normalized else total)
                assert weights[i, 0].item() == pytest.approx(_bounded(raw, bound, lo, hi), rel=1e-12)
                assert bool(outside[i, 0]) == (raw < lo or raw > hi)
            else:
                for t in range(n):
                    raw = 1.0 if t not in valid else torch.exp(prox[i, t] - mu[i, t]).item()
                    assert weights[i, t].item() == pytest.approx(_bounded(raw, bound, lo, hi), rel=1e-12)
    assert not losses.behaviour_log_weights(prox.requires_grad_(), mu, mask, True).requires_grad  # detached


def test_length_normalized_weight_keeps_long_answers():
    """TRL's exp(sum) passes the cap of 3 for a 1e-3 per-token gap over 2,048 tokens; the geometric mean stays ~1."""
    prox, mu, mask = torch.zeros(1, 2048), torch.full((1, 2048), -1e-3), torch.ones(1, 2048)
    summed, _ = losses.bounded_behaviour_weights(
        losses.behaviour_log_weights(prox, mu, mask, True, False), "mask", None, 3.0
    )
    mean, _ = losses.bounded_behaviour_weights(
        losses.behaviour_log_weights(prox, mu, mask, True, True), "mask", None, 3.0
    )
    assert summed.item() == 0.0 and mean.item() == pytest.approx(1.001, abs=1e-4)


def test_length_normalized_is_the_default_for_sequence_levels(tmp_path):
    def config(**kw):
        return GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)

    assert config().vllm_importance_sampling_length_normalized is True  # sequence (GSPO)
    assert config(importance_sampling_level="sequence_token").vllm_importance_sampling_length_normalized is True
    grpo = dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28)
    assert config(**grpo).vllm_importance_sampling_length_normalized is False  # GRPO keeps TRL's correction
    assert config(vllm_importance_sampling_mode="token_truncate").vllm_importance_sampling_length_normalized is False
    assert config(vllm_importance_sampling_length_normalized=False).vllm_importance_sampling_length_normalized is False


def test_sync_vllm_flow_uses_length_normalized_correction_by_default(tokenizer, tmp_path, trainer_factory):
    from test_sampler_logprobs import _fake_vllm, _first_rollout, _UnevenGapVLLMTrainer

    trainer = _fake_vllm(
        tokenizer,
        tmp_path,
        is_correction=True,
        old_logprobs_source="recompute",
        trainer_factory=trainer_factory,
        cls=_UnevenGapVLLMTrainer,  # a gap that varies along the completion: a mask bug in its mean shows
    )
    assert trainer.args.vllm_importance_sampling_mode == "sequence_mask"  # TRL's default mode, left alone
    for batch in _first_rollout(trainer):
        m = batch["completion_mask"].float()
        mean_gap = ((batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * m).sum(1) / m.sum(1)
        # fp32: a mean over the completion and an exp, of differences of log-probs as large as `scale`
        scale = batch["old_per_token_logps"].abs().max().item()
        bound = rounding_bound(torch.float32, m.size(1) + 3) * scale
        assert relative_gap(batch["importance_sampling_ratio"], torch.exp(mean_gap)[:, None], math.inf) <= bound
        # companion (helpers/smallest_bug.py): one token left out of a row's mean moves its weight past the bound
        assert dropped_token_mean_gap(batch["old_per_token_logps"] - batch["sampling_per_token_logps"], m) > bound


# --------------------------------------------------------------------------------------- the decoupled loss
def _naive_logps(model, batch, temperature):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=att).logits[:, -width - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]


def _naive_decoupled_loss(model, batch, level, bound, lo, hi, eps_low, eps_high, temperature, keep=1):
    """GRPO/GSPO/GSPO-token with the decoupled behaviour weight, from its own forward, one sequence at a time; `keep`
    (0 at a token) leaves a token out of the loss, not of the attention: the smallest mask bug."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    width = batch["completion_ids"].size(1)
    lp = _naive_logps(model, batch, temperature)
    old, mu, mask = (
        batch["old_per_token_logps"].double(),
        batch["sampling_per_token_logps"].double(),
        batch["completion_mask"] * keep,
    )
    total = 0.0
    for i in range(ids.size(0)):
        valid = [t for t in range(width) if mask[i, t] > 0]
        if not valid:
            continue
        a = batch["advantages"][i].double()
        clip = lambda r: torch.clamp(r, 1 - eps_low, 1 + eps_high)  # noqa: E731
        if level == "token":
            seq = 0.0
            for t in valid:
                r = torch.exp(lp[i, t] - old[i, t])
                w = _bounded(torch.exp(old[i, t] - mu[i, t]).item(), bound, lo, hi)
                seq = seq - torch.min(r * a, clip(r) * a) * w
            total = total + seq / len(valid)
            continue
        log_s = sum(lp[i, t] - old[i, t] for t in valid) / len(valid)
        w = _bounded(torch.exp(sum(old[i, t] - mu[i, t] for t in valid) / len(valid)).item(), bound, lo, hi)
        if level == "sequence":
            s = torch.exp(log_s)
            total = total - torch.min(s * a, clip(s) * a) * w
        else:  # sequence_token: s_it = sg[s_i] * pi_t / sg[pi_t]
            seq = 0.0
            for t in valid:
                s_it = torch.exp(log_s).detach() * torch.exp(lp[i, t]) / torch.exp(lp[i, t]).detach()
                seq = seq - torch.min(s_it * a, clip(s_it) * a) * w
            total = total + seq / len(valid)
    return total / ids.size(0)


def _scored_batch(tokenizer, tmp_path, level, **overrides):
    clip = dict(epsilon=0.2, epsilon_high=0.28) if level == "token" else dict(epsilon=3e-4, epsilon_high=4e-4)
    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        max_steps=1,
        disable_tqdm=True,
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=4,
        max_completion_length=6,
        temperature=0.9,
        seed=0,
        importance_sampling_level=level,
        async_generation=True,
        gradient_checkpointing=False,
        **{**clip, **overrides},
    )
    model = build_tiny_model(tokenizer, seed=0)
    dataset = Dataset.from_dict({"prompt": [f"copy {a} {b} :" for a in range(4) for b in range(4)]})
    trainer = GSPOTrainer(model, length_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:8] for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    m = batch["completion_mask"].bool()
    # pi_old a little off the current weights (ratios leave 1, some clip), the sampler further off (stale samples)
    batch["old_per_token_logps"] = batch["old_per_token_logps"] + 0.02 * torch.randn(m.shape, generator=g)
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.25 * torch.randn(m.shape, generator=g)
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=g)
    return trainer, {
        k: v[:8] if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == m.size(0) else v for k, v in batch.items()
    }


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("bound", ["truncate", "mask"])
def test_decoupled_loss_and_gradients_match_naive_reference(tokenizer, tmp_path, level, bound):
    lo, hi = 0.9, 1.1  # tight bounds so some weights are truncated / masked
    trainer, batch = _scored_batch(
        tokenizer,
        tmp_path,
        level,
        vllm_importance_sampling_mode=f"sequence_{bound}",
        vllm_importance_sampling_clip_min=lo,
        vllm_importance_sampling_clip_max=hi,
    )
    model = trainer.model
    loss = trainer._compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = _naive_decoupled_loss(
        model, batch, level, bound, lo, hi, trainer.epsilon_low, trainer.epsilon_high, trainer.temperature
    )
    ref.backward()
    # fp32 rounding of the policy loss (rounding.loss_bound; the behaviour weight is a ratio of log-probs too)
    b, s = batch["prompt_ids"].size(0), batch["prompt_ids"].size(1) + batch["completion_ids"].size(1)
    size = max(batch[k].abs().max().item() for k in ("old_per_token_logps", "sampling_per_token_logps"))
    value_bound = loss_bound(torch.float32, model.config, s, b * s, size)
    assert relative_gap(loss, ref) <= value_bound
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    grad_bound = loss_bound(torch.float32, model.config, s, b * s, size, b * s)
    for name, param in model.named_parameters():
        assert relative_gap(grads[name], param.grad) <= grad_bound, name

    def reference(keep):  # the reference with one more token left out of the loss
        model.zero_grad(set_to_none=True)
        args = (level, bound, lo, hi, trainer.epsilon_low, trainer.epsilon_high, trainer.temperature, keep)
        loss = _naive_decoupled_loss(model, batch, *args)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # companion (helpers/smallest_bug.py): one token mis-masked, in any sequence the loss does not clip, moves the loss
    # or some parameter's gradient past its bound (a token whose removal moves its sequence into the clip moves the
    # loss only). A sequence GSPO clips gives no gradient, so a mask bug in it cannot show there, and the loss's
    # value, a mean of ratios within ~1e-3 of 1 times advantages, moves by less than its bound.
    mask = batch["completion_mask"]
    if level != "token":
        with torch.no_grad():
            log_s = ((_naive_logps(model, batch, trainer.temperature) - batch["old_per_token_logps"]) * mask).sum(1)
        ratio, advantages = torch.exp(log_s / mask.sum(1)), batch["advantages"]
        clipped = (advantages > 0) & (ratio > 1 + trainer.epsilon_high)
        clipped |= (advantages < 0) & (ratio < 1 - trainer.epsilon_low)
        assert not clipped.all()
        mask = mask * ~clipped[:, None]
    assert one_token_margin(reference, mask, value_bound, grad_bound) > 1
    window = trainer.diagnostics.windows["train"].flush()
    assert 0 < window["async/behaviour_weight/outside_frac"] < 1  # the bounds acted on some weights, not all
    assert (
        window["async/behaviour_weight/max"] > hi or window["async/behaviour_weight/min"] < lo
    )  # logged before bounds


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_loss_is_the_plain_loss_when_proximal_is_behaviour(tokenizer, tmp_path, level):
    trainer, batch = _scored_batch(tokenizer, tmp_path, level)
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"].clone()
    decoupled = trainer._compute_loss(trainer.model, batch)
    trainer.args.async_generation = False  # the same trainer with hook 3's switch off: the plain loss
    plain = trainer._compute_loss(trainer.model, batch)
    assert decoupled.item() == plain.item()
    assert decoupled.item() != 0.0


# ---------------------------------------------------------------------------------------- whole runs
N = 6


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("sync"), max_steps=N)
    trainer.train()
    return _weights(trainer)


def test_staleness_zero_ends_at_the_synchronous_weights(sync_run, tmp_path):
    """max_staleness=0 generates each batch when due: the generator copy samples what the trainer would have (same
    global RNG draws, same weights), so without the behaviour weight the run is the synchronous one bit for bit; with
    it, the weight is pi_prox / mu at equal weights, 1 up to the two forwards' float rounding. That run is compared
    under plain SGD: Adam would turn a rounding-sized gradient difference on a ~0 gradient into a step of up to the
    learning rate (rounding.sgd_weights_bound bounds SGD's runs)."""
    exact = make_trainer(
        tmp_path / "exact",
        max_steps=N,
        async_generation=True,
        max_staleness=0,
        vllm_importance_sampling_correction=False,
    )
    exact.train()
    assert _max_diff(_weights(exact), sync_run) == 0.0
    sgd = make_trainer(tmp_path / "sgd", max_steps=N, optim="sgd")
    sgd.train()
    corrected = make_trainer(tmp_path / "corrected", max_steps=N, async_generation=True, max_staleness=0, optim="sgd")
    corrected.add_callback(LastStepStart())  # the last-step companion measures where that step ran
    corrected.train()
    args, ends = corrected.args, _weights(corrected)
    seq_len = max(len(corrected.processing_class(p).input_ids) for p in PROMPTS) + args.max_completion_length
    positions = args.per_device_train_batch_size * seq_len
    scale = corrected._buffered_inputs[0]["old_per_token_logps"].abs().max().item()  # the log-probs' size
    step = loss_bound(torch.float32, corrected.model.config, seq_len, positions, scale, positions)
    bounds = {
        name: sgd_weights_bound(torch.float32, step, args, N, value.norm().item())
        for name, value in _weights(sgd).items()
    }
    for name, value in _weights(sgd).items():
        assert (ends[name] - value).norm().item() <= bounds[name], name
    # the generator's log-probs are the trainer's at equal weights: one forward's fp32 rounding, relative to the
    # log-probs' size (the last rollout's)
    logged = [h["sampler/logp_abs_diff/max"] for h in corrected.state.log_history if "sampler/logp_abs_diff/max" in h]
    assert logged and max(logged) <= model_bound(torch.float32, corrected.model.config, seq_len) * scale
    # companion (helpers/smallest_bug.py's kind): one token's generator log-prob mis-masked (0) or taken from another
    # token moves that token's |difference| by about its whole log-prob, at least the smallest |log-prob| of the last
    # rollout (the one the size is read from), past the bound
    smallest = min(
        b["old_per_token_logps"][b["completion_mask"].bool()].abs().min().item() for b in corrected._buffered_inputs
    )
    assert smallest > model_bound(torch.float32, corrected.model.config, seq_len) * scale
    assert not _generator_threads()
    # companion (helpers/smallest_bug.py): one token mis-masked in the last step's loss (one micro-batch per step)
    # moves that step, and so the end weights, past some parameter's bound
    assert args.gradient_accumulation_steps == 1
    last = corrected._buffered_inputs[(corrected.state.global_step - 1) % len(corrected._buffered_inputs)]
    rate = last_step_learning_rate(corrected)
    compute = trainer_loss(corrected, last, last_step_start(corrected))
    gap = one_token_step_gap(compute, last["completion_mask"], rate, args.max_grad_norm, bounds)
    assert gap > 1


def test_staleness_one_is_reproducible(sync_run, tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(tmp_path / name, max_steps=N, async_generation=True, max_staleness=1)
        trainer.train()
        runs.append(_weights(trainer))
    assert _max_diff(runs[0], runs[1]) == 0.0
    assert _max_diff(runs[0], sync_run) > 1e-4  # it did train off-policy (a different run), not synchronously


class _Probe:
    """Records the trainer's weights at each sync point (main thread), the generator's at the start of each request
    (generator thread), the version of every trained row, and which threads ran the trainer's model."""

    def __init__(self, monkeypatch):
        self.at_sync, self.at_request, self.trained, self.model_threads = {}, {}, [], set()
        probe = self
        push, generate = TransformersGenerator.push_weights, TransformersGenerator._generate_batch

        def push_weights(self, busy):
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            probe.at_sync[self.trainer.state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
            return push(self, busy)

        def _generate(self, prompt_ids, rollout, sampled_at):
            probe.at_request[rollout] = (sampled_at, {n: p.detach().clone() for n, p in self.model.named_parameters()})
            return generate(self, prompt_ids, rollout, sampled_at)

        monkeypatch.setattr(TransformersGenerator, "push_weights", push_weights)
        monkeypatch.setattr(TransformersGenerator, "_generate_batch", _generate)

    def attach(self, trainer):
        probe = self
        trainer.model.register_forward_hook(lambda *a: probe.model_threads.add(threading.current_thread().name))
        compute = trainer._compute_loss

        def _compute_loss(model, inputs):
            probe.trained.append((trainer.state.global_step, inputs["sampled_at"].tolist()))
            return compute(model, inputs)

        trainer._compute_loss = _compute_loss


@pytest.mark.parametrize("staleness", [1, 2])
def test_versions_follow_the_schedule_and_generator_weights_match_at_sync_points(tmp_path, monkeypatch, staleness):
    probe = _Probe(monkeypatch)
    trainer = make_trainer(tmp_path, max_steps=8, async_generation=True, max_staleness=staleness)
    probe.attach(trainer)
    trainer.train()
    # rollout r is sampled by the weights of the start of rollout max(r - staleness, 0), i.e. optimizer step U * that
    assert len(probe.trained) == 8
    for step, versions in probe.trained:
        rollout = step // U
        assert set(versions) == {U * max(rollout - staleness, 0)}, (step, versions)
        assert 0 <= step - versions[0] <= U * (staleness + 1) - 1
    assert sorted(probe.at_request) == [0, 1, 2, 3]  # one request per rollout batch, none beyond max_steps
    for rollout, (sampled_at, generator) in probe.at_request.items():
        trainer_weights = probe.at_sync[sampled_at]
        for name, tensor in generator.items():
            assert torch.equal(tensor, trainer_weights[name]), (rollout, name)
    assert "MainThread" in probe.model_threads and not any(t.startswith("gspo-generator") for t in probe.model_threads)
    log = [h for h in trainer.state.log_history if "async/staleness/max" in h]
    assert max(h["async/staleness/max"] for h in log) == U * (staleness + 1) - 1
    assert all(h["async/behaviour_weight/mean"] > 0 for h in log if "async/behaviour_weight/mean" in h)
    assert not _generator_threads()


@pytest.mark.parametrize("staleness", [0, 1])
def test_overlap_training_runs_while_a_generation_is_in_flight(tmp_path, monkeypatch, staleness):
    """Event order, not timing thresholds: with a slow generator, optimizer steps start and end between a
    generation's start and end only when the generator works ahead (max_staleness=1)."""
    events, generate = [], TransformersGenerator._generate_batch

    def slow(self, prompt_ids, rollout, sampled_at):
        events.append(("gen_start", rollout))
        time.sleep(1.0)
        out = generate(self, prompt_ids, rollout, sampled_at)
        events.append(("gen_end", rollout))
        return out

    monkeypatch.setattr(TransformersGenerator, "_generate_batch", slow)
    from transformers import TrainerCallback  # after trl (peft 0.17 of the oldest set fails when imported first)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append(("step_start", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step_end", state.global_step))

    trainer = make_trainer(tmp_path, max_steps=6, async_generation=True, max_staleness=staleness)
    trainer.add_callback(Steps())
    trainer.train()
    in_flight, overlapped = set(), []
    for kind, value in events:
        if kind == "gen_start":
            in_flight.add(value)
        elif kind == "gen_end":
            in_flight.discard(value)
        elif kind == "step_end" and in_flight:
            overlapped.append(value)
    if staleness == 0:
        assert overlapped == []
    else:
        assert len(overlapped) >= 2, events  # steps train while the next batch is being generated


def test_generator_failure_surfaces_at_the_next_micro_step_with_its_traceback(tmp_path, monkeypatch):
    generate = TransformersGenerator._generate_batch

    def broken(self, prompt_ids, rollout, sampled_at):
        if rollout == 2:
            raise ValueError("generator exploded on purpose")
        return generate(self, prompt_ids, rollout, sampled_at)

    monkeypatch.setattr(TransformersGenerator, "_generate_batch", broken)
    trainer = make_trainer(tmp_path, max_steps=8, async_generation=True, max_staleness=1)
    with pytest.raises(GeneratorThreadError, match="rollout batch 2 failed.*generator exploded on purpose") as err:
        trainer.train()
    # rollout 2 is sent at the start of rollout 1 (step 2) and fails at once: raised within rollout 1, before step 4
    assert trainer.state.global_step < 2 * U
    cause = err.value.__cause__
    assert isinstance(cause, ValueError)
    frames = [frame.name for frame in __import__("traceback").extract_tb(cause.__traceback__)]
    assert "broken" in frames  # the generator thread's own traceback travels with it
    assert not _generator_threads()


def test_generation_stops_when_training_ends_with_batches_queued(tmp_path, monkeypatch):
    """max_steps ends mid-queue: nothing is sent past the last rollout, and close() stops what is in flight."""
    generate, calls = TransformersGenerator._generate_batch, []

    def counting(self, prompt_ids, rollout, sampled_at):
        calls.append(rollout)
        return generate(self, prompt_ids, rollout, sampled_at)

    monkeypatch.setattr(TransformersGenerator, "_generate_batch", counting)
    trainer = make_trainer(tmp_path, max_steps=3, async_generation=True, max_staleness=4)
    trainer.train()
    assert sorted(calls) == [0, 1]  # 3 steps = rollouts 0 and 1 only
    assert not _generator_threads()


# ----------------------------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def async_straight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("async-straight")
    trainer = make_trainer(out, max_steps=N, save_strategy="steps", save_steps=3, async_generation=True)
    trainer.train()
    return out, _weights(trainer)


def test_checkpoint_saves_the_batches_in_flight_and_resume_is_exact(async_straight_run, tmp_path):
    out, final = async_straight_run
    state = torch.load(out / "checkpoint-3" / "gspo_rollout_state_rank0.pt", weights_only=True)
    assert sorted(state["source"]["jobs"]) == [2]  # step 3 is mid-rollout 1; rollout 2 was in flight, saved
    assert state["source"]["jobs"][2]["sampled_at"] == 2 and state["source"]["sampled_at"] == 0
    resumed = make_trainer(tmp_path, max_steps=N, async_generation=True)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.state.global_step == N
    assert _max_diff(_weights(resumed), final) == 0.0


@pytest.mark.slow
def test_sigterm_with_a_generation_in_flight_saves_and_resume_matches(async_straight_run, tmp_path):
    _, final = async_straight_run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    script = os.path.join(os.path.dirname(__file__), "helpers", "fault_utils.py")
    base = [sys.executable, script, "--output_dir", str(tmp_path / "run"), "--max_steps", str(N), "--async_generation"]
    proc = subprocess.Popen(
        [*base, "--generation_delay", "1.0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    for line in proc.stdout:  # step 1 ends while rollout 1 (sent at step 0, 1 s to generate) is still in flight
        lines.append(line)
        if line.startswith("STEP 1"):
            proc.send_signal(signal.SIGTERM)
    log = "".join(lines)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log
    assert "Stopped by SIGTERM" in log, log
    checkpoint = checkpointing.last_complete_checkpoint(str(tmp_path / "run"))
    step = int(checkpoint.rsplit("-", 1)[1])
    assert step <= U, log  # rollout 0's steps: rollout 1 (1 s to generate) was still in flight when it saved
    saved = torch.load(os.path.join(checkpoint, "gspo_rollout_state_rank0.pt"), weights_only=True)
    assert sorted(saved["source"]["jobs"]) == [1]  # the generation in flight was waited for and saved
    resume = subprocess.run(
        [*base, "--resume", "--weights_out", str(tmp_path / "w.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert f"STEP {step + 1} " in resume.stdout and f"STEP {step} " not in resume.stdout
    assert _max_diff(torch.load(tmp_path / "w.pt", weights_only=True), final) == 0.0


# ------------------------------------------------------------------------------------- vLLM server mode
class StandInServer:
    """An HTTP server on 127.0.0.1 speaking what TRL 1.16's `VLLMClient` calls: `/v1/completions` (vLLM's OpenAI
    completions with token ids and log-probs), `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
    `/reset_prefix_cache`. The NCCL broadcast of the weights is replaced by handing the tensors over in process.
    Records every request and the weight version it was generated with; `hang` makes generation never answer.

    Kept beside the real server (tests/real_vllm/test_async_server.py) for what the CPU build cannot show: TRL's weight
    push to a server runs on NCCL (CUDA only), so only here do weights reach the "server" between requests and the
    test see which version generated each batch. A server that hangs (rather than dies) is also only staged here."""

    def __init__(self, vocab: int, eos: int):
        self.vocab, self.eos = vocab, eos
        self.version, self.updating, self.in_flight = 0, False, 0
        self.requests, self.violations, self.received = [], [], {}
        self.hang = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                answer = server.handle(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, path, body):
        if path == "/v1/completions":
            with self.lock:
                if self.updating:
                    self.violations.append("generation requested during a weight update")
                self.in_flight += 1
                version = self.version
            if self.hang.is_set():
                while self.hang.is_set():
                    time.sleep(0.05)
            g = torch.Generator().manual_seed(1000 * version + len(self.requests))
            choices = []
            for prompt in body["prompt"]:
                for _ in range(body["n"]):
                    length = int(torch.randint(1, body["max_tokens"] + 1, (1,), generator=g))
                    ids = torch.randint(4, self.vocab, (length,), generator=g).tolist()
                    logps = (-1.0 - torch.rand(length, generator=g)).tolist()
                    choices.append(
                        {
                            "prompt_token_ids": prompt,
                            "token_ids": ids,
                            "logprobs": {
                                "tokens": [f"token_id:{t}" for t in ids],
                                "token_logprobs": logps,
                                "top_logprobs": [None] * length,
                            },
                        }
                    )
            time.sleep(0.05)
            with self.lock:
                if self.version != version:
                    self.violations.append("weights changed while a generation was in flight")
                self.in_flight -= 1
                self.requests.append({"version": version, "prompts": body["prompt"]})
            return {"choices": choices}
        if path == "/start_weight_update":
            with self.lock:
                if self.in_flight:
                    self.violations.append("weight update started while a generation was in flight")
                self.updating = True
        elif path == "/finish_weight_update":
            with self.lock:
                self.updating, self.version = False, self.version + 1
        elif path == "/reset_prefix_cache":
            return {"success": True}
        return {}

    def receive(self, iterator, group=None, src=0, post_iter_func=None):  # stands in for the NCCL broadcast
        self.received[self.version + 1] = {name: tensor.detach().clone() for name, tensor in iterator}

    def close(self):
        self.hang.clear()
        self.httpd.shutdown()


def _client_speaks_vllm_openai_server() -> bool:
    from trl.generation import vllm_client

    return hasattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE")


needs_openai_client = pytest.mark.skipif(
    not _client_speaks_vllm_openai_server(),
    reason="the stand-in speaks the protocol of TRL 1.16's client (vLLM's OpenAI server and weight-transfer endpoints); "
    "older TRL clients talk to `trl vllm-serve`'s own endpoints",
)


def _server_trainer(tokenizer, tmp_path, server, monkeypatch, **overrides):
    """A trainer whose generation goes through TRL's own vLLM server path (`VLLMGeneration` and `VLLMClient`, real
    objects, built without vLLM installed) to the stand-in server."""
    import requests
    from trl.distributed import DistributedBackend
    from trl.generation import vllm_client as client_module
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(client_module, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    monkeypatch.setattr(client_module, "_HAS_RESET_PREFIX_CACHE_SUCCESS", True)
    monkeypatch.setattr(client_module, "packed_nccl_broadcast_producer", server.receive, raising=False)
    trainer = make_trainer(tmp_path, async_generation=True, **overrides)
    client = VLLMClient.__new__(VLLMClient)
    client.session, client.base_url, client.model = requests.Session(), server.url, "stand-in"
    client.communicator, client._updating_weights = object(), False
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.__dict__.update(
        model=trainer.model,
        accelerator=trainer.accelerator,
        _dist=DistributedBackend(trainer.accelerator),
        processing_class=tokenizer,
        mode="server",
        structured_outputs_regex=None,
        enable_sleep_mode=False,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_completion_length=trainer.args.max_completion_length,
        logprobs=0,
        generation_kwargs={},
        _weight_metadata=None,
        vllm_client=client,
    )
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation, trainer._last_loaded_step = (
        True,
        "server",
        generation,
        -1,
    )
    trainer.vllm_importance_sampling_correction = True
    return trainer


@needs_openai_client
@pytest.mark.parametrize("staleness", [1, 2])
def test_vllm_server_mode_against_a_stand_in_server(tokenizer, tmp_path, monkeypatch, staleness):
    server = StandInServer(len(tokenizer), tokenizer.eos_token_id)
    try:
        trainer = _server_trainer(tokenizer, tmp_path, server, monkeypatch, max_steps=8, max_staleness=staleness)
        pushed = {}
        sync = trainer.vllm_generation.sync_weights

        def sync_weights():
            pushed[server.version + 1] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            sync()

        trainer.vllm_generation.sync_weights = sync_weights
        trainer.train()
    finally:
        server.close()
    assert server.violations == []
    # rollouts 0..staleness with the first push, then rollout r with the push at the start of rollout r - staleness
    assert [r["version"] for r in server.requests] == [max(r - staleness, 0) + 1 for r in range(4)]
    for version, received in server.received.items():  # what reached the "server" is the trainer's weights then
        for name, tensor in received.items():
            assert torch.equal(tensor, pushed[version][name]), (version, name)
    assert set(server.received) == {1, 2, 3, 4}  # a push at every rollout start, none during generation
    rows = [h for h in trainer.state.log_history if "async/behaviour_weight/mean" in h]
    assert rows and all(h["async/behaviour_weight/mean"] > 0 for h in rows)  # the server's log-probs were used
    assert not _generator_threads()


@needs_openai_client
def test_vllm_server_that_stops_answering_times_out(tokenizer, tmp_path, monkeypatch):
    server = StandInServer(len(tokenizer), tokenizer.eos_token_id)
    server.hang.set()
    try:
        trainer = _server_trainer(tokenizer, tmp_path, server, monkeypatch, max_steps=4, async_generation_timeout=2)
        start = time.perf_counter()
        with pytest.raises(
            TimeoutError,
            match=rf"rollout batch 0 was not generated within async_generation_timeout=2 "
            rf"s by {server.url}",
        ):
            trainer.train()
        assert time.perf_counter() - start < 30
    finally:
        server.close()  # the request in flight is answered, so the generator thread can end
    deadline = time.time() + 10
    while _generator_threads() and time.time() < deadline:
        time.sleep(0.1)
    assert not _generator_threads()


def test_a_batch_saved_in_flight_is_answered_by_a_server_at_another_address_but_not_for_another_request():
    """After a resume the server may run elsewhere (or serve the model under another name): the batch saved in flight
    still answers TRL's request. A request that differs otherwise (sampling parameters, prompts) raises."""
    from trl_gspo.rollout.async_server import _ServerRequests

    class Session:
        def post(self, url, **kwargs):
            raise AssertionError(f"sent to the server again: {url}")

    class Client:
        session = Session()

    requests = _ServerRequests(Client())
    body = {"model": "/models/policy", "prompt": [[5, 6, 7]], "n": 2, "max_tokens": 8, "seed": 3}
    saved = {"url": "http://10.0.0.1:8000/v1/completions", "json": body, "text": '{"choices": []}'}
    requests.answer(saved)
    reply = Client.session.post("http://127.0.0.1:9000/v1/completions", json={**body, "model": "Qwen/Qwen3-4B"})
    assert reply.status_code == 200 and reply.json() == {"choices": []}
    for changed in ({**body, "n": 4}, {**body, "prompt": [[5, 6]]}):
        requests.answer(saved)
        with pytest.raises(RuntimeError, match="differs from the one sent ahead of time"):
            Client.session.post("http://127.0.0.1:9000/v1/completions", json=changed)
    requests.answer(saved)
    with pytest.raises(RuntimeError, match="differs from the one sent ahead of time"):
        Client.session.post("http://127.0.0.1:9000/v1/chat/completions", json=body)


# ----------------------------------------------------------------------------------- other generation paths
def test_rollout_func_runs_in_the_generator_thread(tmp_path):
    threads = []

    def rollout_func(prompts, trainer):
        threads.append(threading.current_thread().name)
        tok = trainer.processing_class
        ids = [tok(p)["input_ids"] for p in prompts]
        return {
            "prompt_ids": ids,
            "completion_ids": [[5, 6, tok.eos_token_id][: 1 + i % 3] for i in range(len(ids))],
            "logprobs": [[-1.5] * (1 + i % 3) for i in range(len(ids))],
        }

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = make_trainer(tmp_path, max_steps=4, async_generation=True, rollout_func=rollout_func)
    trainer.train()
    assert threads and all(name.startswith("gspo-generator") for name in threads)
    assert any("async/behaviour_weight/mean" in h for h in trainer.state.log_history)


def test_lora_pushes_only_the_adapters(tmp_path, monkeypatch):
    from peft import LoraConfig

    probe = _Probe(monkeypatch)
    trainer = make_trainer(
        tmp_path,
        max_steps=4,
        async_generation=True,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    backend_trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert backend_trained and all("lora_" in n for n in backend_trained)
    for rollout, (sampled_at, generator) in probe.at_request.items():
        for name, tensor in generator.items():
            assert torch.equal(tensor, probe.at_sync[sampled_at][name]), (rollout, name)


def test_moe_r3_routes_travel_with_the_rollout(tokenizer, tmp_path):
    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        max_steps=4,
        disable_tqdm=True,
        per_device_train_batch_size=4,
        num_generations=2,
        steps_per_generation=2,
        max_completion_length=6,
        learning_rate=1e-3,
        seed=0,
        logging_steps=1,
        routing_replay="R3",
        async_generation=True,
    )
    model = build_tiny_model(tokenizer, moe=True, seed=0)
    trainer = GSPOTrainer(
        model,
        length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    assert "old_routes" in trainer._buffered_inputs[0]
    coverage = [h["moe/replay/coverage"] for h in trainer.state.log_history if "moe/replay/coverage" in h]
    assert coverage and min(coverage) > 0.5  # the generator's routes were replayed


def test_evaluation_stays_synchronous(tmp_path):
    eval_set = Dataset.from_dict({"prompt": PROMPTS[:4]})
    trainer = make_trainer(
        tmp_path,
        max_steps=4,
        async_generation=True,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        eval_dataset=eval_set,
    )
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 4]


# ------------------------------------------------------------------------------------------- bad input
def test_config_errors_name_the_field(tmp_path, caplog):
    def config(**kw):
        return GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)

    with pytest.raises(ValueError, match="vllm_mode='colocate'.*cannot overlap.*vllm_mode='server'"):
        config(async_generation=True, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="max_staleness=-1 must be an integer >= 0"):
        config(async_generation=True, max_staleness=-1)
    with pytest.raises(ValueError, match="generation_device='cuda:1'.*needs async_generation=True"):
        config(generation_device="cuda:1")
    with pytest.raises(ValueError, match="async_generation_timeout=0 must be"):
        config(async_generation=True, async_generation_timeout=0)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        config(async_generation=True, use_transformers_continuous_batching=True)
    with caplog.at_level(logging.WARNING, logger="trl_gspo.rollout.async_options"):
        config(async_generation=True, old_logprobs_source="sampler")
    assert "anchored on the sampler" in caplog.text and "clip fraction" in caplog.text


def test_unsupported_sampling_warper_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, async_generation=True, generation_kwargs={"typical_p": 0.9})
    with pytest.raises(ValueError, match="typical_p=0.9"):
        trainer.train()
    assert not _generator_threads()
