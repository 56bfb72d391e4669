"""Dynamic sampling (DAPO): every rollout batch is filled with groups whose rewards differ.

A group whose `num_generations` completions all get the same reward has zero advantage: it adds nothing to the
policy gradient, yet costs its generation, its share of the pi_old / reference passes and of every training forward.
DAPO (Yu et al. 2025, arXiv 2503.14476, "dynamic sampling") drops such groups and keeps sampling further prompts
until the batch is full. `GSPOConfig(dynamic_sampling=True)` does that as the rollout pipeline's `RolloutSource`
(pipeline.py), `DynamicSampling`:

    fill():  round r = 0, 1, ... until the batch is full or r = max_sampling_rounds:
        inputs     = the next generation batch of the training data, in the sampler's order (rollout/prompt_stream.py)
        generation = pipeline.sample(inputs)                    TRL's prompt preparation and generation
        rewards    = trainer._calculate_rewards(...)            TRL's reward functions, gathered over processes
        keep       = the groups that pass the filter, decided on the gathered rewards (so every process agrees)
      plan = GroupFilling.plan(): the first passing groups in data order, up to the batch size; if the cap came
             first, `shrink` (train on what passed) or `pad` (fill up with the best groups that failed)
      assemble(): the planned groups dealt to processes in equal shares, whole groups kept in order where possible
             (rows move between processes only where one passed more groups than its share)
    next_batch() = pipeline.score(inputs, generation, rewards)     TRL's scoring of the kept rows only (pi_old and
                                                                    reference passes, advantages): nothing dropped
                                                                    is forwarded again

What stays as without it: each round draws a whole generation batch (`generation_batch_size / num_generations`
prompts), so the prompts are read in exactly the order TRL's sampler deals them, none skipped or repeated; the
source keeps its own cursor into that order (saved in checkpoints, so a resumed run draws the same prompts), and
TRL's dataloader batch is not used. Evaluation is never filtered (it does not go through the source).

Smaller batches (`dynamic_sampling_underfill="shrink"`). The kept rows per process must split into
`steps_per_generation` equal micro-batches (TRL's split would drop a remainder), so the number of kept groups is
rounded down to a multiple of `batch_unit` (1 on one process whenever `steps_per_generation` divides
`num_generations`; the rest is counted in `dynamic_sampling/discarded_groups`), and when fewer than one unit passed
the best failing groups pad up to it. With equal micro-batches every `loss_type` normalises a shrunk batch as a batch
of that size generated from the start: `grpo`/`sapo`/`luspo` average over the rows of each optimizer step,
`dr_grpo` divides by rows x `max_completion_length`, `bnpo` by the micro-batch's tokens, and `dapo`/`cispo` by the
kept batch's own token count (TRL's `num_items_in_batch`, computed by `score` on the kept rows) per optimizer step.
So a shrunk step has the per-sequence (or per-token) weight of a full one; it is noisier, not larger or smaller.
`tests/test_dynamic_sampling.py` checks loss and gradients against a hand computation for `grpo` and `dapo`.

Epochs. A filled rollout reads more prompts than TRL's schedule, while HF's loop still counts epochs by its
dataloader. With `max_steps` the stream simply continues into the next epoch's order (as the sampler would) and
`dynamic_sampling/data_epoch` logs where it is. Without `max_steps`, `num_train_epochs` counts passes over the data:
rounds stop at its end, that rollout is the last one, and training stops after it (before HF's step count, so a
decaying learning-rate schedule does not reach its end: prefer `max_steps`; a warning says so).

Metrics (per rollout batch, TRL's logging): `dynamic_sampling/rounds`, `kept_groups_fraction` (generated groups that
passed), `generated_per_kept` (completions generated per completion trained on), `generated_tokens_per_kept_token`,
`batch_fill` (trained groups / full batch), `padded_groups`, `discarded_groups`, `underfilled`, `data_epoch`. TRL's
`reward`, `reward_std`, `rewards/<name>/*` and `frac_reward_zero_std` describe everything generated for the batch,
before filtering (TRL's own formulas on all rounds' rewards), so they read as without dynamic sampling; TRL's
`completions/*` cover every round.

Asynchronous generation (`async_generation=True` too). `fill(sample)` takes the function that generates a round;
`AsyncRollouts` (rollout/async_rollouts.py) keeps a `DynamicSampling` and answers it with rounds its generator thread
generated ahead of time, within the staleness bound. `GroupFilling` (group_filling.py, with the filter) is the policy alone
(which groups make the batch; no generation, no communication), `sample_round` one collective round, `assemble` the cross-process dealing. `fill`
runs on the main thread of every process in the same order (TRL's prompt preparation, the vLLM gathers and the
reward gather are collectives).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from ..common.validation import check_bool, check_choice, check_int
from .group_filling import (
    REWARD_STD,
    UNDERFILL_POLICIES,
    FillPlan,
    GroupFilling,
    batch_unit,
    deal,
    group_spread,
    keep_groups,
    load_group_filter,
    weighted_rewards,
    zero_spread,
)
from .pipeline import Generation, gather_rows
from .prompt_stream import PromptStream

logger = logging.getLogger(__name__)


@dataclass
class DynamicSamplingOptions:
    r"""
    `GSPOConfig` fields of dynamic sampling (this module).

    Parameters:
        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            Fill every rollout batch with groups that carry signal (DAPO's dynamic sampling): drop groups the filter
            rejects (by default those whose rewards are all equal, i.e. zero advantage) and generate further prompts,
            in data order, until the batch is full or `max_sampling_rounds` is reached.
        max_sampling_rounds (`int`, *optional*, defaults to `4`):
            Most generation rounds per rollout batch, the first included (each round generates a whole generation
            batch of new prompts); `1` filters without refilling. Bounds the generation cost at this many times the
            cost without dynamic sampling.
        dynamic_sampling_filter (`str`, *optional*, defaults to `"reward_std"`):
            Which groups pass. `"reward_std"`: the group's rewards (TRL's weighted sum of the reward functions) are
            not all equal. Or a dotted import path `pkg.module.fn` of `fn(rewards) -> bool`, called once per group
            with its `(num_generations, num_reward_funcs)` float tensor of unweighted rewards (columns in
            `reward_funcs` order, NaN where a function returned None); truthy keeps the group.
        dynamic_sampling_underfill (`str`, *optional*, defaults to `"shrink"`):
            When the rounds run out first: `"shrink"` trains on the passing groups only (a smaller batch, rounded down
            to whole micro-batches, normalised as a batch of that size for every `loss_type`); `"pad"` fills the batch
            up with the failing groups of highest reward spread (zero-advantage groups under the default filter).
            Either is logged (`dynamic_sampling/underfilled`).
    """

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop groups whose rewards are all equal (they have zero advantage and "
            "teach nothing) and generate further prompts, in data order, until the rollout batch is full, so every "
            "trained group carries signal. Costs extra generation rounds."
        },
    )
    max_sampling_rounds: int = field(
        default=4,
        metadata={
            "help": "Cap on generation rounds per rollout batch, the first included (1 = filter without refilling): "
            "bounds generation at this many times its cost without dynamic sampling."
        },
    )
    dynamic_sampling_filter: str = field(
        default=REWARD_STD,
        metadata={
            "help": "Which groups pass: 'reward_std' (rewards not all equal), or a dotted path pkg.module.fn to "
            "fn(rewards: Tensor[num_generations, num_reward_funcs]) -> bool, for another notion of a useful group."
        },
    )
    dynamic_sampling_underfill: str = field(
        default="shrink",
        metadata={
            "help": "When max_sampling_rounds is reached before the batch is full: 'shrink' (train on the passing "
            "groups, a smaller batch, loss normalised for its size) or 'pad' (fill up with the failing groups of "
            "highest reward spread). Logged either way.",
            "choices": list(UNDERFILL_POLICIES),
        },
    )

    def _validate_options(self):
        check_bool("dynamic_sampling", self.dynamic_sampling)
        check_int(
            "max_sampling_rounds",
            self.max_sampling_rounds,
            1,
            "generation rounds per rollout batch, the first included",
        )
        check_choice("dynamic_sampling_underfill", self.dynamic_sampling_underfill, UNDERFILL_POLICIES)
        rule = self.dynamic_sampling_filter
        if not isinstance(rule, str) or (rule != REWARD_STD and "." not in rule):
            raise ValueError(
                f"dynamic_sampling_filter={rule!r} is not supported; allowed: '{REWARD_STD}', or a dotted import path "
                "'pkg.module.fn' to a function of a group's rewards returning True to keep it."
            )


# ---------------------------------------------------------------------------------- rounds and assembly
@dataclass
class Round:
    """One generation round: this process's share of the generation, and the gathered rewards and decisions."""

    rollout: int  # index of the generation batch in the prompt stream (its data order)
    generation: Generation  # this process's rows
    rewards: torch.Tensor  # gathered reward matrix, all processes' rows (TRL's layout)
    keep: torch.Tensor  # (groups,) passed the filter
    spread: torch.Tensor  # (groups,) reward std
    extra_logs: dict  # completion-table columns the reward functions logged (`log_extra`), per local row


