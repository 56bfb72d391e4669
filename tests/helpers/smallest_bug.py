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
  out: no test of this batch, under any bound, can show it. `one_token_margin`: the same bugs, each caught by the loss's
  bound or the gradients', whichever it passes by more.
- `dropped_token_means`: a per-sequence mean over the tokens (a length-normalised log-ratio, its exp an importance
  weight): each row's mean with one of its tokens left out, for the test to measure as it measures the mean;
  `dropped_token_mean_gap` measures fn(mean) (exp: the weight) every row, relative to the largest.
- `one_token_step_gap`: the weights of two plain-SGD runs (`rounding.sgd_weights_bound`). One token mis-masked in one
  step's loss moves that step, learning rate x the clipped gradient, and a step small enough to train stably carries
  the move forward (first order, as the bound assumes); in the run's last step nothing follows to shrink it. Per
  token, the largest move over the parameters relative to each one's bound; returns the smallest over the tokens.
- `trainer_loss` / `accumulated_trainer_loss`: `compute` over the trainer's own loss on one micro-batch, or on the
  micro-batches one optimizer step accumulates (`last_step_micro_batches`: a finished run's last step), at the
  weights that step started from (`LastStepStart`, added before training; `last_step_start`). At the end weights, one
  step later, the step's importance ratios have moved: GSPO's band (3e-4) then clips rows the step itself did not
  clip, and their tokens seem to weigh nothing (measured: a one-token bug at 5e-9 of the bound that is 15x it where
  the step ran).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import TrainerCallback

from trl_gspo.rounding import relative_gap


def dropped_token_gap(values: torch.Tensor, mask: torch.Tensor) -> float:
    """min |v_k| / max |v| over the tokens `mask` keeps: what one of them, mis-masked, moves the comparison by."""
    kept = values.detach()[mask.bool()].double().abs()
    return (kept.min() / kept.max()).item()


def each_token_dropped(mask: torch.Tensor):
    """`keep` masks of `mask`'s shape, one per token of `mask`: all ones but a 0 at that token, each token in turn."""
    for index in mask.nonzero().tolist():
        keep = torch.ones_like(mask)
        keep[tuple(index)] = 0
        yield keep


def _loss_and_gradients(model, loss: torch.Tensor):
    """`compute`'s answer: `loss` back-propagated into `model` (its gradients zeroed before the forward)."""
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _per_token_gaps(compute, mask: torch.Tensor) -> list[tuple[float, float]]:
    """(loss gap, largest gradient gap) per token of `mask` dropped, leaving out tokens that change nothing."""
    loss, grads = compute(torch.ones_like(mask))
    gaps = []
    for keep in each_token_dropped(mask):
        bug_loss, bug_grads = compute(keep)
        loss_gap = relative_gap(bug_loss, loss)
        grad_gap = max(relative_gap(bug_grads[name], grad) for name, grad in grads.items())
        if loss_gap == 0 and grad_gap == 0:  # the token weighs nothing here (a clipped sequence's): no test sees it
            continue
        gaps.append((loss_gap, grad_gap))
    assert gaps, "no token of the mask changes the loss: the batch cannot show a one-token bug"
    return gaps


def one_token_gaps(compute, mask: torch.Tensor) -> tuple[float, float]:
    """(smallest loss gap, smallest largest-gradient gap) over the tokens of `mask` dropped one at a time;
    `compute(keep)` -> (loss, {parameter name: gradient}) with the loss's mask multiplied by `keep`."""
    gaps = _per_token_gaps(compute, mask)
    return min(g[0] for g in gaps), min(g[1] for g in gaps)


def one_token_margin(compute, mask: torch.Tensor, loss_bound: float, grad_bound: float) -> float:
    """min over the tokens of `mask` of max(loss gap / `loss_bound`, largest gradient gap / `grad_bound`): a test that
    checks a loss and its gradients catches a bug in whichever moves past its bound (a token that moves a sequence into
    GSPO's clip moves the loss, not the gradient). Above 1: the hardest one-token bug is caught."""
    return min(max(loss / loss_bound, grad / grad_bound) for loss, grad in _per_token_gaps(compute, mask))


def dropped_token_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, tokens] in fp64: row i's mean of `values` over `mask` with token (i, t) left out, NaN where `mask` has no
    token or the row has no other token (that bug empties the mean: it shows whatever the bound)."""
    v, m = values.detach().double(), mask.double()
    total, count = (v * m).sum(1, keepdim=True), m.sum(1, keepdim=True)
    means = (total - v) / (count - 1).clamp(min=1)
    return torch.where(mask.bool() & (count > 1), means, torch.full_like(means, float("nan")))


def dropped_token_mean_gap(values: torch.Tensor, mask: torch.Tensor, fn=torch.exp) -> float:
    """min over the tokens of `mask` of |fn(row's mean without the token) - fn(row's mean)| / max |fn(mean)|: a
    per-sequence fn of a mean (exp: an importance weight) compared, every row, relative to the largest."""
    v, m = values.detach().double(), mask.double()
    full = fn((v * m).sum(1) / m.sum(1).clamp(min=1))
    moved = (fn(dropped_token_means(values, mask)) - full[:, None]).abs()
    return (moved[~moved.isnan()].min() / full.abs().max()).item()


def one_token_step_gap(compute, mask: torch.Tensor, learning_rate: float, max_grad_norm: float, bounds: dict) -> float:
    """min over the tokens of `mask`, dropped one at a time, of max over the parameters of ||step moved|| / bound,
    an SGD step being learning_rate x the gradient clipped to `max_grad_norm` in total 2-norm, as the trainer clips;
    `compute` as for `one_token_gaps`, `bounds` each parameter's weights bound. Above 1: the bug shows."""

    def step(grads):
        norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads.values()])).item()
        scale = min(1.0, max_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        return {n: learning_rate * scale * g.double() for n, g in grads.items()}

    base = step(compute(torch.ones_like(mask))[1])
    gaps = []
    for keep in each_token_dropped(mask):
        moved = step(compute(keep)[1])
        gap = max((moved[n] - base[n]).norm().item() / bounds[n] for n in base)
        if gap > 0:  # a token that weighs nothing here (a clipped sequence's) is left out, as in one_token_gaps
            gaps.append(gap)
    assert gaps, "no token of the mask moves the step: the batch cannot show a one-token bug"
    return min(gaps)


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
        return _loss_and_gradients(model, loss)

    return compute


class LastStepStart(TrainerCallback):
    """Keeps the trainable weights as a run's last optimizer step begins (`weights`), for the last-step companions:
    `trainer.add_callback(LastStepStart())` before `train()`, then `last_step_start(trainer)`."""

    weights: dict | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == state.max_steps - 1:
            self.weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def last_step_start(trainer) -> dict:
    """The trainable weights `trainer`'s last optimizer step started from (its `LastStepStart` callback's)."""
    kept = [c.weights for c in trainer.callback_handler.callbacks if isinstance(c, LastStepStart)]
    assert kept and kept[0] is not None, "add LastStepStart() to the trainer before train(): no last step was kept"
    return kept[0]


@contextlib.contextmanager
def at_weights(model, weights: dict | None):
    """`model` with its parameters named in `weights` set to them for the block, then back as they were."""
    if weights is None:
        yield
        return
    params = dict(model.named_parameters())
    kept = {n: params[n].detach().clone() for n in weights}
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, w in kept.items():
                params[n].copy_(w)


def trainer_loss(trainer, inputs: dict, start: dict | None = None):
    """`compute` for `one_token_gaps` / `one_token_step_gap` over the trainer's own loss on a micro-batch it trained
    on (one micro-batch per optimizer step: the step's whole gradient), the completion mask multiplied by `keep`:
    `accumulated_trainer_loss` over that one micro-batch. Overwrites the model's gradients: call it after the test's
    own checks."""
    return accumulated_trainer_loss(trainer, [inputs], start)


def accumulated_trainer_loss(trainer, micro_batches: list, start: dict | None = None):
    """`trainer_loss` over an optimizer step of several micro-batches (gradient accumulation): the trainer's own loss
    on each, the losses and gradients summed as the step accumulates them; `keep` covers their rows stacked in order
    (their completion masks of one width, as slices of one padded batch are). One token dropped changes only its own
    micro-batch's loss and gradient, so only that micro-batch is recomputed. `start`: the weights to compute at (the
    step's own, `last_step_start`), else the model's as they are. Overwrites the model's gradients: call it after the
    test's own checks."""
    model = trainer.model
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    rows = [len(mb["completion_mask"]) for mb in micro_batches]

    def one(mb, keep):
        model.zero_grad(set_to_none=True)
        inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in mb.items()}
        with at_weights(model, start):
            loss = trainer._compute_loss(model, {**inputs, "completion_mask": inputs["completion_mask"] * keep})
            return _loss_and_gradients(model, loss)

    base = [one(mb, torch.ones_like(mb["completion_mask"])) for mb in micro_batches]

    def compute(keep):
        parts = [
            base[i] if bool(k.all()) else one(mb, k) for i, (mb, k) in enumerate(zip(micro_batches, keep.split(rows)))
        ]
        names = dict.fromkeys(n for _, grads in parts for n in grads)
        grads = {n: sum(g[n] for _, g in parts if n in g) for n in names}
        return sum(loss for loss, _ in parts), grads

    return compute


