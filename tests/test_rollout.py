"""The rollout pipeline (rollout/pipeline.py): sampling apart from scoring gives exactly the one-call rollout batch.

- `_score(inputs, _sample(inputs))` returns the same tensors as `_generate_and_score_completions(inputs)` from the
  same random state: dense with sampler log-prob reuse (pi_old from the sampler), and a Qwen3-MoE under R3 (the
  sampler's routes travel with the generation and reach the batch as `old_routes`).
- `_score` with a given reward matrix does not call the reward functions and computes TRL's group advantages from it
  (checked against the formula written out here).
- The sampling stamp (`_rollout_sampled_at`) is the generation's, not the step at which it was scored.
"""

import pytest
import torch
from datasets import Dataset
from helpers.trainers import digit_fraction

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.rollout.pipeline import Generation
from trl_gspo.rounding import rounding_bound
from trl_gspo.testing import build_tiny_model

G = 4
PROMPTS = [f"copy {a} {b} :" for a in range(2) for b in range(2)]


#: The trainers of this file (`trainer_factory`): one optimizer step, in training mode.
TRAINER = dict(
    reward=digit_fraction,
    prompts=PROMPTS,
    train=True,
    per_device_train_batch_size=4,
    num_generations=G,
    steps_per_generation=4,
    max_completion_length=6,
    temperature=0.9,
    learning_rate=1e-3,
    seed=0,
    max_steps=1,
    disable_tqdm=True,
)


def _inputs():  # a local generation batch as TRL's sampler hands it over: each prompt G times in a row
    return [{"prompt": p} for p in PROMPTS for _ in range(G)]


def _assert_same_batch(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("case", ["dense_sampler_logprobs", "moe_r3"])
def test_sample_then_score_is_the_one_call_batch(tokenizer, tmp_path, case, trainer_factory):
    overrides = dict(old_logprobs_source="sampler") if case == "dense_sampler_logprobs" else dict(routing_replay="R3")
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, moe=case == "moe_r3", **overrides)
    torch.manual_seed(7)
    one_call = trainer._generate_and_score_completions(_inputs())
    torch.manual_seed(7)
    generation = trainer.rollout.sample(_inputs())
    assert isinstance(generation, Generation) and generation.sampled_at == 0
    two_steps = trainer.rollout.score(_inputs(), generation)
    _assert_same_batch(one_call, two_steps)
    if case == "moe_r3":
        assert "old_routes" in two_steps and generation.sampler_routes is not None
    else:  # pi_old is the sampler's log-probs, i.e. what the generation recorded
        assert "old_per_token_logps" in two_steps


def test_score_with_given_rewards_skips_the_reward_functions(tokenizer, tmp_path, trainer_factory):
    calls = []

    def counting_reward(completions, **kwargs):
        calls.append(len(completions))
        return [0.0] * len(completions)

    trainer = trainer_factory(TRAINER, output_dir=tmp_path, reward=counting_reward)
    generation = trainer.rollout.sample(_inputs())
    rewards = torch.tensor(
        [[0.0], [1.0], [1.0], [2.0], [3.0], [3.0], [3.0], [3.0], [0.5], [0.0], [0.0], [0.0], [1.0], [2.0], [4.0], [8.0]]
    )
    batch = trainer.rollout.score(_inputs(), generation, rewards)
    assert calls == []
    grouped = rewards.view(-1, G)  # TRL's default: (r - group mean) / (group std, Bessel-corrected, + 1e-4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    # fp32: a group's mean and std (sums over G rewards, a square root, divisions), and r - mean, which carries the
    # rounding of rewards and mean (as large as they are), divided by the std (trl_gspo/rounding.py)
    size = (grouped.abs() + grouped.mean(1, keepdim=True).abs()) / (grouped.std(1, keepdim=True) + 1e-4)
    bound = rounding_bound(torch.float32, 2 * G + 4) * size.flatten()
    assert ((batch["advantages"] - expected.flatten()).abs() <= bound).all()
    # companion (helpers/smallest_bug.py's kind): one row left out of its group's mean and std moves another row's
    # advantage past its bound. A group of equal rewards is left out: its advantages are 0 whichever rows count.
    bound, margins = bound.view(-1, G), []
    for group in range(grouped.size(0)):
        if grouped[group].std() == 0:
            continue
        for row in range(G):
            rest = torch.cat([grouped[group, :row], grouped[group, row + 1 :]])
            moved = (grouped[group] - rest.mean()) / (rest.std() + 1e-4)
            others = torch.arange(G) != row
            margins.append(((moved - expected[group]).abs() / bound[group])[others].max().item())
    assert margins and min(margins) > 1


def test_sampling_stamp_is_the_generations(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path)
    generation = trainer.rollout.sample(_inputs())
    trainer.state.global_step = 3  # scored three optimizer steps after it was sampled
    trainer.rollout.score(_inputs(), generation)
    assert trainer.rollout.sampled_at == 0
    trainer._generate_and_score_completions(_inputs())
    assert trainer.rollout.sampled_at == 3


