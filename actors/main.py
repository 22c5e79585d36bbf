"""The actor process: join the learner, then act and push segments until told to stop.

    asyncvla actor --learner tcp://HOST:PORT [--num-envs N] [--device DEV] [--keys-dir DIR]

Everything else (config, policy, env, endpoints, current weights) comes from the learner. It
exits 0 when the learner says training is over ("shutdown"), 128 + N when stopped by signal N
(130 Ctrl-C, 143 SIGTERM: the launcher restarts an actor that ends while the learner trains). The
loop, per segment:
    take the newest published weights (in --sync mode: wait for a version newer than the last)
    act on num_envs envs for rollout_length policy steps
    push the segment (blocks or drops its oldest when the learner is slow)
"""

from __future__ import annotations

import logging
import os
import socket
import zlib

import torch

from asyncvla.actors import rollout
from asyncvla.actors.envs import make_env
from asyncvla.actors.envs.latency import SimLatency
from asyncvla.actors.envs.tasks import tasks_of
from asyncvla.actors.join import join
from asyncvla.common import placement, transport
from asyncvla.common.advantages import make_estimator
from asyncvla.common.config import TransportConfig
from asyncvla.common.signals import stop_on_signals
from asyncvla.common.transport.sockets import printable

log = logging.getLogger("asyncvla.actor")


def run(learner: str, actor_id: str | None = None, num_envs: int | None = None,
        device: str | None = None, max_segments: int | None = None, actor_index: int | None = None,
        tcfg=None, join_timeout: float | None = None, join_secret: str | None = None) -> int:
    """Join the learner at `learner` (its control endpoint; `join_secret`: the run's, without CURVE
    keys) and act until it finishes. Without a welcome within `join_timeout` seconds (None: keep
    trying) raises TransportError."""
    actor_id = actor_id or f"{socket.gethostname()}-{os.getpid()}"
    # A local actor of `asyncvla train` gets its cores (launch.placement.actors); pinned before it
    # joins, so that the policy loads and the envs start on them.
    cores = placement.cores_from_env()
    if cores is not None:
        placement.apply(cores, threads=False)
    stop = stop_on_signals()
    joined = join(learner, actor_id, tcfg or TransportConfig(), stop, num_envs, device, timeout=join_timeout,
                  join_secret=join_secret)
    if joined is None:
        return stop.exit_code()
    torch.set_num_threads(1)   # actors are many; one core each
    if actor_index is None:   # a standalone actor: seed apart from the others by its id
        actor_index = zlib.crc32(actor_id.encode()) % 100_000
    actor = Actor(joined, actor_id, actor_index, stop)
    try:
        while not stop.is_set() and not actor.client.finished and (max_segments is None or actor.seq < max_segments):
            if actor.client.error:               # e.g. banned by the learner: nothing more to do here
                raise transport.TransportError(f"learner at {learner}: {printable(actor.client.error)}")
            if actor.client.restarts != actor.restarts:
                actor.rejoin()
            # Collect only when the learner has taken all but `in_flight` of what we sent (then
            # take the newest weights): a queued segment waits a whole update, and is one version
            # older when it is used.
            if actor.in_flight and not actor.sender.wait_for_room(actor.in_flight, timeout=1.0, stop=stop):
                continue
            if not actor.take_weights():
                continue
            segment = actor.collect()
            if segment is None or not actor.send(*segment):
                break
    finally:
        actor.close()
        joined.close()
    log.info("actor %s: stopped after %d segments (%d dropped)%s", actor_id, actor.seq, actor.sender.dropped,
             f" by signal {stop.signum}" if stop.is_set() else "")
    return stop.exit_code()


