import fcntl
import os
import resource

# Tiny models on 2 CPU cores: one thread per process keeps timings stable and avoids oversubscription, with `make test`
# running one worker process per core (pytest-xdist) and the tests that launch 2 processes.
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (make test): one worker per core this process may run on, over the threads each one runs. pytest-xdist
    would count the machine's physical cores (psutil), more than a container or `taskset` may give."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own override
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // THREADS)


# Tests that start several processes (accelerate launch, torch.distributed.run) carry `@pytest.mark.launch`. Two of
# them at once would put 4 training processes on a 2-core machine, so under `make test`'s pytest-xdist workers they
# take a lock first (one per run, in the folder that holds the workers' temporary folders): one launch at a time,
# while the other workers run the rest. Each launch also binds its own free rendezvous port (helpers/ports.py), so no launch collides with another
# job's. (pytest-xdist's own `xdist_group` marks a test by rewriting its node id, which pytest 9's structured node ids
# no longer take: such groups are silently ignored.)
@pytest.fixture(autouse=True)
def _one_launch_at_a_time(request):
    if "PYTEST_XDIST_WORKER" not in os.environ or request.node.get_closest_marker("launch") is None:
        yield
        return
    run_folder = request.getfixturevalue("tmp_path_factory").getbasetemp().parent  # .../pytest-N/popen-gwX
    with open(run_folder / "launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the worker dies
        yield


def pytest_collection_modifyitems(config, items):
    """In pytest-xdist's workers, the launches first: `--dist worksteal` hands the first worker the first share of the
    tests, so the launches run one after another there from the start (the lock rarely waits), and a module's tests
    stay together in one worker, which builds its module-scoped runs once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("launch") is None)


# Each test's cost in CPU seconds: its process's and those of the processes it launched and waited for, setup and
# teardown included (a module-scoped fixture is charged to the first test that uses it). On a machine shared with
# other jobs, wall-clock durations (`--durations`) grow with the load; CPU seconds stay what the test needs. The
# figure rides on the teardown report's user_properties, which pytest-xdist carries from its workers.
CPU_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "teardown" and CPU_START in item.stash:
        report.user_properties.append(("cpu_seconds", round(_cpu_seconds() - item.stash[CPU_START], 3)))


def pytest_runtest_logreport(report):
    cpu = dict(report.user_properties).get("cpu_seconds") if report.when == "teardown" else None
    if cpu is not None:
        CPU_COSTS[report.nodeid] = cpu


CPU_COSTS: dict[str, float] = {}


def _kernels_and_threads() -> str:
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    return (
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()} "
        f"(ATEN_CPU_CAPABILITY={requested}), {torch.get_num_threads()} thread(s)"
    )


# Under pytest-xdist (make test) the numbers come from the workers: each one reports its own line to the controller,
# which prints it once (workers write no terminal summary).
WORKER_LINES: dict[str, str] = {}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # inside a pytest-xdist worker
        session.config.workeroutput["kernels_and_threads"] = _kernels_and_threads()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    line = getattr(node, "workeroutput", {}).get("kernels_and_threads")
    if line:
        WORKER_LINES[node.gateway.id] = line


@pytest.hookimpl(trylast=True)  # after pytest's own sections: the line closes the report, before the counts
def pytest_terminal_summary(terminalreporter, config):
    """With `--durations=N`: the N tests that cost the most CPU seconds, and the total. Then one line a failure
    report carries: the kernels (torch's CPU capability: DEFAULT, AVX2, AVX512; the ATEN_CPU_CAPABILITY variable
    picks a lower one) and the thread count the numbers were computed with, in each worker process."""
    shown = config.getoption("durations", None)
    if shown is not None and CPU_COSTS:
        slowest = sorted(CPU_COSTS.items(), key=lambda kv: -kv[1])[: shown or None]
        terminalreporter.write_sep(
            "=", f"{len(slowest)} costliest tests in CPU seconds (setup, call, teardown, children)"
        )
        for nodeid, cpu in slowest:
            terminalreporter.write_line(f"{cpu:9.1f} s  {nodeid}")
        terminalreporter.write_line(f"{sum(CPU_COSTS.values()):9.1f} s  in all, {len(CPU_COSTS)} tests")
    lines = sorted(set(WORKER_LINES.values()))
    if not lines:  # no workers: this process ran the tests
        terminalreporter.write_line(_kernels_and_threads())
    elif len(lines) == 1:
        terminalreporter.write_line(f"{lines[0]} in each of {len(WORKER_LINES)} worker process(es)")
    else:
        terminalreporter.write_line("; ".join(f"{worker}: {line}" for worker, line in sorted(WORKER_LINES.items())))


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
