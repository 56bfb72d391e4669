"""Per-token advantages for GSPO-token (`importance_sampling_level="sequence_token"`).

A function here takes the loss's `inputs` batch (TRL's keys: `advantages` `(B,)`, `completion_ids`,
`completion_mask`, and `tool_mask` for multi-turn tool use) and returns `(B, T)` advantages. Use it from the one
hook, `GSPOTrainer.token_advantages`::

    class TurnCreditTrainer(GSPOTrainer):
        def token_advantages(self, inputs):
            return discounted_turn_advantages(inputs, gamma=0.5)
"""

from __future__ import annotations

import torch


def model_turn_index(tool_mask: torch.Tensor) -> torch.Tensor:
    """Index of the model turn each completion token belongs to, `(B, T)` long.

    In TRL's multi-turn rollouts the completion interleaves model turns (tool_mask 1) with tool results
    (tool_mask 0); a new model turn starts wherever the mask goes from 0 back to 1.
    """
    starts = torch.zeros_like(tool_mask, dtype=torch.long)
    starts[:, 1:] = ((tool_mask[:, 1:] == 1) & (tool_mask[:, :-1] == 0)).long()
    return starts.cumsum(dim=1)


def discounted_turn_advantages(inputs: dict, gamma: float = 0.5) -> torch.Tensor:
    """Give each model turn the outcome advantage discounted by how many turns precede the final one.

        A_i,t = A_i * gamma ** (last_turn_i - turn_i(t))

    The final answer turn, closest to the verified outcome, gets the full advantage; earlier exploratory turns
    (tool calls whose usefulness the reward only judges indirectly) get geometrically less credit. A single-turn
    completion gets `A_i` on every token, where GSPO-token equals GSPO exactly.
    """
    advantages = inputs["advantages"]
    tool_mask = inputs.get("tool_mask")
    if tool_mask is None:
        tool_mask = torch.ones_like(inputs["completion_mask"])
    turn = model_turn_index(tool_mask * inputs["completion_mask"] + (1 - inputs["completion_mask"]))
    valid = inputs["completion_mask"].bool()
    last_turn = torch.where(valid, turn, torch.zeros_like(turn)).amax(dim=1, keepdim=True)
    discount = gamma ** (last_turn - turn).clamp(min=0).to(advantages.dtype)
    return advantages[:, None] * discount


def checked_advantages(advantages: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """What `GSPOTrainer.token_advantages` returned, as the loss takes it: `(B, 1)` or `(B, T)`. A wrong shape, or
    per-token advantages with `importance_sampling_level="sequence"` (one ratio per completion would silently average
    them), raise naming what is allowed."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(1)
    if advantages.dim() != 2 or advantages.size(0) != mask.size(0) or advantages.size(1) not in (1, mask.size(1)):
        raise ValueError(
            f"token_advantages must return shape (B,) or (B, T) = ({mask.size(0)}, {mask.size(1)}), got "
            f"{tuple(advantages.shape)}."
        )
    if advantages.size(1) > 1 and level == "sequence":
        raise ValueError(
            "Per-token advantages of shape (B, T) need importance_sampling_level='sequence_token' (GSPO-token) "
            "or 'token': with 'sequence' there is one ratio per completion and the token advantages would be "
            "silently averaged."
        )
    return advantages
