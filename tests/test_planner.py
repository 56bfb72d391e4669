"""The planner's decisions per device and kernel (forward/planner.py), as pure functions of the row spans.

- CPU: the decisions are pinned. `CPU_DECISIONS` was obtained by running `plan_forward` (the planner that also lays
  a segment call in one row where that costs less) on the span sets of `span_set`, and writing each layout as its
  kind (t: trimmed, p: packed, s: shared) and shape. A change to them changes what the CPU benchmarks measure, so it
  is made on purpose, with the table and the benchmarks' results.
- CUDA without a fused varlen kernel: `"auto"` runs trimmed only; explicit True settings are obeyed.
- CUDA with one: segment calls in one row, chosen under `"auto"` only when they cost less than `CUDA_MARGIN` of the
  trimmed call.
"""

from __future__ import annotations

import random

import pytest
import torch

from trl_gspo.forward.planner import (
    CUDA_MARGIN,
    block_cost,
    choose_layout,
    pair_cost,
    plan_forward,
    segment_cost,
    trimmed_cost,
    unit_widths,
    varlen_cost,
)
from trl_gspo.forward.segment_attention import BLOCK, BLOCKS, TORCH_VARLEN


def span_set(name):
    """(spans, batch_shape, prompt_width, chunk_rows, groups) of a named batch: left-padded prompts, right-padded
    completions, rows of one prompt spread as after TRL's shuffle."""
    rng = random.Random(name)
    if name == "long_prompt":  # 4 groups of 4, ~300-token prompts, short completions
        pw, b, t, chunk = 320, 16, 128, 8
        prompt = [rng.randint(250, 320) for _ in range(4)]
        completion = [rng.randint(20, 120) for _ in range(b)]
        group = [i // 4 for i in range(b)]
        rng.shuffle(group)
    elif name == "long_tail":  # no shared prompts, long-tailed completions
        pw, b, t, chunk = 40, 16, 512, 4
        prompt = [rng.randint(10, 40) for _ in range(b)]
        completion = [min(t, max(1, int(rng.lognormvariate(4.5, 1.0)))) for _ in range(b)]
        group = list(range(b))
    elif name == "equal_settings":  # short prompts, groups of 4
        pw, b, t, chunk = 16, 8, 128, 8
        prompt = [rng.randint(8, 16) for _ in range(2)]
        completion = [rng.randint(64, 128) for _ in range(b)]
        group = [i // 4 for i in range(b)]
    else:  # "mixed": groups of 2, medium prompts, some empty completions
        pw, b, t, chunk = 96, 12, 200, 6
        prompt = [rng.randint(30, 96) for _ in range(6)]
        completion = [rng.randint(0, 200) for _ in range(b)]
        group = [i // 2 for i in range(b)]
        rng.shuffle(group)
    plen = [prompt[g] for g in group]
    spans = torch.tensor([[pw - p, pw + c if c else pw, p + c] for p, c in zip(plen, completion)])
    by_group = {}
    for r, g in enumerate(group):
        by_group.setdefault(g, []).append(r)
    return spans, (b, pw + t), pw, chunk, [rows for rows in by_group.values() if len(rows) > 1]


def _plan(name, pack, share, sort=True, alpha=1e-3, **where):
    spans, shape, pw, chunk, groups = span_set(name)
    return plan_forward(
        spans,
        shape,
        pw,
        chunk,
        groups=groups,
        sort=sort,
        trim=True,
        pack=pack,
        share=share,
        alpha=alpha,
        **where,
    )


def _summary(layouts) -> str:
    kinds = ["t" if lay.columns is not None else "s" if lay.aliases is not None else "p" for lay in layouts]
    return " ".join(f"{k}{lay.shape[0]}x{lay.shape[1]}" for k, lay in zip(kinds, layouts))


#: (span set, alpha, padding_free, shared_prefix, sort) -> layouts on the CPU (`1x` width: a segment call in one row).
CPU_DECISIONS = {
    ("long_prompt", 0.001, "auto", "auto", True): "s1x1261 s1x1078",
    ("long_prompt", 0.001, "auto", "auto", False): "s1x1261 s1x1078",
    ("long_prompt", 0.001, True, "auto", True): "s1x1261 s1x1078",
    ("long_prompt", 0.001, "auto", True, True): "s1x1261 s1x1078",
    ("long_prompt", 0.001, False, "auto", True): "s2x701 s2x583",
    ("long_prompt", 0.001, False, False, True): "t8x440 t8x397",
    ("long_prompt", 0.008, "auto", "auto", True): "s1x1261 s1x1078",
    ("long_prompt", 0.008, False, False, True): "t8x440 t8x397",
    ("long_tail", 0.001, "auto", "auto", True): "p1x886 p1x448 p1x361 p1x278",
    ("long_tail", 0.001, "auto", "auto", False): "p1x479 p1x421 p1x528 p1x545",
    ("long_tail", 0.001, True, "auto", True): "p1x886 p1x448 p1x361 p1x278",
    ("long_tail", 0.001, "auto", True, True): "p1x886 p1x448 p1x361 p1x278",
    ("long_tail", 0.001, False, "auto", True): "t4x305 t4x133 t4x100 t4x81",
    ("long_tail", 0.001, False, False, True): "t4x305 t4x133 t4x100 t4x81",
    ("long_tail", 0.008, "auto", "auto", True): "p1x886 p4x119 p1x361 p4x75",
    ("long_tail", 0.008, "auto", "auto", False): "p1x479 p1x421 p1x528 p1x545",
    ("long_tail", 0.008, "auto", True, True): "p1x886 p4x119 p1x361 p4x75",
    ("long_tail", 0.008, False, False, True): "t4x305 t4x133 t4x100 t4x81",
    ("equal_settings", 0.001, "auto", "auto", True): "s1x769",
    ("equal_settings", 0.001, "auto", "auto", False): "s1x769",
    ("equal_settings", 0.001, True, "auto", True): "s1x769",
    ("equal_settings", 0.001, False, "auto", True): "s2x394",
    ("equal_settings", 0.001, False, False, True): "t8x137",
    ("equal_settings", 0.008, "auto", "auto", True): "s2x394",
    ("mixed", 0.001, "auto", "auto", True): "s1x943 s1x943",
    ("mixed", 0.001, "auto", "auto", False): "s1x943 s1x943",
    ("mixed", 0.001, True, "auto", True): "s1x943 s1x943",
    ("mixed", 0.001, "auto", True, True): "s1x943 s1x943",
    ("mixed", 0.001, False, False, True): "t6x288 t6x212",
    ("mixed", 0.008, "auto", "auto", True): "s1x943 s1x943",
    ("mixed", 0.008, False, False, True): "t6x288 t6x212",
}


@pytest.mark.parametrize("case", sorted(CPU_DECISIONS, key=str), ids=lambda c: "-".join(map(str, c)))
def test_cpu_decisions_are_pinned(case):
    name, alpha, pack, share, sort = case
    assert _summary(_plan(name, pack, share, sort, alpha)) == CPU_DECISIONS[case]  # the default: the CPU
    assert _summary(_plan(name, pack, share, sort, alpha, device="cpu", kernel=None)) == CPU_DECISIONS[case]


@pytest.mark.parametrize("name", ["long_prompt", "long_tail", "equal_settings", "mixed"])
def test_cuda_without_a_varlen_kernel_runs_trimmed_unless_told(name):
    """On CUDA the SDPA blocks lose to stock's flash call: "auto" plans exactly what sharing and packing off plan;
    explicit True settings still get their segment layouts (the SDPA blocks serve them, said once in the log)."""
    cuda = dict(device="cuda", kernel=None)
    assert _summary(_plan(name, "auto", "auto", **cuda)) == _summary(_plan(name, False, False))
    forced = _plan(name, True, "auto", **cuda)
    assert all(lay.packed for lay in forced)
    # the CPU's one-row layouts and smaller blocks are not taken there: rows of the longest unit, 256-position blocks
    assert all(lay.segments.block == BLOCK for lay in forced)
    spans = span_set(name)[0]
    assert all(lay.shape[1] == max(int(spans[r, 1] - spans[r, 0]) for r in _rows(lay)) for lay in forced)
    if span_set(name)[4]:  # rows that share a prompt
        assert all(lay.aliases is not None for lay in _plan(name, "auto", True, **cuda))


def _rows(layout) -> list[int]:
    """The batch rows a layout holds."""
    return sorted({int(r) for r in layout.source.flatten() // layout.batch_shape[1] if r >= 0})


def test_cuda_with_a_varlen_kernel_segments_in_one_row_where_it_saves():
    """With a varlen kernel: one row per segment call (no filler), shared where prompts repeat, and every segment
    call chosen under "auto" costs less than CUDA_MARGIN of its chunk's trimmed call."""
    cuda = dict(device="cuda", kernel=TORCH_VARLEN)
    assert _summary(_plan("long_prompt", "auto", "auto", **cuda)) == "s1x1261 s1x1078"
    assert _summary(_plan("long_tail", "auto", "auto", **cuda)) == "p1x886 t4x133 t4x100 t4x81"
    assert _summary(_plan("long_tail", True, "auto", **cuda)) == "p1x886 p1x448 p1x361 p1x278"
    for name in ("long_prompt", "long_tail", "equal_settings", "mixed"):
        spans, _, pw, _, groups = span_set(name)
        for layout in _plan(name, "auto", "auto", **cuda):
            if not layout.packed:
                continue
            assert layout.shape[0] == 1 and not layout.filler
            rows = sorted({int(r) for r in layout.source.flatten() // layout.batch_shape[1] if r >= 0})
            units = (
                [[r for r in g if r in rows] for g in groups if set(g) & set(rows)]
                if layout.aliases is not None
                else []
            )
            units += [[r] for r in rows if not any(r in u for u in units)]
            segment = varlen_cost(unit_widths(spans, units, pw), 1e-3)
            assert segment < CUDA_MARGIN * trimmed_cost(spans, torch.tensor(rows), pw, 1e-3), (name, rows)


def test_the_margin_keeps_small_savings_trimmed():
    """A chunk whose one-row varlen call would save ~9 % of the trimmed call's cost: chosen by cost alone (the same
    kernel, no margin), trimmed on CUDA, where a saving must clear CUDA_MARGIN; ~37 % clears it."""
    small = torch.tensor([[0, 100, 100], [0, 100, 100], [0, 100, 100], [40, 100, 60]])
    rest = ([0, 1, 2, 3], 50, {}, True, "auto", False, 1e-4)
    assert choose_layout(small, *rest, "cpu", TORCH_VARLEN)[0] == "packed"
    assert choose_layout(small, *rest, "cuda", TORCH_VARLEN)[0] == "trimmed"
    assert choose_layout(small, *rest, "cuda", None)[0] == "trimmed"
    large = torch.tensor([[0, 100, 100], [49, 100, 51], [49, 100, 51], [49, 100, 51]])
    assert choose_layout(large, *rest, "cuda", TORCH_VARLEN)[0] == "packed"
    assert choose_layout(large, *rest, "cuda", None)[0] == "trimmed"


def test_cpu_lays_a_segment_call_in_one_row_only_where_it_costs_less():
    """Two groups of two rows (prompt of 40, all real). Equal completions make equal units that fill their rows
    without filler: one row would only add key pairs, so rows stay. One long and one short group: rows as long as
    the long unit pad the short one; one row has no filler and wins. Each time the SDPA blocks' size is the cheapest
    of `BLOCKS`. With a varlen kernel, one row always."""
    group_of = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    rest = ([0, 1, 2, 3], 40, group_of, True, "auto", "auto", 1e-3)

    def cheapest(widths, one_row):
        return min(segment_cost(widths, True, one_row, 1e-3, block=block) for block in BLOCKS)

    equal = torch.tensor([[0, 60, 60]] * 4)
    choice = choose_layout(equal, *rest)
    assert (choice.kind, choice.one_row) == ("shared", False)
    widths = unit_widths(equal, [[0, 1], [2, 3]], 40)
    assert choice.cost == cheapest(widths, False) < cheapest(widths, True)
    assert choice.cost == segment_cost(widths, True, False, 1e-3, block=choice.block)
    unequal = torch.tensor([[0, 240, 240], [0, 240, 240], [0, 45, 45], [0, 45, 45]])
    choice = choose_layout(unequal, *rest)
    assert (choice.kind, choice.one_row) == ("shared", True)
    widths = unit_widths(unequal, [[0, 1], [2, 3]], 40)
    assert choice.cost == cheapest(widths, True) < cheapest(widths, False)
    layout = plan_forward(
        unequal, (4, 240), 40, 4, groups=[[0, 1], [2, 3]], sort=False, trim=True, pack="auto", share="auto", alpha=1e-3
    )[0]
    assert layout.shape == (1, sum(w for w, _, _ in widths)) and not layout.filler
    assert layout.segments.block == choice.block
    assert choose_layout(equal, *rest, "cpu", TORCH_VARLEN).one_row is True


def test_the_block_size_weighs_key_pairs_against_blocks():
    """Seven short units in one row on a SmolLM2-135M-shaped config (its pair and block costs): small blocks reach
    back over fewer keys, and a block costs under a token there, so the smallest size wins. Where a block costs 50
    token-equivalents, fewer, larger blocks win. A block's cost scales with the model: 4 token-equivalents at hidden
    256, a sixth of that at SmolLM2's width, and no more than 4 below hidden 256."""
    from transformers import LlamaConfig

    from trl_gspo.testing import tiny_config

    smol = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    alpha, overhead = pair_cost(smol), block_cost(smol)
    assert block_cost(tiny_config(100, hidden_size=256, num_layers=4)) == pytest.approx(4.0)
    assert block_cost(tiny_config(100, hidden_size=64, num_layers=2)) == 4.0  # narrower: not measured, the cap
    assert overhead == pytest.approx(4.0 / 6)
    short = [(80, 46, [17, 17])] * 7  # (width, prefix, segments): a 46-token prefix and two 17-token segments
    costs = {block: segment_cost(short, True, True, alpha, block, overhead) for block in BLOCKS}
    assert min(costs, key=costs.get) == min(BLOCKS)
    costs = {block: segment_cost(short, True, True, alpha, block, 50.0) for block in BLOCKS}
    assert min(costs, key=costs.get) == max(BLOCKS)
    # a mini-batch as the real demo's: 16 rows, 47-token prompts, 16-token completions, six prompts with two rows and
    # one with four (units of 80 and 114 positions: rows of the longest would pad six units by 34)
    spans = torch.tensor([[0, 63, 63]] * 16)
    groups = [[2 * i, 2 * i + 1] for i in range(6)] + [[12, 13, 14, 15]]
    group_of = {r: tuple(g) for g in groups for r in g}
    choice = choose_layout(spans, list(range(16)), 47, group_of, True, "auto", "auto", alpha, block_overhead=overhead)
    assert (choice.kind, choice.one_row, choice.block) == ("shared", True, min(BLOCKS))
