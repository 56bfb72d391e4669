"""Shared-prefix forwards (forward/shared_prefix.py, forward/segment_attention.py, forward/pipeline.py): each prompt runs once for all of its
completions in a model call, and every number is the unshared forward's.

Checked against independent computations: the shared forward against the trimmed padded one and a naive per-row
forward written here (log-probs, entropies, every parameter gradient; dense and MoE; left-padded prompts of
different lengths, right-padded completions, an empty completion, a group split across calls), isolation (a
sibling's tokens never reach a completion, while plain causal attention over the same row would let them), the
loss, gradients and metrics of every loss type with sharing on vs off, recorded and replayed MoE routes (R2) against
the unshared forward's, end-to-end weights (also with LoRA, gradient checkpointing and whole-group mini-batches),
and the flash-attention varlen path with a CPU stand-in kernel.
"""

import copy
import math

import pytest
import torch
from datasets import Dataset
from helpers.smallest_bug import (
    LastStepStart,
    boundary_one_key_early,
    dropped_token_gap,
    one_token_gaps,
    one_token_margin,
    trainer_loss,
    weighted_logp_loss,
)
from test_padding import LOSS_CASES, TRAINER, FixedRollouts, _varied_reward, assert_same_sgd_weights
from transformers import AutoModelForCausalLM

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.forward import fused_head, layouts, padding, segment_attention, shared_prefix
from trl_gspo.forward.layouts import row_spans
from trl_gspo.forward.planner import plan_forward
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, rounding_bound
from trl_gspo.testing import build_tiny_model

pytestmark = pytest.mark.skipif(not fused_head.available(), reason="TRL < 1.15: no fused log-prob head")

OFF = dict(shared_prefix=False, padding_free=False)
ON = dict(shared_prefix=True)


def _grouped_batch(vocab, seed=0):
    """Three prompts of different lengths (left-padded) with 3, 2 and 2 completions of different lengths
    (right-padded), one of them empty, the groups' rows interleaved as after TRL's shuffle."""
    g = torch.Generator().manual_seed(seed)
    p, t = 7, 9
    group = torch.tensor([0, 1, 0, 2, 1, 0, 2])
    prompt_len = torch.tensor([7, 4, 5])[group]
    completion_len = torch.tensor([3, 6, 0, 5, 1, 8, 2])
    prompts = torch.randint(4, vocab, (3, p), generator=g)
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    completion_mask = (torch.arange(t)[None] < completion_len[:, None]).long()
    return {
        "prompt_ids": prompts[group] * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (len(group), t), generator=g) * completion_mask,
        "completion_mask": completion_mask,
    }


def _forward(trainer, batch, chunk=None, grad=True):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.set_grad_enabled(grad):
        out = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            mask,
            batch["completion_ids"].size(1),
            batch_size=chunk,
            compute_entropy=True,
        )
    return out


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


# ---------------------------------------------------------------------------------------------- pure parts
def test_prompt_groups_and_group_order():
    batch = _grouped_batch(40)
    groups = shared_prefix.prompt_groups(batch["prompt_ids"], batch["prompt_mask"])
    assert sorted(groups) == [[0, 2, 5], [1, 4], [3, 6]]
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    order = shared_prefix.group_order(row_spans(mask), groups).tolist()
    assert sorted(order) == list(range(7))
    position = {r: order.index(r) for r in order}
    for rows in groups:  # each group's rows are consecutive
        assert max(position[r] for r in rows) - min(position[r] for r in rows) == len(rows) - 1
    # a different last prompt token still shares the prefix; a different earlier token does not
    ids = batch["prompt_ids"].clone()
    ids[2, -1] = (ids[2, -1] + 1) % 40
    ids[5, -2] = (ids[5, -2] + 1) % 40
    assert sorted(shared_prefix.prompt_groups(ids, batch["prompt_mask"])) == [[0, 2], [1, 4], [3, 6]]


