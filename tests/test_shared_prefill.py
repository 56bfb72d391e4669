"""Shared prefill in transformers generation (`GSPOConfig.shared_prefill`, rollout/shared_prefill.py).

- `model.generate` with the prefill shared gives the completions the full prefill gives (greedy, and sampled from
  the same seed with temperature, top-k and top-p), its per-step logits agree to fp32 rounding, the prefill forward
  really ran on the distinct rows only, and the log-probs of the generated tokens (through the sampler's recorder,
  registered inside it) equal an independent full forward of every row's prompt and completion.
- Calls it cannot share are left alone: no repeated row, another cache class, an input it does not know.
- In the trainer: the rollout batch equals stock TRL's (completion ids bit for bit, pi_old from the sampler to fp32
  rounding), the saved positions are logged, and it is off under R3 and on paths other than `generate`.
"""

import contextlib
import copy
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.smallest_bug import dropped_token_gap
from helpers.trainers import SAMPLING_RUN
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache
from trl import GRPOConfig, GRPOTrainer

from trl_gspo.rollout import sampler_logprobs as sl
from trl_gspo.rollout.shared_prefill import PrefillSharing, SharedPrefill, distinct_rows
from trl_gspo.rounding import model_bound, relative_gap
from trl_gspo.testing import build_tiny_model

G = 4


def assert_rounding_close(got, want, config, seq_len, logps=True):
    """Equal up to fp32 rounding of a decoder's value over `seq_len` positions (trl_gspo/rounding.py), relative to the
    values' size: a smaller prefill batch sums in another order, a wrong cache row or position moves them by far
    more. For log-probs (`logps`), the companion (helpers/smallest_bug.py): one token mis-masked, its log-prob 0,
    lands outside the bound."""
    atol = model_bound(torch.float32, config, seq_len) * float(want.abs().max())
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    if logps:
        assert dropped_token_gap(want, torch.ones_like(want)) > model_bound(torch.float32, config, seq_len)


def _repeated_prompts(tokenizer, lengths=(5, 9, 7), seed=0):
    """Left-padded `[len(lengths) * G, S]` ids and mask: each prompt repeated G times consecutively, as TRL does."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, len(tokenizer), (n,), generator=g) for n in lengths]
    rows = [p for p in prompts for _ in range(G)]
    width = max(lengths)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask


def _generate(model, ids, mask, config, share: bool, seed=1):
    """(output, rows of the model's first call, hooks or None)."""
    first_call_rows = []

    def count(module, args, kwargs):  # registered after the sharing hooks: sees what the model is given
        if not first_call_rows:
            first_call_rows.append(kwargs["input_ids"].size(0))

    torch.manual_seed(seed)
    with torch.no_grad(), PrefillSharing(model) if share else contextlib.nullcontext() as hooks:
        handle = model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        finally:
            handle.remove()
    return out, first_call_rows[0], hooks


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_gives_the_full_prefills_completions(tokenizer, sample):
    model = build_tiny_model(tokenizer, seed=1).eval()
    ids, mask = _repeated_prompts(tokenizer)
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9) if sample else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
        **settings,
    )
    full, full_rows, _ = _generate(model, ids, mask, config, share=False)
    shared, shared_rows, hooks = _generate(model, ids, mask, config, share=True)
    assert (full_rows, shared_rows) == (12, 3)  # the prefill ran on the distinct prompts only
    assert hooks.positions_saved == (12 - 3) * ids.size(1)
    assert torch.equal(shared.sequences, full.sequences)
    assert len(shared.scores) == len(full.scores) == 8
    finite = [torch.isfinite(a) for a in full.scores]  # top-k / top-p set the others to -inf, in both
    for a, b, keep in zip(full.scores, shared.scores, finite):
        assert torch.equal(torch.isfinite(b), keep)
        assert_rounding_close(b[keep], a[keep], model.config, full.sequences.size(1), logps=False)
    # companion: the bug of this kind, a wrong cache row (another prompt's), moves some step's scores past the bound
    bound = model_bound(torch.float32, model.config, full.sequences.size(1))
    other = torch.arange(ids.size(0)).roll(G)  # each row against a row of the next prompt
    assert min(relative_gap(a[other][keep], a[keep], math.inf) for a, keep in zip(full.scores, finite)) > bound
    # the rows of a prompt are not all the same completion: the copied cache did not make them one
    assert sample is False or len({tuple(r) for r in shared.sequences[:G].tolist()}) > 1


def test_generated_tokens_logprobs_equal_an_independent_full_forward(tokenizer):
    """The sampler's recorder inside the sharing hooks (as rollout/pipeline.py nests them) sees every row's logits;
    its log-probs of the sampled tokens equal a plain forward of each row's prompt + completion."""
    model = build_tiny_model(tokenizer, seed=2).eval()
    ids, mask = _repeated_prompts(tokenizer, lengths=(6, 3), seed=3)
    temperature = 0.8
    config = GenerationConfig(
        max_new_tokens=6, do_sample=True, temperature=temperature, pad_token_id=0, eos_token_id=None
    )
    torch.manual_seed(0)
    with torch.no_grad(), PrefillSharing(model), sl.SamplerLogprobRecorder(model, temperature) as recorder:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completion = out[:, ids.size(1) :]
    got = torch.tensor(recorder.completion_logprobs(completion.tolist()), dtype=torch.float64)
    expected = []
    for row in range(out.size(0)):  # independent: one row at a time, no padding, no cache
        real = torch.cat([ids[row][mask[row].bool()], completion[row]])[None]
        with torch.no_grad():
            logits = model(input_ids=real).logits[0, -completion.size(1) - 1 : -1].double()
        expected.append(torch.log_softmax(logits / temperature, -1).gather(-1, completion[row][:, None])[:, 0])
    assert_rounding_close(got, torch.stack(expected), model.config, out.size(1))


