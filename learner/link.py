"""The learner's side of its actors: each rank's inbox, rank 0's control and weight servers, the
watches on who feeds it, and the per-update report.

    link = ActorLink(cfg, run_dir, policy_dir, engine, version_fn, state, device)
    link.inbox.fill(...), link.inbox.take(...)      segments in (learner/ingest.py)
    link.weights                                    rank 0's weight server (publish.py serves on it)
    report = link.report(step, scalars, env...)     every rank's figures combined, logged by rank 0
    link.close(final_version)                       "shutdown" to the actors, sockets closed

Rank 0 serves: a joining actor's welcome carries the config, the endpoints, the policy and its
rollout plan (`ingest.rollout_plan`); without CURVE keys only holders of the run's join secret
may say hello (common/transport/auth.py). An actor whose columns keep coming out non-finite in updates
(learner.max_poisoned_columns) is banned on every rank (`report` agrees on it); and at every
`report` the other ranks' inboxes learn which registrations rank 0 ended, so that they too refuse
the tokens of actors that left.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.distributed as dist

from asyncvla.common import transport
from asyncvla.common.transport.allocator import keep_freed_buffers
from asyncvla.common.transport.auth import ensure_join_secret
from asyncvla.common.config import Config, to_dict, to_yaml
from asyncvla.common.transport.protocol import SegmentSpec
from asyncvla.common.transport.sockets import printable
from asyncvla.common.trackers import open_trackers
from asyncvla.learner.collectives import from_rank0, gather
from asyncvla.learner.ingest import Inbox, PoisonCounts, rollout_plan
from asyncvla.learner.metrics import Metrics
from asyncvla.learner.starvation import Roster, StarvationWatch, wait_for_actors

log = logging.getLogger("asyncvla.learner")


class ActorLink:
    def __init__(self, cfg: Config, run_dir: Path, policy_dir: Path, engine, version_fn, state, device):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.cfg, self.device, self.world = cfg, device, world
        self.metrics = Metrics(open_trackers(cfg, run_dir, "learner") if rank == 0 else None, cfg.learner.max_steps,
                               cfg.logging.progress, start_step=state.step, env_steps=state.env_steps,
                               eval_dir=run_dir / "eval", success_window=cfg.learner.target_success_episodes,
                               task_names=tuple(t.id for t in cfg.env.tasks))
        auth_key = _token_key(cfg)
        if cfg.transport.reuse_receive_buffers:
            keep_freed_buffers()           # before the first segment: see common/transport/allocator.py
        spec = SegmentSpec.for_policy(cfg, engine.module.head, engine.module.action_tokenizer)
        receiver = transport.SegmentReceiver(cfg.transport, rank, spec, auth_key=auth_key)
        endpoints = gather(receiver.endpoint)
        self.control = self.weights = None
        self._ended_mark = 0                # rank 0: registrations ended up to here are told to the others
        if rank == 0:
            self._serve(run_dir, policy_dir, endpoints, version_fn, receiver.tokens)
        self.hunger = StarvationWatch(cfg.learner.starvation_timeout_s, rank,
                                      registry=self.control.counts if self.control else None)
        roster = Roster(run_dir, self.control.actor_ids) if self.control else None

        def on_segment(segment, lag: int) -> None:
            self.metrics.add_segment(segment, lag)
            self.hunger.fed(segment.meta["actor_id"])
        self.inbox = Inbox(receiver, cfg.learner.max_policy_lag, on_segment=on_segment,
                           watchdog=lambda: (check_alive(self.servers), self.hunger.check(), roster and roster.update()),
                           count_gaps=world == 1)
        self.poison = PoisonCounts(cfg.learner.max_poisoned_columns)

    @property
    def servers(self) -> tuple:
        """Rank 0's (control server, weight server); () on the other ranks."""
        return (self.control, self.weights) if self.control else ()

    def wait_for_fleet(self, stop) -> None:
        """Before the first update, rank 0 waits for learner.min_actors actors (the other ranks
        wait at the first update's collectives, as they do for data)."""
        if self.control and self.cfg.learner.min_actors:
            wait_for_actors(self.cfg.learner.min_actors, self.control.actor_ids, stop)
            self.hunger.restart()

    def report(self, step: int, scalars: dict, poisoned_by: list[str], time_up: bool) -> dict:
        """This update's figures combined over ranks (a collective), logged by rank 0; actors whose
        columns kept coming out non-finite are banned (all ranks agree: they all see the sum)."""
        samples = self.inbox_columns * self.cfg.actor.rollout_length * self.world
        self._share_ended_registrations()
        report = self.metrics.report(step, {**scalars, "system/seq_gaps": self.inbox.seq_gaps}, self.inbox.drops,
                                     samples=samples, device=self.device, time_up=time_up,
                                     rank0_only=self._server_figures())
        if report["system/poisoned_columns"]:
            for actor in self.poison.add(a for ids in gather(poisoned_by) for a in ids):
                self._ban(actor, step)
        return report

    @property
    def inbox_columns(self) -> int:
        return self.cfg.learner.batch_trajectories // self.world

    def close(self, final_version: int) -> None:
        """Tell the actors training is over ("shutdown" names the last version published), close."""
        self.metrics.close()
        if self.control:
            self.control.close(final_version=final_version)
            self.weights.close()
        self.inbox.receiver.close()

    # ------------------------------------------------------------------------------ helpers
    def _serve(self, run_dir: Path, policy_dir: Path, endpoints: list, version_fn, tokens) -> None:
        """Rank 0's control and weight servers, sharing its inbox's TokenLedger: a registration the
        control server ends is refused on all three at once."""
        cfg = self.cfg
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics.text("config", "```\n" + to_yaml(cfg) + "\n```")
        self.weights = transport.WeightServer(cfg.transport, tokens=tokens)

        def welcome(hello: dict) -> dict:
            return {"config": to_dict(cfg), "segment_endpoints": endpoints, "weights_endpoint": self.weights.endpoint,
                    "weight_version": version_fn(), "policy": {"path": str(policy_dir.resolve())},
                    "rollout": rollout_plan(cfg, self.world, hello["num_envs"] or cfg.actor.num_envs)}
        secret = None if cfg.transport.keys_dir else ensure_join_secret(run_dir)
        self.control = transport.ControlServer(cfg.transport, welcome_fn=welcome, policy_dir=str(policy_dir),
                                               tokens=tokens, join_secret=secret)
        log.info("run dir %s; actors join at %s", run_dir, self.control.endpoint)

    def _share_ended_registrations(self) -> None:
        """The registrations rank 0's control server ended since the last update (actors that left,
        timed out or were replaced), ended in every other rank's ledger too (a collective)."""
        if self.world == 1:
            return
        tokens = self.inbox.receiver.tokens
        ended = None
        if self.control:
            ended, self._ended_mark = tokens.ended_after(self._ended_mark)
        ended = from_rank0(ended)
        if not self.control and tokens is not None:
            tokens.end(*ended)

    def _ban(self, actor: str, step: int) -> None:
        """Refuse from now on the segments (every rank) and requests (rank 0) of `actor`."""
        self.inbox.ban(actor)
        if self.control:
            self.control.ban(actor)
            log.warning("update %d: actor %s banned: its columns came out non-finite in updates %d times "
                        "(learner.max_poisoned_columns); its segments and requests are refused from now on",
                        step, printable(actor), self.cfg.learner.max_poisoned_columns)

    def _server_figures(self) -> dict:
        """Rank 0's figures: the actor registry and the requests each server dropped as invalid."""
        if not self.control:
            return {}
        return {**{f"system/actors_{k}": v for k, v in self.control.counts().items()},
                "system/dropped_control_invalid": sum(self.control.stats["invalid"].values()),
                "system/dropped_weights_invalid": sum(self.weights.stats["invalid"].values())}


def check_alive(servers) -> None:
    """Raise ThreadDied, naming the thread, if a server thread of rank 0 died: without it actors
    could no longer join or get weights, and training would stall without a word."""
    for server in servers:
        server.check()


def _token_key(cfg: Config) -> bytes | None:
    """The key actor tokens are signed with (common/transport/auth.py). With CURVE keys every rank derives
    the same one from the learner's secret key (None: the channels' default); without, rank 0
    draws one and shares it, so that every rank's inbox checks the tokens rank 0's control server
    issued (a per-process key would leave ranks > 0 checking nothing)."""
    if cfg.transport.keys_dir:
        return None
    return from_rank0(os.urandom(32) if dist.get_rank() == 0 else None)


