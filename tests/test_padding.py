"""Padding removal (trl_gspo/forward/padding.py): trimmed, length-sorted and packed forwards give TRL's numbers.

Each claim is checked against an independent computation: layouts against loops over positions, trimmed and
packed forwards against the full padded forward (log-probs, entropies and every parameter gradient), the loss,
gradients and metrics of every loss type with trimming on vs off, the accumulated gradient of an optimizer step
with and without sorting, the rows of each optimizer step on real training runs, and end-to-end weights.
"""

import copy
import functools
import math

import pytest
import torch
from datasets import Dataset
from helpers.smallest_bug import (
    LastStepStart,
    accumulated_trainer_loss,
    boundary_one_key_early,
    dropped_token_gap,
    last_step_gap,
    one_token_gaps,
    one_token_margin,
    trainer_loss,
    weighted_logp_loss,
)
from transformers import AutoModelForCausalLM

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.forward import fused_head, layouts, padding
from trl_gspo.forward.layouts import ForwardLayout, layouts_to_batch, row_spans
from trl_gspo.forward.planner import plan_forward
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, sgd_weights_bound
from trl_gspo.testing import build_tiny_model


def _mask_from_spans(spans, s):
    """[B, S] attention mask with ones on [first, end) of each row."""
    cols = torch.arange(s)
    return ((cols[None] >= spans[:, :1]) & (cols[None] < spans[:, 1:2])).long()


def _fixed_plan(spans, batch_shape, prompt_width, chunk_rows, sort, pack):
    """The planner with its choice forced: every chunk packed where it can be (`pack=True`), else trimmed."""
    return plan_forward(
        spans,
        batch_shape,
        prompt_width,
        chunk_rows,
        groups=[],
        sort=sort,
        trim=True,
        pack=pack,
        share=False,
        alpha=1e-3,
    )


# ----------------------------------------------------------------------------------------- layouts, by hand
def test_row_spans_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0]])
    assert row_spans(mask).tolist() == [[2, 5, 3], [0, 6, 6], [6, 0, 0], [1, 4, 2]]