def sample_round(trainer, pipeline, stream, rollout: int, group_filter=None, sample=None) -> Round:
    """Generate for generation batch `rollout` of the stream, score it with the reward functions and decide which
    groups pass. Collective: every process calls it for the same `rollout`. `sample(rollout, inputs) -> Generation`
    replaces `pipeline.sample(inputs)` (asynchronous generation answers it with completions generated ahead)."""
    inputs = stream.batch(rollout)
    generation = sample(rollout, inputs) if sample is not None else pipeline.sample(inputs)
    if generation.prompts is None:
        raise RuntimeError("dynamic sampling needs the prompts of each generation (Generation.prompts).")
    prompt_ids, completion_ids, _, completions, _, extra_fields, _, _ = generation.outputs
    inputs = [dict(x) for x in inputs]
    for i, row in enumerate(inputs):  # as TRL merges a rollout_func's extra fields before calling the rewards
        for key, values in extra_fields.items():
            if isinstance(values, list) and i < len(values):
                row[key] = values[i]
            elif not isinstance(values, list):
                row[key] = values
    rewards = trainer._calculate_rewards(inputs, generation.prompts, completions, completion_ids)
    pending = trainer._pending_extra_logs  # per-row columns follow their rows into the trained batch
    extra_logs = {column: pending.pop(column) for column in list(pending) if len(pending[column]) == len(inputs)}
    keep, spread = keep_groups(rewards, trainer.reward_weights, trainer.num_generations, group_filter)
    return Round(rollout, generation, rewards, keep, spread, extra_logs)


