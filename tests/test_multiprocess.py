"""Real 2-process CPU runs of the demo under `accelerate launch` with the SHIPPED accelerate configs.

Each run uses the config file as shipped plus one launcher flag, `--num_processes 2` (the files say 8 GPUs). The
files ask for bf16; without CUDA the CLI turns mixed precision off and says so in one line (`recipe_inputs.reconcile_precision`),
which each rank confirms by reporting accelerate's mixed precision. The demo's `use_cpu=True` keeps the tensors on
CPU; the distributed type (DDP / DeepSpeed ZeRO-2 / ZeRO-3) comes from the config file, and each rank reports the one
it ran under. Processes talk over gloo. `tests/helpers/cpu_launch.py` is the CLI with DeepSpeed's
shared-memory all-reduce kernel turned off (it would be compiled on first use, ~45 s on a fresh machine).

What the tests hold a run to: both ranks get through training, saving and `trainer.end()`; the saved model loads,
has every weight at full shape (ZeRO-3 must gather its shards on save), and differs from the initial weights.
"""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.ports import free_port

from trl_gspo.cli.shipped import SHIPPED

ROOT = Path(__file__).resolve().parent.parent
# Seen on these machines: after a rank has finished (and printed its marker), libstdc++ can abort it at interpreter
# exit with this message. That is a teardown crash, not a training failure: tolerated only when every rank printed
# its finish marker and the saved model checks out.
EXIT_ABORT = "terminate called without an active exception"
# Every test here launches 2 processes: one launch at a time, in one worker (conftest.py).
pytestmark = pytest.mark.launch


