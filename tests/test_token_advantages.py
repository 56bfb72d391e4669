"""Worked example of per-token advantages with GSPO-token: a multi-turn tool-use completion in which each model
turn gets its own advantage (the outcome advantage discounted by the number of turns after it).

The trainer's loss and parameter gradients are checked against a naive reference built here: its own forward
pass, Python loops over sequences and tokens, and the paper's GSPO-token formula.
"""

import copy

import torch
from datasets import Dataset
from helpers.smallest_bug import one_token_gaps

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.rounding import loss_bound, relative_gap
from trl_gspo.testing import build_tiny_model
from trl_gspo.token_advantages import discounted_turn_advantages, model_turn_index

EPS_LOW, EPS_HIGH, GAMMA = 3e-4, 4e-4, 0.5


def test_turn_index_and_discounts_on_a_crafted_batch():
    # row 0: model(3) tool(2) model(2) ; row 1: single turn of 4 then padding ; row 2: model(1) tool(1) model(1) tool(1) model(1)
    tool_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]])
    assert model_turn_index(tool_mask).tolist() == [[0, 0, 0, 0, 0, 1, 1], [0] * 7, [0, 0, 1, 1, 2, 2, 2]]
    inputs = {"advantages": torch.tensor([2.0, -1.0, 4.0]), "tool_mask": tool_mask, "completion_mask": completion_mask}
    adv = discounted_turn_advantages(inputs, gamma=GAMMA)
    assert adv[0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]  # first turn half credit, final turn full
    assert adv[1, :4].tolist() == [-1.0] * 4  # single turn: the sequence advantage everywhere (GSPO-token == GSPO)
    assert adv[2, :5].tolist() == [1.0, 1.0, 2.0, 2.0, 4.0]


def _naive_reference_loss(model, batch, token_adv):
    """-(1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it), with its own forward and loops."""
    prompt, completion = batch["prompt_ids"], batch["completion_ids"]
    ids = torch.cat([prompt, completion], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attn).logits
    mask = batch["completion_mask"] * batch["tool_mask"]
    total = 0.0
    G, T = completion.shape
    for i in range(G):
        lp = []
        for t in range(T):
            if mask[i, t]:
                row = torch.log_softmax(logits[i, prompt.size(1) + t - 1], dim=-1)
                lp.append((t, row[completion[i, t]]))
        if not lp:
            continue
        old = batch["old_per_token_logps"][i]
        s_i = torch.exp(sum(v - old[t] for t, v in lp) / len(lp)).detach()
        acc = 0.0
        for t, v in lp:
            s_it = s_i * torch.exp(v) / torch.exp(v).detach()
            a = token_adv[i][t]
            acc = acc + torch.min(s_it * a, torch.clamp(s_it, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        total = total + acc / len(lp)
    return -total / G


class TurnCreditTrainer(GSPOTrainer):
    """The documented way to plug per-token advantages in: override the one hook."""

    def token_advantages(self, inputs):
        return discounted_turn_advantages(inputs, gamma=GAMMA)


def test_trainer_loss_and_gradient_match_reference_on_multi_turn_batch(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=3)
    g = torch.Generator().manual_seed(0)
    G, P, T = 4, 3, 8
    batch = {
        "prompt_ids": torch.randint(4, len(tokenizer), (G, P), generator=g),
        "prompt_mask": torch.ones(G, P, dtype=torch.long),
        "completion_ids": torch.randint(4, len(tokenizer), (G, T), generator=g),
        "completion_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 8, [1] * 2 + [0] * 6]),
        "tool_mask": torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1] * 8, [1, 0, 1, 1, 1, 0, 0, 1], [1] * 8]),
        "advantages": torch.tensor([1.5, -0.5, -1.0, 0.8]),
    }
    with torch.no_grad():  # old log-probs near the current ones: some sequences clip, some do not
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        logits = model(input_ids=ids).logits[:, P - 1 : -1]
        current = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    batch["old_per_token_logps"] = current + 2e-3 * torch.randn(G, T, generator=g)

    # Expected per-token advantages, by hand: turns split at tool results, gamma ** (turns after this one).
    token_adv = []
    for i in range(G):
        turns, turn, prev = [], 0, 1
        for t in range(T):
            m = int(batch["tool_mask"][i, t]) if batch["completion_mask"][i, t] else 1
            turn += int(m == 1 and prev == 0)
            prev = m
            turns.append(turn)
        last = max(turns[t] for t in range(T) if batch["completion_mask"][i, t])
        token_adv.append([batch["advantages"][i].item() * GAMMA ** max(last - k, 0) for k in turns])

    reference_model, model_at_start = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss = _naive_reference_loss(reference_model, batch, token_adv)
    ref_loss.backward()

    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=G,
        num_generations=2,
        importance_sampling_level="sequence_token",
    )
    trainer = TurnCreditTrainer(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()

    # fp32 rounding of the policy loss over the batch (rounding.loss_bound), and of its backward
    s, size = P + T, batch["old_per_token_logps"].abs().max().item()
    assert relative_gap(loss, ref_loss) <= loss_bound(torch.float32, model.config, s, G * T, size)
    ref_params = dict(reference_model.named_parameters())
    grad_bound = loss_bound(torch.float32, model.config, s, G * T, size, G * s)
    for name, p in trainer.model.named_parameters():
        assert relative_gap(p.grad, ref_params[name].grad) <= grad_bound, name

    def reference(keep):  # the same reference with one more token left out of the loss (tool_mask x keep)
        fresh = copy.deepcopy(model_at_start)
        loss = _naive_reference_loss(fresh, {**batch, "tool_mask": batch["tool_mask"] * keep}, token_adv)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in fresh.named_parameters()}

    # companion (helpers/smallest_bug.py): one token mis-masked, in any sequence the loss does not clip, moves some
    # parameter's gradient past its bound. A clipped sequence gives no gradient, so a mask bug in it cannot show there,
    # and the loss's value, a mean of ratios within ~1e-3 of 1 times advantages, moves by less than its own bound.
    mask = batch["completion_mask"] * batch["tool_mask"]
    ratio = torch.exp(((current - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1))
    advantages = batch["advantages"]
    clipped = ((advantages > 0) & (ratio > 1 + EPS_HIGH)) | ((advantages < 0) & (ratio < 1 - EPS_LOW))
    assert clipped.any() and not clipped.all()
    _, grad_gap = one_token_gaps(reference, mask * ~clipped[:, None])
    assert grad_gap > grad_bound
    clipped = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    assert 0.0 < clipped < 1.0  # the batch exercises both sides of the min

    # The same batch under plain GSPO (one advantage per sequence) gives a different gradient.
    seq_loss = _naive_reference_loss(copy.deepcopy(model), batch, [[a.item()] * T for a in batch["advantages"]])
    assert not torch.isclose(seq_loss, ref_loss)
