"""The learner's side of its actors: each rank's inbox and the watches on who feeds it, rank 0's
servers (learner/servers.py), and the per-update report.

    link = ActorLink(cfg, run_dir, policy_dir, engine, version_fn, state, device)
    link.inbox.fill(...), link.inbox.take(...)      segments in (learner/ingest.py)
    link.weights                                    rank 0's weight server (publish.py serves on it)
    report = link.report(step, scalars, env...)     every rank's figures combined, logged by rank 0
    link.close(final_version)                       "shutdown" to the actors, sockets closed

An actor whose columns keep coming out non-finite in updates (learner.max_poisoned_columns) is
banned on every rank (`report` agrees on it); and at every `report` the other ranks' inboxes learn
which registrations rank 0 ended, so that they too refuse the tokens of actors that left.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from asyncvla.common import transport
from asyncvla.common.config import Config
from asyncvla.common.trackers import open_trackers
from asyncvla.common.transport.allocator import keep_freed_buffers
from asyncvla.common.transport.protocol import SegmentSpec
from asyncvla.common.transport.sockets import printable
from asyncvla.learner.collectives import from_rank0, gather
from asyncvla.learner.ingest import Inbox, PoisonCounts
from asyncvla.learner.metrics import Metrics
from asyncvla.learner.servers import ActorServers, token_key
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
        auth_key = token_key(cfg)
        if cfg.transport.reuse_receive_buffers:
            keep_freed_buffers()           # before the first segment: see common/transport/allocator.py
        spec = SegmentSpec.for_policy(cfg, engine.module.head, engine.module.action_tokenizer)
        receiver = transport.SegmentReceiver(cfg.transport, rank, spec, auth_key=auth_key)
        endpoints = gather(receiver.endpoint)
        self._ended_mark = 0                # rank 0: registrations ended up to here are told to the others
        self.rank0 = (ActorServers(cfg, run_dir, policy_dir, endpoints, version_fn, world, receiver.tokens,
                                   self.metrics.text) if rank == 0 else None)
        self.weights = self.rank0.weights if self.rank0 else None
        control = self.rank0.control if self.rank0 else None
        self.hunger = StarvationWatch(cfg.learner.starvation_timeout_s, rank,
                                      registry=control.counts if control else None)
        roster = Roster(run_dir, control.actor_ids) if control else None

        def on_segment(segment, lag: int) -> None:
            self.metrics.add_segment(segment, lag)
            self.hunger.fed(segment.meta["actor_id"])

        def watchdog() -> None:
            if self.rank0:
                self.rank0.check()
            self.hunger.check()
            if roster:
                roster.update()
        self.inbox = Inbox(receiver, cfg.learner.max_policy_lag, on_segment=on_segment, watchdog=watchdog,
                           count_gaps=world == 1)
        self.poison = PoisonCounts(cfg.learner.max_poisoned_columns)

    @property
    def servers(self) -> tuple:
        """Rank 0's (control server, weight server); () on the other ranks."""
        return self.rank0.pair if self.rank0 else ()

    def wait_for_fleet(self, stop) -> None:
        """Before the first update, rank 0 waits for learner.min_actors actors (the other ranks
        wait at the first update's collectives, as they do for data)."""
        if self.rank0 and self.cfg.learner.min_actors:
            wait_for_actors(self.cfg.learner.min_actors, self.rank0.control.actor_ids, stop)
            self.hunger.restart()

    def report(self, step: int, scalars: dict, poisoned_by: list[str], time_up: bool) -> dict:
        """This update's figures combined over ranks (a collective), logged by rank 0; actors whose
        columns kept coming out non-finite are banned (all ranks agree: they all see the sum)."""
        samples = self.inbox_columns * self.cfg.actor.rollout_length * self.world
        self._share_ended_registrations()
        report = self.metrics.report(step, {**scalars, "system/seq_gaps": self.inbox.seq_gaps}, self.inbox.drops,
                                     samples=samples, device=self.device, time_up=time_up,
                                     rank0_only=self.rank0.figures() if self.rank0 else {})
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
        if self.rank0:
            self.rank0.close(final_version)
        self.inbox.receiver.close()

    # ------------------------------------------------------------------------------ helpers
    def _share_ended_registrations(self) -> None:
        """The registrations rank 0's control server ended since the last update (actors that left,
        timed out or were replaced), ended in every other rank's ledger too (a collective)."""
        if self.world == 1:
            return
        tokens = self.inbox.receiver.tokens
        ended = None
        if self.rank0:
            ended, self._ended_mark = tokens.ended_after(self._ended_mark)
        ended = from_rank0(ended)
        if not self.rank0 and tokens is not None:
            tokens.end(*ended)

    def _ban(self, actor: str, step: int) -> None:
        """Refuse from now on the segments (every rank) and requests (rank 0) of `actor`."""
        self.inbox.ban(actor)
        if self.rank0:
            self.rank0.ban(actor)
            log.warning("update %d: actor %s banned: its columns came out non-finite in updates %d times "
                        "(learner.max_poisoned_columns); its segments and requests are refused from now on",
                        step, printable(actor), self.cfg.learner.max_poisoned_columns)