def test_shared_layout_by_hand():
    """Rows 0 and 1 share a 3-token prompt (columns 1..3 of a width-4 prompt): the layout runs the prefix (columns 1,
    2) once, then each row's last prompt token and completion; positions are the padded batch's columns; the mask
    lets each segment see the prefix and itself only."""
    s, pw = 8, 4
    spans = torch.tensor([[1, 7, 6], [1, 5, 4]])
    layout = layouts.segment_layout([[0, 1]], spans, (2, s), pw, one_row=False)
    assert layout.source.tolist() == [[1, 2, 3, 4, 5, 6, s + 3, s + 4]]
    assert layout.position_ids.tolist() == [[1, 2, 3, 4, 5, 6, 3, 4]]
    assert layout.aliases.tolist() == [[0, 1], [s + 1, s + 2]] and layout.shared_positions == 2
    mask = layout.segments.dense_mask()[0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)
    plan = layout.segments.build_blocks(block=3)  # blocks reproduce the dense mask on the keys they reach
    for block in plan.blocks:
        cols = torch.arange(*block.keys) if isinstance(block.keys, tuple) else block.keys
        assert torch.equal(block.mask[0, 0].int(), expected[block.q0 : block.q1][:, cols])
        reached = expected[block.q0 : block.q1].clone()
        reached[:, cols] = 0
        assert reached.sum() == 0  # no visible key is left out of the block


def test_auto_shares_long_prompts_and_not_short_ones():
    """The cost model: a group of 8 with 1000-token prompts and ~100-token completions shares; an 8-token prompt with
    two 200-token completions does not (no padding to remove, and the shared row's masked attention blocks cost more
    than the 7 prompt tokens it saves: the trimmed call keeps SDPA's causal skip)."""

    def spans_for(prompt, completions, pw):
        return torch.tensor([[pw - prompt, pw + c, prompt + c] for c in completions])

    for prompt, completions, expected in ((1000, [90, 110, 100, 80, 120, 95, 105, 100], True), (8, [200, 200], False)):
        pw, n = prompt, len(completions)
        spans = spans_for(prompt, completions, pw)
        layouts = plan_forward(
            spans,
            (n, pw + 200),
            pw,
            n,
            groups=[list(range(n))],
            sort=True,
            trim=True,
            pack="auto",
            share="auto",
            alpha=1e-3,
        )
        assert (layouts[0].shared_positions > 0) is expected


def test_group_rows_keeps_groups_whole_and_in_shuffled_order():
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 40, (4, 3), generator=g)
    rows = torch.randperm(16, generator=g)  # 4 groups x 4 completions, shuffled as TRL does
    group = rows % 4
    batch = {
        "prompt_ids": prompts[group],
        "prompt_mask": torch.ones(16, 3, dtype=torch.long),
        "completion_mask": torch.ones(16, 2, dtype=torch.long),
        "row": rows,
        "names": [f"r{int(r)}" for r in rows],
        "num_items_in_batch": torch.tensor(5),
    }
    micro = [
        {
            k: (v[i * 4 : (i + 1) * 4] if k in ("prompt_ids", "prompt_mask", "completion_mask", "row", "names") else v)
            for k, v in batch.items()
        }
        for i in range(4)
    ]
    out = shared_prefix.group_rows(micro, ["prompt_ids", "prompt_mask", "completion_mask", "row", "names"])
    first_seen = list(dict.fromkeys(group.tolist()))
    for i, mb in enumerate(out):
        assert set((mb["row"] % 4).tolist()) == {first_seen[i]}  # one whole group per micro-batch, TRL's group order
        assert mb["names"] == [f"r{int(r)}" for r in mb["row"]] and mb["num_items_in_batch"] == 5


def test_config_fields(tmp_path):
    args = GSPOConfig(output_dir=str(tmp_path), use_cpu=True, shared_prefix="true", padding_free="AUTO")
    assert args.shared_prefix is True and args.padding_free == "auto" and args.group_minibatches is False
    for field in ("shared_prefix", "padding_free"):
        with pytest.raises(ValueError, match=rf"{field}='sometimes' is not supported; allowed: 'auto', True, False"):
            GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: "sometimes"})
    with pytest.raises(ValueError, match="group_minibatches=1 must be True or False"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, group_minibatches=1)