# ------------------------------------------------------------------------------------------- prompt stream
@pytest.mark.parametrize("shuffle", [True, False])
def test_prompt_stream_is_the_train_dataloaders_order_across_epochs(tokenizer, tmp_path, shuffle):
    """Against TRL's own dataloader (RepeatSampler through accelerate): 10 prompts, 2 per rollout -> 5 rollouts per
    epoch, read over 3 epochs; each rollout's batch is repeated once per micro-step that trains on it."""
    from trl_gspo.rollout.prompt_stream import PromptStream

    dataset = Dataset.from_dict({"prompt": [f"copy {i} :" for i in range(10)], "target": [str(i) for i in range(10)]})
    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=G,
        steps_per_generation=2,
        num_iterations=2,
        seed=5,
        shuffle_dataset=shuffle,
    )
    trainer = GSPOTrainer(
        build_tiny_model(tokenizer), digit_fraction, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    stream = PromptStream.for_trainer(trainer)
    assert stream.rollouts_per_epoch == 5
    loader = trainer.get_train_dataloader()
    repeats = args.steps_per_generation * args.num_iterations
    seen = []
    for epoch in range(3):
        batches = list(loader)
        assert len(batches) == 5 * repeats
        seen += [batches[i] for i in range(0, len(batches), repeats)]
        assert all(batches[i] == batches[i - i % repeats] for i in range(len(batches)))
    assert [stream.batch(r) for r in range(15)] == seen
    assert (seen[0] != seen[5]) == shuffle  # a shuffled epoch 2 starts elsewhere
    fresh = PromptStream.for_trainer(trainer)  # random access: a resumed source asks for rollout 12 first
    assert fresh.batch(12) == seen[12] and fresh.batch(3) == seen[3]


# ------------------------------------------------------------------------------------------ merging rows
def _generation(tag: int, rows: int, tools: bool = True) -> Generation:
    """A hand-made generation whose every per-row value names its (tag, row)."""
    outputs = (
        [[tag, i] for i in range(rows)],  # prompt ids
        [[tag, i, 1] for i in range(rows)],  # completion ids
        [[1, 0, 1] for _ in range(rows)] if tools else None,  # tool mask
        [f"c{tag}.{i}" for i in range(rows)],  # completions
        [[-0.1 * tag, -0.2 * i, -0.3] for i in range(rows)],  # sampler log-probs
        {"turns": [tag * 10 + i for i in range(rows)], "engine": "stand-in"},  # per-row and shared extra fields
        None,  # images
        [[f"img{tag}.{i}"] for i in range(rows)] if tools else [],  # tool images
    )
    routes = ([torch.full((5, 2, 2), tag * 10 + i) for i in range(rows)], [2] * rows, [3] * rows)
    return Generation(outputs, routes, sampled_at=7, prompts=[f"p{tag}.{i}" for i in range(rows)])


def test_gather_rows_moves_every_per_row_value_with_its_row():
    from trl_gspo.rollout.pipeline import gather_rows

    a, b = _generation(1, 3), _generation(2, 2)
    merged = gather_rows([(b, 1), (a, 0), (a, 2)])
    assert len(merged) == 3 and merged.sampled_at == 7
    prompt_ids, completion_ids, tool_mask, completions, logps, extra, images, tool_images = merged.outputs
    assert prompt_ids == [[2, 1], [1, 0], [1, 2]] and completion_ids == [[2, 1, 1], [1, 0, 1], [1, 2, 1]]
    assert completions == ["c2.1", "c1.0", "c1.2"] and merged.prompts == ["p2.1", "p1.0", "p1.2"]
    assert logps == [b.outputs[4][1], a.outputs[4][0], a.outputs[4][2]] and tool_mask == [[1, 0, 1]] * 3
    assert extra == {"turns": [21, 10, 12], "engine": "stand-in"} and images is None
    assert tool_images == [["img2.1"], ["img1.0"], ["img1.2"]]
    routes, prompt_lens, completion_lens = merged.sampler_routes
    assert [int(r[0, 0, 0]) for r in routes] == [21, 10, 12] and prompt_lens == [2] * 3 and completion_lens == [3] * 3
    assert a.take([2, 0]).outputs[3] == ["c1.2", "c1.0"]
    with pytest.raises(ValueError, match="some generations carry a per-row output that others lack"):
        gather_rows([(a, 0), (_generation(3, 1, tools=False), 0)])


def test_gather_rows_keeps_each_rows_sampling_stamp():
    """Rows sampled by different weights (async dynamic sampling) keep their own stamp through every merge; the
    generation's `sampled_at` is the oldest (what sampler reuse and R3 check for an on-policy batch)."""
    from dataclasses import replace

    from trl_gspo.rollout.pipeline import gather_rows

    old, new = replace(_generation(1, 3), sampled_at=2), replace(_generation(2, 2), sampled_at=4)
    merged = gather_rows([(new, 1), (old, 0), (new, 0)])
    assert merged.sampled_at == 2 and merged.sampled_at_rows() == [4, 2, 4]
    again = gather_rows([(merged, 2), (merged, 0), (old, 1)])  # a merged generation merged again (other processes)
    assert again.sampled_at == 2 and again.sampled_at_rows() == [4, 4, 2]
    assert merged.take([0, 2]).sampled_at_rows() == [4, 4] and merged.take([0, 2]).sampled_at == 4
    assert gather_rows([(old, 0), (old, 2)]).row_sampled_at is None  # uniform: one stamp
