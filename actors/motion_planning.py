"""Demonstrations of ManiSkill tasks from ManiSkill's own motion-planning solutions.

    episodes, stats = collect_motion_planning(cfg, num_episodes=50, work_dir=RUN/demos/raw)

1. plan      `num_procs` worker processes run the task's solution (mani_skill.examples.motionplanning,
             with mplib) in pd_joint_pos, worker w's k-th plan from episode_seed(seed, w, k) as
             collection's env starts are seeded (actors/envs/starts.py), recording the successful
             episodes with ManiSkill's RecordEpisode; a progress bar counts them.
2. convert   ManiSkill's own replay tool (python -m mani_skill.trajectory.replay_trajectory) turns
             them into env.control_mode (pd_ee_delta_pose) with RGB observations, replaying every
             converted episode and saving only those that still reach success.
3. resize    the configured camera's frames to policy.image_size (as the env wrapper resizes
             them), with the robot's state (obs/agent, obs/extra), the task's instruction and its
             seed: DemoEpisodes for common/data/demos.py.

stats: attempted (plans tried), solved (plans that succeeded), converted (that replayed to
success in the target control mode) and kept.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from asyncvla.actors.envs.base import resize_images
from asyncvla.actors.envs.instructions import instruction_for
from asyncvla.actors.envs.starts import episode_seed
from asyncvla.common.data.demos import DemoEpisode, pick_state, read_states

PLAN_CONTROL_MODE = "pd_joint_pos"       # what ManiSkill's solutions command


def solutions() -> dict[str, Callable]:
    """Task id -> ManiSkill's motion-planning solution (imports mplib)."""
    from mani_skill.examples.motionplanning.panda.run import MP_SOLUTIONS
    return dict(MP_SOLUTIONS)


def check_task(env_id: str) -> None:
    names = solutions()
    if env_id not in names:
        raise ValueError(f"env.id={env_id!r} has no motion-planning solution; ManiSkill has one for: "
                         f"{', '.join(sorted(names))}")


def collect_motion_planning(cfg, num_episodes: int, work_dir, seed: int = 0, num_procs: int = 2,
                            progress: Optional[Callable[[int], None]] = None,
                            say: Callable[[str], None] = print) -> tuple[list[DemoEpisode], dict]:
    check_task(cfg.env.id)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    planned, attempted = _plan(cfg.env.id, num_episodes, work, seed, num_procs, progress)
    solved = len(read_meta(planned))          # the file also holds successes after the n-th
    say(f"converting {solved} plans to {cfg.env.control_mode} with RGB observations (ManiSkill's replay "
        f"tool, {num_procs} processes; about {solved * 4.3 / num_procs:.0f} s with CPU rendering)")
    converted_h5 = _convert(cfg, planned, num_procs)
    episodes = read_converted(converted_h5, cfg)[:num_episodes]
    return episodes, {"attempted": attempted, "solved": solved, "converted": len(read_meta(converted_h5)),
                      "kept": len(episodes), "steps": int(sum(ep.num_steps for ep in episodes))}


# --------------------------------------------------------------------------------------- plan
def _plan(env_id: str, n: int, work: Path, seed: int, num_procs: int, progress) -> tuple[Path, int]:
    """Successful plans into work/plans.h5 (+ .json), at least n of them; returns (file, attempts)."""
    ctx = mp.get_context("forkserver")
    results, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_plan_worker, args=(env_id, work / f"plans.{i}", seed, i, results, stop),
                         daemon=True) for i in range(num_procs)]
    for p in procs:
        p.start()
    solved = attempted = 0
    try:
        while solved < n:
            try:
                ok = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
                if len(dead) == len(procs):       # all gone without a word: killed or crashed
                    raise RuntimeError(f"the motion-planning workers of {env_id} died (exit codes "
                                       f"{[code for _, code in dead]}); a negative code is the signal "
                                       "that ended them") from None
                continue
            if isinstance(ok, str):                     # a worker's traceback
                raise RuntimeError(f"motion planning of {env_id} failed:\n{ok}")
            attempted += 1
            solved += bool(ok)
            if ok and progress is not None:
                progress(1)
            if attempted >= 4 * n + 8 and solved < n:
                raise ValueError(f"only {solved} of {attempted} motion plans of {env_id} succeeded")
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    while True:                                         # attempts that ended after the n-th success
        try:
            attempted += isinstance(results.get_nowait(), bool)
        except queue.Empty:
            break
    from mani_skill.trajectory.merge_trajectory import merge_trajectories
    parts = sorted(str(p) for p in work.glob("plans.*.h5"))
    out = work / "plans.h5"
    merge_trajectories(str(out), parts)
    return out, attempted