# ----------------------------------------------------------------------------------- forwards, shared vs not
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_shared_forward_matches_the_unshared_one(moe, tokenizer, tmp_path, trainer_factory):
    """Log-probs and entropies of the shared forward (one call, with grad; and no-grad in calls of 3 rows, which
    split the 3-row group) equal the trimmed padded forward's and the naive per-row reference; every parameter
    gradient of a loss on both equals the unshared one's."""
    model = build_tiny_model(tokenizer, moe=moe, seed=3, router_aux_loss_coef=0.0)
    batch = _grouped_batch(model.config.vocab_size)
    weights = torch.randn(7, 9, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, settings in (("off", OFF), ("on", ON)):
        trainer = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / name, **settings)
        logps, entropies, _ = _forward(trainer, batch)
        ((logps * weights).sum() + 0.1 * entropies.sum()).backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        chunked = _forward(trainer, batch, chunk=3, grad=False)
        results[name] = (logps.detach(), entropies.detach(), grads, chunked, trainer.padding.throughput[3].item())
    assert results["off"][4] == 0 and results["on"][4] > 0  # the shared run did share prompt positions
    completion = batch["completion_mask"].bool()
    with torch.no_grad():
        naive = _naive_logps(model, batch)
    b, s = completion.size(0), batch["prompt_ids"].size(1) + completion.size(1)
    bound = model_bound(torch.float32, model.config, s)  # fp32 rounding of a forward, every token
    assert relative_gap(results["on"][0][completion], naive[completion], math.inf) <= bound
    # companions: one completion token mis-masked in this batch lands outside both bounds (helpers/smallest_bug.py)
    assert min(dropped_token_gap(results["off"][0], completion), dropped_token_gap(results["off"][1], completion)) > (
        bound
    )
    for got, ref in (
        (results["on"][0], results["off"][0]),
        (results["on"][1], results["off"][1]),
        (results["on"][3][0], results["off"][0].detach()),
        (results["on"][3][1], results["off"][1]),
    ):
        assert relative_gap(got, ref, math.inf) <= bound
        assert (got[~completion] == 0).all()
    assert results["on"][2].keys() == results["off"][2].keys()
    grad_bound = model_bound(torch.float32, model.config, s, b * s)  # and of its backward
    assert one_token_gaps(weighted_logp_loss(model, batch, weights), batch["completion_mask"])[1] > grad_bound
    for n, g in results["off"][2].items():
        assert relative_gap(results["on"][2][n], g) <= grad_bound, n


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_a_completion_never_sees_its_siblings(moe, tokenizer, tmp_path, trainer_factory):
    """Changing one completion's tokens leaves its siblings' log-probs unchanged in the shared forward; the same
    shared row run with plain causal attention (what a lost segment plan would give) does move them."""
    model = build_tiny_model(tokenizer, moe=moe, seed=5).eval()
    trainer = trainer_factory(TRAINER, model=model, output_dir=tmp_path, **ON)
    trainer.model.eval()
    batch = _grouped_batch(model.config.vocab_size, seed=2)
    before, _, _ = _forward(trainer, batch, grad=False)
    for row in (0, 2, 5):  # rows sharing one prompt; each in turn changes, wherever its segment sits in the row
        changed = copy.deepcopy(batch)
        m = batch["completion_mask"][row].bool()
        changed["completion_ids"][row, m] = (batch["completion_ids"][row, m] + 5) % (model.config.vocab_size - 4) + 4
        after, _, _ = _forward(trainer, changed, grad=False)
        assert torch.equal(before[row], after[row]) is (not m.any())  # its own log-probs move (if it has tokens)
        for sibling in {0, 2, 5} - {row}:
            # dense: bit for bit; MoE: the changed row's tokens change which rows each expert's batched matmul holds,
            # which may reorder its sums, so one forward's fp32 rounding
            bound = model_bound(torch.float32, model.config, before.size(1)) if moe else 0.0
            assert relative_gap(after[sibling], before[sibling], math.inf) <= bound, (row, sibling)
    changed = copy.deepcopy(batch)
    m = batch["completion_mask"][0].bool()
    changed["completion_ids"][0, m] = (batch["completion_ids"][0, m] + 5) % (model.config.vocab_size - 4) + 4

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    ids_changed = torch.cat([changed["prompt_ids"], changed["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    layout = layouts.segment_layout([[0, 2, 5]], row_spans(mask), tuple(ids.shape), 7, one_row=False)
    with torch.no_grad():
        plain = [
            model(
                input_ids=layout.to_model(x),
                position_ids=layout.position_ids,
                attention_mask=torch.ones_like(layout.source),
            ).logits
            for x in (ids, ids_changed)
        ]
    last = layout.source[0] // ids.size(1) == 5  # row 5's segment comes after row 0's in the shared row
    # the lost plan's leak lands past one forward's rounding, the bound the MoE siblings are held to above
    leak = relative_gap(plain[1][0, last], plain[0][0, last], math.inf)
    assert leak > model_bound(torch.float32, model.config, before.size(1))

    # the smallest leak (helpers/smallest_bug.py's kind): row 5's segment one key early, so it also sees the last
    # token of row 0's segment, just before it in a row of the two (row 2 has no completion tokens to change); with
    # row 0 changed, row 5 moves past the same bound
    layout = layouts.segment_layout([[0, 5]], row_spans(mask), tuple(ids.shape), 7, one_row=False)
    last = layout.source[0] // ids.size(1) == 5
    start = int(last.nonzero().min())
    assert int(layout.source[0, start - 1]) // ids.size(1) == 0, "row 5's segment should follow row 0's"
    off_by_one = boundary_one_key_early(layout, start)
    with torch.no_grad():
        one_key = [
            trainer.logprob_forward._call_model(
                model, off_by_one, input_ids=off_by_one.to_model(x), position_ids=off_by_one.position_ids
            ).logits
            for x in (ids, ids_changed)
        ]
    trainer.logprob_forward.release()
    leak = relative_gap(one_key[1][0, last], one_key[0][0, last], math.inf)
    assert leak > model_bound(torch.float32, model.config, before.size(1))


# ------------------------------------------------------------------------------ loss, gradients and metrics


def _loss_inputs(model, seed, tool_mask=False):
    batch = _grouped_batch(model.config.vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        logps = _naive_logps(model, batch)
    mask = batch["completion_mask"]
    inputs = {
        **batch,
        "advantages": torch.tensor([1.0, -0.5, 0.7, 0.3, 1.2, 0.4, -0.8]),
        "old_per_token_logps": (logps + 0.003 * torch.randn(logps.shape, generator=g)) * mask,
        "ref_per_token_logps": (logps + 0.05 * torch.randn(logps.shape, generator=g)) * mask,
        "num_items_in_batch": mask.sum(),
    }
    if tool_mask:  # multi-turn: tool output inside the completion is attended to but not trained on
        inputs["tool_mask"] = (torch.arange(mask.size(1))[None] % 3 != 1).long() * mask
    return inputs


def _loss_grads_metrics(model, tokenizer, tmp_path, inputs, settings, trainer_factory):
    trainer = trainer_factory(
        TRAINER, model=copy.deepcopy(model), output_dir=tmp_path, allow_token_sum_with_sequence_level=True, **settings
    )
    loss = trainer._compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()})
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.logprob_forward.release()
    trainer.log({})
    return loss.detach(), grads, dict(trainer.state.log_history[-1]), trainer


@pytest.mark.parametrize("name", list(LOSS_CASES) + ["grpo, multi-turn tool_mask"])
def test_sharing_leaves_loss_gradients_and_metrics_unchanged(
    name, tokenizer, tiny_model_dir, tmp_path, trainer_factory
):
    """In fp64: the loss, every parameter gradient and every logged metric with shared_prefix on equal the unshared
    run's within rounding (rounding.model_bound: fp64's, plus fp32's for the sums transformers' norms and TRL's
    log-prob head run in fp32 regardless; a shared prompt's key gradient, summed over its completions before the
    k-norm's fp32 backward, does move the k-projection's gradient at that scale); only the throughput counts differ,
    and they show that prompts were shared. A wrong token, position, mask or label would differ by orders of
    magnitude more."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    inputs = _loss_inputs(model, seed=4, tool_mask="tool_mask" in name)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    settings = dict(
        LOSS_CASES[name.split(",")[0] if "tool_mask" in name else name], model_init_kwargs={"dtype": torch.float64}
    )
    off = _loss_grads_metrics(model, tokenizer, tmp_path / "off", inputs, {**settings, **OFF}, trainer_factory)
    on = _loss_grads_metrics(model, tokenizer, tmp_path / "on", inputs, {**settings, **ON}, trainer_factory)
    assert off[0].abs() > 1e-3
    b, s = inputs["prompt_ids"].size(0), inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    size = inputs["old_per_token_logps"].abs().max().item()  # the log-probs' size (rounding.loss_bound)
    value_bound = loss_bound(torch.float64, model.config, s, b * s, size)
    grad_bound = loss_bound(torch.float64, model.config, s, b * s, size, b * s)
    assert relative_gap(on[0], off[0]) <= value_bound
    assert on[1].keys() == off[1].keys() and len(off[1]) > 0
    for n, g in off[1].items():
        assert relative_gap(on[1][n], g) <= grad_bound, n
    # companion (helpers/smallest_bug.py): one token mis-masked in the unshared run's loss moves the loss or some
    # parameter's gradient past its bound, for every token whose loss term moves at all; the tokens trained on (a
    # tool-output token is attended to, not trained on: leaving it out of the loss changes nothing there)
    trained = inputs["completion_mask"] * inputs.get("tool_mask", 1)
    assert one_token_margin(trainer_loss(off[3], inputs), trained, value_bound, grad_bound) > 1
    off[3].logprob_forward.release()
    assert set(on[2]) == set(off[2])
    assert (
        off[2]["throughput/prompt_tokens_saved_per_step"] == 0 and on[2]["throughput/prompt_tokens_saved_per_step"] > 0
    )
    metric_floor = model_bound(torch.float64, model.config, s) * size  # the metrics: functions of the log-probs
    for key, value in off[2].items():
        if not key.startswith("throughput/") and isinstance(value, float):
            assert on[2][key] == pytest.approx(value, rel=value_bound, abs=metric_floor), key


# ------------------------------------------------------------------------------------------- MoE routes (R2)
def test_recorded_and_replayed_routes_follow_shared_positions(tokenizer, tmp_path, trainer_factory):
    """Recorded in a shared forward, each prompt's routes are recorded once and hold for every sibling: at every real
    token they equal the unshared forward's. Replayed (forced random routes, the same for siblings' prompts), the
    shared forward's log-probs and gradients equal the unshared replayed forward's; where siblings' prompt routes
    differ, those rows run unshared and the result still equals."""
    from trl_gspo.moe.routing import RouteTable

    model = build_tiny_model(tokenizer, moe=True, seed=0, router_aux_loss_coef=0.0)
    batch = _grouped_batch(model.config.vocab_size, seed=6)
    real = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
    b, s = real.shape
    recorded = {}
    for name, settings in (("off", OFF), ("on", ON)):
        trainer = trainer_factory(
            TRAINER,
            model=copy.deepcopy(model),
            output_dir=tmp_path / name,
            routing_replay="R2",
            steps_per_generation=4,
            **settings,
        )
        trainer.moe_routing.role = "old"  # what _generate_and_score_completions sets before TRL's pi_old pass
        _forward(trainer, batch, grad=False)
        recorded[name] = trainer.moe_routing.rollout_routes
        assert (trainer.padding.throughput[3].item() > 0) is (name == "on")
    assert torch.equal(recorded["on"].valid[real], recorded["off"].valid[real]) and recorded["on"].valid[real].all()
    assert torch.equal(recorded["on"].ids[real].sort(-1).values, recorded["off"].ids[real].sort(-1).values)

    hooks = trainer_factory(TRAINER, model=copy.deepcopy(model), output_dir=tmp_path / "h", **OFF).moe_routing.hooks
    g = torch.Generator().manual_seed(0)
    forced = torch.rand(b, s, hooks.num_layers, hooks.num_experts, generator=g).argsort(-1)[..., : hooks.top_k]
    forced[2, :6], forced[5, :6] = forced[0, :6], forced[0, :6]  # siblings agree on their prompt's routes
    forced[4, :6] = forced[1, :6]
    split = forced.clone()
    split[5, 4] = (split[5, 4] + 1) % hooks.num_experts  # row 5 disagrees: it must run unshared
    weights = torch.randn(b, 9, generator=g)
    for routes in (forced, split):
        table = RouteTable(routes.to(hooks.id_dtype), torch.ones(b, s, dtype=torch.bool))
        results = {}
        for name, settings in (("off", OFF), ("on", ON)):
            trainer = trainer_factory(
                TRAINER,
                model=copy.deepcopy(model),
                output_dir=tmp_path / f"r{name}",
                routing_replay="R2",
                steps_per_generation=4,
                **settings,
            )
            trainer.moe_routing.role = "loss"  # what compute_loss sets around the loss forward
            trainer.moe_routing.loss_inputs = {**batch, "old_routes": table.ids, "old_routes_valid": table.valid}
            logps = _forward(trainer, batch)[0]
            (logps * weights).sum().backward()
            trainer.logprob_forward.release()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
            results[name] = (logps.detach(), grads, trainer.padding.throughput[3].item())
            if name == "off":
                unshared = trainer
        assert results["on"][2] > 0
        assert relative_gap(results["on"][0], results["off"][0], math.inf) <= model_bound(
            torch.float32, model.config, s
        )
        for n, ref in results["off"][1].items():
            assert relative_gap(results["on"][1][n], ref) <= model_bound(torch.float32, model.config, s, b * s), n
        # companions (helpers/smallest_bug.py): one completion token mis-masked lands outside the log-prob bound, and,
        # in the loss over the unshared replayed forward, moves some parameter's gradient past its bound: one forward,
        # a gradient per token through it
        gap = dropped_token_gap(results["off"][0], batch["completion_mask"])
        assert gap > model_bound(torch.float32, model.config, s)
        trainer = unshared
        trainer.moe_routing.role = "loss"
        logps = _forward(trainer, batch)[0]
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}

        def compute(keep):
            loss = (logps * weights * keep).sum()
            moved = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
            return loss.detach(), {n: g for n, g in zip(params, moved) if g is not None}

        gap = one_token_gaps(compute, batch["completion_mask"])[1]
        trainer.logprob_forward.release()
        assert gap > model_bound(torch.float32, model.config, s, b * s)


# ------------------------------------------------------------------------------------------- flash varlen
def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
    """CPU stand-in for flash_attn_varlen_func: per sequence, bottom-right aligned causal attention."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]]
        vs = v[cu_k[i] : cu_k[i + 1]]
        nq, nk = len(qs), len(ks)
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        rep = qs.size(1) // ks.size(1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1),
            ks.transpose(0, 1).repeat_interleave(rep, 0),
            vs.transpose(0, 1).repeat_interleave(rep, 0),
            attn_mask=mask,
            scale=softmax_scale,
        )
        out[cu_q[i] : cu_q[i + 1]] = o.transpose(0, 1)
    return out


