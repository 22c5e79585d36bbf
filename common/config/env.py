"""env: the environments actors run, and the checks on them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

from .fields import check_field, opt, walk

if TYPE_CHECKING:
    from .schema import Config


@dataclass
class TaskConfig:
    """One task of a multi-task policy (env.tasks): what its envs run and what they are told."""
    id: str = opt("PushCube-v1", "ManiSkill3 task id")
    instruction: Optional[str] = opt(None, "what the policy is told in training (and in evaluation with the "
                                     "training phrasings); null: the task's built-in sentence")
    eval_instruction: Optional[str] = opt(None, "a second phrasing, given only in evaluation with "
                                          "--instruction-set eval, to test the language path; null: the "
                                          "task's built-in second sentence")
    share: float = opt(1.0, "the task's share of the envs, relative to the other tasks' (each actor's envs "
                       "are dealt out in these proportions)", gt=0.0)
    max_episode_steps: Optional[int] = opt(None, "the task's episode limit; null: env.max_episode_steps", ge=1)
    reward_mode: Optional[str] = opt(None, "the task's reward mode; null: env.reward_mode",
                                     choices=["sparse", "dense", "normalized_dense"])


@dataclass
class EnvConfig:
    id: str = opt("PushCube-v1", "ManiSkill3 env id (e.g. PushCube-v1, PickCube-v1) or the built-in "
                  "pixel task 'PixelReach-v0'")
    instruction: Optional[str] = opt(None, "language instruction given to the policy; null takes the "
                                     "built-in one for the task")
    obs_mode: str = opt("rgb", "ManiSkill observation mode the wrapper reads images from",
                        choices=["rgb", "rgbd"])
    camera: str = opt("base_camera", "ManiSkill camera whose RGB image the policy sees")
    camera_pose: Optional[List[float]] = opt(None, "where env.camera looks from and at: [eye x, y, z, target "
                                             "x, y, z] in metres, world frame (ManiSkill's sensor_configs, "
                                             "pose = look_at(eye, target)); null: the task's own")
    camera_fov: Optional[float] = opt(None, "env.camera's field of view in radians; null: the task's own",
                                      gt=0.0, lt=3.14)
    render_size: Optional[int] = opt(None, "render env.camera at this square size in pixels, e.g. "
                                     "policy.image_size: nothing to resize, and at 64 px 4x fewer pixels "
                                     "than the default 128 to render on a CPU; null: the camera's own size, "
                                     "resized to policy.image_size", ge=16, le=1024)
    robot_visual: str = opt("mesh", "how the cameras draw the robot: mesh (its visual meshes, ~135 k "
                            "triangles for the Panda) or hull (its convex collision hulls, ~2 k: the same "
                            "shape, faceted; a 64 px frame on the software renderer ~4x cheaper, "
                            "actors/envs/robot_hulls.py)", choices=["mesh", "hull"])
    robot_uids: Optional[str] = opt(None, "ManiSkill robot to load (gym.make's robot_uids), e.g. "
                                    "panda_wristcam: the Panda with a camera on its hand "
                                    "(env.camera: hand_camera); null: the task's own")
    use_proprio: bool = opt(False, "also give the policy the robot's proprioceptive state")
    state_keys: Optional[Dict[str, int]] = opt(None, "with use_proprio: the state the policy reads, as "
                                               "{observation path: size} in order (e.g. {agent/qpos: 9, "
                                               "extra/goal_pos: 3}), zeros where a task lacks a key, so that "
                                               "env.tasks with different observations share one; null: every "
                                               "leaf of obs/agent and obs/extra in name order")
    control_mode: str = opt("pd_ee_delta_pose", "ManiSkill controller; pd_ee_delta_pose is 7-D like OpenVLA")
    reward_mode: str = opt("normalized_dense", "ManiSkill reward mode; a dense one with episodes that "
                           "end at success pays a policy to avoid success (pair it with "
                           "ignore_terminations, or use sparse)", choices=["sparse", "dense", "normalized_dense"])
    sim_backend: str = opt("physx_cpu", "physics backend: physx_cpu (one process per env) or "
                           "physx_cuda (all envs batched on the GPU)", choices=["physx_cpu", "physx_cuda"])
    render_backend: str = opt("cpu", "renderer device: cpu (software Vulkan) or gpu",
                              choices=["cpu", "gpu"])
    max_episode_steps: Optional[int] = opt(None, "episode time limit in env steps; null keeps the "
                                           "task's own", ge=1)
    auto_reset: bool = opt(True, "reset an env as soon as its episode ends (training needs this)")
    ignore_terminations: bool = opt(False, "never end an episode on success/failure, only on the time limit")
    seed: int = opt(0, "base seed; actor a seeds its envs with seed + 1000*a, and the k-th episode "
                    "of its env i starts from a seed derived from (that seed, i, k)", ge=0)
    sim_latency_ms: float = opt(0.0, "a modelled simulator on other hardware: each env step of an actor's "
                                "env batch takes at least this many ms of wall time, slept without holding a "
                                "core (actors only; see actors/envs/latency.py). 0: the env's own speed",
                                ge=0.0)
    use_fixed_reset_state_ids: bool = opt(False, "reset to a fixed sequence of initial states: every "
                                          "reset() starts the sequence over (reproducible evaluation)")
    tasks: List[TaskConfig] = opt([], "several ManiSkill tasks for one policy, told apart by their "
                                  "instructions (each item: the keys env.tasks[].*); every task shares "
                                  "env.camera, the image and the state; empty: env.id alone")
    retry_failed_starts: float = opt(0.0, "training only: the probability that an env's next episode "
                                      "starts from the initial state of a recent unsolved episode (each "
                                      "retried until solved, at most 3 times) instead of a fresh one, so "
                                      "the starts the policy fails train more often; 0: always fresh "
                                      "(actors/envs/starts.py StartSchedule)", ge=0.0, le=1.0)


def check_camera(env: "EnvConfig") -> list[str]:
    pose = env.camera_pose
    if pose is None:
        return []
    if len(pose) != 6 or not all(math.isfinite(v) for v in pose):
        return [f"env.camera_pose={list(pose)} must have 6 finite values: eye x, y, z and target x, y, z "
                "(metres)"]
    if all(abs(a - b) < 1e-6 for a, b in zip(pose[:3], pose[3:])):
        return [f"env.camera_pose={list(pose)}: the eye and the target are the same point"]
    return []


def check_tasks(env: "EnvConfig") -> list[str]:
    """The field checks of each env.tasks item, and what a mix must share: the pixel task has its
    own observations and the batched simulator runs one scene, so neither mixes."""
    problems = []
    for i, task in enumerate(env.tasks):
        problems += [p for key, value, meta in walk(task, f"env.tasks[{i}].") for p in check_field(key, value, meta)]
    for key, size in (env.state_keys or {}).items():
        if not isinstance(size, int) or size < 1:
            problems.append(f"env.state_keys.{key}={size!r}: a key's size is a whole number >= 1")
    if not env.tasks:
        return problems
    ids = [t.id for t in env.tasks]
    if env.id != ids[0]:
        problems.append(f"env.id={env.id!r} but env.tasks starts with {ids[0]!r}: with env.tasks, env.id names "
                        f"the first task (set env.id={ids[0]})")
    if len(set(ids)) != len(ids):
        problems.append(f"env.tasks={ids}: each task once (give a task's share of the envs with its 'share')")
    if "PixelReach-v0" in ids:
        problems.append(f"env.tasks={ids}: PixelReach-v0 has its own observations, which no ManiSkill task "
                        "shares; train it alone with env.id=PixelReach-v0 and env.tasks=[]")
    if len(ids) > 1 and env.sim_backend == "physx_cuda":
        problems.append(f"env.tasks={ids} with env.sim_backend=physx_cuda: the batched simulator runs one "
                        "task's scene; use physx_cpu (an env process each) for a mix")
    texts = [t.instruction for t in env.tasks if t.instruction is not None]
    if len(set(texts)) != len(texts):
        problems.append("env.tasks: two tasks have the same instruction, so the policy cannot tell them apart")
    return problems


def episode_limit(env: "EnvConfig") -> Optional[int]:
    """The longest episode any task's envs may run (null: some task keeps its own limit)."""
    limits = [t.max_episode_steps or env.max_episode_steps for t in env.tasks] or [env.max_episode_steps]
    return None if None in limits else max(limits)


def check_retry(config: "Config") -> list[str]:
    """Retried starts are restored from their seeds, one training episode at a time."""
    p = config.env.retry_failed_starts
    if not p:
        return []
    if config.env.use_fixed_reset_state_ids:
        why = "env.use_fixed_reset_state_ids=true: fixed initial states are for evaluation"
    elif config.env.sim_backend == "physx_cuda":
        why = "env.sim_backend=physx_cuda: the batched simulator's partial resets do not take seeds"
    else:
        return []
    return [f"env.retry_failed_starts={p} cannot be used with {why}; set it to 0"]
