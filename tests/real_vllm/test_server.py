"""GSPO against a real `trl vllm-serve` process (vLLM's CPU build), over HTTP with TRL's own client.

The one part replaced here: TRL's weight transfer to the server (`VLLMClient.init_communicator` /
`update_named_params`) runs on vLLM's NCCL engine and raises `NotImplementedError` off CUDA. `no_weight_transfer`
makes both no-ops for these tests (test-only: the server keeps serving its initial weights, so every comparison
below is made before the first optimizer step, where those are the trainer's weights). Prompts, generation,
log-probs, batching and the server itself are real.
"""

import math
import re
import time

import pytest
import torch

from trl_gspo.rounding import rounding_bound

from .conftest import free_port, logprob_tolerance, make_trainer, running_server, stop, two_processes

# |vLLM log-prob - trainer log-prob| per token, fp32 server vs fp32 trainer, same weights: within one forward's
# rounding (conftest.logprob_tolerance; seen: 1.2e-6 over 326 completion tokens, 8 ended by EOS and 24 cut,
# 2026-11-25); the same numbers shifted by one position differ by ~1 nat.


def _recomputed(trainer, batch):
    """The trainer's own log-probs of the batch's completions (its forward pipeline, no grad)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].size(1)
        )
    return logps


def test_server_mode_trains_gspo_over_http(vllm_model_dir, vllm_server, tmp_path, no_weight_transfer):
    trainer = make_trainer(vllm_model_dir, vllm_server, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2 and all(math.isfinite(row["loss"]) for row in logs)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    assert logs[0]["completions/mean_length"] > 0  # completions came back from the server


def test_sampler_logprobs_line_up_with_the_trainer_per_position(
    vllm_model_dir, vllm_server, tmp_path, no_weight_transfer
):
    """old_logprobs_source="sampler": pi_old is vLLM's per-token log-prob. At the first rollout (the server's weights
    are the trainer's) it must equal the trainer's recomputation at every completion position, for completions that
    end in EOS and for truncated ones, with left-padded prompts of different lengths."""
    trainer = make_trainer(vllm_model_dir, vllm_server, tmp_path / "run", old_logprobs_source="sampler")
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    mask = batch["completion_mask"].bool()
    ended = (batch["completion_ids"] == trainer.processing_class.eos_token_id).any(1)
    prompt_lengths = batch["prompt_mask"].sum(1)
    assert ended.any() and (~ended).any(), "the batch needs completions that end and completions that are cut"
    assert len(set(prompt_lengths.tolist())) > 1 and (batch["prompt_mask"][:, 0] == 0).any()  # left padding
    sampler = batch["old_per_token_logps"]
    recomputed = _recomputed(trainer, batch)
    gap = (sampler - recomputed).abs()[mask]
    tolerance = logprob_tolerance(trainer, mask.size(1) + batch["prompt_ids"].size(1), recomputed[mask])
    assert gap.max() <= tolerance, f"max |vLLM - trainer| = {gap.max():.3g}"
    # A one-position shift would not pass: the same numbers shifted by one differ by far more than the tolerance.
    shifted = (sampler[:, 1:] - recomputed[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
    assert shifted.max() > 100 * tolerance


def test_length_normalised_correction_equals_a_naive_recomputation(
    vllm_model_dir, vllm_server, tmp_path, no_weight_transfer
):
    """TRL's vLLM correction with `vllm_importance_sampling_length_normalized` (on for the sequence levels): per
    sequence, exp of the mean over its completion tokens of (trainer pi_old - vLLM log-prob), truncated to TRL's
    range; recomputed here with a loop from the same numbers the batch carries."""
    trainer = make_trainer(
        vllm_model_dir, vllm_server, tmp_path / "run", vllm_importance_sampling_mode="sequence_truncate"
    )
    assert trainer.args.vllm_importance_sampling_length_normalized
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    old, sampling, mask = batch["old_per_token_logps"], batch["sampling_per_token_logps"], batch["completion_mask"]
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    # fp32: a mean over the completion and an exp, of differences of log-probs as large as the largest
    rel = rounding_bound(torch.float32, old.size(1) + 3) * old[mask.bool()].abs().max().item()
    for i in range(old.size(0)):
        diffs = [float(old[i, t] - sampling[i, t]) for t in range(old.size(1)) if mask[i, t]]
        expected = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        expected = min(max(expected, low if low is not None else -math.inf), high if high is not None else math.inf)
        assert float(batch["importance_sampling_ratio"][i].squeeze()) == pytest.approx(expected, rel=rel), i
    tolerance = logprob_tolerance(trainer, old.size(1) + batch["prompt_ids"].size(1), old[mask.bool()])
    assert (old - sampling).abs()[mask.bool()].max() <= tolerance  # pi_old and vLLM agree at this step


def test_two_processes_share_one_server_each_row_with_its_own_prompt(vllm_model_dir, vllm_server, tmp_path):
    """2 processes (torchrun, gloo): the client on the main process only, every process's prompts in one request, the
    completions broadcast back; each rank's first-rollout log-probs from the server equal its own recomputation per
    position (two_processes.py), which a row paired with another row's prompt would not."""
    log, returncode = two_processes(
        "two_processes.py", "--model_dir", vllm_model_dir, "--url", vllm_server, "--output_dir", str(tmp_path / "run")
    )
    ranks = sorted(
        re.findall(r"REAL SERVER rank (\d) (client|no client) rows (\d+) gap (\S+) steps (\d+) (OK|BAD)", log)
    )
    assert [(rank, client) for rank, client, *_ in ranks] == [("0", "client"), ("1", "no client")], log[-4000:]
    for rank, _, rows, gap, steps, verdict in ranks:
        assert rows == "16" and steps == "2" and verdict == "OK", (rank, rows, gap, steps, verdict)
    assert returncode == 0, log[-4000:]