def _plan_worker(env_id: str, prefix: Path, seed: int, worker: int, results, stop) -> None:
    import traceback
    try:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the tasks)
        from mani_skill.utils.wrappers.record import RecordEpisode

        solve = solutions()[env_id]
        env = gym.make(env_id, obs_mode="none", control_mode=PLAN_CONTROL_MODE, render_mode="rgb_array",
                       sim_backend="physx_cpu")
        env = RecordEpisode(env, output_dir=str(prefix.parent), trajectory_name=prefix.name, save_video=False,
                            source_type="motionplanning", record_reward=False, save_on_reset=False,
                            source_desc="ManiSkill's motion-planning solution")
        k = 0
        while not stop.is_set():
            try:
                res = solve(env, seed=episode_seed(seed, worker, k))
                ok = res != -1 and bool(res[-1]["success"].item())
            except Exception:                  # the planner found no path from this state
                ok = False
            env.flush_trajectory(save=ok)
            results.put(ok)
            k += 1
        env.close()
    except Exception:
        results.put(traceback.format_exc())


def _states(g, env_cfg) -> dict:
    """The recorded state of one episode: every leaf, or (env.state_keys) the policy's layout of them."""
    states = read_states(g)
    if not env_cfg.state_keys:
        return states
    return {"agent/state": pick_state(states, tuple(env_cfg.state_keys.items()), env_cfg.id)}


# ------------------------------------------------------------------------------------ convert
def _convert(cfg, planned: Path, num_procs: int) -> Path:
    """ManiSkill's replay tool: env.control_mode, RGB, rewards of env.reward_mode; only episodes
    that replay to success are saved."""
    cmd = [sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(planned),
           "--target-control-mode", cfg.env.control_mode, "--obs-mode", "rgb", "--save-traj",
           "--use-first-env-state", "--sim-backend", "physx_cpu", "--num-envs", str(num_procs),
           "--record-rewards", "--reward-mode", cfg.env.reward_mode]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = planned.with_name(f"{planned.stem}.rgb.{cfg.env.control_mode}.physx_cpu.h5")
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"converting {planned} with ManiSkill's replay tool failed:\n{r.stderr[-3000:]}")
    return out


def read_meta(h5_path: Path) -> list[dict]:
    return json.loads(h5_path.with_suffix(".json").read_text())["episodes"]


def read_converted(h5_path: Path, cfg) -> list[DemoEpisode]:
    """The converted episodes, with the configured camera resized to the policy's size."""
    import h5py

    instruction = instruction_for(cfg.env.id, cfg.env.instruction)
    episodes = []
    with h5py.File(h5_path, "r") as f:
        for rec in read_meta(h5_path):
            g = f[f"traj_{rec['episode_id']}"]
            cameras = g["obs/sensor_data"]
            if cfg.env.camera not in cameras:
                raise ValueError(f"env.camera={cfg.env.camera!r} is not in {h5_path} (cameras: {sorted(cameras)})")
            frames = np.asarray(cameras[cfg.env.camera]["rgb"][()])
            success = np.asarray(g["success"][()], bool)
            episodes.append(DemoEpisode(
                images=resize_images(frames, cfg.policy.image_size),
                actions=np.asarray(g["actions"][()], np.float32),
                rewards=np.asarray(g["rewards"][()], np.float32) if "rewards" in g else None,
                success=success, instruction=instruction, seed=rec.get("episode_seed"),
                episode_id=len(episodes), states=_states(g, cfg.env)))
    return episodes

