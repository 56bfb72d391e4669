"""Diagnostics (trl_gspo/common/metrics.py, moe/routing.py): each metric against a hand-computed value on a crafted batch,
the logging window's pooling, and the metrics reaching the trainer's logs for every variant (MoE ones only for MoE).
"""

import math

import pytest
import torch
from datasets import Dataset
from helpers.smallest_bug import dropped_token_means, each_token_dropped

from trl_gspo import GSPOConfig, GSPOTrainer
from trl_gspo.common import metrics
from trl_gspo.moe.routing import RouterHooks, find_routers
from trl_gspo.rounding import model_bound, rounding_bound
from trl_gspo.testing import build_tiny_model

# Three sequences of lengths 3, 1, 0 (empty), with known token log-ratios. No token of row 0 equals its row's mean
# (0.2): one token left out of the mean then always moves it (a token at the mean would leave it where it was, and
# the companion checks below could not show that bug).
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
LOG_RATIO = torch.tensor([[0.1, -0.2, 0.7, 9.0], [0.3, 5.0, 5.0, 5.0], [7.0, 7.0, 7.0, 7.0]])  # padding is garbage


def _logps():
    old = torch.full((3, 4), -2.0)
    return old + LOG_RATIO, old


# fp32: a log-ratio is a difference of two log-probs, so it carries their rounding (relative to the largest of them),
# not its own; then sums over the tokens and a subtraction, square, division and square root (trl_gspo/rounding.py)
LOGP_SIZE = max(x[MASK.bool()].abs().max().item() for x in _logps())
LOG_RATIO_TOL = rounding_bound(torch.float32, MASK.numel() + 4) * LOGP_SIZE


def _one_token_moves(stats, valid):
    """The smallest one-token bug of a dispersion check (helpers/smallest_bug.py's kind): each valid token left out
    of `valid` in turn, `stats(valid)` ({name: value}) recomputed; per token, the largest move over the names the
    test compares (a name that disappears counts as moved without bound); the smallest over the tokens."""
    want, moves = stats(valid), []
    for keep in each_token_dropped(valid):
        got = stats(valid * keep)
        moves.append(max(abs(got[k] - want[k]) if k in got else math.inf for k in want))
    return min(moves)


def test_sequence_log_ratio_is_mean_over_valid_tokens():
    lr, valid = metrics.token_log_ratios(*_logps(), MASK)
    seq = metrics.sequence_log_ratio(lr, valid)
    assert (seq - torch.tensor([0.2, 0.3, 0.0])).abs().max() <= LOG_RATIO_TOL  # (0.1 - 0.2 + 0.7) / 3; 0.3; empty
    # companion (helpers/smallest_bug.py): one token left out of a row's mean moves it past the tolerance (row 1's
    # only token left out empties its mean: 0 against 0.3)
    dropped = dropped_token_means(lr, valid)
    moved = (dropped - seq.double()[:, None]).abs()
    assert moved[~moved.isnan()].min() > LOG_RATIO_TOL


def test_distribution_summary_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    s = metrics.distribution_summary(values, "r")
    assert s["r/mean"] == pytest.approx(4.0)
    assert s["r/std"] == pytest.approx(math.sqrt((9 + 4 + 1 + 0 + 36) / 5))  # population std
    assert (s["r/min"], s["r/max"]) == (1.0, 10.0)
    # linear interpolation: p5 sits at position 0.2 between 1 and 2, p95 at 3.8 between 4 and 10
    assert s["r/p5"] == pytest.approx(1.2)
    assert s["r/p95"] == pytest.approx(4.0 + 0.8 * 6.0)
    assert metrics.distribution_summary(torch.empty(0), "r") == {}


