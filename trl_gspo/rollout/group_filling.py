"""Which groups make a dynamic-sampling batch: the filter and the filling policy, with no generation and no
communication (rollout/dynamic_sampling.py runs the rounds and deals the groups to processes).

The filter (`keep_groups`): a group passes when its weighted rewards are not all equal (TRL's zero-std test), or
when the user's `dynamic_sampling_filter` function says so. The policy (`GroupFilling`): the first passing groups in
data order up to the batch size, in whole `batch_unit`s; `shrink` or `pad` when the rounds run out (`FillPlan`);
`deal` hands the planned groups to processes in equal shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..common.imports import import_object

#: What to do when `max_sampling_rounds` is reached before the batch is full.
UNDERFILL_POLICIES = ("shrink", "pad")
#: The built-in group filter: drop groups whose rewards are all equal.
REWARD_STD = "reward_std"


# ------------------------------------------------------------------------------------------- the filter
def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TRL's reward per completion: the weighted sum over reward functions, NaN where no function scored it."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def group_spread(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Standard deviation of each group's rewards `(groups,)`, TRL's `nanstd` (NaN with fewer than 2 scored)."""
    from trl.trainer.utils import nanstd

    return nanstd(rewards.view(-1, num_generations), dim=1)


def zero_spread(spread: torch.Tensor) -> torch.Tensor:
    """TRL's zero-std test (`frac_reward_zero_std`): `isclose(std, 0)`; NaN is not zero."""
    return torch.isclose(spread, torch.zeros_like(spread))


def keep_groups(rewards_per_func, weights, num_generations, group_filter=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, spread), `(groups,)` each, for a gathered reward matrix `(groups * num_generations, funcs)` laid out
    group after group (TRL's layout). Default filter: the weighted rewards of the group are not all equal (a NaN
    spread, fewer than two scored completions, fails too); `group_filter(group_rewards) -> bool` replaces it."""
    rewards_per_func = rewards_per_func.detach().float().cpu()
    spread = group_spread(weighted_rewards(rewards_per_func, weights.cpu()), num_generations)
    if group_filter is None:
        keep = ~zero_spread(spread) & ~torch.isnan(spread)
    else:
        groups = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        keep = torch.tensor([bool(group_filter(group.clone())) for group in groups], dtype=torch.bool)
    return keep, spread


def load_group_filter(spec: str):
    """`dynamic_sampling_filter` -> None (the built-in rule) or the user's callable."""
    if spec == REWARD_STD:
        return None
    try:
        func = import_object(spec)
    except ValueError as err:
        raise ValueError(f"dynamic_sampling_filter: {err}") from err
    if not callable(func):
        raise ValueError(f"dynamic_sampling_filter={spec!r} is not callable.")
    return func


# ------------------------------------------------------------------------------------------ the policy
def batch_unit(num_generations: int, num_processes: int, steps_per_generation: int) -> int:
    """Smallest number of groups whose rows split into equal shares per process and `steps_per_generation` equal
    micro-batches per share: a smaller batch must be a multiple of it."""
    rows_unit = num_processes * steps_per_generation
    return rows_unit // math.gcd(num_generations, rows_unit)


@dataclass
class FillPlan:
    """Which groups make the rollout batch. A group is `(round, index of the group in that round)`."""

    groups: list[tuple[int, int]]  # passing groups in data order, then padding groups
    target: int  # groups of a full batch
    rounds: int
    generated: int  # groups generated over all rounds
    passed: int  # groups that passed the filter
    padded: int  # failing groups added (`pad`, or `shrink` with less than one unit)
    discarded: int  # passing groups left out (beyond a full batch, or the remainder under `shrink`)

    @property
    def underfilled(self) -> bool:
        return self.passed < self.target


class GroupFilling:
    """The filling policy alone (no generation, no communication): add each round's filter decisions, ask whether
    the batch is done, then `plan()`."""

    def __init__(self, target: int, unit: int, max_rounds: int, underfill: str):
        self.target, self.unit, self.max_rounds, self.underfill = target, unit, max_rounds, underfill
        self.keep: list[torch.Tensor] = []  # per round: (groups,) bool
        self.spread: list[torch.Tensor] = []  # per round: (groups,) reward std, for ranking padding

    def add_round(self, keep: torch.Tensor, spread: torch.Tensor) -> None:
        self.keep.append(keep.bool().cpu())
        self.spread.append(spread.float().cpu())

    @property
    def passed(self) -> int:
        return int(sum(k.sum() for k in self.keep))

    @property
    def done(self) -> bool:
        return self.passed >= self.target or len(self.keep) >= self.max_rounds

    def plan(self) -> FillPlan:
        passing = [(r, int(k)) for r, keep in enumerate(self.keep) for k in keep.nonzero().flatten()]
        failing = [(r, int(k)) for r, keep in enumerate(self.keep) for k in (~keep).nonzero().flatten()]
        # best failing first: highest spread (NaN: none at all, last), then data order
        failing.sort(key=lambda rk: (-_finite_or(self.spread[rk[0]][rk[1]], -math.inf), rk))
        if len(passing) >= self.target:
            chosen, pad = passing[: self.target], []
        elif self.underfill == "pad":
            chosen, pad = passing, failing[: self.target - len(passing)]
        elif len(passing) >= self.unit:  # shrink to whole units
            chosen, pad = passing[: len(passing) // self.unit * self.unit], []
        else:  # less than one unit passed: pad up to one with the best failing groups (a batch cannot be empty)
            chosen, pad = passing, failing[: self.unit - len(passing)]
        generated = sum(len(k) for k in self.keep)
        return FillPlan(
            groups=chosen + pad,
            target=self.target,
            rounds=len(self.keep),
            generated=generated,
            passed=len(passing),
            padded=len(pad),
            discarded=len(passing) - len(chosen),
        )


def _finite_or(value: torch.Tensor, default: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else default


def deal(groups: list[tuple[int, int]], num_generations: int, local_rows: int, num_processes: int):
    """The rows `(round, global row)` of each process's share of `groups`. Groups are ordered by the process that
    generated them (then data order), so a process trains its own groups where it can and rows cross processes
    only where shares and passing groups differ."""
    owner = lambda group: group[1] * num_generations // local_rows  # noqa: E731 - process of the group's first row
    ordered = sorted(groups, key=lambda group: (owner(group), group))
    rows = [(r, k * num_generations + i) for r, k in ordered for i in range(num_generations)]
    share = len(rows) // num_processes
    return [rows[p * share : (p + 1) * share] for p in range(num_processes)]
