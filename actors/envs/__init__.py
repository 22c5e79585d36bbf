"""Environments for actors and evaluation, stepped one action chunk at a time.

    env = make_env(cfg.env, num_envs, image_size, num_action_chunks, reward_type, seed)
    obs = env.reset()                       # {"image": uint8 [B,H,W,3], "state": float32 [B,S] if S > 0}
    step = env.step_chunk(actions)          # float32 [B,K,D] in [-1,1] -> ChunkStep (see base.py)
    env.num_envs, env.action_dim, env.state_dim, env.instructions, env.env_tasks, env.render_frames(), env.close()
(the `ChunkEnv` protocol of base.py)

ManiSkill3 tasks (any env id; CPU: one process per env, GPU: one batched env), several of them
side by side (env.tasks: tasks.py), and the built-in pixel task PixelReach-v0.
"""

from __future__ import annotations

from typing import Optional

from asyncvla.actors.envs.base import ChunkEnv, ChunkStep
from asyncvla.actors.envs.pixel_task import ENV_ID as PIXEL_REACH_ID
from asyncvla.actors.envs.pixel_task import PixelReachEnv
from asyncvla.actors.envs.starts import StartSchedule
from asyncvla.actors.envs.tasks import deal, tasks_of


def make_env(env_cfg, num_envs: int, image_size: int, num_action_chunks: int, reward_type: str,
             seed: int, action_dim: Optional[int] = None, group_size: int = 1, purpose: str = "train",
             first_env: int = 0) -> ChunkEnv:
    """Build `num_envs` envs of `env_cfg.id` for `purpose` (train, evaluate or collect: where their
    episodes start, starts.py StartSchedule). `action_dim` (the policy's D) is checked against a
    ManiSkill task's action space; PixelReach-v0 takes it as is (it reads the first 2 dims).
    `group_size` > 1 (GRPO, training): every group_size consecutive episodes start from one initial
    state (`env.episode_slots` numbers them). With several tasks (env.tasks) these are envs
    `first_env` .. of the fleet, each running the task `tasks.deal` gives it and telling the policy
    its sentence."""
    if num_envs < 1:
        raise ValueError(f"num_envs={num_envs} must be >= 1")
    tasks = tasks_of(env_cfg)
    env_tasks = deal(tasks, first_env, num_envs)
    starts = StartSchedule.for_purpose(purpose, env_cfg, seed, num_envs, group_size, env_tasks)
    if env_cfg.id == PIXEL_REACH_ID:
        return PixelReachEnv(num_envs, image_size, num_action_chunks, reward_type, seed,
                             action_dim=action_dim or 2, max_episode_steps=env_cfg.max_episode_steps,
                             reward_mode=env_cfg.reward_mode,
                             ignore_terminations=env_cfg.ignore_terminations,
                             auto_reset=env_cfg.auto_reset, instruction=env_cfg.instruction,
                             use_proprio=env_cfg.use_proprio, starts=starts)
    from asyncvla.actors.envs.maniskill import ManiSkillBatchedEnv, ManiSkillCPUEnv
    cls = ManiSkillBatchedEnv if env_cfg.sim_backend == "physx_cuda" else ManiSkillCPUEnv
    return cls(env_cfg, num_envs, image_size, num_action_chunks, reward_type, seed, action_dim, starts,
               [tasks[t] for t in env_tasks], env_tasks)


__all__ = ["make_env", "ChunkEnv", "ChunkStep", "PixelReachEnv", "PIXEL_REACH_ID"]