def test_clip_fractions_sequence_level_by_hand():
    # one decision per sequence: seq 0 (3 tokens) clipped low, seq 1 (1 token) not, seq 2 empty but "clipped high"
    ratio = torch.tensor([[0.9], [1.0], [1.5]])
    adv = torch.tensor([[-1.0], [1.0], [1.0]])
    from trl_gspo import losses

    low, high = losses.clip_indicators(ratio, adv, 0.05, 0.05)
    got = metrics.finalize(metrics.clip_fraction_stats(low, high, MASK))
    assert got["clip_fraction/token/low"] == pytest.approx(3 / 4)  # 3 of the 4 valid tokens
    assert got["clip_fraction/token/high"] == 0.0  # the empty sequence has no token to count
    assert got["clip_fraction/sequence/low"] == pytest.approx(1 / 2)  # 1 of the 2 non-empty sequences
    assert got["clip_fraction/sequence/total"] == pytest.approx(1 / 2)


def test_clip_fractions_token_level_by_hand():
    low = torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])  # clipped padding must not count
    high = torch.tensor([[0, 1.0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    got = metrics.finalize(metrics.clip_fraction_stats(low, high, MASK))
    assert got["clip_fraction/token/low"] == pytest.approx(1 / 4)
    assert got["clip_fraction/token/high"] == pytest.approx(2 / 4)
    assert got["clip_fraction/token/total"] == pytest.approx(3 / 4)
    # per sequence: seq 0 has 1/3 low, 1/3 high, 2/3 total; seq 1 has 0 low, 1 high, 1 total
    assert got["clip_fraction/sequence/low"] == pytest.approx((1 / 3 + 0) / 2)
    assert got["clip_fraction/sequence/high"] == pytest.approx((1 / 3 + 1) / 2)
    assert got["clip_fraction/sequence/total"] == pytest.approx((2 / 3 + 1) / 2)


def test_dispersion_and_length_buckets_by_hand():
    lr, valid = metrics.token_log_ratios(*_logps(), MASK)
    got = metrics.finalize(metrics.dispersion_stats(lr, valid, max_length=4))
    # row 0: log-ratios 0.1, -0.2, 0.7, mean 0.2, sum 0.6; row 1: 0.3 alone
    std0 = math.sqrt(((0.1 - 0.2) ** 2 + (-0.2 - 0.2) ** 2 + (0.7 - 0.2) ** 2) / 3)
    assert got["ratio_dispersion/token_logratio_std"] == pytest.approx((std0 + 0.0) / 2, abs=LOG_RATIO_TOL)
    assert got["ratio_dispersion/token_logratio_abs"] == pytest.approx((0.1 + 0.2 + 0.7 + 0.3) / 4, abs=LOG_RATIO_TOL)
    assert got["ratio_dispersion/seq_logratio_abs"] == pytest.approx((0.2 + 0.3) / 2, abs=LOG_RATIO_TOL)
    assert got["ratio_dispersion/seq_logratio_sum_abs"] == pytest.approx((0.6 + 0.3) / 2, abs=LOG_RATIO_TOL)
    assert metrics.length_buckets(4) == [(1, 1), (2, 3), (4, 4)]
    # length 3 -> bucket 2-3, length 1 -> bucket 1-1, nothing in 4-4 (count 0: no value)
    assert got["logratio_by_len/0002-0003/token_std"] == pytest.approx(std0, abs=LOG_RATIO_TOL)
    assert got["logratio_by_len/0002-0003/sum_abs"] == pytest.approx(0.6, abs=LOG_RATIO_TOL)
    assert got["logratio_by_len/0001-0001/seq_abs"] == pytest.approx(0.3, abs=LOG_RATIO_TOL)
    assert got["logratio_by_len/0001-0001/token_abs"] == pytest.approx(0.3, abs=LOG_RATIO_TOL)
    assert not any(k.startswith("logratio_by_len/0004-0004") for k in got)
    # companion (helpers/smallest_bug.py's kind): one valid token left out moves some compared value past the
    # tolerance; the names compared above, recomputed with the token left out
    compared = [
        "ratio_dispersion/token_logratio_std",
        "ratio_dispersion/token_logratio_abs",
        "ratio_dispersion/seq_logratio_abs",
        "ratio_dispersion/seq_logratio_sum_abs",
        "logratio_by_len/0002-0003/token_std",
        "logratio_by_len/0002-0003/sum_abs",
        "logratio_by_len/0001-0001/seq_abs",
        "logratio_by_len/0001-0001/token_abs",
    ]

    def stats(keep):
        out = metrics.finalize(metrics.dispersion_stats(lr, keep, max_length=4))
        return {k: out[k] for k in compared if k in out}

    assert _one_token_moves(stats, valid) > LOG_RATIO_TOL


def test_nonfinite_values_are_counted_and_left_out():
    logps, old = _logps()
    logps[0, 1] = float("nan")
    logps[1, 2] = float("inf")  # padding: not counted
    assert metrics.count_nonfinite(logps, MASK).item() == 1
    assert metrics.count_nonfinite(logps).item() == 2
    lr, valid = metrics.token_log_ratios(logps, old, MASK)
    assert torch.isfinite(lr).all() and valid[0].tolist() == [1, 0, 1, 0]
    got = metrics.finalize(metrics.dispersion_stats(lr, valid, max_length=4))
    # row 0 without its NaN: (0.1 + 0.7) / 2
    assert got["ratio_dispersion/seq_logratio_abs"] == pytest.approx((0.4 + 0.3) / 2, abs=LOG_RATIO_TOL)
    # companion: one of the finite tokens left out moves the compared value past the tolerance

    def stats(keep):
        out = metrics.finalize(metrics.dispersion_stats(lr, keep, max_length=4))
        return {k: out[k] for k in ["ratio_dispersion/seq_logratio_abs"] if k in out}

    assert _one_token_moves(stats, valid) > LOG_RATIO_TOL


def test_routing_shift_by_hand():
    # B=1, T=3 (last token padding), L=2 layers, k=2
    old = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[0, 1], [0, 1]]]])
    new = torch.tensor([[[[1, 0], [2, 0]], [[3, 2], [0, 1]], [[2, 3], [2, 3]]]])
    mask = torch.tensor([[1, 1, 0]])
    got = metrics.finalize(metrics.routing_shift_stats(old, new, mask))
    # (tok0, L0): same set in another order -> unchanged; (tok0, L1): {2,3} -> {2,0} changed, 1 of 2 experts replaced
    # (tok1, L0): {0,1} -> {3,2} changed, 2 of 2 replaced; (tok1, L1) unchanged; token 2 is padding
    assert got["moe/routing_shift"] == pytest.approx(2 / 4)
    assert got["moe/routing_shift_any_layer"] == pytest.approx(2 / 2)
    assert got["moe/expert_change"] == pytest.approx((0 + 0.5 + 1.0 + 0) / 4)


