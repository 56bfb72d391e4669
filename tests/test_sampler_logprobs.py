"""Sampler log-prob reuse (`GSPOConfig.old_logprobs_source="sampler"`).

- The generate-time recorder returns exactly what an independent full forward gives for log_softmax(logits / T)
  at the sampled tokens, even with top-k / top-p on (which `output_scores` would have baked in).
- End to end on CPU, reuse on vs off gives the same pi_old, losses and weights to fp32 precision, and really skips
  TRL's old-policy forward; reuse off gives bit-for-bit stock TRL's rollout batch (inputs and old log-probs).
- The vLLM flow (TRL's vLLM branches, with a stand-in engine whose log-probs are off by a known gap): pi_old is
  the engine's log-prob, the gap is logged, and the length-normalised IS correction is exp(mean), not exp(sum).
- Metric, IS-correction, fused-head chunk and config helpers against straightforward implementations, and errors.
"""

import logging
import math

import pytest
import torch
from helpers.smallest_bug import (
    LastStepStart,
    dropped_token_gap,
    dropped_token_mean_gap,
    last_step_learning_rate,
    last_step_start,
    one_token_gaps,
    one_token_step_gap,
    trainer_loss,
    weighted_logp_loss,
)
from helpers.trainers import SAMPLING_RUN
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.forward import fused_head
from trl_gspo.forward.pipeline import LogprobForward
from trl_gspo.rollout import sampler_logprobs as sl
from trl_gspo.rounding import loss_bound, model_bound, relative_gap, rounding_bound, sgd_weights_bound
from trl_gspo.testing import build_tiny_model


def _logp_bound(model, seq_len):
    """fp32 on CPU: generate's KV-cached logits differ from a full forward only in accumulation order, so log-probs
    agree to one forward's rounding (rounding.model_bound), relative to the largest log-prob; any real bug (a
    wrong temperature, an off-by-one step or top-p renormalisation) moves log-probs by >1e-2."""
    return model_bound(torch.float32, model.config, seq_len)


#: The trainers of this file (`trainer_factory`; `cls=GRPOTrainer, config_cls=GRPOConfig` for stock TRL).
TRAINER = SAMPLING_RUN


def _first_rollout(trainer):
    """The buffered rollout batch of the first generation, in TRL's shuffled mini-batch order."""
    trainer.train()
    return trainer._buffered_inputs


