"""Dynamic sampling (trl_gspo/rollout/dynamic_sampling.py): rollout batches filled with groups whose rewards differ.

- The policy alone: which groups pass (built-in rule, a user predicate), how a batch is filled, shrunk or padded,
  and how kept groups are dealt to processes.
- End to end on a reward that makes known groups constant: those groups never reach the loss, every trained group
  has reward spread, batches are full while prompts allow, the prompts are drawn in exactly the order of TRL's own
  train dataloader (none skipped or repeated), the cap on rounds holds, and the metrics match hand counts.
- Loss normalisation of a shrunk and a padded batch, loss and every gradient, against a hand computation over the
  optimizer step's rows (`grpo` and `dapo`).
- `dynamic_sampling=False` is TRL's own `_prepare_inputs` bit for bit, and a filter that keeps everything gives the
  same weights as dynamic sampling off (the whole sample / reward / assemble / score path changes nothing).
- Exact resume from a checkpoint in the middle of a filled batch; evaluation never filters; epoch-bounded runs stop
  when the data runs out; R3 routes (vLLM stand-in, colocate and server), sampler log-probs, a `rollout_func` with
  an environment mask (TRL's multi-turn `tool_mask`) and packed forwards follow the kept rows.
- 2 processes agree on the kept groups with a reward that differs by rank (slow).
"""

import json
import math
import os
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers.ports import launch_env, two_processes
from helpers.smallest_bug import dropped_token_gap
from trl import GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.common import trl_compat
from trl_gspo.common.trl_compat import fused_logprob_head_module
from trl_gspo.guards import checkpointing
from trl_gspo.rollout.dynamic_sampling import DynamicSampling, prefilter_reward_metrics
from trl_gspo.rollout.group_filling import GroupFilling, batch_unit, deal, keep_groups
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, rounding_bound
from trl_gspo.testing import build_tiny_model

G = 4
PROMPTS = [f"copy {a} {b} :" for a in range(4) for b in range(4)]  # 16 prompts
CONSTANT = ("0", "1")  # "copy 0 *" and "copy 1 *" score the same for every completion: no signal


def has_signal(prompt: str) -> bool:
    return prompt.split()[1] not in CONSTANT


def make_known_reward(num_generations: int):
    def known_reward(prompts, completions, **kwargs):
        """1.0 for the constant prompts; for the others the completion's position in its group (TRL hands each
        group's completions over in consecutive rows), so every such group has spread whatever the model samples."""
        return [1.0 if not has_signal(p) else (i % num_generations) / num_generations for i, p in enumerate(prompts)]

    return known_reward


known_reward = make_known_reward(G)


def keep_all(rewards):
    """A user filter that keeps every group (referenced by dotted path from the tests)."""
    return True


def mean_above_half(rewards):
    return bool(rewards[:, 0].mean() > 0.5)


#: The config fields of this file's runs (`_config`, and the trainers: `TRAINER`).
SETTINGS = dict(
    seed=0,
    per_device_train_batch_size=4,
    num_generations=G,
    steps_per_generation=4,
    gradient_accumulation_steps=2,
    max_completion_length=4,
    learning_rate=1e-3,
    max_steps=4,
    logging_steps=1,
    disable_tqdm=True,
    dynamic_sampling=True,
    max_sampling_rounds=4,
)


def _config(tmp_path, **overrides):
    return GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        **{**SETTINGS, **overrides},
    )


#: The trainers of this file (`trainer_factory`).
TRAINER = dict(reward=known_reward, prompts=PROMPTS, **SETTINGS)


class Recorder:
    """Spies on one trainer: the prompts of every sampling round, the reward matrices its rollout pipeline's `score`
    received (one per rollout batch), and the prompts of every loss micro-batch."""

    def __init__(self, trainer, tokenizer):
        self.sampled, self.scored, self.rounds_per_batch, self.loss_prompts = [], [], [], []
        pipeline = trainer.rollout
        sample, score, compute = pipeline.sample, pipeline.score, trainer._compute_loss
        rounds = [0]

        def recording_sample(inputs):
            self.sampled.append([x["prompt"] for x in inputs])
            rounds[0] += 1
            return sample(inputs)

        def recording_score(inputs, generation, rewards_per_func=None):
            if trainer.model.training:
                self.scored.append((rewards_per_func.clone(), [x["prompt"] for x in inputs]))
                self.rounds_per_batch.append(rounds[0])
                rounds[0] = 0
            return score(inputs, generation, rewards_per_func)

        def recording_loss(model, inputs):
            self.loss_prompts += tokenizer.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
            return compute(model, inputs)

        pipeline.sample, pipeline.score, trainer._compute_loss = recording_sample, recording_score, recording_loss