def test_flash_varlen_path_matches_the_sdpa_blocks(monkeypatch):
    """The GPU path's arguments (gathered keys per segment, cu_seqlens, bottom-right causal), run with a CPU stand-in
    kernel, give the SDPA blocks' output on a one-row shared + packed layout. Not a GPU run."""
    monkeypatch.setattr(segment_attention, "flash_attn_varlen_func", _reference_varlen)
    spans = torch.tensor([[1, 9, 8], [1, 7, 6], [2, 8, 6], [0, 6, 6]])
    layout = layouts.segment_layout([[0, 1], [2], [3]], spans, (4, 10), 5, one_row=True)
    w = layout.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, w, 8, generator=g) for h in (4, 2, 2))
    module = type("Attention", (), {"config": None})()
    blocks = copy.deepcopy(layout.segments).build_blocks(block=4)
    varlen = copy.deepcopy(layout.segments).build_varlen()
    out_blocks, _ = segment_attention.segment_attention(module, q, k, v, None, segment_plan=blocks)
    out_varlen, _ = segment_attention.segment_attention(module, q, k, v, None, segment_plan=varlen)
    bound = rounding_bound(torch.float32, 8 + 2 * w)  # fp32: scores over the head size, softmax and sum over keys
    assert relative_gap(out_varlen, out_blocks, math.inf) <= bound
    dense = layout.segments.dense_mask()[:, None]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense
    ).transpose(1, 2)
    assert relative_gap(out_blocks, reference, math.inf) <= bound
    # companion (helpers/smallest_bug.py's kind): one key position mis-masked, hidden from every query that sees it
    # but its own (a segment's end off by one), moves some output past the bound
    moved = []
    for key in range(w):
        wrong = dense.clone()
        wrong[..., key] &= torch.arange(w) == key  # each query keeps at least itself
        if torch.equal(wrong, dense):
            continue  # a key only its own query sees: nothing to hide
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=wrong
        ).transpose(1, 2)
        moved.append(relative_gap(out, reference, math.inf))
    assert moved and min(moved) > bound


