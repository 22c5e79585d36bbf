"""ManiSkill3 tasks behind the chunk-stepping interface of `make_env`.

CPU (sim_backend physx_cpu): ManiSkill refuses num_envs > 1 on the CPU backend, so each env is a
single-env `EpisodeRunner`; with several envs each runner lives in its own worker process
(actors/envs/pool.py; multiprocessing 'forkserver': the parent may hold threads, torch or
sockets, which fork would copy) and runs the whole chunk there, so a chunk costs one round trip
per env and the envs step in parallel. A single env runs in the calling process (no process
start-up, no copies).

GPU (sim_backend physx_cuda): one batched ManiSkill env (`ManiSkillBatchedEnv`; it also runs a
single env with physx_cpu, which is how its logic is tested without a GPU).

Images come from the configured camera, resized to the policy's size; the optional proprio state
is ManiSkill's own state vector of its visual observation modes (robot qpos/qvel and the task's
non-privileged extras, e.g. the goal position a camera cannot see).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from asyncvla.actors.envs import pool
from asyncvla.actors.envs.base import (ChunkStep, EpisodeTracker, check_actions, task_per_env,
                                       check_reward_type, reduce_reward, resize_images, run_chunk)
from asyncvla.actors.envs.starts import StartSchedule
from asyncvla.actors.envs.tasks import Task, tasks_of
from asyncvla.actors.envs.robot_hulls import draw_robot_with_hulls
from asyncvla.common.data.demos import pick_state, state_leaves

START_TIMEOUT_S = 600.0   # creating an env takes 5-10 s alone, much longer on a busy machine
STEP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RunnerSpec:
    """What a worker needs to build its env (plain values: it crosses a process boundary)."""
    env_id: str
    obs_mode: str
    control_mode: str
    reward_mode: str
    render_backend: str
    max_episode_steps: Optional[int]
    camera: str
    use_proprio: bool
    image_size: int
    ignore_terminations: bool
    auto_reset: bool
    camera_pose: Optional[tuple] = None      # (eye xyz, target xyz)
    camera_fov: Optional[float] = None
    render_size: Optional[int] = None
    robot_visual: str = "mesh"               # or "hull": actors/envs/robot_hulls.py
    robot_uids: Optional[str] = None         # None: the task's own robot
    state_keys: Optional[tuple] = None       # ((observation path, size), ...): env.state_keys


def runner_spec(cfg, image_size: int, task: Optional[Task] = None) -> RunnerSpec:
    """The spec of an env of `task` (None: env.id's) from the env config."""
    task = task or tasks_of(cfg)[0]
    return RunnerSpec(task.id, cfg.obs_mode, cfg.control_mode, task.reward_mode, cfg.render_backend,
                      task.max_episode_steps, cfg.camera, cfg.use_proprio, image_size,
                      cfg.ignore_terminations, cfg.auto_reset,
                      tuple(cfg.camera_pose) if cfg.camera_pose is not None else None, cfg.camera_fov,
                      cfg.render_size, cfg.robot_visual, cfg.robot_uids,
                      tuple(cfg.state_keys.items()) if cfg.state_keys else None)


def make_kwargs(spec: RunnerSpec, sim_backend: str, num_envs: int) -> dict:
    """gym.make keyword arguments for a ManiSkill task."""
    kwargs = dict(num_envs=num_envs, obs_mode=spec.obs_mode, control_mode=spec.control_mode,
                  reward_mode=spec.reward_mode, sim_backend=sim_backend,
                  render_backend=spec.render_backend)
    if spec.robot_uids is not None:
        kwargs["robot_uids"] = spec.robot_uids
    if spec.max_episode_steps is not None:
        kwargs["max_episode_steps"] = spec.max_episode_steps
    camera = sensor_settings(spec)
    if camera:
        kwargs["sensor_configs"] = {spec.camera: camera}
    return kwargs


def sensor_settings(spec: RunnerSpec) -> dict:
    """env.camera_pose / camera_fov / render_size as ManiSkill's settings of one camera (empty: the
    task's own camera as it is)."""
    out = {}
    if spec.camera_pose is not None:
        from mani_skill.utils import sapien_utils
        out["pose"] = sapien_utils.look_at(list(spec.camera_pose[:3]), list(spec.camera_pose[3:]))
    if spec.camera_fov is not None:
        out["fov"] = float(spec.camera_fov)
    if spec.render_size is not None:
        out["width"] = out["height"] = int(spec.render_size)
    return out


def make(spec: RunnerSpec, sim_backend: str, num_envs: int):
    """gym.make of the task, its robot drawn from its hulls where spec.robot_visual says so, and
    rendering only the camera the policy sees; a camera that ManiSkill does not know (its
    sensor_configs take an unknown name for a setting of every camera) is named in one line with
    the task's cameras."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    kwargs = make_kwargs(spec, sim_backend, num_envs)
    try:
        env = gym.make(spec.env_id, **kwargs)
    except (AttributeError, AssertionError) as e:
        if "sensor_configs" not in kwargs:
            raise
        problem = camera_problem(spec.env_id, spec.camera, spec.render_backend, spec.robot_uids)
        if problem:
            raise ValueError(problem) from None
        raise ValueError(f"ManiSkill refused the settings of camera {spec.camera!r} (env.camera_pose, "
                         f"env.camera_fov, env.render_size): {e}") from None
    if spec.robot_visual == "hull":
        draw_robot_with_hulls(env.unwrapped)
    render_only(env.unwrapped, spec.camera)
    return env


def render_only(base_env, camera: str) -> None:
    """Stop rendering the cameras the policy does not see: an observation renders every camera of
    the task, and with panda_wristcam's hand camera PickCube's 128 px base camera doubled the cost
    of a step. Like the hull swap it holds until a reconfigure, which these envs never ask for."""
    sensors = getattr(base_env, "_sensors", None)
    if isinstance(sensors, dict) and camera in sensors:
        for name in [n for n in sensors if n != camera]:
            del sensors[name]


def camera_problem(env_id: str, camera: str, render_backend: str = "cpu",
                   robot_uids: Optional[str] = None) -> Optional[str]:
    """One line when env.id is not a ManiSkill task or env.camera is not one of its cameras, else
    None. Builds the task without observations (~1 s after ManiSkill's import), so that the launcher
    can say it before any process starts rather than an actor inside a traceback."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    robot = {}
    if robot_uids is not None:
        from mani_skill.agents.registration import REGISTERED_AGENTS
        if robot_uids not in REGISTERED_AGENTS:
            return f"env.robot_uids={robot_uids!r} is not a ManiSkill robot; its robots: {sorted(REGISTERED_AGENTS)}"
        robot = {"robot_uids": robot_uids}
    try:
        probe = gym.make(env_id, obs_mode="none", sim_backend="physx_cpu", render_backend=render_backend,
                         num_envs=1, **robot)
    except gym.error.Error as e:
        return f"env.id={env_id!r} is not a ManiSkill3 task nor PixelReach-v0 ({type(e).__name__}: {e})"
    try:
        names = sorted(getattr(probe.unwrapped, "_sensor_configs", {}))
    finally:
        probe.close()
    if camera not in names:
        return f"env.camera={camera!r} is not a camera of {env_id}; its cameras: {names}"
    return None


# ------------------------------------------------------------------------------ one CPU env
class EpisodeRunner:
    """One CPU ManiSkill env: resets, runs a chunk to the end of the episode, auto-resets."""

    def __init__(self, spec: RunnerSpec):
        from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

        self.spec = spec
        self.env = CPUGymWrapper(make(spec, "physx_cpu", 1))
        self.base = self.env.unwrapped
        self.tracker = EpisodeTracker(1)
        self.ended = False
        raw = self._raw_obs()
        first = self._convert(raw)   # checks the camera and gives the state size
        self.info = {"action_dim": int(self.env.action_space.shape[0]),
                     "state_dim": int(first["state"].shape[0]) if "state" in first else 0,
                     "state_sizes": {k: int(np.size(v)) for k, v in _state_tree_leaves(raw).items()}}

    def reset(self, seed: int) -> dict:
        self.tracker = EpisodeTracker(1)
        return self._reset(seed)

    def step_chunk(self, actions: np.ndarray, next_seed: int) -> dict:
        """actions [K,D]; next_seed: the seed of the next episode should this one end."""
        def step(action, active):
            _, reward, terminated, truncated, info = self.env.step(action[0])
            return ([reward], [bool(terminated)], [bool(truncated)], [bool(info.get("success", False))])

        with _cameras_off(self.base):
            out = run_chunk(step, actions[None], active=np.array([not self.ended]),
                            ignore_terminations=self.spec.ignore_terminations)
        self.tracker.add(out)
        result = {"rewards": out.rewards[0], "terminated": out.terminated[0],
                  "truncated": out.truncated[0], "success": out.success[0], "steps": int(out.steps[0]),
                  "final_obs": None, "episode": None}
        if out.done[0]:
            result["final_obs"] = self._observe()
            result["episode"] = self.tracker.finish(np.array([0]))[0]
            if self.spec.auto_reset:
                result["obs"] = self._reset(next_seed)
            else:
                self.ended = True
                result["obs"] = result["final_obs"]
        else:
            result["obs"] = self._observe()
        return result

    def frame(self) -> np.ndarray:
        """The camera image of the current observation at its own resolution."""
        return self._frame

    def expert_action(self) -> np.ndarray:
        """float32 [D]: the task's scripted expert's action in the current state (actors/experts.py:
        it reads the privileged state, for demonstrations only)."""
        from asyncvla.actors.experts import expert_for
        return expert_for(self.spec.env_id, self.spec.control_mode).act(self.base)

    def close(self) -> None:
        self.env.close()

    def _reset(self, seed: int) -> dict:
        obs, _ = self.env.reset(seed=int(seed))
        self.ended = False
        return self._convert(obs)

    def _observe(self) -> dict:
        return self._convert(self._raw_obs())

    def _raw_obs(self) -> dict:
        from mani_skill.utils import common
        return common.unbatch(common.to_numpy(self.base.get_obs()))

    def _convert(self, obs: dict) -> dict:
        self._frame = camera_rgb(obs, self.spec)
        state = None
        if self.spec.use_proprio and self.spec.state_keys:
            state = pick_state({k: np.asarray(v)[None] for k, v in _state_tree_leaves(obs).items()},
                               self.spec.state_keys, self.spec.env_id)[0]
        elif self.spec.use_proprio:
            state = flat_state({"agent": obs["agent"], "extra": obs["extra"]})
        out = policy_obs(self._frame[None], None if state is None else state[None], self.spec)
        return {k: v[0] for k, v in out.items()}


@contextlib.contextmanager
def _cameras_off(base_env):
    """ManiSkill renders every camera on every step (~40 ms with the software renderer), but inside
    a chunk only the observation after the last executed step is used. Stepping in the cheap
    state_dict mode and rendering once afterwards (`get_obs`) gives the same images and rewards."""
    mode = getattr(base_env, "_obs_mode", None)
    if mode is None:          # another ManiSkill version: just render every step
        yield
        return
    base_env._obs_mode = "state_dict"
    try:
        yield
    finally:
        base_env._obs_mode = mode


def name_ordered(tree: dict) -> dict:
    """The nested dict with every level's keys in name order (the order `flat_state` takes)."""
    return {k: name_ordered(v) if isinstance(v, dict) else v for k, v in sorted(tree.items())}


def flat_state(tree: dict) -> np.ndarray:
    """float32 [S]: the leaves of a nested observation dict, each level in name order (the order
    common/data/demos.py reads a recorded state in)."""
    leaves = []

    def walk(node):
        for _, value in sorted(node.items()):
            if isinstance(value, dict):
                walk(value)
            else:
                leaves.append(np.asarray(value, np.float32).reshape(-1))
    walk(tree)
    return np.concatenate(leaves) if leaves else np.zeros(0, np.float32)


# -------------------------------------------------------------------------- CPU, batched
class ManiSkillCPUEnv:
    """num_envs CPU ManiSkill envs (one runner each; worker processes when more than one). With
    `tasks` (one per env) env i runs tasks[i], its index in the run's tasks `env_tasks[i]`, and
    tells the policy the task's sentence; every task must give the policy the same observation and
    take the same action."""

    def __init__(self, cfg, num_envs: int, image_size: int, num_action_chunks: int, reward_type: str,
                 seed: int, action_dim: Optional[int] = None, starts: Optional[StartSchedule] = None,
                 tasks: Optional[list[Task]] = None, env_tasks=None):
        check_reward_type(reward_type)
        self.num_envs, self.num_action_chunks, self.reward_type = num_envs, num_action_chunks, reward_type
        tasks = tasks or tasks_of(cfg)[:1] * num_envs
        self.env_tasks = task_per_env(env_tasks, num_envs)
        self.instructions = [t.instruction for t in tasks]
        self._seeds = starts or StartSchedule.for_purpose("train", cfg, seed, num_envs, env_tasks=self.env_tasks)
        self._started = False
        specs = [runner_spec(cfg, image_size, t) for t in tasks]
        self._envs: list = []
        self._finalizer = weakref.finalize(self, pool.shutdown, self._envs)
        try:
            if num_envs == 1:
                self._envs.append(pool.InProcess(EpisodeRunner, specs[0]))
            else:
                ctx = mp.get_context("forkserver")
                self._envs.extend(pool.Worker(ctx, EpisodeRunner, spec, i, spec.env_id) for i, spec in enumerate(specs))
            infos = [env.recv(START_TIMEOUT_S) for env in self._envs]
            self.action_dim, self.state_dim = infos[0]["action_dim"], infos[0]["state_dim"]
            _check_one_space(tasks, infos)
            _check_action_dim(cfg, action_dim, self.action_dim)
        except BaseException:
            self.close()
            raise

    @property
    def episode_slots(self) -> np.ndarray:
        """int64 [B]: the slot of each env's current episode (starts.py)."""
        return self._seeds.slot.copy()

    def reset(self, seed: Optional[int] = None) -> dict:
        """Start a new episode in every env (`seed` re-seeds as at construction)."""
        self._seeds.restart(seed)
        for i, env in enumerate(self._envs):
            env.send("reset", self._seeds.take(i))
        self._started = True
        return _stack([env.recv(STEP_TIMEOUT_S) for env in self._envs])

    def step_chunk(self, actions) -> ChunkStep:
        if not self._started:
            raise RuntimeError("call reset() before step_chunk()")
        a = check_actions(actions, self.num_envs, self.num_action_chunks, self.action_dim)
        for i, env in enumerate(self._envs):
            env.send("step_chunk", a[i], self._seeds.peek(i))
        results = [env.recv(STEP_TIMEOUT_S) for env in self._envs]
        done = np.array([r["final_obs"] is not None for r in results])
        episodes = []
        for i in np.flatnonzero(done):
            retried = self._seeds.ended(int(i), results[i]["episode"]["success"])
            episodes.append({**results[i]["episode"], "env": int(i), "task": int(self.env_tasks[i]),
                             "retried": retried})
            self._seeds.take(int(i))
        done_index = np.flatnonzero(done).astype(np.int64)
        rewards = np.stack([r["rewards"] for r in results]).astype(np.float32)
        final_obs = (_stack([results[i]["final_obs"] for i in done_index]) if len(done_index)
                     else _empty_like(results[0]["obs"]))
        return ChunkStep(obs=_stack([r["obs"] for r in results]),
                         reward=reduce_reward(rewards, self.reward_type),
                         terminated=np.array([r["terminated"] for r in results], bool),
                         truncated=np.array([r["truncated"] for r in results], bool),
                         success=np.array([r["success"] for r in results], bool),
                         final_obs=final_obs, done_index=done_index, episodes=episodes,
                         env_steps=int(sum(r["steps"] for r in results)))

    def render_frames(self) -> np.ndarray:
        """uint8 [B,h,w,3]: each env's camera image at the camera's own resolution."""
        return self._ask_all("frame")

    def expert_actions(self) -> np.ndarray:
        """float32 [B,D]: each env's scripted expert action (demonstrations only)."""
        return self._ask_all("expert_action")

    def _ask_all(self, method: str) -> np.ndarray:
        for env in self._envs:
            env.send(method)
        return np.stack([env.recv(STEP_TIMEOUT_S) for env in self._envs])

    def close(self) -> None:
        """Close the envs and end the worker processes (also runs when the object is collected)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stack(obs_list: list[dict]) -> dict:
    return {k: np.stack([o[k] for o in obs_list]) for k in obs_list[0]}


def _empty_like(obs: dict) -> dict:
    return {k: np.zeros((0,) + v.shape, v.dtype) for k, v in obs.items()}


# ------------------------------------------------------------------------------ GPU, batched
class ManiSkillBatchedEnv:
    """All envs in one batched ManiSkill env (sim_backend physx_cuda; physx_cpu allows one env).

    The simulator steps every env together, so an env whose episode ended inside a chunk keeps
    moving; its final observation is captured at the step it ended and its later results are
    ignored. Ended envs are reset together after the chunk (a partial reset). Seeds: reset() seeds
    env i with the same per-env seed as the CPU path; later partial resets draw from ManiSkill's
    own seeded random state, so fixed reset states hold for each env's first episode only.
    """

    def __init__(self, cfg, num_envs: int, image_size: int, num_action_chunks: int, reward_type: str,
                 seed: int, action_dim: Optional[int] = None, starts: Optional[StartSchedule] = None,
                 tasks: Optional[list[Task]] = None, env_tasks=None):
        check_reward_type(reward_type)
        starts = starts or StartSchedule.for_purpose("train", cfg, seed, num_envs)
        task = (tasks or tasks_of(cfg))[0]
        if any(t.id != task.id for t in tasks or ()):     # (the config check says so first)
            raise ValueError("env.sim_backend=physx_cuda runs one task's scene: env.tasks cannot mix there")
        if starts.restores_starts:         # (the config checks say so first)
            raise ValueError("the batched simulator's partial resets cannot restore a start from its seed, as "
                             "GRPO's groups and env.retry_failed_starts need: use env.sim_backend=physx_cpu")
        self.spec = runner_spec(cfg, image_size, task)
        self.num_envs, self.num_action_chunks, self.reward_type = num_envs, num_action_chunks, reward_type
        self.instructions = [task.instruction] * num_envs
        self.env_tasks = task_per_env(env_tasks, num_envs)
        self._seeds = starts
        self.env = make(self.spec, cfg.sim_backend, num_envs)
        self.device = self.env.unwrapped.device
        self.action_dim = int(self.env.unwrapped.single_action_space.shape[0])
        _check_action_dim(cfg, action_dim, self.action_dim)
        self._obs = self._convert(self.env.unwrapped.get_obs())
        self.state_dim = int(self._obs["state"].shape[1]) if "state" in self._obs else 0
        self._ended = np.zeros(num_envs, bool)
        self._tracker = EpisodeTracker(num_envs, self.env_tasks)
        self._started = False

    def reset(self, seed: Optional[int] = None) -> dict:
        self._seeds.restart(seed)
        obs, _ = self.env.reset(seed=[self._seeds.take(i) for i in range(self.num_envs)])
        self._obs, self._started = self._convert(obs), True
        self._tracker = EpisodeTracker(self.num_envs, self.env_tasks)
        self._ended[:] = False
        return self._obs

    def step_chunk(self, actions) -> ChunkStep:
        import torch
        if not self._started:
            raise RuntimeError("call reset() before step_chunk()")
        a = check_actions(actions, self.num_envs, self.num_action_chunks, self.action_dim)
        last, finals, was_ended = {}, {}, self._ended.copy()

        def step(action, active):
            obs, reward, terminated, truncated, info = self.env.step(torch.from_numpy(action).to(self.device))
            last["obs"] = obs
            success = info.get("success", torch.zeros_like(terminated))
            return tuple(_numpy(x) for x in (reward.float(), terminated, truncated, success))

        def on_end(index):   # the simulator keeps stepping these envs: keep their final observation now
            rows = self._convert(last["obs"], index)
            for j, i in enumerate(index):
                finals[int(i)] = {k: v[j] for k, v in rows.items()}

        out = run_chunk(step, a, active=~self._ended, ignore_terminations=self.spec.ignore_terminations,
                        on_end=on_end)
        self._tracker.add(out)
        done = np.flatnonzero(out.done)
        obs = self._convert(last["obs"]) if last else self._obs
        if len(done) and self.spec.auto_reset:
            reset_obs, _ = self.env.reset(options={"env_idx": torch.as_tensor(done, device=self.device)})
            obs = self._convert(reset_obs)
        final_obs = ({k: np.stack([finals[int(i)][k] for i in done]) for k in obs} if len(done)
                     else {k: v[:0] for k, v in obs.items()})
        if not self.spec.auto_reset:   # an ended env shows its final observation until reset()
            self._ended[done] = True
            for k in obs:
                obs[k][done] = final_obs[k]
                obs[k][was_ended] = self._obs[k][was_ended]
        self._obs = obs
        return ChunkStep(obs=obs, reward=reduce_reward(out.rewards, self.reward_type),
                         terminated=out.terminated, truncated=out.truncated, success=out.success,
                         final_obs=final_obs, done_index=done.astype(np.int64),
                         episodes=self._tracker.finish(done), env_steps=int(out.steps.sum()))

    def render_frames(self) -> np.ndarray:
        return self._frames

    def close(self) -> None:
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _convert(self, obs: dict, index=None) -> dict:
        rows = slice(None) if index is None else _torch_index(index, self.device)
        frames = _numpy(camera_rgb(obs, self.spec)[rows])
        if index is None:
            self._frames = frames
        state = None
        if self.spec.use_proprio and self.spec.state_keys:
            state = pick_state({k: _numpy(v[rows]) for k, v in _state_tree_leaves(obs).items()},
                               self.spec.state_keys, self.spec.env_id)
        elif self.spec.use_proprio:
            from mani_skill.utils import common
            state = _numpy(common.flatten_state_dict(name_ordered({"agent": obs["agent"], "extra": obs["extra"]}),
                                                     use_torch=True, device=self.device)[rows])
        return policy_obs(frames, state, self.spec)


def _state_tree_leaves(obs: dict) -> dict:
    """{"agent/qpos": array, ...}: the state leaves (obs/agent and obs/extra) of an observation."""
    return state_leaves({"agent": obs["agent"], "extra": obs["extra"]})


def camera_rgb(obs: dict, spec: RunnerSpec):
    """The configured camera's RGB from a ManiSkill observation (an error names the cameras)."""
    cameras = obs["sensor_data"]
    if spec.camera not in cameras:
        raise ValueError(f"env.camera={spec.camera!r} is not a camera of {spec.env_id}; "
                         f"its cameras: {sorted(cameras)}")
    return cameras[spec.camera]["rgb"]


def policy_obs(frames: np.ndarray, state, spec: RunnerSpec) -> dict:
    """The policy's observation of B envs: images [B,h,w,3] resized to its size, float32 state."""
    out = {"image": resize_images(frames, spec.image_size)}
    if state is not None:
        out["state"] = np.asarray(state, np.float32)
    return out


def space_problem(cfg) -> Optional[str]:
    """One line when the tasks of env config `cfg` (env.tasks) do not give the policy one observation
    and take one action size, else None: each task built once, its camera at 16 px (~2 s each)."""
    tasks = tasks_of(cfg)
    if len(tasks) < 2:
        return None
    infos = []
    for task in tasks:
        spec = dataclasses.replace(runner_spec(cfg, 16, task), render_size=16)
        try:
            runner = EpisodeRunner(spec)
        except ValueError as e:                # (env.state_keys: a size the task does not have)
            return str(e)
        infos.append(runner.info)
        runner.close()
    try:
        _check_one_space(tasks, infos)
    except ValueError as e:
        return str(e)
    for key in (cfg.state_keys or {}) if cfg.use_proprio else ():    # (a size mismatch: pick_state's error)
        if not any(key in info["state_sizes"] for info in infos):
            return (f"env.state_keys names {key}, which no task of env.tasks has; they have: "
                    + "; ".join(f"{t.id} {', '.join(i['state_sizes'])}" for t, i in zip(tasks, infos)))
    return None


def _check_one_space(tasks: list[Task], infos: list[dict]) -> None:
    """Every env's task gives the policy the same observation and takes the same action: a mix
    that does not is named, with each task's sizes."""
    for key in ("action_dim", "state_dim"):
        sizes = {t.id: info[key] for t, info in zip(tasks, infos)}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"env.tasks do not share one {'action' if key == 'action_dim' else 'state'} size: "
                             + ", ".join(f"{k} {v}" for k, v in sizes.items())
                             + (" (env.use_proprio=true: each task's own state; set it false to mix them)"
                                if key == "state_dim" else " (env.control_mode)"))


def _check_action_dim(cfg, policy_dim: Optional[int], env_dim: int) -> None:
    if policy_dim is not None and policy_dim != env_dim:
        raise ValueError(f"policy.action_dim={policy_dim} but {cfg.id} with control_mode="
                         f"{cfg.control_mode!r} takes {env_dim}-D actions")


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _torch_index(index: np.ndarray, device):
    import torch
    return torch.as_tensor(np.asarray(index, np.int64), device=device)
