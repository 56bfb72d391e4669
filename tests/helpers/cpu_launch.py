"""Entry point the multi-process CPU tests launch: the `trl-gspo` CLI, minus DeepSpeed's shared-memory all-reduce.

DeepSpeed's CPU accelerator compiles a C++ shared-memory collective (`deepspeed_shm_comm`) the first time a
process group starts (~45 s on 2 cores, on every fresh CI machine). It only speeds up CPU all-reduce; without it
DeepSpeed uses plain gloo collectives, as it does on non-Linux platforms. Skipping it keeps the suite fast and
changes nothing the tests check (ZeRO partitioning, batch-size bookkeeping, saving).
"""

import importlib
import json
import os
import sys

try:  # importlib, not `import deepspeed.comm.torch as m`: the package attribute `deepspeed.comm.torch` is PyTorch.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
except ImportError:  # DeepSpeed not installed: only the DDP test can run
    pass

# What the ranks other than 0 see differently (a JSON object of environment variables), for the tests of what rank 0
# decides for every rank: e.g. another model cache, as when a network blip gives one rank another answer.
if os.environ.get("RANK", "0") != "0":
    os.environ.update(json.loads(os.environ.get("CPU_LAUNCH_OTHER_RANKS_ENV", "{}")))

from trl_gspo.cli.commands import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    if code != 0:  # stopped before or while the trainer was built (a one-line error): no run state to report
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from accelerate.state import AcceleratorState

    # One marker per rank: the process got through training, saving and trainer.end(), under this distribution and
    # mixed precision ("no": fp32).
    state = AcceleratorState()
    print(
        f"cpu_launch: rank {os.environ.get('RANK', '0')} finished with code {code} as {state.distributed_type.value}"
        f" x{state.num_processes} precision {state.mixed_precision}",
        flush=True,
    )
    # Skip interpreter teardown: there libstdc++ sometimes aborts a finished rank ("terminate called without an
    # active exception", even after destroy_process_group, which has already run here) and the launcher then kills
    # the other rank before it prints its marker. Everything is saved by now; os._exit just leaves.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
