import os

# Tiny models on 2 CPU cores: one thread keeps timings stable and avoids oversubscription with 2 processes.
# TRL_GSPO_TEST_THREADS overrides it (.ci/numeric_matrix.sh runs the numeric tests at 1 and 2 threads: another thread
# count cuts torch's sums into other partial sums, which the tolerances must allow).
THREADS = int(os.environ.get("TRL_GSPO_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)


def pytest_terminal_summary(terminalreporter):
    """One line a failure report carries: the kernels (torch's CPU capability: DEFAULT, AVX2, AVX512; the
    ATEN_CPU_CAPABILITY variable picks a lower one) and the thread count the numbers were computed with."""
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    terminalreporter.write_line(
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()} "
        f"(ATEN_CPU_CAPABILITY={requested}), {torch.get_num_threads()} thread(s)"
    )


@pytest.fixture(scope="session")
def tokenizer():
    from trl_gspo.testing import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny dense Qwen3 + tokenizer saved once per session, loadable with from_pretrained."""
    from trl_gspo.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    from trl_gspo.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), moe=True)


@pytest.fixture(scope="session")
def trainer_factory(tokenizer):
    """The tests' trainers (tests/helpers/trainers.py `build_trainer`) with the shared tokenizer fixture:
    `trainer_factory(defaults, output_dir=..., **settings)`, `defaults` a test file's dict of `build_trainer` arguments
    (reward, prompts, config fields), each of which `settings` may replace."""
    from helpers.trainers import build_trainer

    def make(defaults=None, /, output_dir=None, **settings):
        return build_trainer(output_dir, tokenizer=tokenizer, **{**(defaults or {}), **settings})

    return make
