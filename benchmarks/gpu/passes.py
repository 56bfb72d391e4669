"""The `passes` and `loss` parts of `make gpu-quick` (quick.py has the other two and the profile's table, measure.py
the helpers both build on): the pi_old / reference pass and the loss forward+backward, ours against stock TRL, on one
model shared by a stock `GRPOTrainer` and a `GSPOTrainer` whose settings each arm switches.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time

from .measure import (
    BUDGETS,
    REPS,
    TINY_REPS,
    TINY_WARMUPS,
    WARMUPS,
    Result,
    device_of,
    kernels,
    no_sync,
    timer,
    tiny_kernel,
)

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if BENCHMARKS not in sys.path:  # the benchmark's scenarios import each other as `scenarios`, as run.py puts them
    sys.path.insert(0, BENCHMARKS)

#: Batches of the pass and loss parts: rows, rows per chunk (TRL's batch_size), completions per prompt, prompt tokens
#: (range), completion tokens (max) and how completion lengths spread ("uniform" up to max, or lognormal with this
#: median fraction and ~10 % truncated at max, as benchmarks/scenarios/workload.py's LongTailRollouts).
PASS_SHAPES = {
    "equal_settings": dict(rows=32, chunk=16, group=8, prompt=(120, 140), completion=512, spread="uniform"),
    "long_tail": dict(rows=32, chunk=16, group=8, prompt=(64, 256), completion=2048, spread=0.3),
    "long_prompt": dict(rows=32, chunk=16, group=8, prompt=(896, 1152), completion=384, spread=1 / 3),
}
TINY_PASS = dict(rows=8, chunk=4, group=4, prompt=(5, 9), completion=12)
#: The arms of `passes` and `loss`: GSPOConfig settings (None: stock TRL).
ARMS = {
    "stock": None,
    "ours": {},
    "trimmed": dict(padding_free=False, shared_prefix=False),
    "packed": dict(padding_free=True, shared_prefix=False),
    "shared": dict(shared_prefix=True),
}


# ------------------------------------------------------------------------------------------------ c, d. passes, loss
def _batch(spec: dict, vocab: int, device, seed: int = 0):
    """`(ids, mask, logits_to_keep, group_rows)`: prompts left-padded, completions right-padded, each prompt's
    `group` rows spread as after TRL's shuffle."""
    import math
    from statistics import NormalDist

    import torch

    rng = random.Random(seed)
    rows, group, top = spec["rows"], spec["group"], spec["completion"]
    prompts = [rng.randint(*spec["prompt"]) for _ in range(rows // group)]
    spread = spec.get("spread", "uniform")
    if spread == "uniform":
        lengths = [rng.randint(1, top) for _ in range(rows)]
    else:
        sigma = math.log(1 / spread) / NormalDist().inv_cdf(0.9)
        lengths = [
            min(top, max(1, round(math.exp(math.log(spread * top) + sigma * rng.gauss(0, 1))))) for _ in range(rows)
        ]
    owner = [r // group for r in range(rows)]
    rng.shuffle(owner)
    pw = max(prompts)
    g = torch.Generator().manual_seed(seed)
    prompt_tokens = torch.randint(4, vocab, (len(prompts), pw), generator=g)
    ids = torch.randint(4, vocab, (rows, pw + top), generator=g)
    mask = torch.zeros(rows, pw + top, dtype=torch.long)
    for r, (o, n) in enumerate(zip(owner, lengths)):
        ids[r, :pw] = prompt_tokens[o]
        mask[r, pw - prompts[o] : pw + n] = 1
    ids = ids * mask
    return ids.to(device), mask.to(device), top, owner


def _trainers(tiny: bool, device, dtype):
    """One model, a stock GRPOTrainer and a GSPOTrainer over it (arms switch the GSPOTrainer's settings)."""
    import torch
    from datasets import Dataset
    from scenarios.workload import LOSS_SETTINGS, QWEN3_VOCAB, SHAPES, make_model, make_tokenizer, zero_reward
    from trl import GRPOConfig, GRPOTrainer

    from trl_gspo import GSPOConfig, GSPOTrainer

    tokenizer = make_tokenizer(None if tiny else QWEN3_VOCAB)
    model = make_model(tokenizer, SHAPES["tiny" if tiny else "cuda"], device.type).to(device)
    common = dict(
        output_dir="/tmp/trl-gspo-gpu-quick",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=64,
        **LOSS_SETTINGS,
    )
    dataset = Dataset.from_dict({"prompt": ["a"] * 8})
    stock = GRPOTrainer(
        model, zero_reward, args=GRPOConfig(**common), train_dataset=dataset, processing_class=tokenizer
    )
    ours = GSPOTrainer(model, zero_reward, args=GSPOConfig(**common), train_dataset=dataset, processing_class=tokenizer)
    for trainer in (stock, ours):
        trainer.current_gradient_accumulation_steps = 1
    return model, stock, ours


def _set_arm(ours, settings):
    defaults = dict(padding_free="auto", shared_prefix="auto")
    for key, value in {**defaults, **settings}.items():
        setattr(ours.args, key, value)
    tiny_kernel["kernel"] = None


@contextlib.contextmanager
def _recording_plans(log: dict):
    """Each forward's layouts, as the planner chose them: kind (t trimmed, p packed, s shared) and shape per call."""
    from trl_gspo.forward import pipeline

    plan_forward = pipeline.plan_forward

    def recording(*args, **kwargs):
        layouts = plan_forward(*args, **kwargs)
        kinds = ["t" if lay.columns is not None else "s" if lay.aliases is not None else "p" for lay in layouts]
        log["layouts"] = " ".join(f"{k}{lay.shape[0]}x{lay.shape[1]}" for k, lay in zip(kinds, layouts))
        log["kernel"] = kwargs.get("kernel")
        return layouts

    pipeline.plan_forward = recording
    try:
        yield
    finally:
        pipeline.plan_forward = plan_forward


def passes(path: str | None, tiny: bool = False) -> dict:
    return _measure("passes", path, tiny)


def loss(path: str | None, tiny: bool = False) -> dict:
    return _measure("loss", path, tiny)


def _measure(part: str, path: str | None, tiny: bool) -> dict:
    """`passes`: the no-grad log-prob pass over the batch in chunks; `loss`: `_compute_loss` + backward on one
    micro-batch of whole groups (as `group_minibatches=True` arranges it), gradient checkpointing on."""
    import torch

    result = Result(path)
    device, dtype = device_of(tiny)
    timed = timer(device)
    warmups, reps = (TINY_WARMUPS, TINY_REPS) if tiny else (WARMUPS, REPS)
    model, stock, ours = _trainers(tiny, device, dtype)
    vocab = model.config.vocab_size
    if part == "loss":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
    else:
        model.eval()
    start = time.perf_counter()
    with kernels(tiny):
        for shape, spec in PASS_SHAPES.items():
            if not tiny and time.perf_counter() - start > 0.8 * BUDGETS[part]:
                result.set("skipped", shape, value="out of the part's budget")
                continue
            spec = {**spec, **TINY_PASS} if tiny else spec
            ids, mask, keep, owner = _batch(spec, vocab, device)
            if part == "loss":  # one micro-batch of whole groups
                rows = [r for r in range(len(owner)) if owner[r] < spec["chunk"] // spec["group"]] or [0]
                ids, mask = ids[rows], mask[rows]
                inputs = _loss_inputs(stock, ids, mask, keep)
            result.set(shape, "tokens", value={"real": int(mask.sum()), "padded": int(mask.numel())})
            plans = {}

            def call(arm):
                trainer = stock if ARMS[arm] is None else ours
                if trainer is ours:
                    _set_arm(ours, ARMS[arm])
                    if tiny:  # the stand-in kernel serves segment calls, as torch's would on CUDA
                        tiny_kernel["kernel"] = "torch varlen_attn"
                log = plans.setdefault(arm, {})
                with _recording_plans(log):
                    if part == "loss":
                        trainer._compute_loss(trainer.model, inputs).backward()
                        trainer.model.zero_grad(set_to_none=True)
                        if trainer is ours:
                            ours.logprob_forward.release()  # the step is over: disarm the segment attention
                        return None
                    with torch.no_grad():
                        forward = trainer._get_per_token_logps_and_entropies
                        return forward(trainer.model, ids, mask, keep, batch_size=spec["chunk"])[0]

            if part == "passes":  # ours against stock's log-probs (bf16 rounding apart)
                reference = call("stock")
                completion = mask[:, -keep:].bool()
                tolerance = _logp_tolerance(dtype, model.config, ids.size(1), reference[completion])
                for arm in ARMS:
                    diff = (call(arm) - reference)[completion].abs().max().item()
                    result.set(shape, arm, "max_logp_diff_vs_stock", value=diff)
                    result.set(shape, arm, "logp_tolerance", value=tolerance)
                    if diff > tolerance:
                        result.problem(f"{part} {shape} {arm}: log-probs {diff:.3g} from stock's")
            times = {arm: [] for arm in ARMS}
            for rep in range(warmups + reps):
                for arm in list(ARMS) if rep % 2 == 0 else list(ARMS)[::-1]:
                    ms = timed(lambda: call(arm))
                    if rep >= warmups:
                        times[arm].append(ms)
            for arm, values in times.items():
                result.set(shape, arm, "median_ms", value=round(statistics.median(values), 3))
                result.set(shape, arm, "runs_ms", value=[round(t, 3) for t in values])
                result.set(shape, arm, "plan", value=plans.get(arm, {}))
                if arm != "stock":
                    ratio = statistics.median(values) / max(statistics.median(times["stock"]), 1e-9)
                    result.set(shape, arm, "ratio_vs_stock", value=round(ratio, 3))
            if part == "passes" and shape == "long_prompt":
                result.set("no_sync", value=_no_sync_forward(ours, ids, mask, keep, spec["chunk"], device, tiny))
                if result.data["no_sync"]["status"] != "ok":
                    result.problem(f"a host sync between the model calls of a pi_old forward: {result.data['no_sync']}")
    return result.data


#: bf16 on the GPU: ours and stock round every layer's outputs to bf16 (eps 7.8e-3) in different layouts, and a
#: log-prob adds those roundings up over the model's depth; a wrong token or position moves it by whole nats. Not
#: derived from a count here (no GPU to measure on); fp32 (`--tiny`, on the CPU) takes the derived bound.
BF16_LOGP_TOLERANCE = 0.5


def _logp_tolerance(dtype, config, seq_len: int, reference) -> float:
    """Largest |ours - stock| on one log-prob: bf16, `BF16_LOGP_TOLERANCE`; fp32, one forward's rounding
    (trl_gspo/rounding.model_bound) relative to the largest log-prob."""
    import torch

    from trl_gspo.rounding import model_bound

    if dtype == torch.bfloat16:
        return BF16_LOGP_TOLERANCE
    return model_bound(dtype, config, seq_len) * reference.abs().max().item()


def _loss_inputs(stock, ids, mask, keep):
    import torch

    g = torch.Generator().manual_seed(1)
    prompt_width = ids.size(1) - keep
    inputs = {
        "prompt_ids": ids[:, :prompt_width],
        "prompt_mask": mask[:, :prompt_width],
        "completion_ids": ids[:, prompt_width:],
        "completion_mask": mask[:, prompt_width:],
        "advantages": torch.randn(ids.size(0), generator=g).to(ids.device),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    with torch.no_grad():  # pi_old near pi_theta, so some sequence ratios clip as in training
        logps, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, keep)
    inputs["old_per_token_logps"] = logps + 1e-3 * torch.randn(logps.shape, generator=g).to(ids.device)
    return inputs


def _no_sync_forward(ours, ids, mask, keep, chunk, device, tiny) -> dict:
    """One pi_old forward with shared prompts (segment calls) whose model calls and scatter back run under `no_sync`
    (planning reads the row spans to the host once, before the first call)."""
    import torch

    from trl_gspo.forward import pipeline

    _set_arm(ours, ARMS["shared"])  # tiny: the SDPA blocks (the CPU stand-in kernel reads offsets itself)
    forward = ours.logprob_forward
    run_calls, scatter = forward._run_calls, pipeline.scatter

    def guarded(fn):
        def run(*args, **kwargs):
            with no_sync(device):
                return fn(*args, **kwargs)

        return run

    forward._run_calls, pipeline.scatter = guarded(run_calls), guarded(scatter)
    try:
        with torch.no_grad():
            ours._get_per_token_logps_and_entropies(ours.model, ids, mask, keep, batch_size=chunk)
        return {"status": "ok", "mode": "cuda sync debug mode 'error'" if device.type == "cuda" else "dispatch mode"}
    except RuntimeError as err:
        return {"status": "failed", "error": str(err).splitlines()[0][:300]}
    finally:
        del forward._run_calls
        pipeline.scatter = scatter