@pytest.mark.parametrize("pack", [False, True])
def test_to_model_and_back_match_loops(pack):
    """`to_model` gathers exactly `x[b, s]` for `source = b * S + s` (fill at -1); `layouts_to_batch` puts every
    model position back where it came from, for a per-position tensor with trailing dims like routing ids."""
    g = torch.Generator().manual_seed(0)
    b, s, prompt_width = 7, 12, 5
    first = torch.randint(0, prompt_width, (b,), generator=g)
    end = torch.randint(prompt_width + 1, s + 1, (b,), generator=g)
    spans = torch.stack([first, end, end - first], 1)
    layouts = _fixed_plan(spans, (b, s), prompt_width, 3, sort=True, pack=pack)
    x = torch.randint(0, 100, (b, s, 2, 3), generator=g)
    for layout in layouts:
        y = layout.to_model(x, fill=-7)
        assert y.shape == (*layout.shape, 2, 3)
        for r in range(layout.shape[0]):
            for c in range(layout.shape[1]):
                src = int(layout.source[r, c])
                expected = x[src // s, src % s] if src >= 0 else torch.full((2, 3), -7)
                assert torch.equal(y[r, c], expected)
    back = layouts_to_batch(layouts, [layout.to_model(x) for layout in layouts], fill=-1)
    covered = torch.zeros(b, s, dtype=torch.bool)
    for layout in layouts:
        src = layout.source[layout.source >= 0]
        covered.view(-1)[src] = True
    real = _mask_from_spans(spans, s).bool()
    assert covered[real].all()  # every real token is in some call
    assert torch.equal(back[covered], x[covered]) and (back[~covered] == -1).all()
    completion = layouts_to_batch(
        layouts, [layout.to_model(x) for layout in layouts], fill=-1, columns_from=prompt_width
    )
    assert torch.equal(completion, back[:, prompt_width:])


def test_packed_layout_by_hand():
    """Lengths 10, 4, 5 at capacity 10: first-fit decreasing gives rows [10] and [5, 4, filler 1]; every token keeps
    its column in the padded batch as position (as TRL's padded forward); each sequence attends only causally to
    itself (the segment plan), the filler to itself; every real token appears exactly once."""
    s = 12
    spans = torch.tensor([[2, 12, 10], [5, 9, 4], [4, 9, 5]])
    layout = layouts.packed_layout(torch.arange(3), spans, (3, s), one_row=False)
    assert layout.packed and layout.shape == (2, 10)
    assert layout.source[0].tolist() == list(range(2, 12))
    assert layout.source[1].tolist() == [2 * s + c for c in range(4, 9)] + [1 * s + c for c in range(5, 9)] + [-1]
    assert layout.position_ids.tolist() == [list(range(2, 12)), [4, 5, 6, 7, 8, 5, 6, 7, 8, 0]]
    assert layout.segment_lengths == (10, 5, 4, 1)
    assert layout.segments.own_start.tolist() == [[0] * 10, [0] * 5 + [5] * 4 + [9]]
    mask = layout.segments.dense_mask()[1]
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for a, b in ((0, 5), (5, 9), (9, 10)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    one_row = layouts.packed_layout(torch.arange(3), spans, (3, s), one_row=True)
    assert one_row.shape == (1, 19) and (one_row.source >= 0).all()
    assert layouts.packed_layout(torch.arange(3), spans, (3, s), one_row=False, multiple_of=8).shape == (2, 16)


def test_trimmed_layout_keeps_positions_and_one_column_each_side():
    spans = torch.tensor([[3, 7, 4], [4, 6, 2]])
    layout = layouts.trimmed_layout(torch.arange(2), spans, (2, 10), prompt_width=5, trim=True)
    assert layout.source[0].tolist() == list(range(3, 7)) and layout.position_ids[0].tolist() == [3, 4, 5, 6]
    # every row's completion empty: one prompt and one completion column still stay
    empty = torch.tensor([[2, 5, 3], [4, 5, 1]])
    layout = layouts.trimmed_layout(torch.arange(2), empty, (2, 10), prompt_width=5, trim=True)
    assert (layout.source[0] % 10).tolist() == [2, 3, 4, 5]
    assert layouts.trimmed_layout(torch.arange(2), spans, (2, 10), 5, trim=False).source.shape == (2, 10)


def test_optimizer_step_groups_never_mix_steps():
    """Brute force: two buffer entries may be grouped only if every use of both falls in the same optimizer step."""
    for spg, iters, accumulation, first in [
        (4, 1, 2, 0),
        (8, 2, 4, 0),
        (6, 1, 4, 0),
        (4, 3, 2, 4),
        (4, 1, 1, 0),
        (6, 2, 4, 12),
        (4, 1, 2, 2),
    ]:
        groups = padding.optimizer_step_groups(first, spg, iters, accumulation)
        assert sorted(k for g in groups for k in g) == list(range(spg))
        last = (first // (spg * iters) + 1) * spg * iters
        uses = {k: [s // accumulation for s in range(first, last) if s % spg == k] for k in range(spg)}
        for group in groups:
            assert all(uses[k] == uses[group[0]] and uses[k] for k in group) or len(group) == 1
    assert padding.optimizer_step_groups(0, 8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert padding.optimizer_step_groups(0, 6, 1, 4) == [[0, 1, 2, 3], [4, 5]]


def test_sort_permutes_every_per_row_value_and_keeps_scalars():
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(2):
        lengths = torch.randint(0, 6, (3,), generator=g)
        batches.append(
            {
                "prompt_mask": torch.ones(3, 2, dtype=torch.long),
                "completion_mask": (torch.arange(6)[None] < lengths[:, None]).long(),
                "row_id": torch.arange(3) + 3 * i,
                "old_routes": (torch.arange(3) + 3 * i).view(3, 1, 1, 1).expand(3, 6, 2, 2),  # another mixin's key
                "labels": [f"r{j + 3 * i}" for j in range(3)],
                "num_items_in_batch": torch.tensor(17),
            }
        )
    out = padding.sort_rows_by_length(batches)
    ids = torch.cat([b["row_id"] for b in out])
    assert sorted(ids.tolist()) == list(range(6))
    lengths = torch.cat([b["completion_mask"].sum(1) for b in out])
    assert lengths.tolist() == sorted(lengths.tolist(), reverse=True)
    for b in out:
        assert torch.equal(b["old_routes"][:, 0, 0, 0], b["row_id"])
        assert b["labels"] == [f"r{j}" for j in b["row_id"].tolist()] and b["num_items_in_batch"] == 17
    assert padding.sort_rows_by_length([{**batches[0], "pixel_values": torch.zeros(5, 3)}]) is None


# --------------------------------------------------------------------------- forwards through the trainer
def _no_reward(completions, **kwargs):
    return [0.0] * len(completions)


#: The trainers of this file's forward tests (`trainer_factory`), in training mode, two micro-batches per step.
TRAINER = dict(
    reward=_no_reward,
    prompts=["add 1 2 ="] * 8,
    train=True,
    accumulation=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=9,
    logging_steps=1,
    epsilon=3e-3,
    epsilon_high=4e-3,
    seed=0,
)


def _long_tail_batch(vocab, seed=0, b=6, p=7, t=9):
    """Left-padded prompts of different lengths, right-padded completions of different lengths, one row with its
    whole completion masked (as with mask_truncated_completions), padding inside no row."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([7, 3, 5, 4, 6, 2])[:b]
    completion_len = torch.tensor([2, 5, 0, 3, 1, 6])[:b]  # longest 6 < 9: trailing columns are all padding
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    completion_mask = (torch.arange(t)[None] < completion_len[:, None]).long()
    return {
        "prompt_ids": torch.randint(4, vocab, (b, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (b, t), generator=g) * completion_mask,
        "completion_mask": completion_mask,
    }


def _forward(trainer, batch, chunk=None, grad=True):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.set_grad_enabled(grad):
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            mask,
            batch["completion_ids"].size(1),
            batch_size=chunk,
            compute_entropy=True,
            compute_aux_loss=trainer.aux_loss_enabled,
        )


def _naive_logps(model, batch):
    """Independent reference: each row alone, only its real tokens, plain logits -> log_softmax at the completion."""
    t = batch["completion_ids"].size(1)
    logps = torch.zeros(len(batch["prompt_ids"]), t)
    for i in range(len(logps)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        n = int(batch["completion_mask"][i].sum())
        ids = torch.cat([prompt, batch["completion_ids"][i, :n]])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logps[i, :n] = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return logps


# The trimmed / sorted / packed path calls the model with TRL's fused log-prob head (TRL >= 1.15); on older TRL the
# trainer runs TRL's own padded loop (test_old_trl_falls_back_to_trls_padded_loop checks that fallback everywhere).
needs_fused_head = pytest.mark.skipif(not fused_head.available(), reason="TRL < 1.15: no fused log-prob head")


def test_old_trl_falls_back_to_trls_padded_loop(tokenizer, tmp_path, monkeypatch, caplog, trainer_factory):
    """Without TRL's fused head (TRL < 1.15; simulated here on any TRL): a warning, TRL's own forward bit for bit, no
    sorting, and padding_free=True refused naming the TRL version."""
    from trl import GRPOTrainer

    monkeypatch.setattr(fused_head, "available", lambda: False)
    model = build_tiny_model(tokenizer, moe=True, seed=3)
    with caplog.at_level("WARNING", logger="trl_gspo.forward.padding"):
        trainer = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path)
    assert "no fused log-prob head" in caplog.text and "trim_padding and sort_by_length are off" in caplog.text
    assert not trainer.padding.sort_micro_batches and not trainer.padding.sort_no_grad
    batch = _long_tail_batch(model.config.vocab_size)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    ours = _forward(trainer, batch, grad=False)
    with torch.no_grad():
        stock = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, 9, compute_entropy=True, compute_aux_loss=trainer.aux_loss_enabled
        )
    assert all(torch.equal(a, b) for a, b in zip(ours, stock) if a is not None)
    with pytest.raises(
        ValueError,
        match=r"padding_free=True needs TRL's fused log-prob head \(TRL >= 1.15\); the "
        r"installed TRL is [\d.]+",
    ):
        trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / "packed", padding_free=True)


CONFIGS = {
    "full (TRL)": dict(trim_padding=False, sort_by_length="never"),
    "trimmed": dict(trim_padding=True, sort_by_length="never"),
    "trimmed, sorted no-grad pass": dict(trim_padding=True, sort_by_length="auto"),
    "packed": dict(padding_free=True),
}


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@needs_fused_head
def test_trimmed_sorted_and_packed_forwards_match_the_padded_one(moe, tokenizer, tmp_path, trainer_factory):
    """Log-probs, entropies and aux loss of every variant equal the full padded forward (which is TRL's own loop,
    bit for bit) and the naive per-row reference, with grad (loss forward) and without (pi_old pass, chunked)."""
    from trl import GRPOTrainer

    model = build_tiny_model(tokenizer, moe=moe, seed=3)
    batch = _long_tail_batch(model.config.vocab_size)
    results = {}
    for name, settings in CONFIGS.items():
        trainer = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / name, **settings)
        results[name] = [_forward(trainer, batch, chunk, grad) for chunk, grad in ((None, True), (2, False))]
    stock = trainer_factory(
        TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / "stock", trim_padding=False, sort_by_length="never"
    )
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trl_logps, trl_ent, trl_aux = GRPOTrainer._get_per_token_logps_and_entropies(
        stock, stock.model, ids, mask, 9, compute_entropy=True, compute_aux_loss=stock.aux_loss_enabled
    )
    full = results["full (TRL)"][0]
    assert torch.equal(full[0], trl_logps) and torch.equal(full[1], trl_ent)  # our loop, untrimmed, is TRL's
    if moe:
        assert torch.equal(full[2], trl_aux)
    completion = batch["completion_mask"].bool()
    with torch.no_grad():
        naive = _naive_logps(model, batch)
    # fp32 rounding of one forward (trl_gspo/rounding.py), relative to the largest log-prob (entropy): every token holds.
    bound = model_bound(torch.float32, model.config, ids.size(1))
    assert relative_gap(full[0][completion], naive[completion], math.inf) <= bound
    # companion: one completion token mis-masked in this batch lands outside the bound (helpers/smallest_bug.py)
    assert min(dropped_token_gap(full[0], completion), dropped_token_gap(full[1], completion)) > bound
    for name, outs in results.items():
        for logps, entropies, _ in outs:
            assert relative_gap(logps, full[0], math.inf) <= bound, name
            assert relative_gap(entropies, full[1], math.inf) <= bound, name
            assert (logps[~completion] == 0).all() and (entropies[~completion] == 0).all(), name
        # The aux loss of the one-chunk (loss) forward; TRL averages it over chunks, so chunked passes differ anyway.
        # Packing counts its filler positions in the load-balancing loss (documented), so it is left out. The router
        # logits carry a forward's rounding, then the loss sums over every position.
        if moe and name != "packed":
            aux_bound = model_bound(torch.float32, model.config, ids.size(1), extra_terms=ids.numel())
            assert relative_gap(outs[0][2], full[2]) <= aux_bound, name


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@needs_fused_head
def test_packed_and_trimmed_gradients_match_the_padded_ones(moe, tokenizer, tmp_path, trainer_factory):
    """Every parameter gradient of a loss on the log-probs and entropies is the padded forward's."""
    model = build_tiny_model(tokenizer, moe=moe, seed=4)
    batch = _long_tail_batch(model.config.vocab_size, seed=1)
    weights = torch.randn(6, 9, generator=torch.Generator().manual_seed(2))
    grads = {}
    for name, settings in CONFIGS.items():
        trainer = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / name, **settings)
        logps, entropies, _ = _forward(trainer, batch)
        ((logps * weights).sum() + 0.1 * entropies.sum()).backward()
        grads[name] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    reference = grads.pop("full (TRL)")
    positions = batch["prompt_ids"].size(1) + batch["completion_ids"].size(1)
    bound = model_bound(torch.float32, model.config, positions, 6 * positions)  # forward + backward
    # companion: one completion token mis-masked in the loss moves some parameter's gradient past the bound
    assert one_token_gaps(weighted_logp_loss(model, batch, weights), batch["completion_mask"])[1] > bound
    for name, got in grads.items():
        assert got.keys() == reference.keys()
        for n, g in reference.items():
            assert relative_gap(got[n], g) <= bound, (name, n)


def _packed_pair_batch(vocab):
    """Rows of 12, 5 and 6 real tokens: packed at capacity 12, the 6- and the 5-token sequences share a row."""
    g = torch.Generator().manual_seed(7)
    p, t = 7, 5
    prompt_len, completion_len = torch.tensor([7, 3, 4]), torch.tensor([5, 2, 2])
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    completion_mask = (torch.arange(t)[None] < completion_len[:, None]).long()
    return {
        "prompt_ids": torch.randint(4, vocab, (3, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (3, t), generator=g) * completion_mask,
        "completion_mask": completion_mask,
    }


def _row_logps(call, ids, position_ids):
    """Log-prob of each token of one packed row given what it attends to, from a direct model call (position 0: 0)."""
    logits = call(input_ids=ids, position_ids=position_ids, use_cache=False).logits.float()
    return torch.nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@needs_fused_head
def test_packed_sequences_cannot_see_each_other(moe, tokenizer, tmp_path, trainer_factory):
    """Changing the tokens of sequence A must leave sequence B, packed right after it in the same row (and any after B),
    as it was:
    through the trainer's packed path and through a direct call on the packed row with its segment plan. Dense: bit
    for bit. MoE: A's new tokens change which tokens each expert's batched matmul holds, which may reorder its sums
    (seen at 2 threads), so B keeps its values to one forward's fp32 rounding (trl_gspo/rounding.py). The same row through
    the plain model (causal over the whole row, what a lost plan would give) does see the change, far beyond that, so
    this check can fail; `_call_model` refuses an attention_mask on a packed call."""
    model = build_tiny_model(tokenizer, moe=moe, seed=5).eval()
    trainer = trainer_factory(TRAINER, model=model, output_dir=tmp_path, padding_free=True)
    trainer.model.eval()
    batch = _packed_pair_batch(model.config.vocab_size)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    layout = _fixed_plan(row_spans(mask), tuple(ids.shape), 7, 3, sort=False, pack=True)[0]
    own = layout.segments.own_start
    row = next(
        r for r in range(layout.shape[0]) if len({int(x) for x, src in zip(own[r], layout.source[r]) if src >= 0}) >= 2
    )
    starts = sorted({int(x) for x, src in zip(own[row], layout.source[row]) if src >= 0})
    seq_a, seq_b = int(layout.source[row, starts[0]]) // 12, int(layout.source[row, starts[1]]) // 12
    changed = ids.clone()
    changed[seq_a] = torch.where(mask[seq_a].bool(), (ids[seq_a] + 7) % (model.config.vocab_size - 4) + 4, ids[seq_a])

    with torch.no_grad():
        before, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 5)
        after, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, changed, mask, 5)
    assert not torch.equal(before[seq_a], after[seq_a])  # A did change
    bound = model_bound(torch.float32, model.config, ids.size(1)) if moe else 0.0
    assert relative_gap(after[seq_b], before[seq_b], math.inf) <= bound  # B did not see it

    row_layout = ForwardLayout(
        layout.source[row : row + 1],
        layout.batch_shape,
        layout.position_ids[row : row + 1],
        True,
        segments=layouts.SegmentPlan(
            *(x[row : row + 1] for x in (layout.segments.own_start, layout.segments.ctx_start, layout.segments.ctx_end))
        ),
    )
    row_ids, row_changed = row_layout.to_model(ids), row_layout.to_model(changed)
    b_positions = slice(starts[1] + 1, None)

    def segmented(**kwargs):
        return trainer.logprob_forward._call_model(model, row_layout, **kwargs)

    with torch.no_grad():
        separated = [_row_logps(segmented, x, row_layout.position_ids)[0, b_positions] for x in (row_ids, row_changed)]
        causal = functools.partial(model, attention_mask=torch.ones_like(row_ids))  # a mask turns packed detection off
        leaked = [_row_logps(causal, x, row_layout.position_ids)[0, b_positions] for x in (row_ids, row_changed)]
    # the smallest leak (helpers/smallest_bug.py): B's boundary one key early, so each of B's positions also sees A's
    # last token
    off_by_one = boundary_one_key_early(row_layout, starts[1])

    def one_key_early(**kwargs):
        return trainer.logprob_forward._call_model(model, off_by_one, **kwargs)

    with torch.no_grad():
        one_key = [
            _row_logps(one_key_early, x, row_layout.position_ids)[0, b_positions] for x in (row_ids, row_changed)
        ]
    trainer.logprob_forward.release()
    assert relative_gap(separated[1], separated[0], math.inf) <= bound
    # companions of this bound: plain causal attention over the row (B sees all of A) and the one-key leak above each
    # move B past one forward's rounding
    assert relative_gap(leaked[1], leaked[0], math.inf) > model_bound(torch.float32, model.config, ids.size(1))
    assert relative_gap(one_key[1], one_key[0], math.inf) > model_bound(torch.float32, model.config, ids.size(1))
    with pytest.raises(RuntimeError, match="packed forward got an attention_mask"):
        trainer.logprob_forward._call_model(model, layout, input_ids=row_ids, attention_mask=torch.ones_like(row_ids))


@needs_fused_head
def test_packing_refuses_attention_it_cannot_separate(tokenizer, tmp_path, trainer_factory):
    model = build_tiny_model(tokenizer, seed=0)
    model.config._attn_implementation = "paged|sdpa"  # an implementation the segment attention does not wrap
    with pytest.raises(
        ValueError,
        match=r"padding_free=True: the policy \(Qwen3ForCausalLM\) cannot take packed .* "
        r"attn_implementation='paged\|sdpa'",
    ):
        trainer_factory(TRAINER, model=model, output_dir=tmp_path, padding_free=True)


# --------------------------------------------------------------------------- loss, gradients, metrics
LOSS_CASES = {
    "grpo": dict(importance_sampling_level="sequence", loss_type="grpo"),
    "bnpo": dict(importance_sampling_level="token", loss_type="bnpo", epsilon=0.01, epsilon_high=0.012),
    "dr_grpo": dict(importance_sampling_level="token", loss_type="dr_grpo", epsilon=0.01, epsilon_high=0.012),
    "dapo": dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.01, epsilon_high=0.012),
    "cispo": dict(importance_sampling_level="token", loss_type="cispo", epsilon_high=1.01),
    "luspo": dict(importance_sampling_level="sequence", loss_type="luspo"),
    "sapo": dict(importance_sampling_level="sequence", loss_type="sapo"),
    "vespo": dict(importance_sampling_level="token", loss_type="vespo"),
    "gspo-token, kl, entropy mask and bonus": dict(
        importance_sampling_level="sequence_token",
        loss_type="grpo",
        beta=0.04,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
    ),
}


def _loss_inputs(model, seed):
    batch = _long_tail_batch(model.config.vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        logps = _naive_logps(model, batch)
    mask = batch["completion_mask"]
    return {
        **batch,
        "advantages": torch.tensor([1.0, -0.5, 0.7, 0.3, 1.2, 0.4]),  # mostly positive: a loss far from 0
        "old_per_token_logps": (logps + 0.003 * torch.randn(logps.shape, generator=g)) * mask,
        "ref_per_token_logps": (logps + 0.05 * torch.randn(logps.shape, generator=g)) * mask,
        "num_items_in_batch": mask.sum(),
    }


def _loss_grads_metrics(model, tokenizer, tmp_path, inputs, settings, trainer_factory):
    trainer = trainer_factory(
        TRAINER, model=copy.deepcopy(model), output_dir=tmp_path, allow_token_sum_with_sequence_level=True, **settings
    )
    loss = trainer._compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()})
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.log({})  # moves the diagnostics window and throughput counts into TRL's metrics
    metrics = {k: v for k, v in trainer.state.log_history[-1].items()}
    return loss.detach(), grads, metrics, trainer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
@needs_fused_head
def test_trimming_leaves_loss_gradients_and_metrics_unchanged(
    name, dtype, tokenizer, tiny_model_dir, tmp_path, trainer_factory
):
    """Loss, every parameter gradient and every logged metric within the dtype's rounding of the full padded forward's
    (rounding.model_bound), in fp32 (what users run) and in fp64, where only the sums that transformers' norms
    and TRL's log-prob head run in fp32 regardless carry fp32's rounding. The metrics are functions of the log-probs
    (log-ratio statistics are differences of two ~-4 log-probs), so their rounding is taken relative to the log-probs'
    size. A wrong token, position, mask or label moves these by 1e-3 or more. Trimming alone, and the defaults (each
    call's layout chosen by cost: here the micro-batch is packed), against the full padded forward."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)  # a path: beta > 0 loads the reference
    inputs = _loss_inputs(model, seed=4)
    if dtype == torch.float64:
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    settings = dict(LOSS_CASES[name], model_init_kwargs={"dtype": dtype})
    off = _loss_grads_metrics(
        model, tokenizer, tmp_path / "off", inputs, dict(settings, trim_padding=False), trainer_factory
    )
    trimmed = dict(settings, trim_padding=True, padding_free=False, shared_prefix=False)
    runs = {
        "trimmed": _loss_grads_metrics(model, tokenizer, tmp_path / "on", inputs, trimmed, trainer_factory),
        "defaults": _loss_grads_metrics(model, tokenizer, tmp_path / "auto", inputs, settings, trainer_factory),
    }
    assert off[0].abs() > 1e-2
    # 16 columns, the longest completion (6 of 9) ends 3 early, the longest prompt fills all 7: 13 columns run
    assert (
        off[2]["throughput/positions_vs_stock"] == 1.0
        and runs["trimmed"][2]["throughput/positions_vs_stock"] == 13 / 16
    )
    # the defaults packed the sequences (9, 8, 8, 7, 7, 5 real tokens) into one row of their 44 tokens: rows as long as
    # the longest (6 x 9 = 54 positions) would cost more than one row's few extra key pairs
    assert runs["defaults"][2]["throughput/positions_vs_stock"] == 44 / 96
    b, s = inputs["prompt_ids"].size(0), inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    size = inputs["old_per_token_logps"].abs().max().item()  # the log-probs' size (rounding.loss_bound)
    value_bound = loss_bound(dtype, model.config, s, b * s, size)  # a forward, ratios, the loss's sums
    grad_bound = loss_bound(dtype, model.config, s, b * s, size, b * s)  # and the backward
    metric_floor = model_bound(dtype, model.config, s) * size  # the metrics: functions of the log-probs
    skip = {"throughput/positions_vs_stock", "throughput/padding_per_step", "throughput/padding_fraction"}
    for variant, on in runs.items():
        assert relative_gap(on[0], off[0]) <= value_bound, variant
        assert on[1].keys() == off[1].keys() and len(off[1]) > 0
        for n, g in off[1].items():
            assert relative_gap(on[1][n], g) <= grad_bound, (variant, n)
        assert set(on[2]) == set(off[2])
        for key, value in off[2].items():
            if key not in skip and isinstance(value, float):
                assert on[2][key] == pytest.approx(value, rel=value_bound, abs=metric_floor), (variant, key)
    # companion (helpers/smallest_bug.py): one token mis-masked in the padded forward's loss moves the loss or some
    # parameter's gradient past its bound, for every token whose loss term moves at all
    assert one_token_margin(trainer_loss(off[3], inputs), inputs["completion_mask"], value_bound, grad_bound) > 1


# ------------------------------------------------------------------------------- sorted micro-batches
SORT_DEFAULT_ON = ["grpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo"]


def _step_gradient(model, tokenizer, tmp_path, micro_batches, settings, trainer_factory):
    """Accumulated gradient of one optimizer step: `_compute_loss` + backward over each micro-batch; and the trainer."""
    trainer = trainer_factory(
        TRAINER, model=copy.deepcopy(model), output_dir=tmp_path, allow_token_sum_with_sequence_level=True, **settings
    )
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    for mb in micro_batches:
        trainer._compute_loss(trainer.model, {k: v.clone() for k, v in mb.items()}).backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, trainer


@pytest.mark.parametrize("name", SORT_DEFAULT_ON + ["bnpo"])
@needs_fused_head
def test_sorting_leaves_the_accumulated_gradient_unchanged(name, tokenizer, tiny_model_dir, tmp_path, trainer_factory):
    """Rows of one optimizer step re-cut into micro-batches by length: the accumulated gradient is the same for
    every loss type sorting is on for by default; for bnpo (token mean per micro-batch) it is not, which is why
    'auto' leaves bnpo unsorted, and shows this comparison can fail."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inputs = _loss_inputs(model, seed=5)
    settings = {k: v for k, v in LOSS_CASES[name].items()}
    trl_order = [{k: (v[i : i + 2] if v.dim() else v) for k, v in inputs.items()} for i in (0, 2, 4)]
    sorted_batches = padding.sort_rows_by_length(trl_order)
    assert [b["completion_mask"].sum(1).tolist() for b in sorted_batches] == [[6, 5], [3, 2], [1, 0]]
    reference, trainer = _step_gradient(model, tokenizer, tmp_path / "a", trl_order, settings, trainer_factory)
    got, _ = _step_gradient(model, tokenizer, tmp_path / "b", sorted_batches, settings, trainer_factory)
    errors = [relative_gap(got[n], g) for n, g in reference.items()]
    # fp32 rounding of the policy loss's gradient over three micro-batches, accumulated (rounding.loss_bound)
    s = inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    size = inputs["old_per_token_logps"].abs().max().item()
    bound = loss_bound(torch.float32, model.config, s, 6 * s + len(sorted_batches), size, 6 * s)
    if name == "bnpo":
        assert max(errors) > 100 * bound  # another micro-batch's token count: far beyond rounding
    else:
        assert max(errors) <= bound
        # companion (helpers/smallest_bug.py): one token mis-masked in one micro-batch moves some parameter's
        # accumulated gradient past the bound
        compute = accumulated_trainer_loss(trainer, trl_order)
        assert one_token_gaps(compute, inputs["completion_mask"])[1] > bound


@needs_fused_head
def test_auto_sorts_only_where_the_gradient_is_unchanged(tokenizer, tmp_path, trainer_factory):
    def sorted_for(moe=False, **settings):
        model = build_tiny_model(tokenizer, moe=moe, seed=0)
        return trainer_factory(
            TRAINER, model=model, output_dir=tmp_path, allow_token_sum_with_sequence_level=True, **settings
        ).padding.sort_micro_batches

    assert sorted_for() and sorted_for(loss_type="dapo")
    assert not sorted_for(loss_type="bnpo") and not sorted_for(entropy_coef=0.01)
    assert not sorted_for(top_entropy_quantile=0.5) and not sorted_for(moe=True)
    assert sorted_for(loss_type="bnpo", sort_by_length="always") and sorted_for(moe=True, sort_by_length="always")
    assert not sorted_for(sort_by_length="never")


class FixedRollouts:
    """TRL rollout_func with varied completion lengths, one prompt per group of `prompt_lengths` tokens (low, high
    exclusive), the same batches for every trainer (seeded by call count)."""

    def __init__(self, tokenizer, max_len=10, prompt_lengths=(2, 7)):
        self.vocab, self.eos, self.max_len, self.calls = len(tokenizer), tokenizer.eos_token_id, max_len, 0
        self.prompt_lengths = prompt_lengths

    def __call__(self, prompts, trainer):
        g = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        prompt_ids, completion_ids = [], []
        for i in range(len(prompts)):
            if i % trainer.num_generations == 0:
                prompt = torch.randint(
                    4, self.vocab, (int(torch.randint(*self.prompt_lengths, (1,), generator=g)),), generator=g
                )
            n = int(torch.randint(1, self.max_len + 1, (1,), generator=g))
            ids = torch.randint(4, self.vocab, (n,), generator=g)
            if n < self.max_len:
                ids[-1] = self.eos
            prompt_ids.append(prompt.tolist()), completion_ids.append(ids.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _varied_reward(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) + 0.1 * len(ids) for ids in completion_ids]


def _run(tokenizer, tmp_path, model=None, peft_config=None, record=None, **overrides):
    import os

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_generations=3,
        max_completion_length=10,
        learning_rate=0.05,
        optim="sgd",
        logging_steps=1,
        max_steps=4,
        disable_tqdm=True,
    )
    args = GSPOConfig(**{**settings, **overrides})
    model = model if model is not None else build_tiny_model(tokenizer, seed=0)
    trainer = GSPOTrainer(
        model,
        _varied_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 64}),
        processing_class=tokenizer,
        rollout_func=FixedRollouts(tokenizer),
        peft_config=peft_config,
    )
    if record is not None:
        original = trainer._compute_loss

        def recording(model, inputs):
            rows = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            record.append((trainer.state.global_step, [tuple(r.tolist()) for r in rows]))
            return original(model, inputs)

        trainer._compute_loss = recording
    trainer.add_callback(LastStepStart())  # the last-step companion measures where that step ran
    trainer.train()
    return trainer


