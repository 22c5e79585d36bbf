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
from asyncvla.actors.outbox import make_outbox
from asyncvla.actors.envs import make_env
from asyncvla.actors.envs.latency import SimLatency
from asyncvla.actors.join import join
from asyncvla.common import placement, transport
from asyncvla.common.config import TransportConfig
from asyncvla.common.signals import stop_on_signals
from asyncvla.common.sockets import printable

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
    cfg, policy, client, weights, welcome = joined.cfg, joined.policy, joined.client, joined.weights, joined.welcome
    sender = transport.TrajectorySender(welcome["trajectory_endpoints"], cfg.transport,
                                        backpressure=cfg.actor.backpressure)
    if actor_index is None:   # a standalone actor: seed apart from the others by its id
        actor_index = zlib.crc32(actor_id.encode()) % 100_000
    seed = cfg.env.seed + 1000 * actor_index
    outbox = make_outbox(cfg)           # GRPO: segments wait for their groups' returns (actors/outbox.py)
    env = make_env(cfg.env, cfg.actor.num_envs, cfg.policy.image_size, cfg.policy.num_action_chunks,
                   cfg.algorithm.reward_type, seed=seed, action_dim=cfg.policy.action_dim,
                   group_size=cfg.algorithm.group_size if outbox.needs_slots else 1)
    if cfg.env.sim_latency_ms > 0:
        env = SimLatency(env, cfg.env.sim_latency_ms)
    generator = torch.Generator(device=cfg.actor.device).manual_seed(cfg.actor.seed + seed)
    tokenize = rollout.InstructionCache(policy)
    # The learner's plan for this actor (learner/ingest.py rollout_plan): its share of an update,
    # and how many sent segments may wait for a rank before it collects another.
    per_version = welcome["rollout"]["segments_per_version"]
    in_flight = welcome["rollout"]["max_segments_in_flight"]
    log.info("actor %s: %d envs of %s, policy on %s; %d segments per version, at most %d in flight",
             actor_id, env.num_envs, printable(cfg.env.id), printable(cfg.actor.device), per_version, in_flight)

    version, state, seq, sent_at_version = -1, rollout.start(env), 0, 0
    incarnation = int.from_bytes(os.urandom(7), "little")     # seqs restart with a restarted actor
    restarts = client.restarts
    try:
        while not stop.is_set() and not client.finished and (max_segments is None or seq < max_segments):
            if client.error:                     # e.g. banned by the learner: nothing more to do here
                raise transport.TransportError(f"learner at {learner}: {printable(client.error)}")
            if client.restarts != restarts:
                # The learner restarted (e.g. resumed from a checkpoint): its versions may be lower
                # than ours, so take whatever it publishes next.
                restarts, version = client.restarts, -1
                plan = client.welcome["rollout"]           # the restarted learner's plan
                per_version, in_flight = plan["segments_per_version"], plan["max_segments_in_flight"]
                weights.reset()
                sender.forget_in_flight()
                log.info("actor %s: the learner restarted; rejoined, waiting for its weights", actor_id)
            # Collect only when the learner has taken all but `in_flight` of what we sent (then
            # take the newest weights): a queued segment waits a whole update, and is one version
            # older when it is used.
            if in_flight and not sender.wait_for_room(in_flight, timeout=1.0, stop=stop):
                continue
            # Swap weights only between segments, so a segment comes from one version.
            if cfg.launch.sync and sent_at_version >= per_version:
                new = weights.wait_newer(version, timeout=1.0)
            else:
                new = weights.poll_newest(newer_than=version) if version >= 0 else \
                    weights.wait_newer(version, timeout=1.0)
            if new is not None:
                version, tensors = new
                policy.load_trainable_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
                sent_at_version = 0
            if version < 0 or (cfg.launch.sync and sent_at_version >= per_version):
                continue
            try:
                arrays, info = rollout.collect_segment(env, policy, tokenize, state, cfg.actor.rollout_length,
                                                       cfg.policy.temperature, generator, slots=outbox.needs_slots)
            except Exception as e:                  # (a stop can end the env workers under it)
                if not stop.is_set():
                    raise
                log.info("actor %s: stopped during a segment (%s)", actor_id, str(e).splitlines()[0])
                break
            meta = {"actor_id": actor_id, "incarnation": incarnation, "policy_version": version,
                    "num_steps": cfg.actor.rollout_length, "num_envs": env.num_envs,
                    "env_steps": info["env_steps"], "act_s": info["act_s"], "env_s": info["env_s"]}
            if info["ep_replayed"]:     # env.replay_failed_starts: how many ended episodes were replays
                meta.update(ep_replayed=info["ep_replayed"], ep_replayed_success=info["ep_replayed_success"])
            sent_all = True
            for meta, arrays in outbox.add(meta, arrays, info):
                meta.update(seq=seq, token=client.token)    # the newest welcome's token: a rejoin renews it
                sent_all = sender.send(transport.Segment(meta=meta, arrays=arrays), stop=stop)
                if not sent_all:
                    break
                if seq == 0:
                    log.info("actor %s: first segment sent (policy version %d)", actor_id, meta["policy_version"])
                seq += 1
                sent_at_version += 1
            if not sent_all:
                break
    finally:
        env.close()
        sender.close()
        joined.close()
    log.info("actor %s: stopped after %d segments (%d dropped)%s", actor_id, seq, sender.dropped,
             f" by signal {stop.signum}" if stop.is_set() else "")
    return stop.exit_code()
