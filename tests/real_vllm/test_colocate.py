"""Colocate (`use_vllm=True, vllm_mode="colocate"`) against vLLM's CPU build: the engine runs inside the trainer's
process, and every weight sync must bring the trained weights to it.

On that build TRL's sync goes through vLLM's layer-wise reload (`trl_gspo/rollout/colocate_cpu_sync.py`). The test
wraps the sync and, around each call, asks the engine for its log-probs of one fixed prompt + completion: after the
sync they must equal the trainer's own log-probs of that sequence, and after every sync that follows an optimizer step
they must differ from the engine's log-probs before it (the weights reached the engine, and they had moved).
Nothing in these tests is replaced: TRL's engine, its sync and its generation are real. One setting is added: TRL
builds the engine with vLLM's automatic dtype, which turns an fp32 checkpoint into a bf16 engine;
`colocated_engine_dtype` (conftest) passes `dtype` to TRL's `LLM(...)` call so the comparisons run fp32 against fp32
(and one case runs the default, bf16).
"""

import math
import re

import pytest
import torch

from .conftest import colocated_engine_dtype, logprob_tolerance, make_trainer, two_processes

#: Smallest change of the engine's log-probs a sync after an optimizer step must make (learning rate 1e-2 moves the
#: tiny models' log-probs by 0.1-1 nat per step; a sync that does not reach the engine changes them by 0).
MOVED_AT_LEAST = 1e-3
#: A fixed prompt + completion in the saved tokenizer's ids (special tokens left out), scored by engine and trainer.
SEQUENCE = [5, 9, 12, 20, 31, 7, 44, 58, 13, 26, 40, 63, 17, 35]


def _engine_logps(llm) -> torch.Tensor:
    """vLLM's log-prob of each token of SEQUENCE after the first (prompt log-probs of a one-token request)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = llm.generate([{"prompt_token_ids": SEQUENCE}], params, use_tqdm=False)[0]
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], SEQUENCE[1:])])


def _trainer_logps(trainer) -> torch.Tensor:
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


#: The default engine (bf16 from the fp32 checkpoint) against the fp32 trainer: 0.0047 at the first sync on the dense
#: model (2026-11-25); bf16 rounding of weights and activations, not a misplaced weight (those give ~1 nat).
BF16_ENGINE_TOLERANCE = 0.05


@pytest.mark.parametrize(
    "moe, dtype", [(False, "float32"), (True, "float32"), (False, "auto")], ids=["dense", "moe", "dense-bf16-engine"]
)
def test_every_weight_sync_reaches_the_colocated_engine(
    moe, dtype, vllm_model_dir, vllm_moe_model_dir, tmp_path, colocated_engine, monkeypatch
):
    colocated_engine_dtype(dtype, monkeypatch.setattr)
    model_dir = vllm_moe_model_dir if moe else vllm_model_dir
    trainer = make_trainer(
        model_dir,
        None,
        tmp_path / "run",
        vllm_mode="colocate",
        vllm_server_base_url=None,
        steps_per_generation=1,
        max_steps=4,
        vllm_max_model_length=128,
    )
    generation = trainer.vllm_generation
    sync, syncs = generation.sync_weights, []

    def recorded_sync():
        before = _engine_logps(generation.llm)
        sync()
        syncs.append((trainer.state.global_step, before, _engine_logps(generation.llm), _trainer_logps(trainer)))

    generation.sync_weights = recorded_sync
    trainer.train()

    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 4 and all(math.isfinite(row["loss"]) for row in logs)
    assert [step for step, *_ in syncs] == [0, 1, 2, 3]  # one sync before each rollout
    for step, before, after, trainer_logps in syncs:
        # fp32 engine: one forward's rounding (seen: 9.5e-7 dense, 1.9e-6 MoE, 2026-11-25); bf16 engine: its own
        tolerance = (
            logprob_tolerance(trainer, len(SEQUENCE), trainer_logps) if dtype == "float32" else BF16_ENGINE_TOLERANCE
        )
        gap = (after - trainer_logps).abs().max().item()
        assert gap < tolerance, f"sync at step {step}: engine and trainer differ by {gap}"
        moved = (after - before).abs().max().item()
        if step == 0:  # the engine was built from the trainer's initial weights
            assert moved < tolerance, moved
        else:
            assert moved > MOVED_AT_LEAST, f"sync at step {step} left the engine's log-probs as they were ({moved})"


def test_completions_after_a_sync_are_sampled_by_the_synced_weights(
    vllm_model_dir, tmp_path, colocated_engine, monkeypatch
):
    """old_logprobs_source="sampler" in colocate: the log-probs vLLM returns with its completions, after the weights of
    step 2 were loaded, equal the trainer's recomputation with those weights at every completion position (one rollout
    per 2 steps, so pi_old is needed and taken from the sampler)."""
    colocated_engine_dtype("float32", monkeypatch.setattr)
    trainer = make_trainer(
        vllm_model_dir,
        None,
        tmp_path / "run",
        vllm_mode="colocate",
        vllm_server_base_url=None,
        steps_per_generation=2,
        max_steps=2,
        vllm_max_model_length=128,
        old_logprobs_source="sampler",
    )
    trainer.train()
    assert trainer.state.global_step == 2
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert trainer._last_loaded_step == 2  # this rollout synced step 2's weights before generating
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].size(1)
        )
    completion_mask = batch["completion_mask"].bool()
    gap = (batch["old_per_token_logps"] - logps)[completion_mask].abs().max().item()
    tolerance = logprob_tolerance(trainer, ids.size(1), logps[completion_mask])
    assert completion_mask.sum() > 0 and gap <= tolerance, gap


def test_two_processes_each_sync_their_own_engine(vllm_model_dir, tmp_path):
    """2 processes (torchrun, gloo, DDP): TRL builds one engine per rank (`external_launcher`, tensor_parallel_size=1)
    and syncs each from the rank's (DDP-wrapped) model; on both ranks every sync must reach the engine
    (two_processes_colocate.py)."""
    log, returncode = two_processes(
        "two_processes_colocate.py", "--model_dir", vllm_model_dir, "--output_dir", str(tmp_path / "run")
    )
    ranks = sorted(re.findall(r"REAL COLOCATE rank (\d) syncs (\d+) gap/tolerance (\S+) steps (\d+) (OK|BAD)", log))
    assert [rank for rank, *_ in ranks] == ["0", "1"], log[-4000:]
    for rank, syncs, gap, steps, verdict in ranks:
        assert (syncs, steps, verdict) == ("3", "3", "OK"), (rank, syncs, gap, steps, verdict)
    assert returncode == 0, log[-4000:]
