"""The one workload the system benchmarks share: configs/pixel_task.yaml with the overrides below.

Rollout and training of one update take comparable time with these settings on a 2-core CPU
(sync run: ~1.3 s rollout, ~1.45 s training per update), which is where overlapping them pays
most and where the async-vs-sync bound (t_rollout + t_train) / max(...) is close to 2:
one actor process (1 thread) fills one update's batch with one segment of 3 envs x 8 policy
steps, and the learner (1 rank, OMP_NUM_THREADS=1) trains on it for one epoch of one minibatch.
So rollout and training each own one core, and async can run them at the same time. If the
policy or the task changes speed, re-balance with actor.num_envs = learner.batch_trajectories
(the sync run's phase times are in the table).

Also: a real training batch (a segment from the pixel env and the policy, through the learner's
ColumnBuffer).
"""

from __future__ import annotations

import time
from pathlib import Path

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "pixel_task.yaml")
MANISKILL_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
OVERRIDES = [
    "eval.eval_interval=0",             # no evaluator beside the measured processes
    "launch.num_local_actors=1",
    "actor.num_envs=3",
    "actor.rollout_length=8",
    "learner.batch_trajectories=3",     # one segment per update
    "algorithm.update_epochs=1",
    "algorithm.num_minibatches=1",
    # The policy these figures were balanced and documented with: the 6 M default backbone with
    # LoRA (the pixel config's own 0.3 M policy acts in a fraction of its training time, which
    # leaves nothing for overlap to hide; the learning benchmark runs that one).
    "policy.is_lora=true", "policy.value_encoder=none", "policy.value_head_hidden=256",
    "policy.backbone.vision_hidden_size=192", "policy.backbone.vision_layers=4",
    "policy.backbone.text_hidden_size=256", "policy.backbone.text_layers=6",
    "policy.backbone.intermediate_size=512", "policy.backbone.vocab_size=512",
]
LEARNER_THREADS = 1                     # the learner's share of a 2-core machine beside one actor


def config(overrides=()):
    """The benchmark Config: the pixel task + OVERRIDES + `overrides`."""
    from asyncvla.common.config import load_config
    return load_config(CONFIG, [*OVERRIDES, *overrides])


def samples_per_update(cfg) -> int:
    return cfg.learner.batch_trajectories * cfg.actor.rollout_length


def micro_batches(cfg, world: int) -> int:
    """Micro batches per minibatch on one rank (the engine's gradient accumulation steps)."""
    per_minibatch = cfg.learner.batch_trajectories // world * cfg.actor.rollout_length \
        // cfg.algorithm.num_minibatches
    return -(-per_minibatch // cfg.learner.micro_batch_size)


def make_batch(cfg, policy, columns: int, seed: int = 0):
    """A learner Batch of `columns` trajectories, made the way the system makes them: one segment
    of the pixel env under `policy` (before ZeRO-3 partitions it), through a ColumnBuffer."""
    import torch

    from asyncvla.actors import rollout
    from asyncvla.actors.envs import make_env
    from asyncvla.learner.ingest import ColumnBuffer

    env = make_env(cfg.env, columns, cfg.policy.image_size, cfg.policy.num_action_chunks,
                   cfg.algorithm.reward_type, seed=seed, action_dim=cfg.policy.action_dim)
    arrays, _ = rollout.collect_segment(env, policy, rollout.InstructionCache(policy), rollout.start(env),
                                        cfg.actor.rollout_length, cfg.policy.temperature,
                                        torch.Generator().manual_seed(seed))
    env.close()
    buffer = ColumnBuffer(cfg.learner.max_policy_lag)
    buffer.add(arrays, 0)
    return buffer.take(columns)


def collect(procs: list, pipes: list, timeout: float, what: str, close: bool = True) -> list[dict]:
    """One record from each child process (in order). A child reports a failure as {"error": text};
    the first failure from any child is raised at once, and a child that dies silently is named,
    so a rank that failed never leaves the others waiting in a collective until the time-out."""
    from multiprocessing.connection import wait

    if close:                         # once, after start: the child's end of each pipe is the child's
        for _, child in pipes:        # (EOF then arrives here when a child exits)
            child.close()
    records: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(records) < len(pipes):
        waiting = {parent: i for i, (parent, _) in enumerate(pipes) if i not in records}
        ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{what}: no result from {sorted(waiting.values())} within {timeout:.0f} s")
        for conn in ready:
            i = waiting[conn]
            try:
                rec = conn.recv()
            except EOFError:
                raise RuntimeError(f"{what} {i} exited (code {procs[i].exitcode}) without a result") from None
            if "error" in rec:
                raise RuntimeError(f"{what} {i} failed:\n{rec['error']}")
            records[i] = rec
    return [records[i] for i in range(len(pipes))]


def stop(procs: list) -> None:
    """Join child processes, killing any still alive after a grace period."""
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)


