"""Free loopback ports for tests and benchmarks that start real processes."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_replica_step(*ports: int) -> int:
    """A control.replica_port_step that puts replica 1's ports (each of ``ports`` + step) on free ports too."""

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    return next(step for step in range(11, 5000, 7) if all(free(p + step) for p in ports))