def test_expert_load_and_cv_by_hand():
    topk = torch.tensor([[[[0, 1]], [[0, 2]], [[3, 3]]]])  # B=1, T=3, L=1, k=2; last token is padding
    load = metrics.expert_load(topk, torch.tensor([[1, 1, 0]]), num_experts=4)
    assert load.tolist() == [[2.0, 1.0, 1.0, 0.0]]
    mean, std = 1.0, math.sqrt(((2 - 1) ** 2 + 0 + 0 + 1) / 4)
    assert metrics.expert_load_cv(load) == pytest.approx(std / mean)
    assert metrics.expert_load_cv(torch.tensor([[5.0, 5.0, 5.0, 5.0]])) == 0.0


def test_window_pools_sums_and_counts_not_means_of_means():
    window = metrics.MetricWindow()
    window.add_means({"m": torch.tensor([1.0, 1.0])})  # 1 / 1
    window.add_means({"m": torch.tensor([0.0, 3.0])})  # 0 / 3 -> pooled 1 / 4, not (1 + 0) / 2
    window.add_sums("nonfinite/x", torch.tensor(2))
    window.add_sums("nonfinite/x", torch.tensor(3))
    window.add_values("v", torch.tensor([0.0, 1.0, 99.0]), torch.tensor([True, True, False]))
    window.add_values("v", torch.tensor([2.0]))
    window.add_counts("c", torch.tensor([[1.0, 3.0]]), lambda t: {"c_total": t.sum().item()})
    window.add_counts("c", torch.tensor([[1.0, 0.0]]), lambda t: {"c_total": t.sum().item()})
    out = window.flush(transforms={"v": lambda v: v + 1})
    assert out["m"] == pytest.approx(0.25)
    assert out["nonfinite/x"] == 5
    assert out["v/mean"] == pytest.approx(2.0) and out["v/max"] == 3.0  # the invalid 99 is gone
    assert out["c_total"] == 5
    assert not window and window.flush() == {}  # flushed windows start empty