# ----------------------------------------------------------------------------------------------- end to end
def _run(tokenizer, tmp_path, record=None, peft_config=None, **overrides):
    import os

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        num_generations=3,
        max_completion_length=10,
        learning_rate=0.05,
        optim="sgd",
        logging_steps=1,
        # 5 steps at a constant rate: the last is the first of a rollout batch (on-policy, nothing clipped by GSPO's
        # band), at the full rate, where a one-token bug in it moves the end weights past their bound (the companion)
        max_steps=5,
        lr_scheduler_type="constant",
        disable_tqdm=True,
    )
    args = GSPOConfig(**{**settings, **overrides})
    trainer = GSPOTrainer(
        build_tiny_model(tokenizer, seed=0),
        _varied_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * 64}),
        processing_class=tokenizer,
        rollout_func=FixedRollouts(tokenizer, prompt_lengths=(3, 9)),
        peft_config=peft_config,
    )
    if record is not None:
        original = trainer._compute_loss

        def recording(model, inputs):
            record.append(
                (
                    trainer.state.global_step,
                    [tuple(r[m.bool()].tolist()) for r, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])],
                )
            )
            return original(model, inputs)

        trainer._compute_loss = recording
    trainer.add_callback(LastStepStart())  # the last-step companion measures where that step ran
    trainer.train()
    return trainer


