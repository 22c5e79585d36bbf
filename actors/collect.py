"""Demonstrations from a scripted demonstrator, recorded for supervised fine-tuning.

    episodes, stats = collect_demos(cfg, num_episodes=100, action_noise=0.3, seed=7)

Demonstrators: the pixel task's oracle, and the scripted experts of ManiSkill tasks
(actors/experts.py, e.g. PushCube-v1 in pd_ee_delta_pos), which read the simulator's privileged
state inside each env's process; the recorded observations are the policy's (image, robot state).

The demonstrator acts one env step at a time (the env is built with chunks of one step, so every
step's observation is recorded). With `action_noise` p, each step executes a uniformly random
action with probability p while the demonstrator's own action stays the label: the demos then
cover states off the demonstrator's path, and the policy learns how to come back from them.
Only successful episodes are kept; `stats` says how many were attempted, solved and kept.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from asyncvla.actors.envs import PIXEL_REACH_ID, make_env
from asyncvla.actors.envs.starts import episode_seed
from asyncvla.actors.envs.tasks import deal, tasks_of
from asyncvla.actors.envs.pixel_task import scripted_actions
from asyncvla.actors.experts import expert_for
from asyncvla.common.data.demos import DemoEpisode, camera_settings

# demonstrator(env, action_dim) -> actions float32 [B, 1, D] for the current step
Demonstrator = Callable[[object, int], np.ndarray]


def demonstrator_for(env_cfg) -> Demonstrator:
    """The env's demonstrator, or a ValueError naming the keys and what is allowed."""
    if env_cfg.id == PIXEL_REACH_ID:
        return lambda env, action_dim: scripted_actions(env, 1, action_dim)
    for env_id in [t.id for t in env_cfg.tasks] or [env_cfg.id]:   # (checked here, before any env starts)
        expert_for(env_id, env_cfg.control_mode)
    return lambda env, action_dim: env.expert_actions()[:, None]


def collect_demos(cfg, num_episodes: int, action_noise: float, seed: int, num_envs: int = 16,
                  progress=None) -> tuple[list[DemoEpisode], dict]:
    """Run the demonstrator until `num_episodes` successful episodes are recorded.

    progress: an optional callable(n) told of each kept episode (e.g. a tqdm bar's update).
    Gives up (ValueError) when 4x the wanted number of episodes yields too few successes."""
    if not 0.0 <= action_noise <= 1.0:
        raise ValueError(f"action_noise={action_noise} must lie in [0, 1]")
    demonstrate = demonstrator_for(cfg.env)
    D = cfg.policy.action_dim
    # A demonstration ends where the expert succeeds, whatever RL's env.ignore_terminations says:
    # past it the expert has nothing to show, and the demo would run to the time limit.
    env_cfg = dataclasses.replace(cfg.env, auto_reset=False, ignore_terminations=False)
    tasks = tasks_of(cfg.env)
    # Several tasks (env.tasks): an env for each at least, and each task's share of the episodes.
    num_envs = max(len(tasks), min(num_envs, num_episodes))
    quota = np.bincount(deal(tasks, 0, num_episodes), minlength=len(tasks))
    env = make_env(env_cfg, num_envs, cfg.policy.image_size, 1, "action_level", seed, action_dim=D, purpose="collect")
    rng = np.random.default_rng(seed)
    kept, attempted, solved, round_ = [], 0, 0, 0
    try:
        while len(kept) < num_episodes:
            if attempted >= 4 * num_episodes:
                raise ValueError(f"only {solved} of {attempted} demonstrations of "
                                 f"{', '.join(t.id for t in tasks)} succeeded "
                                 f"(collect.action_noise={action_noise}); lower the noise")
            reset_seed = seed * 100_003 + round_
            episodes = _run_round(env, demonstrate, D, action_noise, rng, reset_seed)
            round_ += 1
            attempted += len(episodes)
            for ep, task in zip(episodes, env.env_tasks):
                if ep.success[-1] and quota[task] > 0:
                    quota[task] -= 1
                    solved += 1
                    ep.episode_id = len(kept)
                    kept.append(ep)
                    if progress is not None:
                        progress(1)
                elif ep.success[-1]:
                    solved += 1
    finally:
        env.close()
    stats = {"attempted": attempted, "solved": solved, "kept": len(kept),
             "steps": int(sum(ep.num_steps for ep in kept))}
    return kept, stats


def _run_round(env, demonstrate, D: int, noise: float, rng, reset_seed: int) -> list[DemoEpisode]:
    """One episode in every env, from the initial states of `reset_seed`."""
    B = env.num_envs
    obs = env.reset(seed=reset_seed)
    instructions = list(env.instructions)
    frames = [[obs["image"][b]] for b in range(B)]
    states = [[obs["state"][b]] for b in range(B)] if "state" in obs else None
    labels, executed, rewards, success = ([[] for _ in range(B)] for _ in range(4))
    active = np.ones(B, bool)
    while active.any():
        label = np.asarray(demonstrate(env, D), np.float32)             # [B, 1, D]
        act = label.copy()
        noisy = rng.random(B) < noise
        act[noisy] = rng.uniform(-1.0, 1.0, (int(noisy.sum()), 1, D)).astype(np.float32)
        step = env.step_chunk(act)
        for b in np.flatnonzero(active):
            seen = step.obs if b not in step.done_index else step.final_obs
            row = b if b not in step.done_index else list(step.done_index).index(b)
            frames[b].append(seen["image"][row])
            if states is not None:
                states[b].append(seen["state"][row])
            labels[b].append(label[b, 0])
            executed[b].append(act[b, 0])
            rewards[b].append(float(np.asarray(step.reward)[b].sum()))
            success[b].append(bool(step.success[b]))
        active[step.done_index] = False
        obs = step.obs
    return [DemoEpisode(images=np.stack(frames[b]), actions=np.stack(labels[b]),
                        rewards=np.asarray(rewards[b], np.float32), success=np.asarray(success[b]),
                        instruction=instructions[b], seed=episode_seed(reset_seed, b, 0),
                        executed_actions=np.stack(executed[b]) if noise > 0 else None,
                        states={"agent/state": np.stack(states[b])} if states is not None else None)
            for b in range(B)]


def env_info(cfg) -> dict:
    """The `env_info` record of trajectory.json for this config (ManiSkill's keys)."""
    kwargs = {"obs_mode": "rgb", "reward_mode": cfg.env.reward_mode, "image_size": cfg.policy.image_size}
    if cfg.env.id != PIXEL_REACH_ID:
        kwargs.update(control_mode=cfg.env.control_mode, sim_backend=cfg.env.sim_backend,
                      camera_settings=camera_settings(cfg.env))
    return {"env_id": cfg.env.id, "env_kwargs": kwargs, "max_episode_steps": cfg.env.max_episode_steps}