def test_per_microbatch_path_never_reads_a_value_back():
    """Everything done per micro-batch runs on the `meta` device, where any host read (`.item()`, `bool()`,
    boolean indexing, data-dependent shapes) raises: so the hot path cannot force a device sync."""
    with pytest.raises(Exception):
        torch.ones(2, device="meta").sum().item()  # the guard works: a read-back fails here
    B, T, L, k, E = 4, 6, 2, 2, 4
    meta = dict(device="meta")
    logps, old, mask = torch.randn(B, T, **meta), torch.randn(B, T, **meta), torch.ones(B, T, **meta)
    window = metrics.MetricWindow()
    lr, valid = metrics.token_log_ratios(logps, old, mask)
    window.add_values("seq_ratio", metrics.sequence_log_ratio(lr, valid), valid.sum(-1) > 0)
    from trl_gspo import losses

    adv = torch.randn(B, 1, **meta)
    for ratio in (torch.randn(B, 1, **meta), torch.randn(B, T, **meta)):  # sequence-level and token-level ratios
        window.add_means(metrics.clip_fraction_stats(*losses.clip_indicators(ratio, adv, 0.2, 0.2), mask))
        window.add_means(metrics.dispersion_stats(lr, valid, T))
        window.add_sums("nonfinite/logps", metrics.count_nonfinite(logps, mask))
        topk = torch.randint(0, E, (B, T, L, k), **meta)
        window.add_means(metrics.routing_shift_stats(topk, topk, mask))
        window.add_counts("moe/expert_load", metrics.expert_load(topk, mask, E), lambda load: {})
    assert window


def test_router_hooks_record_the_models_own_routing(tokenizer):
    model = build_tiny_model(tokenizer, moe=True, seed=0)
    assert len(find_routers(model)) == model.config.num_hidden_layers
    assert RouterHooks.for_model(build_tiny_model(tokenizer, seed=0)) is None  # dense: nothing to record
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(4, len(tokenizer), (3, 6))
    with hooks.forward_pass(3, 6) as observed:
        model(input_ids=ids[:2])  # two consecutive row chunks, as TRL's chunked log-prob loop feeds them
        model(input_ids=ids[2:])
    assert observed.check() is None
    topk = observed.native_routes()
    assert topk.shape == (3, 6, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    out = model(input_ids=ids, output_router_logits=True)  # not observed: nothing recorded
    for layer, logits in enumerate(out.router_logits):  # the model's own router logits, (B * S, E)
        expected = logits.view(3, 6, -1).topk(model.config.num_experts_per_tok, dim=-1).indices
        assert torch.equal(topk[:, :, layer].long().sort(-1).values, expected.sort(-1).values)
    with hooks.forward_pass(3, 6) as partial:
        model(input_ids=ids[:2])  # a forward that covers only part of the batch is reported, not silently used
    assert "saw [12, 12] tokens for a 3x6 batch" in partial.check()


# ------------------------------------------------------------------------------------ through the trainer
LEVELS = {
    "token": dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=0.27),
    "sequence": dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "sequence_token": dict(importance_sampling_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4),
}
CORE = [
    "seq_ratio/mean",
    "seq_ratio/std",
    "seq_ratio/min",
    "seq_ratio/max",
    "seq_ratio/p5",
    "seq_ratio/p95",
    "clip_fraction/token/low",
    "clip_fraction/token/high",
    "clip_fraction/token/total",
    "clip_fraction/sequence/low",
    "clip_fraction/sequence/high",
    "clip_fraction/sequence/total",
    "ratio_dispersion/token_logratio_std",
    "ratio_dispersion/seq_logratio_abs",
    "nonfinite/logps",
]
MOE = ["moe/routing_shift", "moe/routing_shift_any_layer", "moe/expert_change", "moe/expert_load_cv"]


