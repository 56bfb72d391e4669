"""Property tests (hypothesis) on the pure loss functions: finite values and gradients on extreme inputs, and the
clipped objective's gradient equal to the unclipped one inside the clip range and zero on the clipped side."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_gspo import losses

LEVELS = list(losses.LOG_WEIGHT_FUNCTIONS)


@st.composite
def batches(draw, max_b=5, max_t=8):
    """logps / old_logps anywhere in [-1e4, 0], lengths 0..T (all-masked rows included), advantages of any sign."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    g = torch.Generator().manual_seed(seed)
    logps = -(torch.rand(b, t, generator=g, dtype=torch.float64) * scale).float()
    old = -(torch.rand(b, t, generator=g, dtype=torch.float64) * scale).float()
    extreme = draw(st.sampled_from(["none", "logps", "old"]))  # some rows pinned at the -1e4 floor
    if extreme == "logps":
        logps[0] = -1e4
    elif extreme == "old":
        old[0] = -1e4
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    advantages = (torch.rand(b, 1, generator=g) - 0.5) * draw(st.sampled_from([0.0, 1.0, 10.0]))
    return logps, old, mask, advantages


def _policy_loss(level, logps, old, mask, advantages, kind, eps=(3e-4, 4e-4)):
    ratio = losses.importance_ratio(losses.LOG_WEIGHT_FUNCTIONS[level](logps, old, mask))
    if kind == "cispo":
        return losses.token_sum_loss(losses.cispo_loss(ratio, advantages, logps, 5.0), mask, mask.sum().clamp(min=1))
    per_token = losses.clipped_surrogate_loss(ratio, advantages, *eps, delta=3.0 if kind == "delta" else None)
    if kind == "token_sum":
        return losses.token_sum_loss(per_token, mask, mask.sum().clamp(min=1))
    if kind == "luspo":
        return losses.sequence_sum_loss(per_token, mask)
    return losses.sequence_mean_loss(per_token, mask)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(LEVELS), st.sampled_from(["grpo", "token_sum", "luspo", "delta", "cispo"]))
def test_finite_loss_and_gradient_on_extreme_inputs(batch, level, kind):
    logps, old, mask, advantages = batch
    logps = logps.clone().requires_grad_(True)
    loss = _policy_loss(level, logps, old, mask, advantages, kind)
    loss.backward()
    assert torch.isfinite(loss), (level, kind)
    assert torch.isfinite(logps.grad).all(), (level, kind)
    assert (logps.grad[mask == 0] == 0).all()  # padding and empty rows get no gradient


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e6, 1e6, allow_nan=False), st.floats(1.0, 80.0))
def test_log_ratio_clamp(log_weight, bound):
    x = torch.tensor(log_weight, dtype=torch.float64, requires_grad=True)
    ratio = losses.importance_ratio(x, bound)
    ratio.backward()
    assert torch.isfinite(ratio) and ratio <= torch.exp(torch.tensor(bound, dtype=torch.float64))
    if abs(log_weight) < bound:  # inside the bound the clamp is the identity, value and gradient
        assert ratio.item() == torch.exp(x).item() and x.grad.item() == ratio.item()
    elif abs(log_weight) > bound:
        assert x.grad.item() == 0.0


def _unclipped_sequence_loss(logps, old, mask, advantages):
    """Independent GSPO objective without clipping: -(1/B) sum_i A_i * exp(mean_t(lp - old))."""
    per_seq = []
    for i in range(logps.size(0)):
        n = int(mask[i].sum())
        log_s = (logps[i, :n] - old[i, :n]).sum() / n if n else logps[i].sum() * 0  # empty: ratio 1, no gradient
        per_seq.append(-advantages[i, 0] * torch.exp(log_s))
    return torch.stack(per_seq).mean()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 8), st.floats(0.0, 1.0))
def test_gradient_inside_clip_range_equals_unclipped(seed, b, t, where):
    """Sequence ratios strictly inside [1 - eps_low, 1 + eps_high]: GSPO's gradient is the unclipped objective's."""
    g = torch.Generator().manual_seed(seed)
    eps_low, eps_high = 0.2, 0.3
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    logps = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    target = (1 - eps_low) + (where * 0.98 + 0.01) * (eps_low + eps_high)  # a ratio inside the range
    # Old log-probs shifted so that mean_t(lp - old) = log(target) on every row.
    old = logps - torch.log(torch.tensor(target, dtype=torch.float64)) * torch.ones_like(logps)
    advantages = torch.randn(b, 1, generator=g, dtype=torch.float64)
    for level in ("sequence", "sequence_token"):
        a = logps.clone().requires_grad_(True)
        ratio = losses.importance_ratio(losses.LOG_WEIGHT_FUNCTIONS[level](a, old, mask))
        losses.sequence_mean_loss(losses.clipped_surrogate_loss(ratio, advantages, eps_low, eps_high), mask).backward()
        ref = logps.clone().requires_grad_(True)
        _unclipped_sequence_loss(ref, old, mask, advantages).backward()
        torch.testing.assert_close(a.grad, ref.grad, rtol=1e-10, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(st.floats(1e-4, 0.5), st.floats(1e-4, 0.5), st.floats(0.0, 3.0), st.floats(0.01, 5.0), st.booleans())
def test_gradient_outside_clip_range(eps_low, eps_high, overshoot, adv, above):
    """Ratio beyond 1 + eps_high with A > 0, or below 1 - eps_low with A < 0: zero gradient (clipped side).
    The same ratio with the opposite advantage sign is not clipped: gradient -A, the unclipped one."""
    ratio_value = (1 + eps_high) * (1 + overshoot) + 1e-3 if above else (1 - eps_low) * (1 - overshoot / 3.01) - 1e-3
    ratio_value = max(ratio_value, 1e-6)
    for sign, clipped in ((1.0, above), (-1.0, not above)):
        ratio = torch.tensor([[ratio_value]], dtype=torch.float64, requires_grad=True)
        a = torch.tensor([[sign * adv]], dtype=torch.float64)
        losses.clipped_surrogate_loss(ratio, a, eps_low, eps_high).sum().backward()
        expected = 0.0 if clipped else -sign * adv
        assert ratio.grad.item() == expected
        low, high = losses.clip_indicators(ratio.detach(), a, eps_low, eps_high)
        assert (low + high).item() == float(clipped)