def last_step_micro_batches(trainer) -> list:
    """The micro-batches of a finished run's last optimizer step, from its buffer (TRL takes micro-batch
    `_step % steps_per_generation` of the buffered rollout; a step accumulates `gradient_accumulation_steps` of them)."""
    buffered, ga = trainer._buffered_inputs, trainer.args.gradient_accumulation_steps
    return [buffered[step % len(buffered)] for step in range(trainer._step - ga, trainer._step)]


def weighted_tokens(micro_batches: list) -> torch.Tensor:
    """The completion tokens of `micro_batches` (rows stacked) whose rows carry a non-zero advantage: a token of a
    zero-advantage row weighs nothing in the policy loss, so leaving it out moves the step by rounding alone, which no
    test of these batches can show (as a clipped sequence's, left out by `one_token_gaps`)."""
    rows = []
    for mb in micro_batches:
        advantages = mb["advantages"] if mb["advantages"].dim() > 1 else mb["advantages"][:, None]
        rows.append(mb["completion_mask"] * (advantages != 0))
    return torch.cat(rows)


def last_step_gap(trainer, bounds: dict) -> float:
    """`one_token_step_gap` over a finished run's last optimizer step: its micro-batches accumulated at the weights it
    started from (`LastStepStart`), each token of a row with a non-zero advantage dropped in turn (`weighted_tokens`);
    `bounds` each parameter's end-weights bound. Above 1: the bug shows."""
    last = last_step_micro_batches(trainer)
    compute = accumulated_trainer_loss(trainer, last, last_step_start(trainer))
    rate, max_norm = last_step_learning_rate(trainer), trainer.args.max_grad_norm
    return one_token_step_gap(compute, weighted_tokens(last), rate, max_norm, bounds)


def boundary_one_key_early(layout, start: int):
    """`layout` (a segment layout) with the segment that starts at position `start` starting one key earlier, so each of
    its positions also sees the token before it (its neighbour's last): the smallest leak between packed sequences or
    shared-prefix siblings. A fresh plan, built again when the layout is called."""
    plan = layout.segments
    own_start = plan.own_start.clone()
    own_start[own_start == start] = start - 1
    return dataclasses.replace(layout, segments=type(plan)(own_start, plan.ctx_start, plan.ctx_end))


def last_step_learning_rate(trainer) -> float:
    """The learning rate of a finished run's last optimizer step, from its scheduler (a `LambdaLR`, as transformers'
    schedules are): the step whose bug nothing after it shrinks."""
    factor = trainer.lr_scheduler.lr_lambdas[0](trainer.state.global_step - 1)
    return trainer.args.learning_rate * factor
