"""How far two floating-point evaluations of the same math may lie apart: the bound the tests, `trl-gspo check`'s
parity cases and the benchmarks' own checks compare with, derived from the dtype and the number of terms behind a
value. Test numerics, not command line: it sits beside `testing.py`, below everything that uses it.

What it bounds: the rounding of a sum, relative to the sizes of the terms summed. It holds for one sum (and for
sums in a chain whose terms keep their size), not for a whole forward and backward: a network's nonlinearities can
grow an early rounding, and its outputs are not the size of the terms behind them. There `model_bound` counts the
sums on a value's path as if they were one long sum, a budget rather than a proof; a test comparing a forward's or a
backward's results with it should also show that the smallest real bug of its kind in its batch (one token
mis-masked or mis-weighted) lands outside the bound, or the bound proves nothing there.

Two evaluations of the same math that add the same terms in another order differ by rounding alone. The order
changes with the layout (padded, trimmed, packed, shared prefix), with the thread count, and with the CPU's kernels:
torch cuts a sum into partial sums as wide as its vectors (`ATEN_CPU_CAPABILITY` DEFAULT, AVX2, AVX512), and its
vectorised exp and log differ from the scalar ones in the last bit. A bound read off one machine's results fails on
another's (an AVX-512 CPU put a trimmed forward's gradient 8.6 eps from the padded one's, past a bound of 1e-6 that
had held on AVX2); this one is derived from the dtype and the number of roundings, not read off any machine's results:

    rounding_bound(dtype, terms) = min(terms, LAMBDA * sqrt(terms)) * eps(dtype)

relative to the size of what is compared (`relative_gap`: a gradient's norm, the largest log-prob, the loss).
`terms` counts the roundings behind a value: a sum of n terms rounds n - 1 times, and a value computed through a
chain of sums (a model's forward and backward, `model_terms`) carries the roundings of every sum on its path.

Where it comes from. An evaluation in which n roundings lie behind a value is within n * u of the exact value,
relative to the magnitudes of the terms (u = eps / 2; Higham, Accuracy and Stability of Numerical Algorithms, 2nd
ed., section 4.2), whatever the order; two evaluations are then within n * eps of each other. That worst case needs
every rounding to err the same way. Round-to-nearest on data that is not special (random weights and their
activations) errs either way independently, and under that model the value is within LAMBDA * sqrt(n) * u with
probability at least 1 - 2n * exp(-LAMBDA^2 / 2) (Higham and Mary, A New Approach to Probabilistic Rounding Error
Analysis, SIAM J. Sci. Comput. 41(5), 2019); independent roundings along a chain add the same way, so `terms` is the
chain's total. LAMBDA = 8 puts the chance of a miss below 2n * exp(-32) < 3e-14 * n. The smaller of the two bounds
holds: the exact one below LAMBDA^2 = 64 roundings, the probabilistic one above. The magnitudes in both are the
terms' own: where a compared value is a small difference of large ones, the caller scales by the large ones (the
tests say where).

What the bound leaves room for (as a budget, see above): the tiny models of the tests (hidden size 64, two layers)
put about 2,500 roundings behind a parameter gradient, so fp32 allows 4.8e-5 of its norm (1.9e-4 for a policy loss's
gradient, whose importance ratios carry the log-probs' rounding: `loss_bound`). How much room that leaves a real bug
is measured, not assumed: each comparison's companion check (`tests/helpers/smallest_bug.py`) makes the smallest bug
of its kind in the test's own batch (one token mis-masked; for the isolation checks, a boundary one key early) and
asserts that the change lands outside the bound. For the LoRA and shared-prefix runs compared by their weights after
training, measured at the weights their last step started from, the change is 2.2 to 8 times the bound: a margin,
not orders of magnitude. Two lie inside their bounds and are caught by another quantity of the same test: the MoE
load-balancing loss (one position left out moves it by 2.4e-7, under its 3.3e-5 bound) and the per-step losses of an
on-policy last step with a KL term (0.06 % to 5 % of the bound; the end weights catch it). An fp64 model is not fp64
throughout: transformers' RMSNorms and TRL's log-prob head compute in fp32 whatever the model's dtype
(`fp32_terms`), so its bound is fp32's for those sums, 3e-5 for such a gradient, not fp64's 8.9e-14 (`model_bound`).
"""

from __future__ import annotations

import math

import torch

#: The probabilistic bound's multiple of sqrt(n) * u: 2n * exp(-LAMBDA^2 / 2) is its chance of a miss.
LAMBDA = 8.0


def rounding_bound(dtype: torch.dtype, terms: int) -> float:
    """min(terms, LAMBDA * sqrt(terms)) * eps(dtype): how far, relative to their size, two evaluations of the same
    math in `dtype` may differ when `terms` roundings lie behind each and their order differs (module docstring)."""
    if not dtype.is_floating_point:
        raise ValueError(f"rounding_bound: dtype={dtype} is not a floating-point dtype")
    if int(terms) < 1:
        raise ValueError(f"rounding_bound: terms={terms!r} must be a positive count of roundings")
    terms = int(terms)
    return min(terms, LAMBDA * math.sqrt(terms)) * torch.finfo(dtype).eps


