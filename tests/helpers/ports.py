"""A free TCP port for a launch's rendezvous. The launchers' default, 29500, is one port for the whole machine: two
launches at once (`make test`'s worker processes, or other jobs on a shared machine) would both try to take it."""

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
