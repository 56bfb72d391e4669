"""Asynchronous generation and dynamic sampling together (rollout/async_rollouts.py `_next_filled_batch`): the generator
thread generates sampling rounds ahead, the main thread fills each rollout batch from them.

- `max_staleness=0` ends at the weights of synchronous dynamic sampling, bit for bit.
- With `max_staleness` 1 and 2: constant groups never reach the loss, rounds are consumed in the stream's order
  (nothing skipped or repeated), every trained row's weight version is within the bound, rounds generated ahead of
  a batch's sync point are used (the look-ahead is real), and two runs with the same seed end at the same weights.
- A round that waited longer than `max_staleness` batches (the look-ahead overestimated the next batches' needs) is
  generated again at the current weights, and counted.
- Exact resume from a checkpoint in the middle of a filled batch with rounds in flight.
"""

import pytest
import torch
from test_dynamic_sampling import PROMPTS, TRAINER, G, has_signal

from trl_gspo.rollout.async_rollouts import AsyncRollouts
from trl_gspo.rollout.prompt_stream import PromptStream

U = 2  # _trainer: steps_per_generation=4, gradient_accumulation_steps=2 -> 2 optimizer steps per rollout batch


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Spy:
    """Records the positions of the rounds the filling consumes, the stamp of the job that answered each, the sync
    point (rollout batch) it was sent at, and, per loss micro-batch, the step, the rows' versions and prompts."""

    def __init__(self, trainer, tokenizer):
        self.rounds, self.trained = [], []
        source = trainer.rollout_source
        assert isinstance(source, AsyncRollouts) and source.filler is not None
        sample_round, compute = source._sample_round, trainer._compute_loss

        def recording_sample_round(position, inputs):
            generation = sample_round(position, inputs)
            self.rounds.append((source._batch, position, generation.sampled_at))
            return generation

        def recording_loss(model, inputs):
            prompts = tokenizer.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
            self.trained.append((trainer.state.global_step, inputs["sampled_at"].tolist(), prompts))
            return compute(model, inputs)

        source._sample_round, trainer._compute_loss = recording_sample_round, recording_loss


def test_staleness_zero_is_synchronous_dynamic_sampling(tokenizer, tmp_path, trainer_factory):
    sync = trainer_factory(TRAINER, output_dir=tmp_path / "sync", max_steps=6)
    sync.train()
    exact = trainer_factory(
        TRAINER,
        output_dir=tmp_path / "async",
        max_steps=6,
        async_generation=True,
        max_staleness=0,
        vllm_importance_sampling_correction=False,
    )
    exact.train()
    assert _max_diff(_weights(exact), _weights(sync)) == 0.0
    assert (
        exact.rollout_source.filler.cursor == sync.rollout_source.cursor > 3
    )  # the same rounds, more than one per batch


@pytest.mark.parametrize("staleness", [1, 2])
def test_filled_from_rounds_generated_ahead_within_the_bound(tokenizer, tmp_path, staleness, trainer_factory):
    runs = []
    for name in ("a", "b"):
        trainer = trainer_factory(
            TRAINER, output_dir=tmp_path / name, max_steps=8, async_generation=True, max_staleness=staleness
        )
        spy = Spy(trainer, tokenizer)
        trainer.train()
        runs.append((trainer, spy))
    (trainer, spy), (again, _) = runs
    assert _max_diff(_weights(trainer), _weights(again)) == 0.0  # reproducible from the seed
    # nothing skipped or repeated: consecutive positions of the stream, more than one round per batch somewhere
    positions = [position for _, position, _ in spy.rounds]
    assert positions == list(range(len(positions))) and len(positions) > 4
    # only groups with reward spread are trained; batches full (16 rows per rollout batch, 4 rollout batches)
    assert sum(len(p) for _, _, p in spy.trained) == 4 * 16
    assert all(has_signal(p) for _, _, prompts in spy.trained for p in prompts)
    # every row's version is the sync point of a batch at most `staleness` batches back
    for step, versions, _ in spy.trained:
        batch_start = step // U * U
        assert all(batch_start - U * staleness <= v <= batch_start and v % U == 0 for v in versions), (step, versions)
    # the look-ahead is used: some batch trains on rounds sent at an earlier batch's sync point
    assert any(sampled_at < U * batch for batch, _, sampled_at in spy.rounds)
    log = [h for h in trainer.state.log_history if "async/staleness/max" in h]
    assert max(h["async/staleness/max"] for h in log) <= U * (staleness + 1) - 1
    assert any(h.get("dynamic_sampling/rounds", 0) > 1 for h in trainer.state.log_history)


def test_a_round_that_became_too_stale_is_generated_again(tokenizer, tmp_path, trainer_factory):
    """The first round's prompts all score the same, so batch 0 takes two rounds and the look-ahead at the next sync
    point sends 2 x (1 + 1) rounds; the following batches (in the first epoch) take one round each, so the last rounds
    sent there would be trained more than one batch later: they are generated again at the current weights."""
    args = trainer_factory(TRAINER, output_dir=tmp_path / "probe", max_steps=10).args
    stream = PromptStream(PROMPTS, 4, G, 16, 0, args.seed, shuffle=True)
    first = {PROMPTS[i] for i in stream.prompt_indices(0)}

    def reward(prompts, completions, **kwargs):
        return [1.0 if p in first else (i % G) / G for i, p in enumerate(prompts)]

    trainer = trainer_factory(
        TRAINER, output_dir=tmp_path / "run", reward=reward, max_steps=10, async_generation=True, max_staleness=1
    )
    spy = Spy(trainer, tokenizer)
    trainer.train()
    positions = [position for _, position, _ in spy.rounds]
    assert positions == list(range(len(positions))) and [b for b, _, _ in spy.rounds][:4] == [0, 0, 1, 2]
    regenerated = [h["async/regenerated_rounds"] for h in trainer.state.log_history if "async/regenerated_rounds" in h]
    assert sum(regenerated) >= 1
    for batch, _, sampled_at in spy.rounds:
        assert U * (batch - 1) <= sampled_at <= U * batch, (batch, sampled_at)


def test_resume_in_the_middle_of_a_filled_batch_with_rounds_in_flight(tokenizer, tmp_path, trainer_factory):
    settings = dict(max_steps=6, async_generation=True, max_staleness=1)
    straight = trainer_factory(
        TRAINER, output_dir=tmp_path / "straight", save_strategy="steps", save_steps=3, **settings
    )
    straight.train()
    state = torch.load(tmp_path / "straight" / "checkpoint-3" / "gspo_rollout_state_rank0.pt", weights_only=True)
    source = state["source"]
    assert source["jobs"] and min(source["jobs"]) >= source["filler"]["cursor"]  # rounds sent ahead, saved
    resumed = trainer_factory(TRAINER, output_dir=tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    assert resumed.rollout_source.filler.cursor == straight.rollout_source.filler.cursor
    assert _max_diff(_weights(resumed), _weights(straight)) == 0.0  # the same computations in the same order