def _launch(config: str, output_dir: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    demo = (
        "demo",
        "--config",
        "demo",
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "2",
        "--num_train_prompts",
        "64",
    )
    return _launch_command(config, *demo, "--num_eval_prompts", "16", "--logging_steps", "1", *extra, timeout=timeout)


def _launch_command(
    config: str, *command: str, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`tests/helpers/cpu_launch.py COMMAND ...` in 2 processes under the shipped accelerate `config`; `env` over
    this process's environment."""
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(SHIPPED["accelerate config"] / config),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests" / "helpers" / "cpu_launch.py"),
        *command,
        "--disable_tqdm",
        "true",
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, distributed_type, extra",
    [
        ("multi_gpu.yaml", ("MULTI_CPU",), ()),
        # max_grad_norm other than 1.0: DeepSpeed's gradient_clipping is left to it (a fixed value fails at start-up)
        ("zero2.yaml", ("DEEPSPEED",), ("--max_grad_norm", "0.5")),
        ("zero3.yaml", ("DEEPSPEED",), ()),
        ("multi_gpu.yaml", ("MULTI_CPU",), ("--moe", "true", "--routing_replay", "R2")),
        # packed forwards (forward/padding.py): each rank packs its own rows, ZeRO-3 ranks still make the same model calls
        # (longer completions, so rows end at different lengths and the ranks' packed widths differ)
        ("zero3.yaml", ("DEEPSPEED",), ("--padding_free", "true", "--max_completion_length", "12")),
        # shared-prefix forwards with whole-group mini-batches: every pass (pi_old and loss) runs each prompt once
        ("zero3.yaml", ("DEEPSPEED",), ("--shared_prefix", "true", "--group_minibatches", "true")),
        # asynchronous generation (rollout/async_rollouts.py): a generator copy per rank, weights pushed (ZeRO-3: gathered) on
        # every rank's main thread at the same sync points
        # (one step per rollout batch, so the second step trains on a batch sent after the first push)
        ("multi_gpu.yaml", ("MULTI_CPU",), ("--async_generation", "true", "--steps_per_generation", "1")),
        (
            "zero3.yaml",
            ("DEEPSPEED",),
            ("--async_generation", "true", "--max_staleness", "2", "--steps_per_generation", "1"),
        ),
        # both: the generator generates sampling rounds ahead, the ranks fill each batch on the gathered rewards
        (
            "multi_gpu.yaml",
            ("MULTI_CPU",),
            ("--async_generation", "true", "--dynamic_sampling", "true", "--steps_per_generation", "1"),
        ),
        # the KL reference model under the default layouts, inside DeepSpeed's ZeRO-3 engine (TRL prepares it there)
        ("zero3.yaml", ("DEEPSPEED",), ("--beta", "0.04", "--max_completion_length", "12")),
    ],
    ids=[
        "ddp",
        "zero2",
        "zero3",
        "ddp-moe-r2",
        "zero3-packed",
        "zero3-shared-prefix",
        "ddp-async",
        "zero3-async",
        "ddp-async-dynamic-sampling",
        "zero3-beta",
    ],
)
def test_two_process_demo_with_shipped_config(tmp_path, config, distributed_type, extra):
    from transformers import AutoModelForCausalLM

    from trl_gspo.cli.demo import build_demo_model

    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    from trl_gspo.forward import fused_head

    if ("--padding_free" in extra or "--shared_prefix" in extra) and not fused_head.available():
        pytest.skip("TRL < 1.15: no fused log-prob head, padding_free=True is refused (tests/test_padding.py)")
    out = tmp_path / "run"
    result = _launch(config, out, *extra)
    log = result.stdout + result.stderr
    # Ranks share the launcher's pipes, so a marker may not start its own line: match anywhere.
    markers = re.findall(
        r"cpu_launch: rank (\d) finished with code (-?\d+) as (\w+ x\d) precision (no|fp16|bf16|fp8)", log
    )
    assert len(markers) == 2, f"expected both ranks to finish, got {markers}\n{log[-4000:]}"
    assert sorted((rank, code) for rank, code, _, _ in markers) == [("0", "0"), ("1", "0")], markers
    assert all(how in {f"{t} x2" for t in distributed_type} for _, _, how, _ in markers), markers
    assert [precision for *_, precision in markers] == ["no", "no"], markers  # fp32, though the file says bf16
    note = "no CUDA device: mixed precision off (no autocast), ignoring mixed_precision='bf16' from accelerate launch"
    assert log.count(note) == 1, log[-4000:]  # said once, by rank 0
    if result.returncode != 0:  # see EXIT_ABORT: acceptable only as a teardown abort after a complete run
        assert EXIT_ABORT in log, f"launcher exited {result.returncode}\n{log[-4000:]}"

    saved = AutoModelForCausalLM.from_pretrained(out)
    initial, _ = build_demo_model(seed=0, moe="--moe" in extra)
    saved_state, initial_state = saved.state_dict(), initial.state_dict()
    assert saved_state.keys() == initial_state.keys()
    changed = 0
    for name, tensor in saved_state.items():
        assert tensor.shape == initial_state[name].shape, f"{name}: {tuple(tensor.shape)} (ZeRO-3 shard saved?)"
        assert torch.isfinite(tensor).all(), name
        changed += not torch.equal(tensor, initial_state[name])
    assert changed > len(saved_state) // 2, "the saved weights look untrained"
    if "--beta" in extra:  # the folder TRL loaded the reference model from: whole tensors, not ZeRO-3 shards
        reference = AutoModelForCausalLM.from_pretrained(out / "initial-model").state_dict()
        assert {n: t.shape for n, t in reference.items()} == {n: t.shape for n, t in initial_state.items()}
        assert all(t.abs().sum() > 0 for n, t in reference.items() if n.endswith("proj.weight"))
        assert any(not torch.equal(reference[n], t) for n, t in saved_state.items())  # the policy moved away from it
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2]
    if "R2" in extra:  # both steps replayed every completion token's route, pooled over the two ranks
        assert [float(r["moe/replay/coverage"]) for r in rows] == [1.0, 1.0]
        assert float(rows[0]["moe/routing_shift"]) == 0.0  # step 1: on-policy mini-batch
    if "--shared_prefix" in extra:  # prompts ran once for their completions on both ranks' steps
        assert all(float(r["throughput/prompt_tokens_saved_per_step"]) > 0 for r in rows)
    if "--dynamic_sampling" in extra:  # filled from rounds generated ahead: within the bound, every trained group
        assert all(float(r["dynamic_sampling/rounds"]) >= 1 for r in rows)  # with reward spread (or padding, logged)
        assert all(float(r["async/staleness/max"]) <= 1.0 for r in rows)
        assert all(float(r["dynamic_sampling/batch_fill"]) > 0 for r in rows)
    elif "--async_generation" in extra:  # both steps trained on batches generated ahead, pooled over the two ranks
        assert [float(r["async/staleness/max"]) for r in rows] == [0.0, 1.0]  # step 2's batch: weights of step 0
        assert all(float(r["async/behaviour_weight/mean"]) > 0 for r in rows)
    if "--padding_free" in extra:  # packing ran and removed padding TRL would have computed
        assert all(
            float(r["throughput/padding_fraction"]) < float(r["throughput/stock_padding_fraction"]) for r in rows
        )


