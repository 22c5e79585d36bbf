"""Free TCP ports for tests and benchmarks that start servers or whole runs.

A port the kernel hands out with bind(0) lies in its ephemeral range, where every outgoing
connection on the machine takes its source port: one found free there can be taken a moment later,
before the run that was given it binds it. So the ports come from outside that range, each
pytest-xdist worker from its own slice, in turn, and each is checked free as it is handed out; a
run's trajectory port comes with its other ranks' ports (segment_port + r) free too.

A port is handed out once per machine while its taker lives: the fault suite starts runs from
several threads at once, and tests start benchmarks in processes of their own on the same slice.
So taking is under a lock, and each port taken is claimed by a file (its taker's pid) in a shared
folder; a claim whose process has died is taken over.
"""

from __future__ import annotations

import atexit
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

# The ports one `asyncvla train` run binds, by config key (segment_port is rank 0's; rank r
# binds segment_port + r).
RUN_PORTS = ("transport.control_port", "transport.weights_port", "transport.segment_port", "launch.master_port")
RANK_PORTS = 8          # trajectory ports kept free per run: rank 0's and the next 7
FIRST_PORT = 15000      # the pool starts here, above the well-known services


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535     # the IANA range, which macOS and Windows use


def _worker_pool() -> list[int]:
    """This process's ports: those outside the ephemeral range, its xdist worker's share of them."""
    low, high = _ephemeral_range()
    ports = [p for p in range(FIRST_PORT, 65536) if not low <= p <= high]
    if len(ports) < 1000:       # an unusual kernel setting: fall back to the whole range
        ports = list(range(FIRST_PORT, 65536))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    share = len(ports) // max(count, 1)
    return ports[index * share:(index + 1) * share]


_POOL = _worker_pool()
_cursor = random.randrange(len(_POOL))      # a fresh start per session: a run left over may hold the first ones
_LOCK = threading.Lock()
_CLAIMS = Path(tempfile.gettempdir()) / f"asyncvla-test-ports-{os.getuid() if hasattr(os, 'getuid') else 0}"
_mine: list[Path] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process: alive
        return True
    return True


def _claim(port: int) -> bool:
    """Claim the port for this process, unless a living process has claimed it."""
    _CLAIMS.mkdir(exist_ok=True)
    path = _CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                owner = int(path.read_text())
            except (OSError, ValueError):       # being written this moment: held
                return False
            if owner == os.getpid() or _alive(owner):
                return False
            path.unlink(missing_ok=True)      # its process is gone: take it over
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        _mine.append(path)
        return True
    return False


def _claim_all(block: list[int]) -> bool:
    """Claim every port of the block, or none."""
    for k, port in enumerate(block):
        if not _claim(port):
            for _ in range(k):                  # the ones this call claimed, last in _mine
                _mine.pop().unlink(missing_ok=True)
            return False
    return True


@atexit.register
def _release() -> None:
    for path in _mine:
        path.unlink(missing_ok=True)


def _is_free(port: int) -> bool:
    """Nothing holds the port on any address (the multi-node tests bind 0.0.0.0)."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _take(n: int) -> int:
    """The first port of the next n consecutive free ones in this worker's pool."""
    global _cursor
    with _LOCK:
        for _ in range(len(_POOL)):
            i, _cursor = _cursor, (_cursor + 1) % len(_POOL)
            block = _POOL[i:i + n]
            if len(block) == n and block[-1] - block[0] == n - 1 and all(map(_is_free, block)) \
                    and _claim_all(block):
                _cursor = (i + n) % len(_POOL)
                return block[0]
    raise RuntimeError(f"no {n} consecutive free TCP ports among this worker's {len(_POOL)}")


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports, free when handed out."""
    return [_take(1) for _ in range(n)]


def run_ports() -> dict[str, int]:
    """Distinct free ports for one run: config key -> port, with the ports of ranks 1-7 free too."""
    return {key: _take(RANK_PORTS if key == "transport.segment_port" else 1) for key in RUN_PORTS}


def run_port_overrides() -> list[str]:
    """`run_ports()` as config overrides (key=port)."""
    return [f"{key}={port}" for key, port in run_ports().items()]
