"""How the learner's ranks agree, each way written once.

Every function here is a collective: all ranks call it, at the same point of their loop, or the
ones that did wait forever for the others. Each returns the same answer on every rank, so that
all ranks take the same branch afterwards (a rank that stopped alone would leave the others
waiting inside DeepSpeed's next collective). Without torch.distributed (one process, or a test),
each returns this process's own answer.

    any_rank(flag)        True everywhere when any rank's flag is: stop, a failure, a non-finite value
    max_over_ranks(n)     the largest n of any rank (e.g. the micro-batches every rank must step)
    gather(obj)           every rank's obj, in rank order, on every rank
    from_rank0(obj)       rank 0's obj on every rank: a decision only rank 0 can make
    first_problem(p)      the first rank's problem (a string) or None, on every rank

Tensors of `any_rank` / `max_over_ranks` go on `device` (the CPU for gloo, the rank's GPU for
NCCL); objects go through pickle (torch's *_object collectives), so keep them small.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool, device=None) -> bool:
    return bool(max_over_ranks(int(bool(flag)), device))


def max_over_ranks(n: int, device=None) -> int:
    if _world() == 1:
        return int(n)
    t = torch.tensor([int(n)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather(obj) -> list:
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's `obj` (what other ranks pass is ignored: pass None)."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(problem: str | None) -> str | None:
    return next((p for p in gather(problem) if p), None)