# ----------------------------------------------------------------------------------------- the recorder
def test_recorder_matches_independent_forward_with_top_k_top_p(tokenizer):
    model = build_tiny_model(tokenizer, seed=1).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16]])
    mask = (ids != 0).long()
    temperature = 0.7
    gen = GenerationConfig(
        max_new_tokens=7,
        do_sample=True,
        temperature=temperature,
        top_k=5,
        top_p=0.8,
        pad_token_id=0,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.no_grad(), sl.SamplerLogprobRecorder(model, temperature) as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    completion = out[:, ids.size(1) :]
    lists = [row.tolist() for row in completion]
    lists[1] = lists[1][:3]  # an EOS-truncated completion keeps its prefix
    got = rec.completion_logprobs(lists)

    with torch.no_grad():  # independent: one full forward, log_softmax(raw logits / T), no top-k/top-p
        logits = model(input_ids=out, attention_mask=torch.cat([mask, torch.ones_like(completion)], 1)).logits
    expected = torch.log_softmax(logits[:, ids.size(1) - 1 : -1].double() / temperature, -1)
    expected = expected.gather(-1, completion[..., None])[..., 0]
    assert [len(r) for r in got] == [7, 3, 7]
    for row, exp in zip(got, expected):
        gap = relative_gap(torch.tensor(row, dtype=torch.float64), exp[: len(row)], math.inf)
        assert gap <= _logp_bound(model, out.size(1))
        # companion (helpers/smallest_bug.py): one of the row's tokens mis-masked lands outside the bound
        assert dropped_token_gap(exp[: len(row)], torch.ones(len(row))) > _logp_bound(model, out.size(1))
    # top-k=5 / top-p=0.8 renormalise the sampling distribution: the processed log-prob would be visibly higher.
    assert (expected.exp() < 0.99).all()


def test_recorder_rejects_bad_temperature_and_unused_state(tokenizer):
    model = build_tiny_model(tokenizer)
    with pytest.raises(ValueError, match="temperature=0"):
        sl.SamplerLogprobRecorder(model, 0.0)
    with pytest.raises(RuntimeError, match="saw no generation step"):
        sl.SamplerLogprobRecorder(model, 1.0).completion_logprobs([[1]])


# ------------------------------------------------------------------------------------------ end to end
def test_reuse_on_matches_recompute_and_skips_the_old_forward(tokenizer, tmp_path, monkeypatch, trainer_factory):
    calls = []
    # Where the forward pipeline (forward/pipeline.py) runs the model: every log-prob pass that calls it goes through here.
    original = LogprobForward._planned_forward

    def counting(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LogprobForward, "_planned_forward", counting)
    runs = {}
    for source in ("recompute", "sampler"):
        calls.clear()
        # plain SGD: its runs stay within rounding of each other (rounding.sgd_weights_bound); Adam would turn a
        # rounding-sized gradient difference on a ~0 gradient into a step of up to the learning rate. A constant
        # rate: a linear decay would leave the last step an eighth of it, too small a step for a one-token bug in
        # it to move the weights past their bound (the companion below)
        trainer = trainer_factory(
            TRAINER,
            output_dir=tmp_path / source,
            max_steps=8,
            old_logprobs_source=source,
            optim="sgd",
            lr_scheduler_type="constant",
        )
        trainer.add_callback(LastStepStart())  # the last-step companion measures where that step ran
        trainer.train()
        runs[source] = dict(
            no_grad_forwards=calls.count(False),
            batches=trainer._buffered_inputs,
            losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
            params=[p.detach().clone() for p in trainer.model.parameters()],
            history=trainer.state.log_history,
        )
    # One pi_old forward per rollout batch (2 rollouts) with recompute, none with the sampler's log-probs.
    assert runs["recompute"]["no_grad_forwards"] == 2
    assert runs["sampler"]["no_grad_forwards"] == 0
    first = runs["recompute"]["batches"][0]
    seq_len = first["prompt_ids"].size(1) + first["completion_ids"].size(1)
    logp_bound = _logp_bound(trainer.model, seq_len)
    for a, b in zip(runs["recompute"]["batches"], runs["sampler"]["batches"]):
        assert torch.equal(a["completion_ids"], b["completion_ids"])  # same samples (sampling is RNG-identical)
        m = a["completion_mask"].bool()
        assert relative_gap(b["old_per_token_logps"][m], a["old_per_token_logps"][m], math.inf) <= logp_bound
        assert dropped_token_gap(a["old_per_token_logps"], m) > logp_bound  # companion: one token mis-masked shows
    # the loss (rounding.loss_bound): its terms are advantage x ratio, each ~1 (advantages scaled to unit std)
    args, positions = trainer.args, TRAINER["per_device_train_batch_size"] * seq_len
    scale = max(b["old_per_token_logps"].abs().max().item() for b in runs["recompute"]["batches"])
    value = loss_bound(torch.float32, trainer.model.config, seq_len, positions, scale)
    for a, b in zip(runs["recompute"]["losses"], runs["sampler"]["losses"]):
        assert b == pytest.approx(a, rel=value, abs=value)
    assert any(abs(x) > 1e-3 for x in runs["recompute"]["losses"])  # a non-trivial loss was compared
    gradient = loss_bound(torch.float32, trainer.model.config, seq_len, positions, scale, positions)
    bounds = {}
    for (name, _), pa, pb in zip(
        trainer.model.named_parameters(), runs["recompute"]["params"], runs["sampler"]["params"]
    ):
        bounds[name] = sgd_weights_bound(torch.float32, gradient, args, 8, pa.norm().item())
        assert (pb - pa).norm().item() <= bounds[name]
    # companion (helpers/smallest_bug.py): one token mis-masked in the last step's loss (one micro-batch per step)
    # moves that step, and so the end weights, past some parameter's bound. The loss's value, a mean of sequence
    # ratios within ~1e-3 of 1 times advantages, moves by less than its own bound: the weights are what shows it.
    assert args.gradient_accumulation_steps == 1
    last = trainer._buffered_inputs[(trainer.state.global_step - 1) % len(trainer._buffered_inputs)]
    rate = last_step_learning_rate(trainer)
    step_gap = one_token_step_gap(
        trainer_loss(trainer, last, last_step_start(trainer)), last["completion_mask"], rate, args.max_grad_norm, bounds
    )
    assert step_gap > 1
    # The gap is logged from the on-policy mini-batches only (one per rollout), and is fp32-small.
    logged = [h for h in runs["sampler"]["history"] if "sampler/logp_abs_diff/max" in h]
    assert len(logged) == 2
    assert all(0 <= h["sampler/logp_abs_diff/max"] <= logp_bound * scale for h in logged)
    # companion (helpers/smallest_bug.py's kind): one token's sampler log-prob mis-masked (0) or taken from another
    # token moves that token's |difference| by about its whole log-prob, at least the smallest |log-prob| of the
    # rollout, past the bound (the last rollout's batches: the size the bound is taken from)
    smallest = min(
        b["old_per_token_logps"][b["completion_mask"].bool()].abs().min().item() for b in runs["sampler"]["batches"]
    )
    assert smallest > logp_bound * scale
    assert all(h["sampler/seq_outside_clip_frac"] == 0 for h in logged)
    assert not any("sampler/logp_abs_diff/max" in h for h in runs["recompute"]["history"])


def test_reuse_off_rollout_batch_is_bit_for_bit_stock(tokenizer, tmp_path, trainer_factory):
    stock = _first_rollout(
        trainer_factory(TRAINER, output_dir=tmp_path / "stock", cls=GRPOTrainer, config_cls=GRPOConfig)
    )
    # Trimming and sorting off (forward/padding.py): its forward must then be TRL's bit for bit; with them on, rows are
    # reordered within optimizer steps and log-probs differ by float rounding (tests/test_padding.py).
    ours = _first_rollout(
        trainer_factory(
            TRAINER,
            output_dir=tmp_path / "ours",
            old_logprobs_source="recompute",
            trim_padding=False,
            sort_by_length="never",
        )
    )
    assert len(stock) == len(ours) == 4
    for a, b in zip(stock, ours):
        assert a.keys() == b.keys()
        assert "old_per_token_logps" in a and "sampling_per_token_logps" not in a
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_nan_sampler_logprobs_fall_back_to_recompute(tokenizer, tmp_path, caplog, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, old_logprobs_source="sampler")
    trainer.sampler_logprobs.logps = [[-1.0, None], [-0.5]]
    with caplog.at_level(logging.WARNING, logger="trl_gspo.trainer"):
        assert trainer.sampler_logprobs.old_logps(2, 3, "cpu") is None
    assert "NaN" in caplog.text
    trainer.sampler_logprobs.logps = [[-1.0, -2.0], [-0.5]]
    assert torch.equal(trainer.sampler_logprobs.old_logps(2, 3, "cpu"), torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0, 0]]))
    with pytest.raises(RuntimeError, match="cover 2 completions but the batch has 3"):
        trainer.sampler_logprobs.old_logps(3, 3, "cpu")