def _assert_same_weights(a, b):
    """Two plain-SGD runs' weights within rounding (test_padding.assert_same_sgd_weights, with its companion);
    prompts of up to 8 tokens (FixedRollouts' prompt_lengths=(3, 9)), completions of up to 10."""
    weights = dict(b.model.named_parameters()), dict(a.model.named_parameters())
    assert_same_sgd_weights(*weights, b, "shared", 18)


def _saved(trainer):
    return [
        row["throughput/prompt_tokens_saved_per_step"]
        for row in trainer.state.log_history
        if "throughput/prompt_tokens_saved_per_step" in row
    ]


@pytest.mark.slow
def test_training_with_shared_prefixes_ends_with_the_same_weights(tokenizer, tmp_path):
    """End to end (gradient checkpointing on, TRL's default), same rollouts, SGD: shared_prefix=True ends where
    shared_prefix=False ends, with TRL's row order and with whole-group mini-batches; and with LoRA."""
    from peft import LoraConfig

    off, on = _run(tokenizer, tmp_path / "a", **OFF), _run(tokenizer, tmp_path / "b", **ON)
    initial = dict(build_tiny_model(tokenizer, seed=0).named_parameters())
    assert max((p - initial[n]).abs().max().item() for n, p in off.model.named_parameters()) > 1e-3
    _assert_same_weights(off, on)
    assert all(x == 0 for x in _saved(off)) and sum(_saved(on)) > 0
    grouped = {
        k: _run(tokenizer, tmp_path / f"g{k}", group_minibatches=True, **s) for k, s in (("off", OFF), ("on", ON))
    }
    _assert_same_weights(grouped["off"], grouped["on"])
    assert sum(_saved(grouped["on"])) > sum(_saved(on))  # the loss forward shares too
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    adapters = [_run(tokenizer, tmp_path / f"l{k}", peft_config=lora, **s) for k, s in (("off", OFF), ("on", ON))]
    _assert_same_weights(*adapters)


