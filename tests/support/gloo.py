"""Two (or more) gloo ranks in spawned processes, for tests of what ranks agree on: each runs
`target(rank, port, answers, *args)` and puts what it saw (or the error it raised) on `answers`.

    answers = run_ranks(target, world=2)      # {rank: what it put}
"""

from __future__ import annotations

import multiprocessing as mp

from tests.support.ports import free_ports


def run_ranks(target, *args, world: int = 2, timeout: float = 240.0) -> dict:
    """Start `world` ranks of `target`, wait for them, return {rank: answer}; each rank must put
    exactly one (rank, answer) pair and exit 0."""
    port = free_ports(1)[0]
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    ranks = [ctx.Process(target=target, args=(r, port, answers, *args)) for r in range(world)]
    for p in ranks:
        p.start()
    got = dict(answers.get(timeout=timeout) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert [p.exitcode for p in ranks] == [0] * world, f"rank exit codes {[p.exitcode for p in ranks]}: {got}"
    return got