# --------------------------------------------------------------------------------------- pure helpers
def test_mismatch_stats_against_loops():
    g = torch.Generator().manual_seed(0)
    trainer = torch.randn(4, 6, generator=g)
    sampler = trainer + 1e-3 * torch.randn(4, 6, generator=g)
    sampler[0, 1] = float("nan")  # unscored token: left out
    sampler[2, 0] += 0.01  # one sequence pushed outside the clip range
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1] * 4 + [0] * 2, [0] * 6])
    stats = sl.mismatch_stats(trainer, sampler, mask, 3e-4, 4e-4)
    deltas, seqs = [], []
    for i in range(4):
        d = [float(trainer[i, t] - sampler[i, t]) for t in range(6) if mask[i, t] and sampler[i, t] == sampler[i, t]]
        deltas += [abs(x) for x in d]
        if d:
            seqs.append(sum(d) / len(d))
    outside = sum(1 for s in seqs if not (1 - 3e-4 <= torch.exp(torch.tensor(s)).item() <= 1 + 4e-4))
    expected = [sum(deltas), len(deltas), max(deltas), sum(map(abs, seqs)), len(seqs), max(map(abs, seqs)), outside]
    # the same fp32 differences, summed in fp32 there and in fp64 here: the rounding of a sum over every token, each
    # sum relative to itself, a sequence's mean (signed terms) relative to the largest difference
    bound = rounding_bound(torch.float32, mask.numel())
    torch.testing.assert_close(stats.double(), torch.tensor(expected).double(), rtol=bound, atol=bound * max(deltas))
    # companion (helpers/smallest_bug.py's kind): one scored token mis-masked moves some statistic past the tolerance
    # (the token count moves by 1 whatever the token; the sums by its |difference|)
    want, atol = torch.tensor(expected).double(), bound * max(deltas)
    scored = mask.bool() & (sampler == sampler)
    for index in scored.nonzero().tolist():
        keep = mask.clone()
        keep[tuple(index)] = 0
        moved = (sl.mismatch_stats(trainer, sampler, keep, 3e-4, 4e-4).double() - want).abs()
        assert (moved / (atol + bound * want.abs())).max() > 1, index
    assert outside >= 1
    summary = sl.summarize_mismatch(torch.stack([stats, stats]))
    assert summary["sampler/logp_abs_diff/mean"] == pytest.approx(sum(deltas) / len(deltas), rel=bound)
    assert summary["sampler/seq_outside_clip_frac"] == pytest.approx(outside / len(seqs))


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_length_normalized_is_ratio_against_loops(mode):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 5, generator=g)
    sampling = old - torch.tensor([[0.3], [0.0], [-2.0]]) + 0.01 * torch.randn(3, 5, generator=g)
    sampling[1, 2] = float("nan")
    mask = torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0]])
    got = sl.length_normalized_is_ratio(old, sampling, mask, mode, clip_min=0.5, clip_max=1.2)
    moves = []  # per scored token left out of its row's mean, the ratio's relative move (the companion below)
    for i in range(3):
        d = [float(old[i, t] - sampling[i, t]) for t in range(5) if mask[i, t] and sampling[i, t] == sampling[i, t]]
        r = torch.exp(torch.tensor(sum(d) / len(d))).item()
        want = min(max(r, 0.5), 1.2) if mode == "sequence_truncate" else (r if 0.5 <= r <= 1.2 else 0.0)
        # fp32: a mean over the tokens and an exp, of differences of log-probs as large as |old|
        rel = rounding_bound(torch.float32, 5 + 3) * old.abs().max().item()
        assert got[i, 0].item() == pytest.approx(want, rel=rel)
        # companion (helpers/smallest_bug.py's kind): one of the row's scored tokens left out of its mean moves the
        # ratio past the tolerance, wherever the ratio moves at all (a ratio clipped to its bound, or masked to 0,
        # stays put when one token goes: no test of this batch can show that)
        for t in range(len(d)):
            r_bug = torch.exp(torch.tensor(sum(d[:t] + d[t + 1 :]) / (len(d) - 1))).item()
            bug = min(max(r_bug, 0.5), 1.2) if mode == "sequence_truncate" else (r_bug if 0.5 <= r_bug <= 1.2 else 0.0)
            if bug != want:
                moves.append(abs(bug - want) / abs(want) if want else math.inf)
    assert moves and min(moves) > rel
    # The sum over 2k tokens of a 1e-3 gap is e^2 ~ 7.4 (masked by TRL's cap of 3); the mean stays at e^1e-3.
    long_old, long_sampling = torch.full((1, 2048), -1.0), torch.full((1, 2048), -1.001)
    ratio = sl.length_normalized_is_ratio(long_old, long_sampling, torch.ones(1, 2048), "sequence_mask", None, 3.0)
    assert ratio.item() == pytest.approx(1.001, abs=1e-4)
    with pytest.raises(ValueError, match="'token_mask'.*allowed modes"):
        sl.length_normalized_is_ratio(old, sampling, mask, "token_mask", None, 3.0)