@pytest.mark.slow
def test_group_minibatches_keeps_whole_groups_in_each_optimizer_step(tokenizer, tmp_path):
    """With group_minibatches=True every optimizer step trains on whole groups (3 completions of each of its prompts)
    and each micro-batch holds one prompt; with TRL's shuffle (default) the same run mixes groups across steps."""
    runs = {}
    for grouped in (False, True):
        record = []
        _run(
            tokenizer, tmp_path / str(grouped), record=record, group_minibatches=grouped, learning_rate=0.0, max_steps=4
        )
        runs[grouped] = record
    for grouped, record in runs.items():
        by_step = {}
        for step, prompts in record:
            by_step.setdefault(step, []).extend(prompts)
        whole = all(all(prompts.count(p) == 3 for p in prompts) for prompts in by_step.values())
        assert whole is grouped
        if grouped:
            assert all(len(set(prompts)) == 1 for _, prompts in record)


def test_sorting_inside_a_step_groups_prompts_only_when_cheaper():
    """`arrange_micro_batches` with a cost: inside each optimizer step (2 micro-batches here) rows are ordered by
    length, or by prompt group when the cost says the grouped micro-batches are cheaper; either way each step keeps
    exactly its rows."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(4, 40, (4, 3), generator=g)
    group = torch.tensor([0, 1, 2, 3, 1, 0, 3, 2, 0, 0, 1, 1, 2, 3, 2, 3])  # 4 micro-batches of 4 rows, 2 per step
    lengths = torch.randint(1, 6, (16,), generator=g)
    buffer = [
        {
            "prompt_ids": prompts[group[i : i + 4]],
            "prompt_mask": torch.ones(4, 3, dtype=torch.long),
            "completion_mask": (torch.arange(6)[None] < lengths[i : i + 4, None]).long(),
            "row": torch.arange(i, i + 4),
        }
        for i in range(0, 16, 4)
    ]

    def groups_in(batch):  # distinct prompts in a micro-batch: fewer means more sharing
        return len({tuple(p.tolist()) for p in batch["prompt_ids"]})

    arranged = {}
    for name, cost in (("length", lambda b: -groups_in(b)), ("grouped", groups_in)):
        out = padding.arrange_micro_batches(
            [dict(b) for b in buffer], 0, 4, 1, 2, sort=True, group_minibatches=False, cost=cost
        )
        for step in (0, 1):  # rows never leave their optimizer step
            got = sorted(torch.cat([out[2 * step]["row"], out[2 * step + 1]["row"]]).tolist())
            assert got == list(range(8 * step, 8 * step + 8))
        arranged[name] = out
    assert sum(map(groups_in, arranged["grouped"])) < sum(map(groups_in, arranged["length"]))
    plain = padding.arrange_micro_batches([dict(b) for b in buffer], 0, 4, 1, 2, sort=True, group_minibatches=False)
    assert all(torch.equal(a["row"], b["row"]) for a, b in zip(plain, arranged["length"]))  # = length order
