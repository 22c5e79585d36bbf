"""Real DeepSpeed ranks of tests/ds_worker.py, each in its own process (so that no process group
lives in the test session), for tests of the learner's parts:

    WORKER      tests/ds_worker.py, the script each rank runs
    DIST_VARS   the launcher's environment variables, taken out of the environment a rank inherits
    launch      start a phase's ranks of tests/ds_worker.py, wait for them, return each rank's record
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.support.ports import free_ports

WORKER = Path(__file__).parents[1] / "ds_worker.py"
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(phase: str, out: Path, world: int, timeout: float = 240) -> list[dict]:
    """Start `world` ranks of the worker (world=0: one rank with no launcher environment) and
    return each rank's record. A rank that fails takes the others down (as the launcher would)."""
    base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    base["OMP_NUM_THREADS"] = "1"
    base["TORCH_EXTENSIONS_DIR"] = str(out / "torch_extensions")   # empty, as on a fresh machine
    port = str(free_ports(1)[0])
    ranks = range(max(world, 1))
    procs = []
    for r in ranks:
        env = dict(base) if world == 0 else dict(base, RANK=str(r), LOCAL_RANK=str(r),
                                                 WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port)
        log = open(out / f"{phase}_{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), phase, str(out)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p, _ in procs):
        if failed is None:
            failed = next((p for p, _ in procs if p.poll() not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    for _, log in procs:
        log.close()
    logs = "\n".join((out / f"{phase}_{r}.log").read_text()[-3000:] for r in ranks)
    assert all(p.returncode == 0 for p, _ in procs), f"{phase} failed:\n{logs}"
    return [torch.load(out / phase / f"rank{r}.pt", weights_only=False) for r in ranks]