# ---------------------------------------------------------------------------------------- validation
def _config(tmp_path, **kw):
    return GSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)


def test_config_validation(tmp_path, caplog):
    with pytest.raises(ValueError, match="old_logprobs_source='cache'.*allowed: recompute, sampler"):
        _config(tmp_path, old_logprobs_source="cache")
    with pytest.raises(ValueError, match="top_p=0.9.*vLLM"):
        _config(tmp_path, old_logprobs_source="sampler", use_vllm=True, top_p=0.9)
    with pytest.raises(ValueError, match="top_k=20"):
        _config(tmp_path, old_logprobs_source="sampler", use_vllm=True, top_k=20)
    with pytest.raises(ValueError, match="continuous batching"):
        _config(tmp_path, old_logprobs_source="sampler", use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="'token_truncate'; token modes"):
        _config(
            tmp_path, vllm_importance_sampling_length_normalized=True, vllm_importance_sampling_mode="token_truncate"
        )
    with pytest.raises(ValueError, match="has no effect with old_logprobs_source='sampler'"):
        _config(tmp_path, old_logprobs_source="sampler", use_vllm=True, vllm_importance_sampling_length_normalized=True)
    with caplog.at_level(logging.WARNING, logger="trl_gspo.config"):
        cfg = _config(tmp_path, old_logprobs_source="sampler", use_vllm=True)
    assert cfg.vllm_importance_sampling_correction is False and "identity" in caplog.text
    # transformers generate: the recorder scores raw logits / T, so sampling processors are allowed.
    assert _config(tmp_path, old_logprobs_source="sampler", top_p=0.9, top_k=20).old_logprobs_source == "sampler"