def _dataloader_order(trainer, epochs: int) -> list[list[str]]:
    """The local generation batches TRL's own train dataloader deals, one per rollout, over `epochs` epochs."""
    loader = trainer.get_train_dataloader()
    repeats = trainer.args.steps_per_generation * trainer.num_iterations
    order = []
    for _ in range(epochs):
        batches = list(loader)
        order += [[x["prompt"] for x in batches[i]] for i in range(0, len(batches), repeats)]
    return order


# --------------------------------------------------------------------------------------------------- policy
def test_reward_std_rule_and_user_filter():
    weights = torch.tensor([1.0, 0.5])
    rewards = torch.tensor(
        [
            [1.0, 0.0],
            [1.0, 0.0],
            [1.0, 0.0],  # constant
            [1.0, 0.0],
            [0.0, 2.0],
            [1.0, 0.0],  # weighted sums 1, 1, 1: all equal, functions differ
            [0.0, 0.0],
            [1.0, 0.0],
            [float("nan"), float("nan")],  # spread among the scored ones
            [float("nan")] * 2,
            [float("nan")] * 2,
            [0.5, 0.0],  # one scored completion: no spread
            [0.2, 0.0],
            [0.2 + 1e-9, 0.0],
            [0.2, 0.0],  # differ below TRL's isclose: equal
        ]
    )
    keep, spread = keep_groups(rewards, weights, 3)
    assert keep.tolist() == [False, False, True, False, False]
    assert spread[0] == 0 and torch.isnan(spread[3]) and spread[2] > 0
    keep, _ = keep_groups(rewards, weights, 3, mean_above_half)  # the user's predicate sees (G, F), unweighted
    assert keep.tolist() == [True, True, False, False, False]


def test_batch_unit():
    assert batch_unit(num_generations=8, num_processes=1, steps_per_generation=4) == 1
    assert batch_unit(num_generations=2, num_processes=1, steps_per_generation=4) == 2
    assert batch_unit(num_generations=8, num_processes=8, steps_per_generation=4) == 4
    assert batch_unit(num_generations=3, num_processes=2, steps_per_generation=4) == 8


def _filling(rounds, target=4, unit=1, max_rounds=3, underfill="shrink"):
    filling = GroupFilling(target, unit, max_rounds, underfill)
    for keep, spread in rounds:
        assert not filling.done
        filling.add_round(torch.tensor(keep), torch.tensor(spread))
    return filling


def test_group_filling_plans():
    # full after two rounds: the first passing groups in data order, the surplus discarded
    filling = _filling([([1, 0, 0, 1], [1, 0, 0, 1]), ([0, 1, 1, 1], [0, 2, 2, 2])])
    assert filling.done
    plan = filling.plan()
    assert plan.groups == [(0, 0), (0, 3), (1, 1), (1, 2)] and plan.discarded == 1 and not plan.underfilled
    assert (plan.rounds, plan.generated, plan.passed, plan.padded) == (2, 8, 5, 0)
    # the cap first: pad with the failing groups of highest spread (NaN last), then data order
    rounds = [([1, 0, 0, 0], [1, 0, 0.5, float("nan")]), ([0, 0, 0, 0], [0.5, 0, 0, 0])]
    plan = _filling(rounds, max_rounds=2, underfill="pad").plan()
    assert plan.groups == [(0, 0), (0, 2), (1, 0), (0, 1)] and plan.padded == 3 and plan.underfilled
    # shrink: whole units only, the remainder discarded; nothing passed -> the best failing groups make one unit
    rounds = [([1, 1, 1, 0], [1, 1, 1, 0])]
    plan = _filling(rounds, unit=2, max_rounds=1).plan()
    assert plan.groups == [(0, 0), (0, 1)] and plan.discarded == 1 and plan.padded == 0
    plan = _filling([([0, 0, 0, 0], [0, 0.3, 0, 0.1])], unit=2, max_rounds=1).plan()
    assert plan.groups == [(0, 1), (0, 3)] and plan.padded == 2
    plan = _filling([([0, 0, 1, 0], [0, 0.3, 1, 0.1])], unit=2, max_rounds=1).plan()  # one passed: it stays
    assert plan.groups == [(0, 2), (0, 1)] and plan.padded == 1 and plan.discarded == 0


