"""Two-process launches for the tests: a free TCP port for the rendezvous, the command and the ranks' environment.
The launchers' default port, 29500, is one port for the whole machine: two launches at once (`make test`'s worker
processes, or other jobs on a shared machine) would both try to take it."""

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_processes(script, *args) -> list[str]:
    """`torch.distributed.run` of `script args` as 2 processes on this machine, on a free rendezvous port."""
    port = ["--master_port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *port, str(script), *map(str, args)]


def launch_env() -> dict:
    """The launched ranks' environment: one torch thread each, and this process's import path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