def logp_size(trainer) -> float:
    """The largest |old log-prob| of the trainer's last rollout: the size the importance ratios' rounding is relative
    to (rounding.loss_bound); 0 where pi_old was never computed, the ratios then being exactly 1."""
    olds = [b.get("old_per_token_logps") for b in trainer._buffered_inputs]
    return max((o.abs().max().item() for o in olds if o is not None), default=0.0)


def assert_same_sgd_weights(got, want, trainer, what, seq_len=16):
    """`got` and `want` ({name: parameter}), the ends of two plain-SGD runs with `trainer`'s settings, within
    rounding of each other (rounding.sgd_weights_bound): each step's gradient that of a policy loss over the
    step's rows of at most `seq_len` positions (FixedRollouts' default: prompts up to 6 tokens, completions up to 10),
    accumulated over the micro-batches."""
    args = trainer.args
    positions = args.per_device_train_batch_size * args.gradient_accumulation_steps * seq_len
    tokens = positions + args.gradient_accumulation_steps
    step = loss_bound(torch.float32, trainer.model.config, seq_len, tokens, logp_size(trainer), positions)
    bounds = {}
    for n, p in want.items():
        bound = sgd_weights_bound(torch.float32, step, args, trainer.state.global_step, p.detach().norm().item())
        assert (got[n].detach() - p.detach()).norm().item() <= bound, (what, n)
        bounds[n] = bound
    # companion (helpers/smallest_bug.py): one token mis-masked in the run's last optimizer step (its micro-batches
    # accumulated, at the weights it started from) moves that step, and so the end weights, past some parameter's bound
    assert last_step_gap(trainer, bounds) > 1, what


