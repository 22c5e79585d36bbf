"""Rank 0's servers: the control server actors join through and the weight server they fetch from.

    servers = ActorServers(cfg, run_dir, policy_dir, endpoints, version_fn, world, tokens, note)
    servers.weights                      publish.py serves each new version on it
    servers.check()                      raises ThreadDied if a server thread died
    servers.ban(actor); servers.figures(); servers.close(final_version)

A joining actor's welcome carries the config, every rank's segment endpoint, the weight server's,
the policy and its rollout plan (`ingest.rollout_plan`); without CURVE keys only holders of the
run's join secret may say hello (common/transport/auth.py). The servers share rank 0's inbox's
TokenLedger, so a registration the control server ends is refused on all three at once.
`token_key` is the key every rank's tokens are checked with.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from asyncvla.common import transport
from asyncvla.common.config import Config, to_dict, to_yaml
from asyncvla.common.transport.auth import ensure_join_secret
from asyncvla.learner.collectives import from_rank0
from asyncvla.learner.ingest import rollout_plan

log = logging.getLogger("asyncvla.learner")


class ActorServers:
    def __init__(self, cfg: Config, run_dir: Path, policy_dir: Path, endpoints: list, version_fn: Callable,
                 world: int, tokens, note: Callable[[str, str], None]):
        """`note(tag, text)` records the config where the run's trackers show text (tensorboard)."""
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        note("config", "```\n" + to_yaml(cfg) + "\n```")
        self.weights = transport.WeightServer(cfg.transport, tokens=tokens)

        def welcome(hello: dict) -> dict:
            return {"config": to_dict(cfg), "segment_endpoints": endpoints, "weights_endpoint": self.weights.endpoint,
                    "weight_version": version_fn(), "policy": {"path": str(policy_dir.resolve())},
                    "rollout": rollout_plan(cfg, world, hello["num_envs"] or cfg.actor.num_envs)}
        secret = None if cfg.transport.keys_dir else ensure_join_secret(run_dir)
        self.control = transport.ControlServer(cfg.transport, welcome_fn=welcome, policy_dir=str(policy_dir),
                                               tokens=tokens, join_secret=secret)
        log.info("run dir %s; actors join at %s", run_dir, self.control.endpoint)

    @property
    def pair(self) -> tuple:
        """(control server, weight server)."""
        return self.control, self.weights

    def check(self) -> None:
        check_alive(self.pair)

    def ban(self, actor: str) -> None:
        self.control.ban(actor)

    def figures(self) -> dict:
        """The actor registry and the requests each server dropped as invalid."""
        return {**{f"system/actors_{k}": v for k, v in self.control.counts().items()},
                "system/dropped_control_invalid": sum(self.control.stats["invalid"].values()),
                "system/dropped_weights_invalid": sum(self.weights.stats["invalid"].values())}

    def close(self, final_version: int) -> None:
        """Tell the actors training is over ("shutdown" names the last version published), close."""
        self.control.close(final_version=final_version)
        self.weights.close()


def check_alive(servers) -> None:
    """Raise ThreadDied, naming the thread, if a server thread of rank 0 died: without it actors
    could no longer join or get weights, and training would stall without a word."""
    for server in servers:
        server.check()


def token_key(cfg: Config) -> bytes | None:
    """The key actor tokens are signed with (common/transport/auth.py). With CURVE keys every rank derives
    the same one from the learner's secret key (None: the channels' default); without, rank 0
    draws one and shares it, so that every rank's inbox checks the tokens rank 0's control server
    issued (a per-process key would leave ranks > 0 checking nothing)."""
    if cfg.transport.keys_dir:
        return None
    return from_rank0(os.urandom(32) if dist.get_rank() == 0 else None)