# ------------------------------------------------------------------------------------------------ faults
def test_a_server_that_never_becomes_ready_gives_a_clear_error_at_its_timeout(
    vllm_model_dir, tmp_path, no_weight_transfer
):
    # no_weight_transfer: on CPU the trainer refuses TRL's NCCL push before connecting (tests/real_vllm/test_demo.py)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(OSError, match=rf"can't be reached at {url} after 5 seconds"):  # TRL's client says so
        make_trainer(vllm_model_dir, url, tmp_path / "run", vllm_server_timeout=5)
    assert time.monotonic() - start < 60


def test_a_server_killed_mid_run_stops_the_trainer_naming_the_server(vllm_model_dir, tmp_path, no_weight_transfer):
    """The server dies after the first rollout: the next one fails within 30 s with an error naming its URL, and the
    checkpoint saved before is complete."""
    from trl_gspo.guards.checkpointing import checkpoint_problem
    from trl_gspo.rollout.pipeline import VLLMServerError

    with running_server(vllm_model_dir) as (url, proc):
        trainer = make_trainer(
            vllm_model_dir,
            url,
            tmp_path / "run",
            max_steps=8,
            save_strategy="steps",
            save_steps=4,
            steps_per_generation=4,
            gradient_accumulation_steps=1,
        )
        original = trainer._save_checkpoint

        def save_then_kill(*args, **kwargs):
            original(*args, **kwargs)
            stop(proc)  # the server goes away right after the checkpoint of step 4

        trainer._save_checkpoint = save_then_kill
        start = time.monotonic()
        with pytest.raises(VLLMServerError, match=rf"vLLM server at {url} stopped answering") as failure:
            trainer.train()
        elapsed = time.monotonic() - start
    assert trainer.state.global_step == 4, failure.value
    assert elapsed < 30 + 60, elapsed  # the steps before the kill, then at most 30 s to fail
    assert checkpoint_problem(str(tmp_path / "run" / "checkpoint-4")) is None