def test_deal_keeps_groups_whole_and_shares_equal():
    # 2 processes x 8 local rows, groups of 4: process 0 generated groups 0-1 of each round, process 1 groups 2-3
    shares = deal([(0, 0), (0, 2), (0, 3), (1, 3)], num_generations=4, local_rows=8, num_processes=2)
    assert [len(s) for s in shares] == [8, 8]
    assert shares[0] == [(0, g) for g in range(0, 4)] + [(0, g) for g in range(8, 12)]  # its own group 0, then 2
    assert shares[1] == [(0, g) for g in range(12, 16)] + [(1, g) for g in range(12, 16)]  # only its own groups
    with_single = deal([(0, 1), (2, 0)], num_generations=4, local_rows=16, num_processes=1)
    assert with_single == [[(0, g) for g in range(4, 8)] + [(2, g) for g in range(4)]]


def test_prefilter_metrics_are_trls_formulas():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [2.0], [2.0]])
    got = prefilter_reward_metrics(rewards, torch.tensor([2.0]), ["r"], num_generations=2)
    weighted = 2 * rewards[:, 0]
    rel = rounding_bound(torch.float32, rewards.numel() + 4)  # fp32 sums over the rows, a square, root and divisions
    assert got["reward"] == pytest.approx(weighted.mean().item(), rel=rel)
    assert got["reward_std"] == pytest.approx(weighted.std().item(), rel=rel)
    assert got["rewards/r/mean"] == pytest.approx(rewards.mean().item(), rel=rel)
    # companion (helpers/smallest_bug.py's kind): one row left out moves the mean and the std past the bound
    for row in range(len(weighted)):
        rest = torch.cat([weighted[:row], weighted[row + 1 :]])
        assert abs(rest.mean() / weighted.mean() - 1) > rel and abs(rest.std() / weighted.std() - 1) > rel
    assert got["frac_reward_zero_std"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def filled_run(tokenizer, tmp_path_factory, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path_factory.mktemp("filled"), max_steps=6)
    record = Recorder(trainer, tokenizer)
    trainer.train()
    return trainer, record


def test_constant_groups_never_reach_the_loss_and_batches_are_full(filled_run):
    trainer, record = filled_run
    assert len(record.scored) == 3  # 6 optimizer steps, 2 per rollout batch
    assert all(has_signal(p) for p in record.loss_prompts)
    assert len(record.loss_prompts) == 3 * 16  # every rollout batch full: 16 rows
    for rewards, prompts in record.scored:
        groups = rewards[:, 0].view(-1, G)
        assert groups.size(0) == 4 and (groups.std(1) > 0).all()  # every trained group has reward spread
        assert all(has_signal(p) for p in prompts)


def test_prompts_are_drawn_in_the_dataloaders_order(filled_run):
    trainer, record = filled_run
    assert len(record.sampled) == sum(record.rounds_per_batch) > 3  # some batches needed more than one round
    assert all(1 <= n <= trainer.args.max_sampling_rounds for n in record.rounds_per_batch)
    reference = _dataloader_order(trainer, epochs=3)
    assert record.sampled == reference[: len(record.sampled)]  # consecutive: nothing skipped or repeated


def test_metrics_match_hand_counts(filled_run):
    trainer, record = filled_run
    logged = [row for row in trainer.state.log_history if "dynamic_sampling/rounds" in row]
    assert len(logged) == 3
    start = 0
    for row, rounds in zip(logged, record.rounds_per_batch):
        drawn = [p for batch in record.sampled[start : start + rounds] for p in batch]
        start += rounds
        groups = drawn[::G]
        constant = sum(not has_signal(p) for p in groups)
        assert row["dynamic_sampling/rounds"] == rounds
        assert row["dynamic_sampling/kept_groups_fraction"] == pytest.approx(1 - constant / len(groups))
        assert row["frac_reward_zero_std"] == pytest.approx(constant / len(groups))  # before filtering
        assert row["dynamic_sampling/generated_per_kept"] == pytest.approx(len(drawn) / 16)
        rewards = known_reward(drawn, [None] * len(drawn))
        assert row["reward"] == pytest.approx(sum(rewards) / len(rewards))
        assert row["dynamic_sampling/batch_fill"] == 1.0 and row["dynamic_sampling/underfilled"] == 0.0
    assert logged[-1]["dynamic_sampling/data_epoch"] == pytest.approx(len(record.sampled) / 4)


def test_round_cap_and_underfill(tokenizer, tmp_path, trainer_factory):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    for underfill, rows in (("shrink", 4), ("pad", 16)):
        trainer = trainer_factory(
            TRAINER,
            output_dir=tmp_path / underfill,
            reward=constant,
            max_sampling_rounds=2,
            dynamic_sampling_underfill=underfill,
        )
        record = Recorder(trainer, tokenizer)
        trainer.train()
        assert record.rounds_per_batch == [2, 2]  # the cap, exactly
        assert len(record.loss_prompts) == 2 * rows  # shrink: one group (the unit) per batch; pad: full
        logged = [row for row in trainer.state.log_history if "dynamic_sampling/rounds" in row]
        assert all(row["dynamic_sampling/underfilled"] == 1.0 for row in logged)
        assert all(row["dynamic_sampling/batch_fill"] == rows / 16 for row in logged)
        assert all(np.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)


# ---------------------------------------------------------------------------------------- normalisation
NORM_PROMPTS = [
    "copy 0 0 :",
    "copy 1 1 :",
    "copy 0 1 :",
    "copy 2 0 :",
    "copy 2 1 :",
    "copy 3 0 :",
    "copy 3 1 :",
    "copy 2 2 :",
]  # (3 constant, 5 with signal)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("underfill", ["shrink", "pad"])
def test_underfilled_batch_loss_and_gradients_match_a_hand_computation(
    tokenizer, tmp_path, loss_type, underfill, trainer_factory
):
    """G=2, 4 micro-batches of 4 rows per rollout, 2 per optimizer step: a full batch is 8 groups, one round holds 5
    passing ones. `shrink` trains on 4 (whole micro-batches: 4 x 2 rows), `pad` on all 8 (3 zero-advantage groups).
    The trainer's loss and gradients over the first optimizer step must equal the hand computation over that step's
    rows: `grpo` the mean over rows of each sequence's loss; `dapo` the token sum over the kept batch's token count
    per optimizer step (num tokens of the whole kept batch / optimizer steps per rollout)."""
    ga, spg = 2, 4
    extra = dict(allow_token_sum_with_sequence_level=True) if loss_type == "dapo" else {}
    trainer = trainer_factory(
        TRAINER,
        output_dir=tmp_path,
        reward=make_known_reward(2),
        prompts=NORM_PROMPTS,
        num_generations=2,
        max_sampling_rounds=1,
        dynamic_sampling_underfill=underfill,
        loss_type=loss_type,
        learning_rate=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        **extra,
    )
    trainer.model.train()
    trainer._prepare_inputs(None)
    plan = trainer.rollout_source.last.plan
    expected_groups = 4 if underfill == "shrink" else 8
    assert len(plan.groups) == expected_groups and plan.passed == 5
    batches = trainer._buffered_inputs
    assert [len(b["advantages"]) for b in batches] == [expected_groups * 2 // spg] * spg  # equal micro-batches

    trainer.current_gradient_accumulation_steps = ga
    trainer.model.zero_grad()
    trained = sum(trainer._compute_loss(trainer.model, batches[k]) for k in range(ga))
    trained.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    trainer.model.zero_grad()
    step = {
        key: torch.cat([batches[k][key] for k in range(ga)])
        for key in (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "advantages",
            "old_per_token_logps",
        )
    }
    ids = torch.cat([step["prompt_ids"], step["completion_ids"]], 1)
    attention = torch.cat([step["prompt_mask"], step["completion_mask"]], 1)
    width = step["completion_ids"].size(1)
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, step["completion_ids"][..., None])[..., 0]
    mask = step["completion_mask"].float()
    lengths = mask.sum(1)
    ratio = torch.exp(((logps - step["old_per_token_logps"]) * mask).sum(1) / lengths)  # GSPO's s_i
    adv = step["advantages"]
    per_sequence = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    kept_tokens = sum(len(ids) for ids in trainer.rollout_source.last.generation.outputs[1])

    def aggregate(x):  # the loss type's aggregation of per-sequence values over the step's rows
        return x.mean() if loss_type == "grpo" else (x * lengths).sum() / (kept_tokens / (spg // ga))

    hand = aggregate(per_sequence)
    hand.backward(retain_graph=True)  # the companion below takes further gradients through the same forward
    # fp32 rounding of the policy loss over the step's rows (rounding.loss_bound), and of its backward. A sum's
    # rounding is relative to its terms' sizes, not to the result: with each group's advantages summing to 0 the loss
    # itself is ~0 (1e-8 on some CPUs, exactly 0 on others), so the gap is measured against the sum of |terms|.
    seq_len, size = ids.size(1), step["old_per_token_logps"].abs().max().item()
    config = trainer.model.config
    terms = aggregate(per_sequence.abs()).item()
    assert abs(trained.item() - hand.item()) <= loss_bound(torch.float32, config, seq_len, ids.numel(), size) * terms
    assert terms > 1e-3  # the terms are not ~0 themselves: the bound above is not vacuous
    assert grads and all(p.grad is not None for n, p in trainer.model.named_parameters() if n in grads)
    grad_bound = loss_bound(torch.float32, config, seq_len, ids.numel() + ga, size, ids.numel())
    for name, param in trainer.model.named_parameters():
        if name in grads:
            assert relative_gap(grads[name], param.grad) <= grad_bound, name
    assert any(g.abs().max() > 0 for g in grads.values())
    # companion (helpers/smallest_bug.py): one token mis-masked in the step's loss moves the loss (relative to the
    # terms, as above) or some parameter's gradient past its bound, for every token whose loss term moves at all (a
    # sequence the clip holds, or a zero-advantage row, weighs nothing: no test of this batch can see its tokens)
    value_bound = loss_bound(torch.float32, config, seq_len, ids.numel(), size)
    params = [param for name, param in trainer.model.named_parameters() if name in grads]
    want = [param.grad.clone() for param in params]
    margins = []
    for row, t in step["completion_mask"].nonzero().tolist():
        keep = mask.clone()
        keep[row, t] = 0
        kept = keep.sum(1)
        ratio_bug = torch.exp(((logps - step["old_per_token_logps"]) * keep).sum(1) / kept.clamp(min=1))
        per_sequence_bug = -torch.min(ratio_bug * adv, ratio_bug.clamp(0.8, 1.2) * adv)
        bug = (
            per_sequence_bug.mean()
            if loss_type == "grpo"
            else (per_sequence_bug * kept).sum() / (kept_tokens / (spg // ga))
        )
        moved = torch.autograd.grad(bug, params, retain_graph=True, allow_unused=True)
        loss_gap = abs(bug.item() - hand.item()) / (value_bound * terms)
        grad_gap = (
            max(relative_gap(torch.zeros_like(w) if g is None else g, w) for g, w in zip(moved, want)) / grad_bound
        )
        if loss_gap or grad_gap:
            margins.append(max(loss_gap, grad_gap))
    assert margins and min(margins) > 1


# ------------------------------------------------------------------------------------- same as without it
def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_equal_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _varied(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) + 0.1 * len(ids) for ids in completion_ids]


class StockPrepare(GSPOTrainer):
    """TRL's own `_prepare_inputs` (its schedule, shuffle and split), i.e. the code path without any rollout source."""

    _prepare_inputs = GRPOTrainer._prepare_inputs


def test_off_is_trls_own_path_bit_for_bit(tokenizer, tmp_path, trainer_factory):
    common = dict(reward=_varied, dynamic_sampling=False, sort_by_length="never")
    ours = trainer_factory(TRAINER, output_dir=tmp_path / "ours", **common)
    ours.train()
    stock = trainer_factory(TRAINER, output_dir=tmp_path / "stock", cls=StockPrepare, **common)
    stock.train()
    _assert_equal_weights(_weights(ours), _weights(stock))
    assert type(ours.rollout_source).__name__ == "SynchronousRollouts"


def test_a_filter_that_keeps_everything_changes_nothing(tokenizer, tmp_path, trainer_factory):
    off = trainer_factory(TRAINER, output_dir=tmp_path / "off", dynamic_sampling=False)
    off.train()
    keep = trainer_factory(
        TRAINER, output_dir=tmp_path / "keep", dynamic_sampling_filter="test_dynamic_sampling.keep_all"
    )
    keep.train()
    assert keep.rollout_source.last.plan.rounds == 1
    _assert_equal_weights(_weights(off), _weights(keep))
    control = trainer_factory(TRAINER, output_dir=tmp_path / "filter")  # the real filter changes the batches
    control.train()
    assert control.rollout_source.last.plan.generated > control.rollout_source.last.plan.target
    assert any(not torch.equal(v, off.model.state_dict()[k]) for k, v in _weights(control).items())


# --------------------------------------------------------------------------------------------- resume
def _length_reward(completions, **kwargs):  # equal lengths in a group are common: groups get dropped
    return [1.0 / (1 + len(c.split())) for c in completions]


@pytest.fixture(scope="module")
def straight_filled(tokenizer, tmp_path_factory, trainer_factory):
    out = tmp_path_factory.mktemp("straight-ds")
    trainer = trainer_factory(
        TRAINER, output_dir=out, reward=_length_reward, max_steps=6, save_strategy="steps", save_steps=3
    )
    trainer.train()
    return out, _weights(trainer), trainer


def test_resume_in_the_middle_of_a_filled_batch_is_exact(tokenizer, straight_filled, tmp_path, trainer_factory):
    out, final, straight = straight_filled
    state = torch.load(out / "checkpoint-3" / "gspo_rollout_state_rank0.pt", weights_only=True)
    assert state["step"] == 6 and state["source"]["cursor"] > 2  # mid-rollout; more batches drawn than trained
    resumed = trainer_factory(TRAINER, output_dir=tmp_path, reward=_length_reward, max_steps=6)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.state.global_step == 6 and resumed.rollout_source.cursor == straight.rollout_source.cursor
    for name, value in _weights(resumed).items():  # the same computations in the same order: bit for bit
        assert torch.equal(value, final[name]), name


def test_resume_without_the_sources_cursor_differs(tokenizer, straight_filled, tmp_path, trainer_factory):
    """Control: without the saved cursor the source restarts at TRL's schedule position and draws other prompts."""
    out, final, _ = straight_filled
    copy = tmp_path / "checkpoint-3"
    subprocess.run(["cp", "-r", str(out / "checkpoint-3"), str(copy)], check=True)
    path = copy / "gspo_rollout_state_rank0.pt"
    state = torch.load(path, weights_only=True)
    state["source"] = {}
    torch.save(state, path)
    checkpointing.mark_complete(str(copy))
    resumed = trainer_factory(TRAINER, output_dir=tmp_path / "run", reward=_length_reward, max_steps=6)
    resumed.train(resume_from_checkpoint=str(copy))
    diff = max((resumed.model.state_dict()[k] - v).abs().max().item() for k, v in final.items())
    assert diff > 1e-5


# ---------------------------------------------------------------------------------------- evaluation, epochs
def test_evaluation_never_filters(tokenizer, tmp_path, trainer_factory):
    eval_set = Dataset.from_dict({"prompt": PROMPTS})
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, per_device_eval_batch_size=16)
    trainer.eval_dataset = eval_set
    called = []
    trainer.rollout.sample = lambda inputs: called.append(inputs)
    trainer.rollout_source.next_batch = lambda batch: called.append(batch)
    metrics = trainer.evaluate()
    assert not called
    assert metrics["eval_frac_reward_zero_std"] == pytest.approx(0.5)  # half the prompts are constant, all kept


def test_epoch_bounded_run_stops_when_the_data_is_used_up(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, max_steps=-1, num_train_epochs=1)
    record = Recorder(trainer, tokenizer)
    trainer.train()
    drawn = [p for batch in record.sampled for p in batch[::G]]
    assert sorted(drawn) == sorted(PROMPTS)  # one pass over the data, every prompt once
    assert trainer.rollout_source.cursor == 4
    hf_steps = 4 * 4 // 2  # TRL's schedule: 4 rollout batches of 4 micro-batches, 2 per optimizer step
    assert trainer.state.global_step == 2 * len(record.scored) < hf_steps  # stopped after the last filled batch


def test_environment_factory_is_refused(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path)
    trainer.environment_factories = {None: object}
    with pytest.raises(ValueError, match="dynamic_sampling=True does not support environment_factory"):
        DynamicSampling(trainer, trainer.rollout)


def test_streaming_dataset_is_refused_at_construction(tokenizer, tmp_path):
    streamed = Dataset.from_dict({"prompt": PROMPTS}).to_iterable_dataset()
    with pytest.raises(ValueError, match="needs an indexable \\(map-style\\) training dataset; got a streaming one"):
        GSPOTrainer(
            build_tiny_model(tokenizer, seed=0),
            known_reward,
            args=_config(tmp_path),
            train_dataset=streamed,
            processing_class=tokenizer,
        )


def test_bad_filter_path_fails_at_construction(tokenizer, tmp_path, trainer_factory):
    with pytest.raises(
        ValueError,
        match=r"dynamic_sampling_filter: module 'test_dynamic_sampling' has no attribute "
        "'nope'",
    ):
        trainer_factory(TRAINER, output_dir=tmp_path, dynamic_sampling_filter="test_dynamic_sampling.nope")


# ------------------------------------------------------------------------------------------ compositions
class ShiftedSampler(GSPOTrainer):
    """The sampler's log-probs shifted by a known gap, as another engine's numerics would be: pi_old taken from the
    sampler is then told apart from a recomputed one."""

    def _generate_single_turn(self, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        return completion_ids, [[x - 0.25 for x in row] for row in logprobs]


def test_sampler_logprobs_of_kept_rows_are_pi_old(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, cls=ShiftedSampler, old_logprobs_source="sampler")
    trainer.model.train()
    batch = trainer.rollout_source.next_batch(None)
    filled = trainer.rollout_source.last
    assert len(batch["advantages"]) == 16 < sum(len(r.generation) for r in filled.rounds)  # groups were dropped
    ids, mask = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1), batch["completion_mask"]
    with torch.no_grad():  # each row's own log-probs, recomputed: the sampler's are these minus the gap
        logits = trainer.model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"], mask], 1)).logits
    width = mask.size(1)
    logps = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
    recomputed = logps.gather(-1, batch["completion_ids"][..., None])[..., 0]
    m = mask.bool()
    # the sampler's forward (generate, with its cache) and this one: one forward's fp32 rounding, every token
    bound = model_bound(torch.float32, trainer.model.config, ids.size(1))
    assert relative_gap(batch["old_per_token_logps"][m] + 0.25, recomputed[m], math.inf) <= bound
    assert dropped_token_gap(recomputed, m) > bound  # companion: one token mis-masked lands outside it


class EnvRollouts:
    """A multi-turn `rollout_func` stand-in: environment tokens in the completion (TRL's `env_mask` -> `tool_mask`)
    and a per-row extra field the reward reads. Completion ids are unique per call and row."""

    def __init__(self, tokenizer):
        self.vocab, self.eos, self.calls, self.made = len(tokenizer), tokenizer.eos_token_id, 0, {}

    def __call__(self, prompts, trainer):
        g = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [], "difficulty": []}
        for i, prompt in enumerate(prompts):
            n = 3 + i % 4
            ids = torch.randint(4, self.vocab, (n,), generator=g).tolist() + [self.eos]
            env = [1] * (n + 1)
            env[1] = 0  # an environment token inside the completion
            key = tuple(ids)
            self.made[key] = (env, 0.0 if not has_signal(prompt) else 1.0)
            out["prompt_ids"].append([5, 6, 7 + len(prompt) % 5])
            out["completion_ids"].append(ids)
            out["env_mask"].append(env)
            out["difficulty"].append(self.made[key][1])
        return out


def _env_reward(completion_ids, difficulty, **kwargs):
    return [d * len(ids) for ids, d in zip(completion_ids, difficulty)]


def test_rollout_func_with_env_mask_and_packed_forwards(tokenizer, tmp_path):
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    rollouts = EnvRollouts(tokenizer)
    packed = fused_logprob_head_module() is not None  # packing needs TRL's fused head (TRL >= 1.15)
    args = _config(tmp_path, padding_free=packed, max_completion_length=8)
    trainer = GSPOTrainer(
        build_tiny_model(tokenizer, seed=0),
        _env_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    trainer.model.train()
    batch = trainer.rollout_source.next_batch(None)
    for ids, mask, tool in zip(batch["completion_ids"], batch["completion_mask"], batch["tool_mask"]):
        key = tuple(ids[mask.bool()].tolist())
        env, difficulty = rollouts.made[key]
        assert difficulty == 1.0  # constant-reward rows (difficulty 0) were dropped
        assert tool[: len(env)].tolist() == env
    trainer.train()
    assert all(np.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_r3_routes_follow_the_kept_rows(tokenizer, tmp_path, mode, trainer_factory):
    """vLLM stand-ins whose routes are a function of each row's own prompt and completion (tests/helpers/vllm_stand_in.py;
    server mode runs TRL's own `VLLMGeneration` / `VLLMClient` code): every trained row carries its own routes, so
    the routes of dropped groups went with them."""
    from helpers import vllm_stand_in
    from test_routing_replay import StandInVLLM

    model = build_tiny_model(tokenizer, moe=True, seed=0, num_experts=8)
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, model=model, routing_replay="R3", max_completion_length=6)
    hooks = trainer.moe_routing.hooks
    layers = len(hooks.routers)

    class TokenRoutedVLLM(StandInVLLM):  # colocate: routes from the tokens, as the stand-in server computes them
        def _engine(self, prompts, **kwargs):
            outputs = []
            for prompt, completion in zip(prompts, self._completions(prompts)):
                ids = prompt["prompt_token_ids"]
                raw = vllm_stand_in.routes_for(ids, completion, layers, hooks.top_k, hooks.num_experts)
                choice = types.SimpleNamespace(token_ids=completion, routed_experts=raw)
                outputs.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=[choice]))
            return outputs

    if mode == "server":
        if not trl_compat.vllm_server_returns_routes():
            pytest.skip("this TRL's vLLM client talks to `trl vllm-serve`, which returns no routes")
        server = vllm_stand_in.StandInServer(layers, hooks.top_k, hooks.num_experts)
        vllm_stand_in.server_generation(trainer, server)
    else:
        trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, TokenRoutedVLLM(mode, None), -1
        trainer.vllm_importance_sampling_correction = False
        trainer.moe_routing.capture_vllm_routes(trainer.vllm_generation, trainer.accelerator)
    checked = vllm_stand_in.check_rollout_routes(trainer, layers, hooks.top_k, hooks.num_experts)
    trainer.model.train()
    batch = trainer.rollout_source.next_batch(None)
    filled = trainer.rollout_source.last
    assert len(batch["advantages"]) == checked["rows"] == 16 < sum(len(r.generation) for r in filled.rounds)
    assert filled.plan.rounds > 1  # groups were dropped and more prompts generated
    if mode == "server":
        assert [path for path, _ in server.requests] == ["/v1/completions"] * filled.plan.rounds
    else:
        assert trainer.vllm_generation.calls == filled.plan.rounds


# ----------------------------------------------------------------------------------------- 2 processes
WORKER = Path(__file__).parent / "helpers" / "dynamic_sampling_worker.py"


@pytest.mark.slow
@pytest.mark.launch  # several processes: one launch at a time (conftest.py)
def test_two_processes_agree_on_kept_groups_with_a_rank_dependent_reward(tmp_path):
    """Rank 0's reward is constant, rank 1's varies: decided on local rewards, rank 0 would keep nothing and rank 1
    its own groups. On the gathered rewards both keep exactly the groups rank 1 generated, and each trains an equal
    share of them (rows move from rank 1 to rank 0)."""
    cmd = two_processes(WORKER, "--output_dir", tmp_path)
    run = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=300)
    log = run.stdout + run.stderr
    reports = {}
    for rank in (0, 1):
        path = tmp_path / f"report_rank{rank}.json"
        assert path.exists(), log[-4000:]
        reports[rank] = json.loads(path.read_text())
    a, b = reports[0], reports[1]
    assert len(a["kept"]) == 2 and a["kept"] == b["kept"] and a["rewards"] == b["rewards"], log[-4000:]
    for kept, rewards, rows0, rows1 in zip(a["kept"], a["rewards"], a["rows"], b["rows"]):
        groups = [rewards[i : i + 2] for i in range(0, len(rewards), 2)]  # gathered: 4 groups per round, in order
        varying = [k for k, group in enumerate(groups) if group[0] != group[1]]
        assert kept == varying[:4]  # a full batch of the first passing groups, decided on the gathered rewards
        assert all(k % 4 in (2, 3) for k in kept)  # rank 1 generated them (global rows 4-7 of each round)
        assert len(rows0) == len(rows1) == 4  # equal shares of whole groups: rank 0 trains rows rank 1 generated
        assert sorted(rows0 + rows1) == sorted(k for k in kept for _ in range(2))
    assert a["finished"] == b["finished"] == [1]
