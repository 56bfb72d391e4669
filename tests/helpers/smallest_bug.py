"""The smallest real bug of a numeric test's kind, measured in the test's own batch: the companion checks that show a
rounding bound (trl_gspo/rounding.py) still fails on it. A bound a one-token mistake passes would prove nothing.

- `dropped_token_gap`: a per-token comparison (log-probs, entropies) scaled, as the tests scale it, by the largest
  |value| in the batch. One token mis-masked moves its own value to 0 (or puts a value where 0 was), so the smallest
  such gap is the smallest |value| among the masked tokens over the largest.
- `one_token_gaps`: a loss and its parameter gradients, from the test's own reference. Each token of the loss mask is
  dropped in turn (`compute(keep)` with a 0 at that token); per token, the loss's relative gap and the largest
  relative gap over the parameters (the tests check every parameter, so a bug shows where it moves most); returns
  the smallest of each over the tokens: the one-token bug the bound has the hardest time catching. A token whose
  removal changes nothing at all (in a sequence GSPO clips, every token's term is the same clipped value) is left
  out: no test of this batch, under any bound, can show it.
"""

from __future__ import annotations

import torch

from trl_gspo.rounding import relative_gap


def dropped_token_gap(values: torch.Tensor, mask: torch.Tensor) -> float:
    """min |v_k| / max |v| over the tokens `mask` keeps: what one of them, mis-masked, moves the comparison by."""
    kept = values.detach()[mask.bool()].double().abs()
    return (kept.min() / kept.max()).item()


def one_token_gaps(compute, mask: torch.Tensor) -> tuple[float, float]:
    """(smallest loss gap, smallest largest-gradient gap) over the tokens of `mask` dropped one at a time;
    `compute(keep)` -> (loss, {parameter name: gradient}) with the loss's mask multiplied by `keep`."""
    loss, grads = compute(torch.ones_like(mask))
    loss_gaps, grad_gaps = [], []
    for index in mask.nonzero().tolist():
        keep = torch.ones_like(mask)
        keep[tuple(index)] = 0
        bug_loss, bug_grads = compute(keep)
        loss_gap = relative_gap(bug_loss, loss)
        grad_gap = max(relative_gap(bug_grads[name], grad) for name, grad in grads.items())
        if loss_gap == 0 and grad_gap == 0:  # the token weighs nothing here (a clipped sequence's): no test sees it
            continue
        loss_gaps.append(loss_gap)
        grad_gaps.append(grad_gap)
    assert loss_gaps, "no token of the mask changes the loss: the batch cannot show a one-token bug"
    return min(loss_gaps), min(grad_gaps)


def weighted_logp_loss(model, batch: dict, weights, entropy_coef: float = 0.1, temperature: float = 1.0):
    """`compute` for `one_token_gaps` over the loss the layout tests take gradients of, sum(log-prob x weight) +
    entropy_coef x sum(entropy) over the completion tokens: a plain padded forward of `model`, its logits divided by
    `temperature` as the trainer does. Uses `model` itself (a trainer's model may be patched to read its own weights,
    which a copy would not train), so its gradients are overwritten: call it after the test's own checks."""
    prompt, completion = batch["prompt_ids"], batch["completion_ids"]
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)

    def compute(keep):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, prompt.size(1) - 1 : -1].float() / temperature
        logp_all = torch.log_softmax(logits, -1)
        logps = logp_all.gather(-1, completion[..., None])[..., 0]
        entropies = -(logp_all.exp() * logp_all).sum(-1)
        mask = batch["completion_mask"] * keep
        loss = (logps * weights * mask).sum() + entropy_coef * (entropies * mask).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    return compute
