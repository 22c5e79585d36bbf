"""`asyncvla train --hostfile` with two learner nodes, for real (tests/benchmarks/multinode.py):
the deepspeed launcher reaches both through ssh + pdsh (a private sshd on 127.0.0.2 and 127.0.0.3),
one rank each; two standalone actors join over TCP with CURVE keys; the run trains, checkpoints
both ranks' shards, and a `--resume` continues from that step. ~1.5 minutes on 2 cores.

Needs root: it installs openssh-server and pdsh with apt-get when they are missing, runs its own
sshd and adds an ssh client drop-in for the two addresses while it runs. Skipped otherwise.
"""

import pytest

from tests.benchmarks import multinode


def test_two_learner_nodes_train_checkpoint_and_resume():
    r = multinode.run()             # raises, with the logs' tails, when a run misses a promise
    if "skipped" in r:
        pytest.skip(r["skipped"])
    steps, resumed = multinode.STEPS, multinode.RESUMED_STEPS
    for host in multinode.NODES:    # each node's rank (pdsh labels its lines) trained to the budget
        assert r["train"]["finished"][host] == [steps]
        assert r["resume"]["resumed_at"][host] == [steps]
        assert r["resume"]["finished"][host] == [resumed]
    for run, step in ((r["train"], steps), (r["resume"], resumed)):
        assert run["exit_code"] == 0 and run["actor_exit_codes"] == [0] * multinode.NUM_ACTORS
        assert run["checkpoint"]["step"] == step and run["checkpoint"]["world_size"] == 2
        assert run["checkpoint"]["ranks_with_shards"] == [0, 1]
