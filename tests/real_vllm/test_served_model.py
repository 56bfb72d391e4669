"""A vLLM server serving another model than the trainer's is refused while the trainer is built, before any step
(trl_gspo/rollout/served_model.py): the real server, the real client, trainers built from other tiny models."""

import logging

import pytest

from trl_gspo.rollout import served_model
from trl_gspo.rollout.served_model import ServedModelMismatch

from .conftest import make_trainer, save_served_model


def test_a_server_with_another_vocabulary_is_refused(vllm_server, tmp_path, no_weight_transfer):
    other = save_served_model(tmp_path / "vocab96", vocab=96)
    with pytest.raises(
        ServedModelMismatch,
        match=rf"server at {vllm_server} serves .*, whose vocab_size is 64; the "
        r"trainer's model .* has vocab_size=96",
    ):
        make_trainer(other, vllm_server, tmp_path / "run")


def test_a_server_with_another_architecture_is_refused(vllm_moe_model_dir, vllm_server, tmp_path, no_weight_transfer):
    """The trainer's tiny Qwen3-MoE against the server's dense Qwen3: same tokenizer and vocabulary."""
    with pytest.raises(
        ServedModelMismatch,
        match=r"whose model_type is 'qwen3'; the trainer's model .* has "
        r"model_type='qwen3_moe'",
    ):
        make_trainer(vllm_moe_model_dir, vllm_server, tmp_path / "run")


def test_a_server_with_another_tokenizer_is_refused(vllm_server, tmp_path, no_weight_transfer):
    """Same config as the served model, a tokenizer of the same size with other words: only the probe can tell."""
    other = save_served_model(tmp_path / "other-words", word="v")
    with pytest.raises(
        ServedModelMismatch,
        match=r"whose tokenizer differs from the trainer's: a probe text of \d+ "
        r"trainer tokens gives ids \[3, 3, 3",
    ):  # (3: <unk> there)
        make_trainer(other, vllm_server, tmp_path / "run")


def test_the_served_model_is_accepted_and_an_unreadable_config_is_logged(
    vllm_model_dir, vllm_server, tmp_path, no_weight_transfer, monkeypatch, caplog
):
    make_trainer(vllm_model_dir, vllm_server, tmp_path / "same")  # the served model itself: accepted
    monkeypatch.setattr(served_model, "_served_config", lambda name: None)  # as for a server on another machine
    with caplog.at_level(logging.WARNING, logger="trl_gspo.rollout.served_model"):
        make_trainer(vllm_model_dir, vllm_server, tmp_path / "unreadable")
    assert f"vLLM server at {vllm_server} serves" in caplog.text and "its tokenizer is" in caplog.text
    other = save_served_model(tmp_path / "other-words", word="v")
    with pytest.raises(ServedModelMismatch, match="tokenizer differs"):  # the probe still runs
        make_trainer(other, vllm_server, tmp_path / "run")