@pytest.mark.slow
@pytest.mark.parametrize("num_iterations", [1, 2])
@needs_fused_head
def test_sorting_keeps_every_row_in_its_optimizer_step(num_iterations, tokenizer, tmp_path):
    """On real training runs (identical rollouts, learning rate 0 so both runs see the same batches): each optimizer
    step trains on exactly the same rows with and without sorting; with sorting its micro-batches are ordered
    longest first, so they differ from TRL's."""
    runs = {}
    for sort in ("never", "always"):
        record = []
        _run(
            tokenizer,
            tmp_path / sort,
            record=record,
            sort_by_length=sort,
            learning_rate=0.0,
            max_steps=6,
            num_iterations=num_iterations,
            steps_per_generation=6,
        )
        runs[sort] = record
    by_step = {k: {} for k in runs}
    for sort, record in runs.items():
        for step, rows in record:
            by_step[sort].setdefault(step, []).extend(rows)
    assert by_step["never"].keys() == by_step["always"].keys() and len(by_step["never"]) == 6
    for step in by_step["never"]:
        assert sorted(by_step["never"][step]) == sorted(by_step["always"][step]), step
    assert [rows for _, rows in runs["never"]] != [rows for _, rows in runs["always"]]  # sorting did reorder


@pytest.mark.slow
@needs_fused_head
def test_trimmed_sorted_and_packed_training_ends_with_the_same_weights(tokenizer, tmp_path):
    """End to end, same seed and rollouts, SGD: trimming + sorting (defaults) and packing end where TRL's padded
    forwards end, up to float rounding; with LoRA only the adapter moves in every variant."""
    from peft import LoraConfig

    runs = {
        "padded": _run(tokenizer, tmp_path / "a", trim_padding=False, sort_by_length="never"),
        "trim+sort": _run(tokenizer, tmp_path / "b"),
        "packed": _run(tokenizer, tmp_path / "c", padding_free=True),
    }
    reference = dict(runs["padded"].model.named_parameters())
    initial = dict(build_tiny_model(tokenizer, seed=0).named_parameters())
    assert max((reference[n] - initial[n]).abs().max().item() for n in reference) > 1e-3  # training moved weights
    for name, trainer in runs.items():
        assert_same_sgd_weights(dict(trainer.model.named_parameters()), reference, trainer, name)
    logged = [row for row in runs["trim+sort"].state.log_history if "throughput/positions_vs_stock" in row]
    assert logged and all(row["throughput/positions_vs_stock"] < 1 for row in logged)

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    adapters = {}
    for name, settings in (
        ("padded", dict(trim_padding=False, sort_by_length="never")),
        ("packed", dict(padding_free=True)),
    ):
        trainer = _run(tokenizer, tmp_path / f"lora-{name}", peft_config=lora, **settings)
        params = dict(trainer.model.named_parameters())
        base = {
            n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in params.items()
            if "lora" not in n
        }
        assert all(torch.equal(base[n], initial[n]) for n in initial)
        adapters[name] = {n: p.detach() for n, p in params.items() if "lora" in n}
    assert_same_sgd_weights(adapters["packed"], adapters["padded"], trainer, "LoRA")