@pytest.mark.slow
def test_zero2_keeps_fp32_master_weights_of_a_bf16_model(tmp_path, tiny_model_dir):
    """A recipe's `dtype: bfloat16` at learning rate 1e-6 under the shipped ZeRO-2 config, 2 CPU processes, one
    optimizer step of 2 accumulated micro-batches: recognised as keeping DeepSpeed's fp32 master weights (no upcast,
    no weights_changed warning), the fp32 partitions move (weights_changed, each rank's shard), the precision line
    says what runs, the model is saved in bf16, and accelerate and DeepSpeed agree on the accumulation (no mismatch
    warning) without torch's deprecation warnings of DeepSpeed's collectives."""
    pytest.importorskip("deepspeed")
    from helpers.recipes import train_recipe
    from safetensors.torch import load_file

    from trl_gspo.cli.demo import make_demo_dataset
    from trl_gspo.common.engine import DEEPSPEED_COLLECTIVE_DEPRECATIONS

    data = tmp_path / "copy.jsonl"
    make_demo_dataset(32).to_json(str(data))
    out = tmp_path / "run"
    recipe = train_recipe(
        tmp_path,
        str(tiny_model_dir),
        str(data),
        output_dir=str(out),
        use_cpu=True,  # as a CPU try of a recipe runs (without it, transformers fills DeepSpeed's batch for 1 process)
        dtype="bfloat16",
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        logging_steps=1,
        console="stock",
    )
    result = _launch_command("zero2.yaml", "train", "--config", recipe)
    log = result.stdout + result.stderr
    markers = re.findall(r"cpu_launch: rank (\d) finished with code (-?\d+) as (\w+ x\d)", log)
    assert sorted(markers) == [("0", "0", "DEEPSPEED x2"), ("1", "0", "DEEPSPEED x2")], log[-4000:]
    line = (
        "precision: weights bfloat16, compute bfloat16 (no autocast), master weights: DeepSpeed ZeRO-2's fp32 copy; "
        "final save writes bfloat16"
    )
    assert log.count(line) == 1, log[-4000:]
    assert "weights_changed=" not in log and "low_precision_weights=" not in log  # no warning, no upcast
    changed = [float(v) for v in re.findall(r"'weights_changed': '?([0-9.e-]+)", log)]
    assert len(changed) == 1 and changed[0] >= 0.9, log[-4000:]
    assert "Gradient accumulation steps mismatch" not in log
    assert not re.search(DEEPSPEED_COLLECTIVE_DEPRECATIONS, log)
    saved = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


@pytest.mark.slow
def test_two_ranks_train_the_copy_rank_0_resolved(tmp_path, tiny_model_dir):
    """A recipe naming a Hub id the model store knows (SmolLM2), 2 processes under the shipped DDP config, offline:
    rank 0 resolves it to the prepared copy in its cache (a tiny model stands in for it) and tells rank 1, whose
    cache is empty (resolving on its own, it would stop with "no prepared copy"). Both ranks train, and the output's
    `model_source.json` names the copy, with the SHA-256 its provenance file gives."""
    import json
    import shutil

    from helpers.recipes import train_recipe

    from trl_gspo.cli.demo import make_demo_dataset
    from trl_gspo.cli.run_model import RECORD
    from trl_gspo.common.model_store import PROVENANCE, SMOLLM2, prepared_folder
    from trl_gspo.common.prepared_copy import record_files

    cache, empty = tmp_path / "cache", tmp_path / "empty-cache"
    copy = prepared_folder(SMOLLM2, cache)
    shutil.copytree(tiny_model_dir, copy)
    files = record_files(copy)  # as prepare records them: the copy is checked against them before use
    weights = files["model.safetensors"]["sha256"]
    record = {"source": "a tiny stand-in", "weights_sha256": weights, "files": files}
    (copy / PROVENANCE).write_text(json.dumps(record))
    empty.mkdir()
    data = tmp_path / "copy.jsonl"
    make_demo_dataset(32).to_json(str(data))
    out = tmp_path / "run"
    recipe = train_recipe(tmp_path, SMOLLM2, str(data), output_dir=str(out), max_steps=1, logging_steps=1)
    env = {
        "TRL_GSPO_CACHE": str(cache),
        "HF_HUB_CACHE": str(tmp_path / "hub-cache"),  # no Hub copy to fall back on
        "CPU_LAUNCH_OTHER_RANKS_ENV": json.dumps({"TRL_GSPO_CACHE": str(empty)}),
    }
    result = _launch_command("multi_gpu.yaml", "train", "--config", recipe, env=env)
    log = result.stdout + result.stderr
    markers = re.findall(r"cpu_launch: rank (\d) finished with code (-?\d+) as (\w+ x\d)", log)
    assert sorted(markers) == [("0", "0", "MULTI_CPU x2"), ("1", "0", "MULTI_CPU x2")], log[-4000:]
    assert "no prepared copy" not in log, log[-4000:]
    assert json.loads((out / RECORD).read_text()) == {"model": SMOLLM2, "source": "gguf", "sha256": weights}


