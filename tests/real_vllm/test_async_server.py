"""Asynchronous generation (`async_generation=True`) against a real `trl vllm-serve` process: the generator thread
sends TRL's own request to vLLM's server ahead of time, and the trainer answers TRL's call with the reply.

The weight push is the test-only no-op of `no_weight_transfer` (NCCL needs CUDA): the server samples with its
initial weights throughout, so `sampled_at` is the schedule's stamp (the optimizer step whose weights would have been
pushed), and the behaviour weight measures the gap between those initial weights and the trainer's. The server samples
with a seed (`generation_kwargs={"seed": ...}`, which TRL's client passes to vLLM): the same request gives the same
completions, which is what lets a resumed run be compared with an uninterrupted one.
"""

import json

import pytest
import torch

from trl_gspo.rollout.async_server import _ServerRequests

from .conftest import make_trainer

STEPS, PER_ROLLOUT, STALENESS = 8, 2, 1  # 4 rollout batches of 16 completions, each trained over 2 steps
#: Largest |resumed - uninterrupted| weight seen: 0.0 (2026-11-25; the replies are the same, the trainer's arithmetic
#: too). The bound allows for a server whose fp32 log-probs differ in the last bits between two identical requests.
RESUME_TOLERANCE = 1e-5


def _async(model_dir, url, out, **overrides):
    settings = dict(
        async_generation=True,
        max_staleness=STALENESS,
        steps_per_generation=PER_ROLLOUT,
        max_steps=STEPS,
        generation_kwargs={"seed": 1234},
        async_generation_timeout=120,
    )
    return make_trainer(model_dir, url, out, **{**settings, **overrides})


@pytest.fixture
def server_replies(monkeypatch):
    """Each reply the generator thread receives from the server: its completion ids, in order."""
    replies, send = [], _ServerRequests.send

    def recording(self, url, kwargs, timeout):
        result = send(self, url, kwargs, timeout)
        replies.append([choice["token_ids"] for choice in json.loads(result["text"])["choices"]])
        return result

    monkeypatch.setattr(_ServerRequests, "send", recording)
    return replies


def _record_batches(trainer):
    """(optimizer step, sampled_at stamps, completion rows without padding) of every micro-batch trained."""
    seen, compute = [], trainer._compute_loss

    def _compute_loss(model, inputs):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"])]
        seen.append((trainer.state.global_step, inputs["sampled_at"].tolist(), rows))
        return compute(model, inputs)

    trainer._compute_loss = _compute_loss
    return seen


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_async_batches_come_from_the_server_within_the_staleness_bound(
    vllm_model_dir, vllm_server, tmp_path, no_weight_transfer, server_replies
):
    trainer = _async(vllm_model_dir, vllm_server, tmp_path / "run")
    batches = _record_batches(trainer)
    trainer.train()
    assert len(server_replies) == STEPS // PER_ROLLOUT  # one request per rollout batch, none past max_steps
    assert len(batches) == STEPS
    for step, stamps, rows in batches:
        rollout = step // PER_ROLLOUT
        # rollout r is sampled at the start of rollout max(r - max_staleness, 0), i.e. optimizer step 2 * that
        assert set(stamps) == {PER_ROLLOUT * max(rollout - STALENESS, 0)}, (step, stamps)
        assert 0 <= step - stamps[0] <= PER_ROLLOUT * (STALENESS + 1) - 1
    for rollout, reply in enumerate(server_replies):  # each rollout batch is the server's reply, every row of it
        trained = [row for step, _, rows in batches if step // PER_ROLLOUT == rollout for row in rows]
        eos = trainer.processing_class.eos_token_id
        served = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in reply]  # TRL masks after the first EOS
        assert sorted(trained) == sorted(served), rollout
    logs = [row for row in trainer.state.log_history if "async/staleness/max" in row]
    assert max(row["async/staleness/max"] for row in logs) == PER_ROLLOUT * (STALENESS + 1) - 1
    weights = [row["async/behaviour_weight/mean"] for row in logs if "async/behaviour_weight/mean" in row]
    assert weights and all(w > 0 for w in weights)  # the decoupled correction used the server's log-probs


def test_async_resume_with_a_generation_in_flight_ends_as_the_uninterrupted_run(
    vllm_model_dir, vllm_server, tmp_path, no_weight_transfer, server_replies
):
    """Checkpoint at step 3 (mid rollout batch 1): batch 2, sent to the server at step 2, is in flight and saved with
    the checkpoint; the resumed run trains on it without asking again, asks the server for batch 3 only, and ends
    where the uninterrupted run ends."""
    straight = _async(vllm_model_dir, vllm_server, tmp_path / "straight", save_strategy="steps", save_steps=3)
    start = _weights(straight)
    straight.train()
    final = _weights(straight)
    assert len(server_replies) == 4
    state = torch.load(tmp_path / "straight" / "checkpoint-3" / "gspo_rollout_state_rank0.pt", weights_only=True)
    assert sorted(state["source"]["jobs"]) == [2] and state["source"]["jobs"][2]["sampled_at"] == 2

    server_replies.clear()
    resumed = _async(vllm_model_dir, vllm_server, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert resumed.state.global_step == STEPS
    assert len(server_replies) == 1  # batch 3; batch 2 came from the checkpoint
    gap = max((p.detach() - final[n]).abs().max().item() for n, p in resumed.model.named_parameters())
    assert gap <= RESUME_TOLERANCE, gap
    moved = max((p - start[n]).abs().max().item() for n, p in final.items())
    assert moved > 100 * RESUME_TOLERANCE  # training moved the weights: the comparison above is not trivially met
