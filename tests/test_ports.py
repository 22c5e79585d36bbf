"""The tests' free ports: outside the kernel's ephemeral range, one slice per xdist worker, never
handed out twice (across threads and processes), and a run's trajectory port with the next ranks'
ports free too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from tests.support import ports


def test_a_run_gets_distinct_free_ports_outside_the_ephemeral_range():
    low, high = ports._ephemeral_range()
    given = [ports.run_ports() for _ in range(20)]
    flat = [p for run in given for p in run.values()]
    assert len(set(flat)) == len(flat)
    assert not any(low <= p <= high for p in flat)
    for run in given:
        first = run["transport.segment_port"]
        ranks = range(first, first + ports.RANK_PORTS)
        assert not set(ranks) & (set(flat) - {first})            # no other key lands on a rank's port
        assert all(ports._is_free(p) for p in ranks)


def test_a_taken_port_is_skipped():
    taken = ports._POOL[ports._cursor]                  # the next one to be handed out
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", taken))
        except OSError:                                 # held elsewhere already: skipped all the same
            pass
        assert ports.free_ports(1)[0] != taken


def test_xdist_workers_get_disjoint_slices(monkeypatch):
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        slices.append(set(ports._worker_pool()))
    assert all(len(s) > 1000 for s in slices)
    assert not (slices[0] & slices[1] or slices[1] & slices[2] or slices[0] & slices[2])


def test_threads_taking_ports_at_once_get_distinct_ones():
    """The fault suite starts several runs from threads at once: no two may share a port."""
    got: list[dict] = []
    start = threading.Barrier(4)

    def take():
        start.wait()
        got.append(ports.run_ports())

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [set(range(p, p + (ports.RANK_PORTS if key == "transport.segment_port" else 1)))
            for run in got for key, p in run.items()]
    assert len(got) == 4 and sum(map(len, held)) == len(set().union(*held))


def test_a_port_claimed_by_a_living_process_is_skipped_and_a_dead_ones_taken_over():
    """Processes on one xdist worker's slice (a test and the benchmark it starts) never share a port."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        port = ports._POOL[ports._cursor]
        (ports._CLAIMS / str(port)).write_text(str(sleeper.pid))     # a living process's claim
        assert ports.free_ports(1)[0] != port
    finally:
        sleeper.kill()
        sleeper.wait()
    (ports._CLAIMS / str(port)).write_text(str(sleeper.pid))         # now a dead process's claim
    assert ports._claim(port)
    assert (ports._CLAIMS / str(port)).read_text() == str(os.getpid())
