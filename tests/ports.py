"""Free loopback TCP ports for tests and benchmarks that start servers or whole runs."""

from __future__ import annotations

import socket

# The ports one `asyncvla train` run binds, by config key (trajectory_port is rank 0's; rank r
# binds trajectory_port + r).
RUN_PORTS = ("transport.control_port", "transport.weights_port", "transport.trajectory_port", "launch.master_port")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (held open together so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ports() -> dict[str, int]:
    """Distinct free ports for one run: config key -> port."""
    return dict(zip(RUN_PORTS, free_ports(len(RUN_PORTS))))


def run_port_overrides() -> list[str]:
    """`run_ports()` as config overrides (key=port)."""
    return [f"{key}={port}" for key, port in run_ports().items()]