# ------------------------------------------------------------------------------- fused-head vocab chunk
NO_FUSED_HEAD = "TRL < 1.15 has no fused log-prob head (it computes full logits)"


@pytest.mark.skipif(not fused_head.available(), reason=NO_FUSED_HEAD)
def test_vocab_chunk_matches_full_logits_values_and_grads(tokenizer, tmp_path, trainer_factory):
    """A vocabulary split into 5 tiles gives the log-probs, entropies and gradients of a plain full-logits pass."""
    from trl.trainer import utils as trl_utils

    trainer = trainer_factory(
        TRAINER, output_dir=tmp_path, logprob_vocab_chunk_size=11
    )  # 48-word vocab -> 5 tiles, the last short
    model = trainer.model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    logps, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 5, compute_entropy=True)
    (logps.sum() + 0.5 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 32768  # restored after the call

    logits = model(input_ids=ids, attention_mask=mask).logits[:, -6:-1].double() / TRAINER["temperature"]
    ref_all = torch.log_softmax(logits, -1)
    ref_logps = ref_all.gather(-1, ids[:, -5:, None])[..., 0]
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    (ref_logps.sum() + 0.5 * ref_entropy.sum()).backward()
    # fp32 rounding of a forward (trl_gspo/rounding.py), every token; and of its backward for the gradients
    bound = model_bound(torch.float32, model.config, ids.size(1))
    assert relative_gap(logps, ref_logps, math.inf) <= bound
    assert relative_gap(entropy, ref_entropy, math.inf) <= bound
    grad_bound = model_bound(torch.float32, model.config, ids.size(1), ids.numel())
    for name, param in model.named_parameters():
        assert relative_gap(grads[name], param.grad) <= grad_bound, name
    # companions (helpers/smallest_bug.py): one token mis-masked lands outside both bounds
    batch = _split_batch(ids, mask, 5)
    assert min(dropped_token_gap(ref_logps, mask[:, -5:]), dropped_token_gap(ref_entropy, mask[:, -5:])) > bound
    compute = weighted_logp_loss(model, batch, 1.0, 0.5, TRAINER["temperature"])
    assert one_token_gaps(compute, batch["completion_mask"])[1] > grad_bound


@pytest.mark.skipif(not fused_head.available(), reason=NO_FUSED_HEAD)
def test_fused_head_scores_only_completion_tokens_on_the_cpu(tokenizer, tmp_path, trainer_factory, monkeypatch):
    """On the CPU the pipeline's head projects only the positions that score a completion token (TRL's own choice
    there: every position), with the log-probs and gradients of a plain full-logits pass, and TRL's switch restored."""
    from trl.trainer import utils as trl_utils

    rows_scored = []
    apply = trl_utils._ChunkedLogProbFunction.apply

    def counting_apply(hidden, *args):
        rows_scored.append(hidden.reshape(-1, hidden.size(-1)).size(0))
        return apply(hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counting_apply)
    use_triton = trl_utils._use_triton
    trainer = trainer_factory(TRAINER, output_dir=tmp_path)
    model = trainer.model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, model.config.vocab_size, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    mask[1, -3:] = 0  # a completion shorter than the batch's
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 5)
    logps.sum().backward()
    assert trl_utils._use_triton is use_triton
    assert sum(rows_scored) == int(mask[:, -5:].sum())  # 12 completion tokens, not the 3 x 10 positions
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # Reference: each row alone, its own tokens only, full logits in float64.
    ref_rows = []
    for r in range(3):
        keep = mask[r].bool()
        logits = model(input_ids=ids[r : r + 1, keep]).logits[0].double() / TRAINER["temperature"]
        row_ids = ids[r, keep]
        n = int(mask[r, -5:].sum())
        first = row_ids.numel() - n
        ref = torch.log_softmax(logits[first - 1 : -1], -1).gather(-1, row_ids[first:, None])[:, 0]
        ref_rows.append(torch.nn.functional.pad(ref, (0, 5 - n)))
    ref_logps = torch.stack(ref_rows)
    (ref_logps * mask[:, -5:]).sum().backward()
    bound = model_bound(torch.float32, model.config, ids.size(1))
    assert relative_gap(logps * mask[:, -5:], ref_logps * mask[:, -5:], math.inf) <= bound
    grad_bound = model_bound(torch.float32, model.config, ids.size(1), ids.numel())
    for name, param in model.named_parameters():
        assert relative_gap(grads[name], param.grad) <= grad_bound, name
    # companions (helpers/smallest_bug.py): one completion token mis-masked lands outside both bounds
    batch = _split_batch(ids, mask, 5)
    assert dropped_token_gap(ref_logps, mask[:, -5:]) > bound
    compute = weighted_logp_loss(model, batch, 1.0, 0.0, TRAINER["temperature"])
    assert one_token_gaps(compute, batch["completion_mask"])[1] > grad_bound


