"""learner/collectives.py on 2 real gloo ranks: every rank gets the same answer, whichever rank
holds the flag, the largest number, the problem or the decision; and in one process each
collective returns its own answer. Seconds."""

from __future__ import annotations

from asyncvla.learner import collectives
from tests.support.gloo import run_ranks


def _rank(rank: int, port: int, answers) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        answers.put((rank, {
            "any: rank 1 only": collectives.any_rank(rank == 1),
            "any: none": collectives.any_rank(False),
            "max": collectives.max_over_ranks(3 if rank == 0 else 7),
            "gather": collectives.gather({"rank": rank}),
            "from rank 0": collectives.from_rank0(f"decided by {rank}" if rank == 0 else None),
            "first problem: rank 1's": collectives.first_problem("disk full" if rank == 1 else None),
            "first problem: both": collectives.first_problem(f"problem {rank}"),
            "first problem: none": collectives.first_problem(None),
        }))
    except Exception as e:             # (reported, not lost in the child's stderr)
        answers.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_same_answer():
    got = run_ranks(_rank)
    expected = {"any: rank 1 only": True, "any: none": False, "max": 7,
                "gather": [{"rank": 0}, {"rank": 1}], "from rank 0": "decided by 0",
                "first problem: rank 1's": "disk full", "first problem: both": "problem 0",
                "first problem: none": None}
    assert got == {0: expected, 1: expected}


def test_one_process_answers_alone():
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.max_over_ranks(5) == 5
    assert collectives.gather("x") == ["x"]
    assert collectives.from_rank0("mine") == "mine"
    assert collectives.first_problem("bad") == "bad" and collectives.first_problem(None) is None
