"""Component placement: which CPU cores the learner ranks and the local actors may use.

    launch.placement.learner = "0-5"     launch.placement.actors = "6-7"

A core spec is `all`, a core (`3`), a range (`0-3`) or a comma list of them (`0-1,4,6-7`), as
RLinf's `cluster.component_placement`. Learner rank r (local to its machine) gets the r-th of
even, disjoint slices of the learner cores, or all of them when there are fewer cores than ranks;
every actor gets the whole actor set (an actor runs one torch thread). `all` pins nothing: the
processes keep the cores they inherit, as without placement. Explicit learner and actor sets
must not overlap.

It lives in common/ because the config's validation parses the specs (common must not import
launch); the launcher, the learner ranks and the actors apply what `plan` returns.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from asyncvla.common.errors import ConfigError

CORES_ENV = "ASYNCVLA_CORES"          # the launcher hands a local actor its cores: "0,1"
ALLOWED = "all, a core (3), a range (0-3) or a comma list of them (0-1,4,6-7)"
_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


@dataclass
class Placement:
    learner: list[list[int]]     # cores of local learner rank r
    actors: list[list[int]]      # cores of local actor i
    pin_learner: bool            # False: launch.placement.learner is `all`, the ranks are not pinned
    pin_actors: bool             # False: launch.placement.actors is `all`


def available_cores() -> set[int]:
    """The cores this process may run on (its affinity, which a container or taskset may narrow)."""
    return set(os.sched_getaffinity(0))


def parse_cores(spec: str, available: set[int], key: str) -> list[int]:
    """The sorted cores `spec` names; ConfigError (naming key, value and what is allowed) on bad
    syntax, a reversed range, an empty set or a core not in `available`."""
    spec = str(spec).strip()
    where = f"{key}={spec!r}"
    if spec == "all":
        return sorted(available)
    if not spec:
        raise ConfigError(f"{where}: no cores named; use {ALLOWED}")
    cores: set[int] = set()
    for item in spec.split(","):
        m = _ITEM.fullmatch(item.strip())
        if m is None:
            raise ConfigError(f"{where}: '{item.strip()}' is not a core spec; use {ALLOWED}")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if lo > hi:
            raise ConfigError(f"{where}: range {lo}-{hi} is reversed; write {hi}-{lo}")
        cores.update(range(lo, hi + 1))
    missing = sorted(cores - available)
    if missing:
        which = f"core {missing[0]} does not" if len(missing) == 1 else f"cores {compact(missing)} do not"
        raise ConfigError(f"{where}: {which} exist on this machine (cores {compact(available)})")
    return sorted(cores)


def plan(placement_cfg, num_learner_ranks: int, num_actors: int, available: set[int]) -> Placement:
    """The cores of each local learner rank and each local actor (`placement_cfg`: the config's
    launch.placement)."""
    learner_spec, actor_spec = str(placement_cfg.learner).strip(), str(placement_cfg.actors).strip()
    learner = parse_cores(learner_spec, available, "launch.placement.learner")
    actors = parse_cores(actor_spec, available, "launch.placement.actors")
    pin_learner, pin_actors = learner_spec != "all", actor_spec != "all"
    shared = sorted(set(learner) & set(actors))
    if pin_learner and pin_actors and shared:
        raise ConfigError(f"launch.placement.learner={learner_spec!r} and launch.placement.actors="
                          f"{actor_spec!r} share cores {compact(shared)}; give them disjoint sets, or "
                          "`all` to one of them to share")
    return Placement(learner=_slices(learner, num_learner_ranks) if pin_learner else [learner] * num_learner_ranks,
                     actors=[actors] * num_actors, pin_learner=pin_learner, pin_actors=pin_actors)


def apply(cores: list[int], threads: bool = True) -> None:
    """Pin this process, every thread it already runs (and so the threads and processes they
    start later) to `cores`; with `threads`, size torch's intra-op thread pool to match."""
    os.sched_setaffinity(0, cores)
    # Linux pins only the calling thread: a pool or I/O thread started before would keep every core.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:      # a thread that ended meanwhile
            pass
    if threads:
        import torch              # (here, so that parsing and the launcher stay free of torch)
        torch.set_num_threads(len(cores))


def cores_from_env() -> list[int] | None:
    """The cores the launcher gave this process through CORES_ENV, or None."""
    value = os.environ.get(CORES_ENV)
    return [int(c) for c in value.split(",")] if value else None


def summary(p: Placement, available: set[int]) -> str:
    """One line for the launcher's log."""
    def side(cores_per_proc: list[list[int]], pinned: bool, key: str) -> str:
        if not pinned:
            return f"[{compact(available)}] (launch.placement.{key}=all: not pinned)"
        return ", ".join(f"[{compact(c)}]" for c in cores_per_proc) or "[] (none started)"
    return (f"placement: learner ranks on cores {side(p.learner, p.pin_learner, 'learner')}; "
            f"actors on cores {side(p.actors[:1], p.pin_actors, 'actors')}")


def compact(cores) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the spec syntax)."""
    out, cores = [], sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def _slices(cores: list[int], n: int) -> list[list[int]]:
    """n even, disjoint, contiguous slices of `cores` (the first len % n one core larger); every
    slice is all of `cores` when there are fewer cores than n."""
    if len(cores) < n:
        return [cores] * n
    size, extra = divmod(len(cores), n)
    bounds = [r * size + min(r, extra) for r in range(n + 1)]
    return [cores[bounds[r]:bounds[r + 1]] for r in range(n)]