def _split_batch(ids, mask, completion_length):
    """`ids` and their attention mask as the prompt / completion batch `helpers.smallest_bug` takes."""
    cut = ids.size(1) - completion_length
    return {
        "prompt_ids": ids[:, :cut],
        "prompt_mask": mask[:, :cut],
        "completion_ids": ids[:, cut:],
        "completion_mask": mask[:, cut:],
    }


def test_vocab_chunk_validation(tmp_path):
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match=f"logprob_vocab_chunk_size={bad!r} must be a positive int"):
            _config(tmp_path, logprob_vocab_chunk_size=bad)


@pytest.mark.skipif(fused_head.available(), reason="this TRL has the fused log-prob head")
def test_vocab_chunk_refused_without_fused_head(tmp_path):
    with pytest.raises(ValueError, match="logprob_vocab_chunk_size=4096 sets the tile of TRL's fused log-prob head"):
        _config(tmp_path, logprob_vocab_chunk_size=4096)


# ------------------------------------------------------------------------ the vLLM flow, with a stand-in
# Kept beside the real engine (tests/real_vllm/test_server.py: positions, EOS and truncation, the correction): vLLM's
# fp32 CPU engine agrees with the trainer to ~1e-6 nats, too close to show that a known sampler/trainer gap reaches
# pi_old, the logged mismatch and the correction; this engine's gap is set.
SAMPLER_GAP = -2e-3  # the stand-in engine scores every token 2e-3 nats lower than the trainer does


class _FakeVLLMTrainer(GSPOTrainer):
    """Takes TRL's vLLM branches (`use_vllm=True` set after init) but samples with transformers `generate` and
    returns per-token log-probs shifted by SAMPLER_GAP, as an engine with slightly different numerics would."""

    def _generate_single_turn(self, *args, **kwargs):  # TRL's arguments vary across releases (common/trl_compat.py)
        self.use_vllm = False  # just for the stock generate path
        try:
            with sl.SamplerLogprobRecorder(self.model, self.temperature) as rec:
                completion_ids, _ = GRPOTrainer._generate_single_turn(self, *args, **kwargs)
        finally:
            self.use_vllm = True
        return completion_ids, [
            [x + self.gap(t) for t, x in enumerate(row)] for row in rec.completion_logprobs(completion_ids)
        ]

    @staticmethod
    def gap(position):
        return SAMPLER_GAP