# --------------------------------------------------------------------- MoE routes through the layouts
# Routing replay (moe/routing_replay.py) meets padding removal in the same model calls: MoERouting._call_model tells the
# open router pass where each position of a trimmed / sorted / packed call came from.
@needs_fused_head
def test_recorded_routes_follow_trimmed_sorted_and_packed_rows(tokenizer, tmp_path, trainer_factory):
    """The routes recorded in trimmed, length-sorted and packed calls land at the batch position they came from:
    at every real token they equal the padded forward's, and every real token has one (skipped padding has none)."""
    model = build_tiny_model(tokenizer, moe=True, seed=0)
    batch = _long_tail_batch(model.config.vocab_size, seed=6)
    real = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
    b, s = real.shape
    routes = {}
    for name, settings in CONFIGS.items():
        trainer = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / name, **settings)
        with trainer.moe_routing.hooks.forward_pass(b, s, record=True) as observed:
            _forward(trainer, batch, chunk=4, grad=False)
        assert observed.check() is None, name
        routes[name] = (observed.native_routes(), observed.recorded_positions())
    full_ids, full_seen = routes["full (TRL)"]
    assert full_seen.all()
    for name, (ids, seen) in routes.items():
        assert seen[real].all(), name
        assert torch.equal(ids[real].sort(-1).values, full_ids[real].sort(-1).values), name
    for name in ("trimmed", "trimmed, sorted no-grad pass", "packed"):
        assert not routes[name][1].all(), name  # these calls did skip padding positions


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad-chunked", "loss-forward"])
@needs_fused_head
def test_replayed_routes_follow_trimmed_sorted_and_packed_rows(grad, tokenizer, tmp_path, trainer_factory):
    """Forced routes (random experts, not the router's) replayed through every layout give the padded forward's
    log-probs at every completion token and, with grad, its parameter gradients. A route forced at the wrong position
    would change them: forcing these routes moves the log-probs far more than the tolerance."""
    from trl_gspo.moe.routing import RouterHooks, RouteTable

    model = build_tiny_model(tokenizer, moe=True, seed=0)
    batch = _long_tail_batch(model.config.vocab_size, seed=7)
    completion = batch["completion_mask"].bool()
    b, s = completion.size(0), batch["prompt_ids"].size(1) + completion.size(1)
    hooks = RouterHooks.for_model(model)
    g = torch.Generator().manual_seed(0)
    forced = torch.rand(b, s, hooks.num_layers, hooks.num_experts, generator=g).argsort(-1)[..., : hooks.top_k]
    table = RouteTable(forced.to(hooks.id_dtype), torch.ones(b, s, dtype=torch.bool))
    weights = torch.randn(b, completion.size(1), generator=g)
    results, trainers = {}, {}
    for name, settings in CONFIGS.items():
        trainer = trainers[name] = trainer_factory(
            TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / name, **settings
        )
        with trainer.moe_routing.hooks.forward_pass(
            b, s, record=False, replay=table, keep_for_recompute=grad
        ) as observed:
            logps = _forward(trainer, batch, chunk=None if grad else 4, grad=grad)[0]
        assert observed.check() is None, name
        grads = None
        if grad:
            (logps * weights * completion).sum().backward()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.moe_routing.hooks.release()
        results[name] = (logps.detach(), grads)
    native = _forward(
        trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / "native"), batch, grad=False
    )[0]
    full, full_grads = results.pop("full (TRL)")
    assert (full[completion] - native[completion]).abs().max() > 1e-2  # the forced routes do change the output
    logp_bound = model_bound(torch.float32, model.config, s)  # fp32 rounding of a forward
    grad_bound = model_bound(torch.float32, model.config, s, b * s)  # and of its backward
    for name, (logps, grads) in results.items():
        assert relative_gap(logps[completion], full[completion], math.inf) <= logp_bound, name
        if grad:
            assert grads.keys() == full_grads.keys()
            for n, ref in full_grads.items():
                assert relative_gap(grads[n], ref) <= grad_bound, (name, n)
    # companions (helpers/smallest_bug.py): one completion token mis-masked lands outside the log-prob bound; with
    # grad, one token mis-masked in the loss (the padded forward, the same forced routes replayed) moves some
    # parameter's gradient past its bound: one replayed forward, a gradient per token through it
    assert dropped_token_gap(full, completion) > logp_bound
    if grad:
        trainer = trainers["full (TRL)"]
        with trainer.moe_routing.hooks.forward_pass(b, s, record=False, replay=table, keep_for_recompute=True):
            logps = _forward(trainer, batch)[0]
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}

        def compute(keep):
            loss = (logps * weights * completion * keep).sum()
            moved = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
            return loss.detach(), {n: g for n, g in zip(params, moved) if g is not None}

        assert one_token_gaps(compute, batch["completion_mask"])[1] > grad_bound
        trainer.moe_routing.hooks.release()


