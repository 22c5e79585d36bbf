"""Freed receive buffers are reused, not faulted in afresh (common/allocator.py).

Each case runs in its own process: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from asyncvla.common.allocator import keep_freed_buffers

# Receives 4 frames of 8 MB over loopback tcp, holds them and frees them together, as a learner
# rank frees a batch of segments; prints the page faults per frame received after warming up.
RECEIVE_AND_FREE = """
import resource, sys
import numpy as np, zmq
from asyncvla.common.allocator import keep_freed_buffers
if sys.argv[1] == "keep":
    assert keep_freed_buffers()
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
push = ctx.socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
frame = np.ones(8 << 20, np.uint8)

def batch():
    for _ in range(4):
        push.send(frame, copy=False)
    held = [pull.recv(copy=False) for _ in range(4)]
    del held

batch(); batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    batch()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_frame(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", RECEIVE_AND_FREE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)")
def test_kept_buffers_are_reused_without_page_faults():
    default, kept = faults_per_frame("default"), faults_per_frame("keep")
    # glibc's default hands the 32 MB freed together back to the kernel: every 8 MB frame then
    # faults in hundreds of fresh pages (about 600 here); kept, the next frames reuse them.
    assert default > 100, default
    assert kept < 5, kept


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold_mb=64"):
        keep_freed_buffers(mmap_threshold_mb=64)
    with pytest.raises(ValueError, match="trim_threshold_mb=8"):
        keep_freed_buffers(mmap_threshold_mb=16, trim_threshold_mb=8)