def _started_apart(command: list[str], envs: list[dict], timeout: int = 120) -> list[tuple[int, str, float]]:
    """`tests/helpers/cpu_launch.py COMMAND ...` as 2 processes started directly, each with its environment over this
    one's, as srun or mpirun start them (no launcher agent that stops the other ranks when one fails): each rank's
    (exit code, output, seconds until it ended); a rank still running after `timeout` s is killed (code -9)."""
    import time

    base = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    script = [sys.executable, str(ROOT / "tests" / "helpers" / "cpu_launch.py"), *command, "--disable_tqdm", "true"]
    start, ranks = time.monotonic(), []
    for rank, env in enumerate(envs):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **env}
        ranks.append(subprocess.Popen(script, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    ended = []
    for process in ranks:
        try:
            out, _ = process.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        ended.append((process.returncode, out.decode(errors="replace"), time.monotonic() - start))
    return ended


def _prepared_stand_in(cache: Path, model_dir, provenance: str | None = None) -> Path:
    """A tiny model as SmolLM2's prepared copy in `cache`, its files recorded as prepare records them (the copy is
    checked against them before use), or `provenance` written as is."""
    import json
    import shutil

    from trl_gspo.common.model_store import PROVENANCE, SMOLLM2, prepared_folder
    from trl_gspo.common.prepared_copy import record_files

    copy = prepared_folder(SMOLLM2, cache)
    shutil.copytree(model_dir, copy)
    files = record_files(copy)
    record = {"source": "a stand-in", "weights_sha256": files["model.safetensors"]["sha256"], "files": files}
    (copy / PROVENANCE).write_text(provenance if provenance is not None else json.dumps(record))
    return copy


@pytest.mark.slow
def test_two_nodes_each_resolve_their_own_copy(tmp_path, tiny_model_dir):
    """Two processes standing in for two nodes (each local rank 0, each with its own cache, as node-local disks are):
    each resolves the copy its own cache holds and says so, and both train; the output's record names the copy of
    the node that saves (rank 0's)."""
    import json

    from helpers.recipes import train_recipe

    from trl_gspo.cli.demo import make_demo_dataset
    from trl_gspo.cli.run_model import RECORD
    from trl_gspo.common.model_store import PROVENANCE, SMOLLM2

    copies = [_prepared_stand_in(tmp_path / f"node-{n}", tiny_model_dir) for n in range(2)]
    data = tmp_path / "copy.jsonl"
    make_demo_dataset(32).to_json(str(data))
    out = tmp_path / "run"
    recipe = train_recipe(tmp_path, SMOLLM2, str(data), output_dir=str(out), max_steps=1, logging_steps=1)
    envs = [
        {
            "LOCAL_RANK": "0",
            "TRL_GSPO_CACHE": str(tmp_path / f"node-{n}"),
            "HF_HUB_CACHE": str(tmp_path / f"node-{n}-hub"),
            "HF_DATASETS_CACHE": str(tmp_path / f"node-{n}-datasets"),
        }
        for n in range(2)
    ]
    ranks = _started_apart(["train", "--config", recipe], envs, timeout=240)
    for rank, ((code, log, _), copy) in enumerate(zip(ranks, copies)):
        assert code == 0 and f"cpu_launch: rank {rank} finished with code 0" in log, log[-4000:]
        assert f"the prepared copy in {copy}" in log, log[-4000:]  # its node's copy, said on its node
    weights = json.loads((copies[0] / PROVENANCE).read_text())["weights_sha256"]
    assert json.loads((out / RECORD).read_text()) == {"model": SMOLLM2, "source": "gguf", "sha256": weights}


@pytest.mark.slow
def test_a_fault_on_the_resolving_rank_stops_every_rank_at_once(tmp_path, tiny_model_dir):
    """Rank 0 resolves for its node and meets a corrupt provenance file (a JSON error, not a missing copy). Started
    as srun starts ranks, rank 1 is waiting for rank 0's answer in a collective (until ddp_timeout, 30 minutes, where
    rank 0's process lives on; a collective's error where it exits): both stop within seconds with the same one line
    naming the node, and no traceback."""
    import socket

    from helpers.recipes import train_recipe

    from trl_gspo.common.model_store import SMOLLM2

    _prepared_stand_in(tmp_path / "cache", tiny_model_dir, provenance="{not json")
    (tmp_path / "data.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    recipe = train_recipe(tmp_path, SMOLLM2, str(tmp_path / "data.jsonl"), max_steps=1)
    env = {"TRL_GSPO_CACHE": str(tmp_path / "cache"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    ranks = _started_apart(["train", "--config", recipe], [env, env], timeout=90)
    lines = []
    for code, log, _ in ranks:
        said = [line for line in log.splitlines() if "JSONDecodeError" in line]
        assert code == 2 and len(said) == 1 and "Traceback" not in log, log[-4000:]
        lines.append(said[0])
    assert lines[0] == lines[1] and f"{socket.gethostname()}, rank 0" in lines[0]
    assert abs(ranks[0][2] - ranks[1][2]) < 20, [seconds for *_, seconds in ranks]