def _train(tokenizer, tmp_path, level, moe, **extra):
    model = build_tiny_model(tokenizer, moe=moe, seed=0)
    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=3e-3,
        max_steps=4,
        logging_steps=1,
        **LEVELS[level],
        **extra,
    )
    dataset = Dataset.from_dict({"prompt": ["copy 1 2 :", "add 3 4 =", "copy a b :", "count 5 6"] * 4})

    def reward(completions, **kwargs):
        return [float(len(c.split()) % 3) for c in completions]  # varied rewards: non-zero advantages

    trainer = GSPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [row for row in trainer.state.log_history if "train_runtime" not in row], trainer


@pytest.mark.parametrize("level", list(LEVELS))
def test_metrics_reach_the_logs_for_every_variant(level, tokenizer, tmp_path):
    rows, trainer = _train(tokenizer, tmp_path, level, moe=False)
    assert len(rows) == 4
    for row in rows:
        assert set(CORE) <= row.keys(), set(CORE) - row.keys()
        assert not any(k.startswith("moe/") for k in row)  # dense model: no MoE metrics
        assert row["nonfinite/logps"] == 0
        # TRL's clip metric (aggregated separately, in trl_gspo.common.metrics.loss_metrics, and checked against stock TRL by
        # test_parity) counts tokens for per-token ratios and sequences for per-sequence ones; one micro-batch per
        # log step, so pooled == per-batch here
        ours = "clip_fraction/sequence/total" if level == "sequence" else "clip_fraction/token/total"
        # both a count divided by a count (fractions <= 1): one fp32 rounding each
        assert row[ours] == pytest.approx(row["clip_ratio/region_mean"], abs=rounding_bound(torch.float32, 2))
    assert any(row[ours] > 0 for row in rows)  # the comparison above saw real clipping
    # companion (helpers/smallest_bug.py's kind): one token (sequence) miscounted moves a fraction c / n to
    # c / (n - 1) or (c - 1) / (n - 1), at least 1 / (n (n - 1)) when it moves at all (0 / n stays 0: no test sees
    # that); n at most the step's tokens (rows), each step one micro-batch of the one rollout
    for batch in trainer._buffered_inputs:
        n = batch["completion_mask"].size(0) if level == "sequence" else int(batch["completion_mask"].sum())
        assert 1 / (n * (n - 1)) > rounding_bound(torch.float32, 2)
    # first mini-batch of a rollout is on-policy (ratio 1, up to the float rounding of the pi_old pass and the loss
    # forward running in different layouts: one forward's, relative to the log-probs' size); later ones moved and the
    # ratio spread shows it
    batch = trainer._buffered_inputs[0]
    seq_len = batch["prompt_ids"].size(1) + batch["completion_ids"].size(1)
    tol = model_bound(torch.float32, trainer.model.config, seq_len) * batch["old_per_token_logps"].abs().max().item()
    assert rows[0]["seq_ratio/std"] <= tol and rows[0]["seq_ratio/mean"] == pytest.approx(1, abs=tol)
    # companion (helpers/smallest_bug.py's kind): one token mis-masked in one of the two passes gives it a log-ratio
    # of its whole log-prob, moving its row's mean log-ratio by |log-prob| / the row's length and the ratio by at
    # least 1 - exp(-that); the mean over the rows moves by that over the rows (the std by more), past the tolerance.
    # The batch is that first mini-batch: one rollout (steps_per_generation = max_steps), its first micro-batch.
    assert len(trainer._buffered_inputs) == len(rows)
    mask = batch["completion_mask"].bool()
    per_token = batch["old_per_token_logps"].abs() / mask.sum(1, keepdim=True).clamp(min=1)
    assert (1 - torch.exp(-per_token[mask])).min().item() / mask.size(0) > tol
    assert any(row["seq_ratio/std"] > 0 for row in rows[1:])
    assert any(k.startswith("logratio_by_len/") for k in rows[-1])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_diagnostics_false_switches_them_off_and_keeps_trls_metrics(moe, tokenizer, tmp_path):
    rows, _ = _train(tokenizer, tmp_path, "sequence", moe=moe, diagnostics=False)
    ours = [
        k
        for row in rows
        for k in row
        if k.startswith(
            ("seq_ratio/", "clip_fraction/", "ratio_dispersion/", "logratio_by_len/", "moe/", "nonfinite/logps")
        )
    ]
    assert ours == []
    assert all({"clip_ratio/region_mean", "entropy", "loss", "nonfinite/microbatches"} <= row.keys() for row in rows)
    if moe:
        assert all("aux_loss" in row for row in rows)  # TRL's MoE loss term is untouched