def assemble(trainer, stream, rounds: list[Round], plan: FillPlan):
    """This process's share of the planned groups: (inputs, generation, gathered reward matrix of the whole batch in
    its new layout, completion-table columns). Rows generated on another process arrive in one object gather
    (collective when there are several processes)."""
    accelerator = trainer.accelerator
    me, num_processes = accelerator.process_index, accelerator.num_processes
    local_rows = len(rounds[0].generation)
    shares = deal(plan.groups, trainer.num_generations, local_rows, num_processes)
    here = {}  # (round, global row) -> (generation, local index, {column: value})
    for r, round_ in enumerate(rounds):
        for i in range(local_rows):
            here[(r, me * local_rows + i)] = (round_.generation, i, {c: v[i] for c, v in round_.extra_logs.items()})
    if num_processes > 1:
        from accelerate.utils import gather_object

        outgoing = []  # per round: the keys and rows this process generated that another one will train on
        for r, round_ in enumerate(rounds):
            keys = [
                key
                for p, share in enumerate(shares)
                if p != me
                for key in share
                if key[0] == r and key[1] // local_rows == me
            ]
            if keys:
                rows = [key[1] - me * local_rows for key in keys]
                logs = {c: [v[i] for i in rows] for c, v in round_.extra_logs.items()}
                outgoing.append((keys, _to_cpu(round_.generation.take(rows)), logs))
        for keys, part, logs in gather_object(outgoing):
            for i, key in enumerate(keys):
                here.setdefault(key, (part, i, {c: v[i] for c, v in logs.items()}))
    mine = shares[me]
    generation = gather_rows([here[key][:2] for key in mine])
    columns = sorted({c for key in mine for c in here[key][2]})
    extra_logs = {c: [here[key][2].get(c) for key in mine] for c in columns}
    order = {r: stream.prompt_indices(rounds[r].rollout) for r in {r for r, _ in mine}}  # dataset index per prompt
    indices = [order[r][g // trainer.num_generations] for r, g in mine]
    inputs = stream.collate([stream.dataset[i] for i in indices])
    rewards = torch.stack([rounds[r].rewards[g] for share in shares for r, g in share])
    return inputs, generation, rewards, extra_logs


def _to_cpu(obj):
    """Tensors moved to the CPU, so an object gathered from another process unpickles on any device."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, Generation):
        return dataclasses.replace(obj, outputs=_to_cpu(obj.outputs), sampler_routes=_to_cpu(obj.sampler_routes))
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(value) for value in obj)
    return obj


# ------------------------------------------------------------------------------------------------- metrics
def prefilter_reward_metrics(rewards_per_func: torch.Tensor, weights, names, num_generations: int) -> dict:
    """TRL's reward metrics of everything generated (all rounds' gathered reward matrices, concatenated)."""
    from trl.trainer.utils import nanstd

    rewards_per_func = rewards_per_func.float().cpu()
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    rewards = weighted_rewards(rewards_per_func, weights.cpu())
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = zero_spread(group_spread(rewards, num_generations)).float().mean().item()
    return metrics


def log_fill(trainer, rounds: list[Round], plan: FillPlan, generation: Generation, data_epoch: float) -> None:
    """`dynamic_sampling/*` and TRL's reward metrics measured before filtering (replacing the kept batch's)."""
    metrics = trainer._metrics["train"]
    every = torch.cat([round_.rewards for round_ in rounds])
    for name, value in prefilter_reward_metrics(
        every, trainer.reward_weights, trainer.reward_func_names, trainer.num_generations
    ).items():
        if metrics.get(name):
            metrics[name][-1] = value  # the value `score` just logged for the kept rows
        else:
            metrics[name].append(value)
    counts = torch.tensor(
        [
            float(sum(len(ids) for r in rounds for ids in r.generation.outputs[1])),
            float(sum(len(ids) for ids in generation.outputs[1])),
        ]
    )
    if trainer.accelerator.num_processes > 1:
        counts = trainer.accelerator.reduce(counts.to(trainer.accelerator.device), reduction="sum").cpu()
    generated_tokens, kept_tokens = counts.tolist()
    trained = len(plan.groups)
    values = {
        "rounds": plan.rounds,
        "kept_groups_fraction": plan.passed / plan.generated,
        "generated_per_kept": plan.generated / trained,
        "generated_tokens_per_kept_token": generated_tokens / max(kept_tokens, 1.0),
        "batch_fill": trained / plan.target,
        "padded_groups": plan.padded,
        "discarded_groups": plan.discarded,
        "underfilled": float(plan.underfilled),
        "data_epoch": data_epoch,
    }
    for name, value in values.items():
        metrics[f"dynamic_sampling/{name}"].append(float(value))


# ---------------------------------------------------------------------------------------------- the source
@dataclass
class Filled:
    """A filled rollout batch before scoring: what `pipeline.score` needs, and how it was obtained."""

    inputs: list
    generation: Generation
    rewards: torch.Tensor
    extra_logs: dict
    rounds: list[Round]
    plan: FillPlan


class DynamicSampling:
    """`RolloutSource` of `dynamic_sampling=True`: fills each rollout batch with groups that pass the filter, reading
    prompts from the training data in the sampler's order with its own cursor (module docstring)."""

    def __init__(self, trainer, pipeline):
        self.trainer, self.pipeline = trainer, pipeline  # TRL's trainer; rollout/pipeline.py's steps over its code
        args = trainer.args
        if getattr(trainer, "environment_factories", None) is not None:
            raise ValueError(
                "dynamic_sampling=True does not support environment_factory: scoring the kept groups repeats TRL's "
                "prompt preparation, which would reset the environments their completions were generated in. Use "
                "tools or a rollout_func, or dynamic_sampling=False."
            )
        if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError(
                "dynamic_sampling=True reads further prompts in the sampler's order, which needs an indexable "
                "(map-style) training dataset; got a streaming one. Load the dataset without streaming, or set "
                "dynamic_sampling=False."
            )
        self.group_filter = load_group_filter(args.dynamic_sampling_filter)
        self.cursor: int | None = None  # next generation batch of the prompt stream to draw (None: not started)
        self.end_step: int | None = None  # micro-step after which the data of num_train_epochs is used up
        self.last: Filled | None = None  # the latest filled batch (for inspection and tests)
        self._stream = None
        self._warned_underfill = False
        trainer.add_callback(_StopAtDataEnd(self))

    @property
    def stream(self):
        if self._stream is None:
            self._stream = PromptStream.for_trainer(self.trainer)
        return self._stream

    @property
    def budget(self) -> int | None:
        """Generation batches the run may draw: None when `max_steps` bounds training (the stream goes on into the
        next epochs, as TRL's sampler would), else `num_train_epochs` worth of data."""
        args = self.trainer.args
        return None if args.max_steps > 0 else math.ceil(args.num_train_epochs * self.stream.rollouts_per_epoch)

    # ------------------------------------------------------------------------------- RolloutSource
    def next_batch(self, generation_batch: list[dict], sample=None) -> dict:
        """The filled, scored rollout batch (TRL's dataloader batch is not used: the source reads its own stream);
        `sample`: as in `fill`."""
        filled = self.fill(sample)
        trainer = self.trainer
        trainer._pending_extra_logs.update(filled.extra_logs)
        batch = self.pipeline.score(filled.inputs, filled.generation, filled.rewards)
        log_fill(trainer, filled.rounds, filled.plan, filled.generation, self.cursor / self.stream.rollouts_per_epoch)
        return batch

    def fill(self, sample=None) -> Filled:
        """Draw rounds until the batch is full or the cap is reached, and assemble this process's share.
        `sample(position, inputs) -> Generation` generates round `position` of the stream (default: now, through
        `pipeline.sample`; rollout/async_rollouts.py answers it with completions generated ahead of time)."""
        trainer, args, stream = self.trainer, self.trainer.args, self.stream
        if self.cursor is None:
            self.cursor = self._starting_cursor()
        spg = args.steps_per_generation
        unit = batch_unit(trainer.num_generations, trainer.accelerator.num_processes, spg)
        filling = GroupFilling(
            stream.prompts_per_rollout, unit, args.max_sampling_rounds, args.dynamic_sampling_underfill
        )
        rounds, budget = [], self.budget
        while not filling.done:
            if budget is not None and self.cursor >= budget:
                if rounds:
                    break  # the data of num_train_epochs is used up: this batch is the last
                logger.warning(
                    "dynamic sampling: the data of num_train_epochs=%s is used up but another rollout batch "
                    "was asked for; reading on into the next epoch.",
                    args.num_train_epochs,
                )
            round_ = sample_round(trainer, self.pipeline, stream, self.cursor, self.group_filter, sample)
            self.cursor += 1
            filling.add_round(round_.keep, round_.spread)
            rounds.append(round_)
        plan = filling.plan()
        if plan.underfilled and not self._warned_underfill:
            self._warned_underfill = True
            logger.warning(
                "dynamic sampling: %d of %d groups passed the filter in %d rounds (max_sampling_rounds=%d); training "
                "on %d groups, %d of them failing ones added as padding (dynamic_sampling_underfill=%r). Later "
                "occurrences are counted in dynamic_sampling/underfilled.",
                plan.passed,
                plan.target,
                plan.rounds,
                args.max_sampling_rounds,
                len(plan.groups),
                plan.padded,
                args.dynamic_sampling_underfill,
            )
        if budget is not None and self.cursor >= budget and self.end_step is None:
            self.end_step = trainer._step + spg * trainer.num_iterations
            logger.warning(
                "dynamic sampling: the data of num_train_epochs=%s is used up; training stops after this "
                "rollout batch (optimizer step ~%d of %d).",
                args.num_train_epochs,
                self.end_step // args.gradient_accumulation_steps,
                trainer.state.max_steps,
            )
        inputs, generation, rewards, extra_logs = assemble(trainer, stream, rounds, plan)
        self.last = Filled(inputs, generation, rewards, extra_logs, rounds, plan)
        return self.last

    def state_dict(self) -> dict:
        return {
            "cursor": -1 if self.cursor is None else self.cursor,
            "end_step": -1 if self.end_step is None else self.end_step,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("cursor", -1) >= 0:
            self.cursor = int(state["cursor"])
        if state.get("end_step", -1) >= 0:
            self.end_step = int(state["end_step"])

    def poll(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _starting_cursor(self) -> int:
        """0 for a fresh run; for a run resumed from a checkpoint without this source's state, the position of TRL's
        own schedule (prompts may then repeat or be skipped relative to the run that saved it)."""
        trainer = self.trainer
        per_rollout = trainer.args.steps_per_generation * trainer.num_iterations
        done = trainer.state.global_step * trainer.args.gradient_accumulation_steps // per_rollout
        if done:
            logger.warning(
                "dynamic sampling: the checkpoint holds no dynamic-sampling state; reading prompts from "
                "generation batch %d, where TRL's schedule is.",
                done,
            )
        return done


class _StopAtDataEnd(TrainerCallback):
    """Stops training once the last rollout batch the epochs' data allows has been trained on (epoch-bounded runs)."""

    def __init__(self, source: DynamicSampling):
        self.source = source

    def on_train_begin(self, args, state, control, **kwargs):
        if args.max_steps <= 0:
            logger.warning(
                "dynamic_sampling=True without max_steps: num_train_epochs=%s counts passes over the data, which a "
                "filled rollout batch reads faster than TRL's schedule, so training will stop before HF's %d steps "
                "(and before a decaying learning-rate schedule ends). Set max_steps to train a fixed number of steps.",
                args.num_train_epochs,
                state.max_steps,
            )

    def on_step_end(self, args, state, control, **kwargs):
        end = self.source.end_step
        if end is not None and self.source.trainer._step >= end:
            control.should_training_stop = True
        return control
