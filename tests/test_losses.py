"""The pure loss functions against a deliberately naive reference written here with Python loops.

The reference follows the paper's formulas token by token (GSPO.md), in float64, sharing no code with
`trl_gspo.losses`. Both the loss value and the gradient w.r.t. the current log-probs are compared.
"""

import math

import pytest
import torch

from trl_gspo import losses

B, T = 7, 9
EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _batch(seed, token_advantages=False, scale=1e-3):
    """Random log-probs with padding: lengths 1..T plus one fully-masked row; ratios straddle the clip range."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 4, 0, T - 2, 2, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    if token_advantages:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    else:
        adv = torch.tensor([1.0, -0.7, 0.4, 1.3, -1.1, -0.2, 0.9], dtype=torch.float64)
    return logps, old, mask, adv


def naive_gspo_loss(logps, old, mask, adv):
    """J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp((1/|y_i|) sum_t (lp - old)); loss = -J."""
    total = 0.0
    for i in range(logps.shape[0]):
        n = int(mask[i].sum().item())
        if n == 0:
            continue  # an empty completion contributes nothing but still counts in 1/G
        log_s = sum(logps[i, t] - old[i, t] for t in range(logps.shape[1]) if mask[i, t] > 0) / n
        s = torch.exp(log_s)
        a = adv[i] if adv.dim() == 1 else adv[i, 0]
        total = total + torch.min(s * a, torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    return -total / logps.shape[0]


def naive_gspo_token_loss(logps, old, mask, adv):
    """J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it), s_it = sg[s_i] pi_t / sg[pi_t]."""
    total = 0.0
    for i in range(logps.shape[0]):
        valid = [t for t in range(logps.shape[1]) if mask[i, t] > 0]
        if not valid:
            continue
        s_i = torch.exp(sum(logps[i, t] - old[i, t] for t in valid) / len(valid)).detach()
        seq_total = 0.0
        for t in valid:
            s_it = s_i * torch.exp(logps[i, t]) / torch.exp(logps[i, t]).detach()
            a = adv[i, t] if adv.dim() == 2 else adv[i]
            seq_total = seq_total + torch.min(s_it * a, torch.clamp(s_it, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        total = total + seq_total / len(valid)
    return -total / logps.shape[0]


def ours(level, logps, old, mask, adv):
    log_w = losses.LOG_WEIGHT_FUNCTIONS[level](logps, old, mask)
    ratio = losses.importance_ratio(log_w)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    per_token = losses.clipped_surrogate_loss(ratio, adv, EPS_LOW, EPS_HIGH)
    return losses.sequence_mean_loss(per_token, mask)


def _value_and_grad(fn, logps, *rest):
    logps = logps.clone().requires_grad_(True)
    loss = fn(logps, *rest)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 3e-2])
def test_gspo_matches_naive_reference(seed, scale):
    logps, old, mask, adv = _batch(seed, scale=scale)
    ref_loss, ref_grad = _value_and_grad(naive_gspo_loss, logps, old, mask, adv)
    loss, grad = _value_and_grad(lambda lp, *r: ours("sequence", lp, *r), logps, old, mask, adv)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert grad[3].abs().sum() == 0 and (grad * (1 - mask)).abs().sum() == 0  # empty row and padding get nothing


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 3e-2])
def test_gspo_token_matches_naive_reference_with_token_advantages(seed, scale):
    logps, old, mask, adv = _batch(seed, token_advantages=True, scale=scale)
    ref_loss, ref_grad = _value_and_grad(naive_gspo_token_loss, logps, old, mask, adv)
    loss, grad = _value_and_grad(lambda lp, *r: ours("sequence_token", lp, *r), logps, old, mask, adv)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_reference_batches_exercise_both_clip_branches_and_both_signs():
    """Guard for the tests above: with scale 1e-3 some sequences clip and some do not."""
    logps, old, mask, adv = _batch(0, scale=1e-3)
    s = losses.importance_ratio(losses.sequence_log_weights(logps, old, mask))[:, 0]
    low, high = losses.clip_indicators(s, adv, EPS_LOW, EPS_HIGH)
    clipped = (low + high)[mask.sum(-1) > 0]
    assert 0 < clipped.sum() < len(clipped)
    assert (adv > 0).any() and (adv < 0).any()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 3e-2])
def test_gspo_token_equals_gspo_when_every_token_carries_the_sequence_advantage(seed, scale):
    logps, old, mask, adv = _batch(seed, scale=scale)
    adv_tokens = adv[:, None].expand(B, T).clone()
    loss_seq, grad_seq = _value_and_grad(lambda lp, *r: ours("sequence", lp, *r), logps, old, mask, adv)
    loss_tok, grad_tok = _value_and_grad(lambda lp, *r: ours("sequence_token", lp, *r), logps, old, mask, adv_tokens)
    torch.testing.assert_close(loss_tok, loss_seq, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_tok, grad_seq, rtol=1e-12, atol=1e-15)
    # Same clip decisions: the GSPO-token ratio equals s_i at every token.
    s_seq = losses.importance_ratio(losses.sequence_log_weights(logps, old, mask))
    s_tok = losses.importance_ratio(losses.sequence_token_log_weights(logps, old, mask))
    assert torch.equal(s_tok, s_seq.expand(B, T))
    low_s, high_s = losses.clip_indicators(s_seq, adv[:, None], EPS_LOW, EPS_HIGH)
    low_t, high_t = losses.clip_indicators(s_tok, adv_tokens, EPS_LOW, EPS_HIGH)
    assert torch.equal(low_t, low_s.expand(B, T)) and torch.equal(high_t, high_s.expand(B, T))


def test_gspo_token_differs_from_gspo_when_token_advantages_vary():
    logps, old, mask, adv = _batch(1, token_advantages=True, scale=1e-4)  # tiny drift: nothing clips
    seq_adv = losses.masked_sequence_mean(adv, mask)  # what 'sequence' would see if it silently averaged
    _, grad_seq = _value_and_grad(lambda lp, *r: ours("sequence", lp, *r), logps, old, mask, seq_adv)
    _, grad_tok = _value_and_grad(lambda lp, *r: ours("sequence_token", lp, *r), logps, old, mask, adv)
    assert not torch.allclose(grad_tok, grad_seq)
    # GSPO-token's gradient at token t is s_i * A_it / (G |y_i|) (unclipped): per-token credit assignment.
    s = losses.importance_ratio(losses.sequence_log_weights(logps, old, mask))
    expected = -(s * adv * mask) / (mask.sum(-1, keepdim=True).clamp(min=1) * B)
    torch.testing.assert_close(grad_tok, expected, rtol=1e-10, atol=1e-15)


def test_sequence_log_ratio_is_length_normalised_geometric_mean():
    logps = torch.tensor([[-1.0, -2.0, -3.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.5, -2.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    s = losses.importance_ratio(losses.sequence_log_weights(logps, old, mask))
    token_ratios = [math.exp(0.5), math.exp(0.5), math.exp(-1.0)]
    assert s.item() == pytest.approx(math.prod(token_ratios) ** (1 / 3), rel=1e-12)


def test_grpo_token_level_matches_naive_ppo():
    logps, old, mask, adv = _batch(2, scale=0.3)
    eps = 0.2

    def naive(lp, old, mask, adv):
        total = 0.0
        for i in range(B):
            valid = [t for t in range(T) if mask[i, t] > 0]
            if not valid:
                continue
            acc = 0.0
            for t in valid:
                r = torch.exp(lp[i, t] - old[i, t])
                acc = acc + torch.min(r * adv[i], torch.clamp(r, 1 - eps, 1 + eps) * adv[i])
            total = total + acc / len(valid)
        return -total / B

    def ours_token(lp, old, mask, adv):
        ratio = losses.importance_ratio(losses.token_log_weights(lp, old, mask))
        return losses.sequence_mean_loss(losses.clipped_surrogate_loss(ratio, adv[:, None], eps, eps), mask)

    ref_loss, ref_grad = _value_and_grad(naive, logps, old, mask, adv)
    loss, grad = _value_and_grad(ours_token, logps, old, mask, adv)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_log_ratio_clamp_keeps_ratio_finite_and_is_identity_inside_the_bound():
    log_w = torch.tensor([-1e4, -5.0, 0.0, 5.0, 1e4], requires_grad=True)
    r = losses.importance_ratio(log_w, max_log_ratio=20.0)
    assert torch.isfinite(r).all()
    r.sum().backward()
    assert log_w.grad[0] == 0 and log_w.grad[-1] == 0  # saturated: no gradient
    assert log_w.grad[1:4].tolist() == pytest.approx([math.exp(-5), 1.0, math.exp(5)])
    assert torch.isinf(losses.importance_ratio(torch.tensor([1e4]), max_log_ratio=None)).all()


def naive_sapo_sequence_loss(logps, old, mask, adv, tau_pos=1.0, tau_neg=1.05):
    """SAPO on GSPO's sequence ratio: J = (1/G) sum_i (4/tau_i) sigmoid(tau_i (s_i - 1)) A_i; loss = -J."""
    total = 0.0
    for i in range(logps.shape[0]):
        valid = [t for t in range(logps.shape[1]) if mask[i, t] > 0]
        if not valid:
            continue
        s = torch.exp(sum(logps[i, t] - old[i, t] for t in valid) / len(valid))
        tau = tau_pos if adv[i] > 0 else tau_neg
        total = total + 4 / tau / (1 + torch.exp(-tau * (s - 1))) * adv[i]
    return -total / logps.shape[0]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale", [1e-3, 0.3])
def test_sapo_on_the_sequence_ratio_matches_naive_reference(seed, scale):
    def ours_sapo(logps, old, mask, adv):
        ratio = losses.importance_ratio(losses.sequence_log_weights(logps, old, mask))
        return losses.sequence_mean_loss(losses.sapo_loss(ratio, adv.unsqueeze(1), 1.0, 1.05), mask)

    logps, old, mask, adv = _batch(seed, scale=scale)
    ref_loss, ref_grad = _value_and_grad(naive_sapo_sequence_loss, logps, old, mask, adv)
    loss, grad = _value_and_grad(ours_sapo, logps, old, mask, adv)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert grad.abs().sum() > 0