class Actor:
    """What an actor holds between segments: its envs and their state, the policy and the version of
    the weights it acts with, the learner's plan for it, and the segments it has sent."""

    def __init__(self, joined, actor_id: str, actor_index: int, stop):
        cfg, welcome = joined.cfg, joined.welcome
        self.cfg, self.policy, self.client, self.weights = cfg, joined.policy, joined.client, joined.weights
        self.actor_id, self.stop = actor_id, stop
        self.sender = transport.SegmentSender(welcome["segment_endpoints"], cfg.transport,
                                                 backpressure=cfg.actor.backpressure)
        seed = cfg.env.seed + 1000 * actor_index
        estimator = make_estimator(cfg.algorithm)
        self.outbox = estimator.make_outbox()    # GRPO: segments wait for their groups' returns
        self.env = make_env(cfg.env, cfg.actor.num_envs, cfg.policy.image_size, cfg.policy.num_action_chunks,
                            cfg.algorithm.reward_type, seed=seed, action_dim=cfg.policy.action_dim,
                            group_size=estimator.episodes_per_start, first_env=actor_index * cfg.actor.num_envs)
        if cfg.env.sim_latency_ms > 0:
            self.env = SimLatency(self.env, cfg.env.sim_latency_ms)
        self.generator = torch.Generator(device=cfg.actor.device).manual_seed(cfg.actor.seed + seed)
        self.tokenize = rollout.InstructionCache(self.policy)
        self._take_plan(welcome["rollout"])
        log.info("actor %s: %d envs of %s, policy on %s; %d segments per version, at most %d in flight",
                 actor_id, self.env.num_envs, printable(", ".join(self._task_names())), printable(cfg.actor.device),
                 self.per_version, self.in_flight)
        self.version, self.state, self.seq, self.sent_at_version = -1, rollout.start(self.env), 0, 0
        self.incarnation = int.from_bytes(os.urandom(7), "little")     # seqs restart with a restarted actor
        self.restarts = self.client.restarts

    def _task_names(self) -> list[str]:
        """The tasks this actor's envs run, each once (env.tasks: tasks.deal decides)."""
        tasks = tasks_of(self.cfg.env)
        return list(dict.fromkeys(tasks[t].id for t in self.env.env_tasks))

    def _take_plan(self, plan: dict) -> None:
        """The learner's plan for this actor (learner/ingest.py rollout_plan): its share of an update,
        and how many sent segments may wait for a rank before it collects another."""
        self.per_version, self.in_flight = plan["segments_per_version"], plan["max_segments_in_flight"]

    def rejoin(self) -> None:
        """The learner restarted (e.g. resumed from a checkpoint): its versions may be lower than
        ours, so take whatever it publishes next, under its new plan."""
        self.restarts, self.version = self.client.restarts, -1
        self._take_plan(self.client.welcome["rollout"])
        self.weights.reset()
        self.sender.forget_in_flight()
        log.info("actor %s: the learner restarted; rejoined, waiting for its weights", self.actor_id)

    def take_weights(self) -> bool:
        """Load the newest published weights (in --sync mode, once this version's share is sent: a
        newer one), only between segments, so that a segment comes from one version. False: none
        to act with yet."""
        sync_done = self.cfg.launch.sync and self.sent_at_version >= self.per_version
        if sync_done or self.version < 0:
            new = self.weights.wait_newer(self.version, timeout=1.0)
        else:
            new = self.weights.poll_newest(newer_than=self.version)
        if new is not None:
            self.version, tensors = new
            self.policy.load_trainable_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
            self.sent_at_version = 0
        return self.version >= 0 and not (self.cfg.launch.sync and self.sent_at_version >= self.per_version)

    def collect(self):
        """(meta, arrays, info) of one segment of every env, or None when a stop ended the envs under it."""
        cfg = self.cfg
        try:
            arrays, info = rollout.collect_segment(self.env, self.policy, self.tokenize, self.state,
                                                   cfg.actor.rollout_length, cfg.policy.temperature,
                                                   self.generator, slots=self.outbox.needs_slots)
        except Exception as e:                  # (a stop can end the env workers under it)
            if not self.stop.is_set():
                raise
            log.info("actor %s: stopped during a segment (%s)", self.actor_id, str(e).splitlines()[0])
            return None
        meta = {"actor_id": self.actor_id, "incarnation": self.incarnation, "policy_version": self.version,
                "num_steps": cfg.actor.rollout_length, "num_envs": self.env.num_envs,
                "env_steps": info["env_steps"], "act_s": info["act_s"], "env_s": info["env_s"]}
        if info["ep_retried"]:     # env.retry_failed_starts: how many ended episodes were retries
            meta.update(ep_retried=info["ep_retried"], ep_retried_success=info["ep_retried_success"])
        return meta, arrays, info

    def send(self, meta: dict, arrays: dict, info: dict) -> bool:
        """Send what the outbox releases (with V-trace: this segment); False when a stop cut it short."""
        for meta, arrays in self.outbox.add(meta, arrays, info):
            meta.update(seq=self.seq, token=self.client.token)    # the newest welcome's token: a rejoin renews it
            if not self.sender.send(transport.Segment(meta=meta, arrays=arrays), stop=self.stop):
                return False
            if self.seq == 0:
                log.info("actor %s: first segment sent (policy version %d)", self.actor_id, meta["policy_version"])
            self.seq += 1
            self.sent_at_version += 1
        return True

    def close(self) -> None:
        self.env.close()
        self.sender.close()