@pytest.mark.slow
@needs_fused_head
def test_routing_replay_r2_trains_the_same_with_trimmed_sorted_and_packed_forwards(tokenizer, tmp_path):
    """End to end, GRPO + R2 on the tiny MoE, same rollouts, SGD: with trimming + sorting and with packing, pi_old's
    routes (recorded in a sorted, trimmed or packed no-grad pass) are replayed in trimmed or packed loss forwards over
    length-sorted micro-batches and training ends where the padded R2 run ends; every completion token's route is
    replayed (coverage 1), the first mini-batch of each rollout is on-policy (shift 0), and replay did change the
    result (the run without replay ends elsewhere)."""

    def moe_model():  # no aux loss: it is per micro-batch (sorting changes it) and counts packed filler
        return build_tiny_model(tokenizer, moe=True, seed=0, router_aux_loss_coef=0.0)

    # a constant learning rate: under the linear decay the last step's is a quarter of the first's, too small a step
    # for a one-token bug in it to move the weights past their bound (the companion in assert_same_sgd_weights); 5
    # steps, so the last is the first of a rollout batch (on-policy: none of its tokens clipped, all of them weigh)
    common = dict(
        importance_sampling_level="token",
        max_steps=5,
        steps_per_generation=6,
        gradient_accumulation_steps=3,
        lr_scheduler_type="constant",
    )
    variants = {
        "padded": dict(routing_replay="R2", trim_padding=False, sort_by_length="never"),
        "trim+sort": dict(routing_replay="R2", sort_by_length="always"),
        "packed": dict(routing_replay="R2", padding_free=True, sort_by_length="always"),
        "padded, no replay": dict(trim_padding=False, sort_by_length="never"),
    }
    runs = {
        name: _run(tokenizer, tmp_path / str(i), model=moe_model(), **common, **settings)
        for i, (name, settings) in enumerate(variants.items())
    }
    reference = dict(runs["padded"].model.named_parameters())
    for name in ("trim+sort", "packed"):
        weights = dict(runs[name].model.named_parameters())
        assert_same_sgd_weights(weights, reference, runs[name], name)
        rows = [row for row in runs[name].state.log_history if "moe/replay/coverage" in row]
        assert len(rows) == 5 and all(row["moe/replay/coverage"] == 1.0 for row in rows), name
        # the on-policy steps (the first of each rollout batch, two steps each)
        assert (
            rows[0]["moe/routing_shift"] == 0
            and rows[2]["moe/routing_shift"] == 0
            and rows[4]["moe/routing_shift"] == 0
        ), name
        positions = [
            row["throughput/positions_vs_stock"]
            for row in runs[name].state.log_history
            if "throughput/positions_vs_stock" in row
        ]
        assert positions and all(p < 1 for p in positions), name
    unreplayed = dict(runs["padded, no replay"].model.named_parameters())
    assert max((unreplayed[n] - p).abs().max().item() for n, p in reference.items()) > 1e-4


@needs_fused_head
def test_throughput_counts_by_hand(tokenizer, tmp_path, trainer_factory):
    """throughput/* from one no-grad pass in chunks of 3 rows, against counts made here."""
    model = build_tiny_model(tokenizer, seed=0)
    trainer = trainer_factory(
        TRAINER, model=model, output_dir=tmp_path, sort_by_length="never", padding_free=False, shared_prefix=False
    )
    batch = _long_tail_batch(model.config.vocab_size)
    _forward(trainer, batch, chunk=3, grad=False)
    trainer.state.global_step = 1
    trainer.log({})
    row = trainer.state.log_history[-1]
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    real = int(mask.sum())
    widths = []
    for rows in (range(0, 3), range(3, 6)):  # first real column .. last real completion column, per chunk
        cols = mask[list(rows)].any(0).nonzero()[:, 0]
        widths.append(int(cols.max()) + 1 - int(cols.min()))
    run = 3 * sum(widths)
    assert row["throughput/tokens_per_step"] == real
    assert row["throughput/padding_per_step"] == run - real
    assert row["throughput/positions_vs_stock"] == pytest.approx(run / mask.numel())
    assert row["throughput/stock_padding_fraction"] == pytest.approx(1 - real / mask.numel())