class _UnevenGapVLLMTrainer(_FakeVLLMTrainer):
    """The stand-in with a gap that alternates along the completion, 1x and 1.5x SAMPLER_GAP: a per-sequence mean of
    the gaps then moves when one token is left out of it or let into it, so a mask bug shows (with every token's gap
    equal, the mean over any subset of tokens is that gap)."""

    @staticmethod
    def gap(position):
        return SAMPLER_GAP * (1 + 0.5 * (position % 2))


def _gap_tolerance(trainer, batches):
    """How far the stand-in's gap may read from SAMPLER_GAP: the engine's and the trainer's log-probs of one token
    differ by one forward's fp32 rounding (rounding.model_bound), relative to the largest log-prob."""
    seq_len = batches[0]["prompt_ids"].size(1) + batches[0]["completion_ids"].size(1)
    scale = max(b["old_per_token_logps"].abs().max().item() for b in batches)
    return model_bound(torch.float32, trainer.model.config, seq_len) * scale


def _fake_vllm(tokenizer, tmp_path, is_correction, trainer_factory, cls=_FakeVLLMTrainer, **overrides):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, cls=cls, **overrides)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, is_correction
    return trainer


def test_vllm_flow_reuses_engine_logprobs_and_logs_the_gap(tokenizer, tmp_path, trainer_factory):
    # As GSPOConfig sets it up for use_vllm=True: the IS correction off (it would be exp(0) = 1).
    trainer = _fake_vllm(
        tokenizer, tmp_path, is_correction=False, old_logprobs_source="sampler", trainer_factory=trainer_factory
    )
    batches = _first_rollout(trainer)
    for batch in batches:
        m = batch["completion_mask"].bool()
        assert torch.equal(batch["old_per_token_logps"][m], batch["sampling_per_token_logps"][m])
        assert "importance_sampling_ratio" not in batch
    (logged,) = [h for h in trainer.state.log_history if "sampler/logp_abs_diff/mean" in h]
    # the engine's and the trainer's forwards: one forward's rounding, relative to the log-probs' size
    tol = _gap_tolerance(trainer, batches)
    assert logged["sampler/logp_abs_diff/mean"] == pytest.approx(-SAMPLER_GAP, abs=tol)
    assert logged["sampler/seq_log_ratio_abs/mean"] == pytest.approx(-SAMPLER_GAP, abs=tol)
    # exp(2e-3) is past the paper's 1 + 4e-4: the metric shows every sequence would start clipped.
    assert logged["sampler/seq_outside_clip_frac"] == 1.0


def test_vllm_flow_length_normalized_is_correction(tokenizer, tmp_path, trainer_factory):
    trainer = _fake_vllm(
        tokenizer,
        tmp_path,
        is_correction=True,
        old_logprobs_source="recompute",
        vllm_importance_sampling_length_normalized=True,
        vllm_importance_sampling_mode="sequence_truncate",
        trainer_factory=trainer_factory,
        cls=_UnevenGapVLLMTrainer,
    )
    batches = _first_rollout(trainer)
    tol = _gap_tolerance(trainer, batches)
    for batch in batches:
        m = batch["completion_mask"].float()
        diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * m
        mean_gap = diff.sum(1) / m.sum(1)
        gaps = torch.tensor([_UnevenGapVLLMTrainer.gap(t) for t in range(m.size(1))])  # the engine's, per position
        assert (mean_gap + (gaps * m).sum(1) / m.sum(1)).abs().max() <= tol  # recomputed pi_old vs engine
        # exp of the mean gap (1.002 to 1.003 at any length), not TRL's exp of the sum (1.002 ** length and more); fp32: a mean over
        # the completion and an exp, of differences of log-probs as large as the largest
        scale = batch["old_per_token_logps"].abs().max().item()
        bound = rounding_bound(torch.float32, m.size(1) + 3) * scale
        assert relative_gap(batch["importance_sampling_ratio"], torch.exp(mean_gap)[:, None], math.inf) <= bound
        # companion (helpers/smallest_bug.py): one token left out of a row's mean moves its weight past the bound
        assert dropped_token_mean_gap(diff, m) > bound
        long = m.sum(1) > 3
        assert long.any() and (torch.exp(diff.sum(1)[long]) > torch.exp(mean_gap[long]) + 3e-3).all()
    assert any("sampling/importance_sampling_ratio_length_normalized/mean" in h for h in trainer.state.log_history)
