"""launch: what `asyncvla train` starts on this machine, and where its processes run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from asyncvla.common import placement

from .fields import ConfigError, opt


@dataclass
class PlacementConfig:
    """Which CPU cores each kind of process may use (common/placement.py), as RLinf's
    cluster.component_placement. A spec is `all`, a core (3), a range (0-3) or a comma list of
    them (0-1,4,6-7), numbered as this machine's cores (os.sched_getaffinity)."""
    learner: str = opt("all", "cores of the learner ranks on each machine: rank r is pinned to the r-th "
                       "of even, disjoint slices (all of them when there are fewer cores than ranks) and "
                       "runs as many torch threads as it has cores; all: not pinned (shares the machine)")
    actors: str = opt("all", "cores of the local actor processes of `asyncvla train`: each actor may use "
                      "all of them (one torch thread each); must not overlap launch.placement.learner "
                      "unless one is all; all: not pinned")


@dataclass
class LaunchConfig:
    num_learner_ranks: int = opt(1, "learner processes on this machine (deepspeed --num_gpus)", ge=1)
    hostfile: Optional[str] = opt(None, "deepspeed hostfile for multi-node learners")
    actor_hostfile: Optional[str] = opt(None, "hosts that each run an actor fleet over ssh, one 'HOST slots=N' "
                                        "per line (N actors there; `asyncvla actors`)")
    num_local_actors: int = opt(2, "actor processes started beside the learner", ge=0)
    restart_actors: bool = opt(True, "restart a local actor that crashes")
    max_actor_restarts: int = opt(5, "give up on an actor after this many restarts", ge=0)
    sync: bool = opt(False, "serialise rollout and training (actors wait for new weights before each "
                     "segment): the synchronous baseline")
    master_port: int = opt(29500, "torch.distributed rendezvous port", ge=1, le=65535)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def check_placement(launch: "LaunchConfig") -> list[str]:
    try:
        placement.plan(launch.placement, launch.num_learner_ranks, launch.num_local_actors,
                       placement.available_cores())
    except ConfigError as e:
        return [str(e)]
    return []
