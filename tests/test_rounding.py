"""The rounding bound every numeric comparison uses (trl_gspo/rounding.py), checked against sums computed here.

The bound must hold for any order a CPU may add the same terms in (sequential, reversed, pairwise, cut into 4, 8 or
16 vector lanes as the DEFAULT, AVX2 and AVX-512 kernels cut them, shuffled), and a difference well above it (what a
wrong token or mask gives) must not pass. The hand count of a tiny model's sums pins `model_terms` down.
"""

import math

import numpy as np
import pytest
import torch

from trl_gspo.rounding import (
    LAMBDA,
    fp32_terms,
    model_bound,
    model_terms,
    relative_gap,
    rounding_bound,
    sgd_weights_bound,
)
from trl_gspo.testing import tiny_config


def _orders(x: np.ndarray) -> list[float]:
    """The fp32 sum of `x` in the orders kernels use: one term at a time (both ways), torch's own, pairwise, and
    partial sums in 4, 8 and 16 lanes added up at the end, and a shuffled order. numpy's cumsum adds one term at a
    time in the array's dtype."""

    def sequential(v):
        return np.cumsum(v)[-1]

    def pairwise(v):
        while v.size > 1:
            v = np.concatenate([v, np.zeros(v.size % 2, v.dtype)])
            v = v[0::2] + v[1::2]
        return v[0]

    def lanes(v, width):  # one vector add per step, as a vectorised loop does, then the lanes in turn
        padded = np.concatenate([v, np.zeros(-v.size % width, v.dtype)]).reshape(-1, width)
        return sequential(np.cumsum(padded, axis=0)[-1])

    shuffled = np.random.default_rng(x.size).permutation(x)
    own = torch.from_numpy(x).sum().item()
    orders = [sequential(x), sequential(x[::-1]), own, pairwise(x), sequential(shuffled)]
    return [float(v) for v in orders + [lanes(x, w) for w in (4, 8, 16)]]


@pytest.mark.parametrize("n", [10, 64, 1000, 5000])
def test_every_order_of_a_sum_stays_within_the_bound_of_any_other(n):
    rng = np.random.default_rng(n)
    for x in (rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32)):
        sums = np.array(_orders(x))  # the same fp32 terms in every order: only the additions round differently
        size = np.abs(x.astype(np.float64)).sum()  # the bound is relative to the terms' magnitudes
        assert (sums.max() - sums.min()) / size <= rounding_bound(torch.float32, n), n
        truth = x.astype(np.float64).sum()  # each order on its own is within half of it of the exact sum
        assert np.abs(sums - truth).max() / size <= rounding_bound(torch.float32, n) / 2, n
        assert n < 64 or sums.max() > sums.min()  # the orders do round differently: the check is not vacuous


def test_the_bound_takes_the_smaller_of_the_exact_and_the_probabilistic_one():
    eps = torch.finfo(torch.float32).eps
    assert rounding_bound(torch.float32, 10) == pytest.approx(10 * eps)  # n < LAMBDA^2: n * eps, exact
    assert rounding_bound(torch.float32, 10_000) == pytest.approx(LAMBDA * 100 * eps)  # LAMBDA * sqrt(n) * eps
    assert rounding_bound(torch.float32, int(LAMBDA**2)) == pytest.approx(LAMBDA**2 * eps)  # where they meet
    assert rounding_bound(torch.float64, 100) == pytest.approx(LAMBDA * 10 * torch.finfo(torch.float64).eps)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"terms={bad} must be a positive count"):
            rounding_bound(torch.float32, bad)
    with pytest.raises(ValueError, match="torch.int64 is not a floating-point dtype"):
        rounding_bound(torch.int64, 10)


def test_model_terms_count_the_tiny_models_sums_by_hand():
    config = tiny_config(48)  # hidden 64, 4 heads of 16, intermediate 128, 2 layers, 48 words
    layer = (
        2 * 64 + 2 * 16 + 2 * 64 + 2 * 16 + 4 * 16 + 128
    )  # norms, q/k norms, q/k/v + gate/up, softmax + sum, o, down
    forward = 2 * layer + 64 + 64 + 48  # final norm, LM head, log-sum-exp
    assert model_terms(config, 16) == forward == 1200
    assert model_terms(config, 16, 96) == 2 * forward + 96  # the backward, and a weight gradient over 96 positions
    assert fp32_terms(config, 16) == 2 * (2 * 64 + 2 * 16) + 64 + 48
    moe = tiny_config(48, moe=True)  # experts of size 64, 4 of them, top-2: down projection, router softmax, mix
    assert model_terms(moe, 16) - model_terms(config, 16) == 2 * ((64 + 4 + 2) - 128)
    # fp32 keeps its own bound; an fp64 model adds fp32's for the norms and TRL's head, which compute in fp32
    assert model_bound(torch.float32, config, 16, 96) == rounding_bound(torch.float32, 2496)
    fp64 = model_bound(torch.float64, config, 16, 96)
    assert fp64 == rounding_bound(torch.float64, 2496) + rounding_bound(torch.float32, fp32_terms(config, 16, 96))
    assert rounding_bound(torch.float64, 2496) < 1e-12 < fp64 < model_bound(torch.float32, config, 16, 96)


def test_a_gradient_off_by_more_than_rounding_is_caught():
    """A gradient as two layouts give it (the same terms summed in another order) passes; one with a single token's
    contribution scaled by 1.01 (a mask or weight off for one token) does not."""
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(96, 64, 128, generator=g) / 96  # each position's contribution to a weight gradient
    reference = per_token.sum(0)
    reordered = per_token.flip(0).cumsum(0)[-1]  # the same sum in another order
    bound = rounding_bound(torch.float32, 96)
    assert relative_gap(reordered, reference) <= bound
    wrong = reference + 0.01 * per_token[5]
    assert relative_gap(wrong, reference) > 10 * bound


def test_relative_gap_norms_and_edge_cases():
    want = torch.tensor([3.0, -4.0])
    assert relative_gap(want + torch.tensor([0.0, 0.5]), want) == pytest.approx(0.1)  # 2-norm: 0.5 / 5
    assert relative_gap(want + torch.tensor([0.0, 0.5]), want, math.inf) == pytest.approx(0.125)  # 0.5 / 4
    assert relative_gap(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_gap(torch.tensor([1e-30, 0.0]), torch.zeros(2)) == math.inf
    assert not relative_gap(torch.tensor([float("nan"), 1.0]), want) <= 1.0  # NaN never passes a bound


def test_sgd_weights_bound_refuses_what_it_does_not_bound():
    from types import SimpleNamespace

    args = SimpleNamespace(max_grad_norm=1.0, optim="sgd", weight_decay=0.0, learning_rate=0.05)
    # 4 steps of at most 0.05 each: the gradients' bound over that path, and 4 roundings of weights up to 2 + 0.2
    assert sgd_weights_bound(torch.float32, 1e-4, args, 4, 2.0) == pytest.approx(
        1e-4 * 0.2 + rounding_bound(torch.float32, 4) * 2.2
    )
    with pytest.raises(ValueError, match="optim='adamw_torch'.*plain SGD"):
        sgd_weights_bound(torch.float32, 1e-4, SimpleNamespace(**{**vars(args), "optim": "adamw_torch"}), 4, 2.0)
    with pytest.raises(ValueError, match="max_grad_norm=0.0; without clipping"):
        sgd_weights_bound(torch.float32, 1e-4, SimpleNamespace(**{**vars(args), "max_grad_norm": 0.0}), 4, 2.0)
