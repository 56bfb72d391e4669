"""R3 (routing replay of the sampler's routes) with vLLM's CPU build: the refusal a user meets, pinned.

vLLM returns routed experts through its AuxOutput connector, which needs Model Runner V2, which needs Triton; the CPU
build has no Triton CPU backend. So on vLLM 0.31.0's CPU build `trl vllm-serve ... --enable-return-routed-experts`
stops at start-up with vLLM's reason, and so does the colocated engine trl-gspo builds for R3. R3's alignment of vLLM's routes (prompt + completion - 1 rows per completion, server and colocate)
is therefore tested with stand-ins only (tests/test_routing_replay.py, tests/helpers/vllm_stand_in.py), until a CUDA build
runs it (`make gpu-check`).
"""

import time

import pytest

from .conftest import make_trainer, running_server

#: vLLM's own words (vllm/config, 0.31.0), without and with the variable the first one asks for.
REFUSALS = {
    "default": ({}, "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1"),
    "VLLM_USE_V2_MODEL_RUNNER=1": ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "Model Runner V2 requires Triton"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_the_cpu_build_refuses_to_return_routed_experts(vllm_moe_model_dir, case):
    env, reason = REFUSALS[case]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"trl vllm-serve exited with 1") as failure:
        with running_server(vllm_moe_model_dir, "--enable-return-routed-experts", env=env, timeout=120):
            pass
    assert reason in str(failure.value), str(failure.value)[-2000:]
    assert time.monotonic() - start < 120


@pytest.fixture(scope="module")
def moe_server(vllm_moe_model_dir):
    """A real `trl vllm-serve` serving the tiny Qwen3-MoE, started as a CPU user must: without the routes flag."""
    with running_server(vllm_moe_model_dir) as (url, _):
        yield url


def test_r3_against_a_server_without_routes_is_refused_before_the_first_step(
    vllm_moe_model_dir, moe_server, tmp_path, no_weight_transfer
):
    """The trainer reads the server's `/server_info` (vLLM's `aux_output_config`) while it is built and names the
    flag, and why the CPU build cannot have it, instead of failing at the first rollout."""
    with pytest.raises(
        ValueError,
        match=rf"the vLLM server at {moe_server} was started without "
        r"--enable-return-routed-experts.*Model Runner V2 requires Triton",
    ):
        make_trainer(vllm_moe_model_dir, moe_server, tmp_path / "r3", routing_replay="R3")


def test_the_moe_model_trains_gspo_over_the_server_without_replay(
    vllm_moe_model_dir, moe_server, tmp_path, no_weight_transfer
):
    """What a CPU user can run: GSPO on the MoE model with native routing (the paper's setting) or R2 (routes
    recorded in the trainer's own pi_old forward), generation by the real engine."""
    trainer = make_trainer(
        vllm_moe_model_dir,
        moe_server,
        tmp_path / "r2",
        routing_replay="R2",
        steps_per_generation=2,
        gradient_accumulation_steps=1,
    )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2 and logs[0]["completions/mean_length"] > 0


def test_r3_in_colocate_stops_while_the_trainer_is_built_with_vllms_reason(
    vllm_moe_model_dir, tmp_path, colocated_engine
):
    """Colocate: trl-gspo builds TRL's engine with `enable_return_routed_experts=True` for R3; the CPU build stops it
    in the trainer's constructor with vLLM's own reason, before any step."""
    start = time.monotonic()
    with pytest.raises(Exception, match=r"AuxOutput Connector requires Model Runner V2"):
        make_trainer(
            vllm_moe_model_dir,
            None,
            tmp_path / "r3",
            vllm_mode="colocate",
            vllm_server_base_url=None,
            routing_replay="R3",
            vllm_max_model_length=128,
        )
    assert time.monotonic() - start < 120