def test_moe_metrics_only_for_moe_and_routing_moves_after_updates(tokenizer, tmp_path):
    rows, _ = _train(tokenizer, tmp_path, "sequence", moe=True)
    for row in rows:
        assert set(CORE + MOE) <= row.keys(), set(CORE + MOE) - row.keys()
    assert rows[0]["moe/routing_shift"] == 0  # same weights as at rollout time: identical routing
    assert any(row["moe/routing_shift"] > 0 for row in rows[1:])  # after an update some top-k sets changed
    assert all(row["moe/expert_load_cv"] > 0 for row in rows)


DISTRIBUTED_SCRIPT = """
import json, torch
from accelerate import Accelerator
from trl_gspo.common.metrics import MetricWindow
acc = Accelerator(cpu=True)
r = acc.process_index
w = MetricWindow()
w.add_means({"m": torch.tensor([float(r + 1), 2.0 + r])})       # rank 0: 1/2, rank 1: 2/3 -> pooled 3/5
if r == 1:
    w.add_sums("nonfinite/only_rank1", torch.tensor(4))          # a name rank 0 never saw: must not hang
w.add_values("v", torch.arange(3 * r + 1, dtype=torch.float32))  # rank 0: [0], rank 1: [0, 1, 2, 3]
w.add_counts("c", torch.tensor([[1.0 + r, 0.0]]), lambda t: {"c0": t[0, 0].item()})
out = w.flush(acc)
if acc.is_main_process:
    print("RESULT", json.dumps(out))
"""


@pytest.mark.launch  # several processes: one launch at a time (conftest.py)
def test_window_reduces_across_two_processes(tmp_path):
    """Two gloo ranks with uneven names and value counts: pooled means, sums, counts and quantiles are global."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "dist.py"
    script.write_text(DISTRIBUTED_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(line[len("RESULT ") :])
    assert out["m"] == pytest.approx(3 / 5)
    assert out["nonfinite/only_rank1"] == 4
    assert out["c0"] == 3
    values = torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0])
    assert out["v/mean"] == pytest.approx(values.mean().item()) and out["v/max"] == 3
    assert out["v/p95"] == pytest.approx(torch.quantile(values, 0.95).item())


def test_routing_shift_uses_the_old_policy_forward_not_the_reference(tokenizer, tmp_path):
    """PEFT with beta > 0: TRL scores the reference by running the policy model with its adapter off, so two
    forwards of the same modules run at rollout time. Only the pi_old one may feed the routing shift: at the first
    mini-batch of every rollout the policy still equals pi_old, so the shift must be exactly 0 even once the adapter
    has moved away from the reference."""
    from peft import LoraConfig

    model = build_tiny_model(tokenizer, moe=True, seed=0)
    args = GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=5e-2,
        max_steps=8,
        logging_steps=1,
        beta=0.04,
    )
    dataset = Dataset.from_dict({"prompt": ["copy 1 2 :", "add 3 4 =", "copy a b :", "count 5 6"] * 4})

    def reward(completions, **kwargs):
        return [float(len(c.split()) % 3) for c in completions]

    trainer = GSPOTrainer(
        model,
        reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate"]),
    )
    trainer.train()
    rows = [row for row in trainer.state.log_history if "moe/routing_shift" in row]
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert rows[0]["moe/routing_shift"] == 0 and rows[4]["moe/routing_shift"] == 0  # rollout starts: on-policy
    assert rows[4]["kl"] > 0  # the adapter has moved away from the reference by the second rollout
    assert any(row["moe/routing_shift"] > 0 for row in rows[5:])