def _forward_sums(config, seq_len: int) -> tuple[int, int]:
    """(all, fp32) roundings on the longest path through a decoder's forward, read from its transformers config
    (`model_terms`); the second counts those that run in fp32 whatever the model's dtype (`fp32_terms`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads, layers = text.hidden_size, text.num_attention_heads, text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((getattr(text, k) for k in names if getattr(text, k, None)), 0)
    if experts:
        mlp = (getattr(text, "moe_intermediate_size", None) or text.intermediate_size) + experts
        mlp += text.num_experts_per_tok
    else:
        mlp = text.intermediate_size
    norms = 2 * hidden + 2 * head_dim  # per layer: input and post-attention norms, q/k norms
    layer = norms + 2 * hidden + 2 * seq_len + heads * head_dim + mlp
    every = layers * layer + 2 * hidden + text.vocab_size
    fp32 = layers * norms + hidden + text.vocab_size  # the norms, the final norm, the head's log-sum-exp
    return every, fp32


def model_terms(config, seq_len: int, batch_positions: int = 0) -> int:
    """Roundings on the longest path to a value a decoder computes from `seq_len` positions (a log-prob, an entropy),
    read from its transformers config. Per layer: two RMSNorms and the q/k/v and gate/up projections over the hidden
    size, the q/k norms and the attention scores over the head size, the softmax and the value sum over the positions,
    the output projection over the heads, the down projection over the intermediate size (an MoE's expert size, its
    router's softmax over the experts and the top-k mix); then the final norm and the LM head over the hidden size and
    the log-sum-exp over the vocabulary. A parameter gradient (`batch_positions` > 0, the positions of the batch) runs
    those sums again, transposed, in the backward and adds the weight gradient's sum over every position."""
    forward = _forward_sums(config, seq_len)[0]
    return forward if batch_positions <= 0 else 2 * forward + batch_positions


def fp32_terms(config, seq_len: int, batch_positions: int = 0) -> int:
    """The roundings among `model_terms` that run in fp32 even in an fp64 model: transformers' RMSNorms cast their
    input to fp32 (two per layer over the hidden size, the q/k norms over the head size, the final norm), and TRL's
    fused log-prob head folds its log-sum-exp over the vocabulary, and sums its LM-head weight gradient over the
    positions, in fp32. A layout that merges or splits a sum in front of one of them (a shared prompt's key gradient,
    summed over its completions before the k-norm's backward) moves an fp64 model's results at fp32's scale."""
    forward = _forward_sums(config, seq_len)[1]
    return forward if batch_positions <= 0 else 2 * forward + batch_positions


def model_bound(dtype: torch.dtype, config, seq_len: int, batch_positions: int = 0, extra_terms: int = 0) -> float:
    """The `rounding_bound` of a value a decoder in `dtype` computes (`model_terms`; a gradient with
    `batch_positions`), plus `extra_terms` roundings of what follows it (a loss's sums over the tokens). Wider than
    fp32 (fp64), the sums that run in fp32 regardless (`fp32_terms`) add fp32's bound for them."""
    bound = rounding_bound(dtype, model_terms(config, seq_len, batch_positions) + extra_terms)
    if torch.finfo(dtype).eps < torch.finfo(torch.float32).eps:
        bound += rounding_bound(torch.float32, fp32_terms(config, seq_len, batch_positions))
    return bound


def loss_bound(
    dtype: torch.dtype, config, seq_len: int, tokens: int, logp_size: float, batch_positions: int = 0
) -> float:
    """The bound of a policy loss over `tokens` tokens (with `batch_positions`, of its parameter gradients) computed
    from a decoder's log-probs through importance ratios exp(log-prob - old log-prob). A log-prob's rounding is
    relative to the log-probs' size (`logp_size`, the largest |log-prob|: ~4 for a tiny model's 48 words), and the
    ratio's relative error is that absolute error, so the forward's bound enters times `logp_size`; the loss's own
    sums and the backward's enter as they are."""
    own = model_bound(dtype, config, seq_len, batch_positions, extra_terms=tokens)
    return own + model_bound(dtype, config, seq_len) * logp_size


def relative_gap(got: torch.Tensor, want: torch.Tensor, ord: float = 2) -> float:
    """||got - want|| / ||want|| in the vector `ord`-norm, computed in fp64: 2 for a tensor taken as a whole (a
    gradient), `math.inf` for one whose every entry must hold (per-token log-probs: one wrong token must show).
    0 when the two are equal, inf when `want` is zero and `got` is not."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    gap = torch.linalg.vector_norm(got - want, ord).item()
    size = torch.linalg.vector_norm(want, ord).item()
    if gap == 0:
        return 0.0
    return gap / size if size > 0 else math.inf


def sgd_weights_bound(dtype: torch.dtype, gradient_bound: float, args, steps: int, norm: float) -> float:
    """How far (2-norm) one parameter may end apart in two plain-SGD runs whose gradients differ by rounding alone,
    each step's by at most `gradient_bound` of its norm: `steps` optimizer steps, `args` the runs' `TrainingArguments`,
    `norm` the parameter's norm at the start or the end of either run. The gradient is clipped to `max_grad_norm`, so
    no step moves the weights by more than learning_rate * max_grad_norm (a scheduler only lowers the rate) and no
    weight along the way is larger than `norm` plus that path. Each step carries its gradient's bound and rounds the
    new weights once in `dtype` (`steps` roundings). First order in the steps' size: a step small enough to train
    stably carries an earlier gap forward without growing it. Adam has no such bound (it divides by sqrt(v), so on a
    weight whose gradient is ~0 it turns a rounding-sized difference into a step of up to the learning rate): its runs
    can only be compared for exact equality."""
    if not args.max_grad_norm or args.max_grad_norm <= 0:
        raise ValueError(
            f"sgd_weights_bound: max_grad_norm={args.max_grad_norm!r}; without clipping no step is bounded"
        )
    if args.optim != "sgd" or args.weight_decay:
        raise ValueError(
            f"sgd_weights_bound: optim={args.optim!r}, weight_decay={args.weight_decay!r}; the bound holds for plain "
            "SGD ('sgd', no weight decay) only"
        )
    path = steps * args.learning_rate * args.max_grad_norm
    return gradient_bound * path + rounding_bound(dtype, steps) * (norm + path)