def test_calls_it_cannot_share_are_left_alone(tokenizer):
    model = build_tiny_model(tokenizer, seed=1).eval()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    ids, mask = _repeated_prompts(tokenizer)
    # every row distinct: nothing to share
    distinct = ids[::G].contiguous(), mask[::G].contiguous()
    full, _, _ = _generate(model, *distinct, config, share=False)
    shared, rows, hooks = _generate(model, *distinct, config, share=True)
    assert rows == 3 and hooks.positions_saved == 0 and torch.equal(shared, full)
    # a static cache: generate's own prefill, the same tokens
    static = copy.deepcopy(config)
    static.cache_implementation = "static"
    full, _, _ = _generate(model, ids, mask, static, share=False)
    shared, rows, hooks = _generate(model, ids, mask, static, share=True)
    assert rows == 12 and hooks.positions_saved == 0 and torch.equal(shared, full)
    # an input it does not know how to share, or a cache that already holds positions: the call as it came
    hooks = PrefillSharing(model)
    kwargs = dict(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config))
    assert hooks._before(model, (), {**kwargs, "token_type_ids": torch.zeros_like(ids)}) is None
    assert hooks._before(model, (), {**kwargs, "input_ids": ids[:, -1:], "attention_mask": mask}) is None
    with torch.no_grad():
        model(input_ids=ids[:, :2], attention_mask=mask[:, :2], cache=kwargs["cache"])
    assert hooks._before(model, (), kwargs) is None
    assert hooks.pending is None


def test_distinct_rows_against_a_loop():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (40, 2), generator=g)
    mask = torch.randint(0, 2, (40, 2), generator=g)
    keep, expand = distinct_rows({"input_ids": ids, "attention_mask": mask})
    first = {}
    for row in range(40):
        first.setdefault((tuple(ids[row].tolist()), tuple(mask[row].tolist())), row)
    assert sorted(keep.tolist()) == sorted(first.values())  # one row per distinct (ids, mask), its first occurrence
    for row in range(40):  # every row points at a kept row equal to it
        kept = int(keep[expand[row]])
        assert torch.equal(ids[kept], ids[row]) and torch.equal(mask[kept], mask[row])
    assert distinct_rows({"input_ids": torch.arange(6).view(3, 2)}) is None


# ------------------------------------------------------------------------------------------ in the trainer
TRAINER = SAMPLING_RUN  # the sampling path's run (tests/helpers/trainers.py)


def test_trainer_rollout_equals_stocks_and_logs_the_saving(tmp_path, trainer_factory):
    stock = trainer_factory(TRAINER, output_dir=tmp_path / "stock", cls=GRPOTrainer, config_cls=GRPOConfig)
    stock.train()
    runs = {}
    for shared in (True, False):
        trainer = trainer_factory(
            TRAINER, output_dir=tmp_path / str(shared), shared_prefill=shared, old_logprobs_source="sampler"
        )
        trainer.train()
        runs[shared] = trainer
    saved = [
        h["throughput/prefill_tokens_saved"]
        for h in runs[True].state.log_history
        if "throughput/prefill_tokens_saved" in h
    ]
    assert saved and saved[0] > 0  # 32 rows, 8 distinct prompts: 24 rows' prefill not run
    assert not any("throughput/prefill_tokens_saved" in h for h in runs[False].state.log_history)
    for a, b, c in zip(stock._buffered_inputs, runs[True]._buffered_inputs, runs[False]._buffered_inputs):
        assert torch.equal(b["completion_ids"], a["completion_ids"])  # stock's samples, bit for bit
        assert torch.equal(c["completion_ids"], a["completion_ids"])
        m = a["completion_mask"].bool()
        # pi_old from the sampler (through the expanded cache) against stock's recomputed forward
        seq_len = a["prompt_ids"].size(1) + a["completion_ids"].size(1)
        for other in (a, c):
            assert_rounding_close(
                b["old_per_token_logps"][m], other["old_per_token_logps"][m], stock.model.config, seq_len
            )


@pytest.mark.parametrize(
    "path, r3, applies",
    [("generate", False, True), ("generate", True, False), ("vllm", False, False), ("rollout_func", False, False)],
)
def test_only_on_the_generate_path_and_not_under_r3(tokenizer, path, r3, applies):
    model = build_tiny_model(tokenizer)
    run = SimpleNamespace(sampling_path=path, log_metric=lambda *a, **k: None)
    accelerator = SimpleNamespace(unwrap_model=lambda m: m)
    part = SharedPrefill(run, accelerator, SimpleNamespace(records_sampler_routes=r3), enabled=True)
    with part.sharing(model) as hooks:
        assert (hooks is not None) == applies
        assert bool(model._forward_pre_hooks) == applies
    assert not model._forward_pre_hooks and not model._forward_hooks  # removed after the call
    off = SharedPrefill(run, accelerator, SimpleNamespace(records_sampler_routes=False))  # the default: off
    with off.sharing(model) as hooks:
        assert hooks is None
