"""Env steps per second of the env layer, with random actions and auto-reset on.

PixelReach-v0 at 64 px with 1, 8 and 64 envs in one process (K = 1 and 4 env steps per chunk),
plus its success rate under a random and a scripted policy; ManiSkill PushCube-v1 from RGB (CPU
physics, software renderer, 128 px camera resized to 64) with 1 env (in process) and 2 envs
(worker processes), and PushCube-v1 as configs/maniskill.yaml renders it (the framed camera at
64 px, 1 env, K = 4) with the robot drawn from its visual meshes and from its collision hulls
(env.robot_visual). "per env" = total / num_envs.

    python -m tests.benchmarks.env_throughput [--quick] [--out bench_results/env_throughput.json]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from asyncvla.actors.envs import make_env
from asyncvla.actors.envs.pixel_task import scripted_actions
from asyncvla.common.config import EnvConfig
from tests.benchmarks.report import Figure, main

IMAGE_SIZE = 64
PIXEL_ENVS = (1, 8, 64)
MANISKILL_ENVS = (1, 2)


def run(quick: bool = False) -> dict:
    results = {"image_size": IMAGE_SIZE, "pixel": [], "maniskill": []}
    pixel_steps = 20_000 if quick else 100_000
    for num_envs in PIXEL_ENVS:
        for K in (1, 4):
            env = make_env(EnvConfig(id="PixelReach-v0"), num_envs, IMAGE_SIZE, K, "chunk_level", seed=0)
            results["pixel"].append(_measure(env, "PixelReach-v0", max(1, pixel_steps // (num_envs * K))))
    results["pixel_success"] = _pixel_success_rates(episodes=1000 if quick else 5000)

    maniskill_chunks = 8 if quick else 40
    cfg = EnvConfig(id="PushCube-v1", max_episode_steps=48)
    for num_envs in MANISKILL_ENVS:
        for K in ((1, 4) if num_envs == 1 else (4,)):
            t0 = time.perf_counter()
            env = make_env(cfg, num_envs, IMAGE_SIZE, K, "chunk_level", seed=0, action_dim=7)
            create_s = time.perf_counter() - t0
            try:
                row = _measure(env, "PushCube-v1", maniskill_chunks * (4 // K))
            finally:
                env.close()
            results["maniskill"].append({**row, "create_s": round(create_s, 2)})
    framed = dict(id="PushCube-v1", control_mode="pd_ee_delta_pos", camera_fov=0.8,
                  camera_pose=[0.5, 0.0, 0.35, 0.05, 0.0, 0.02], render_size=IMAGE_SIZE, use_proprio=True,
                  max_episode_steps=50)
    for robot_visual in ("mesh", "hull"):
        env = make_env(EnvConfig(**framed, robot_visual=robot_visual), 1, IMAGE_SIZE, 4, "chunk_level",
                       seed=0, action_dim=4)
        try:
            row = _measure(env, f"PushCube-v1 framed 64 px, robot {robot_visual}", maniskill_chunks * 4)
        finally:
            env.close()
        results["maniskill"].append(row)
    return results


def _measure(env, name: str, chunks: int) -> dict:
    rng = np.random.default_rng(0)
    B, K, D = env.num_envs, env.num_action_chunks, env.action_dim
    actions = rng.uniform(-1, 1, (min(chunks, 256), B, K, D)).astype(np.float32)
    env.reset()
    env.step_chunk(actions[0])                               # warm-up
    steps, t0 = 0, time.perf_counter()
    for i in range(chunks):
        steps += env.step_chunk(actions[i % len(actions)]).env_steps
    elapsed = time.perf_counter() - t0
    return {"env": name, "num_envs": B, "K": K, "env_steps": steps, "seconds": round(elapsed, 3),
            "steps_per_s": round(steps / elapsed, 1), "steps_per_s_per_env": round(steps / elapsed / B, 1)}


def _pixel_success_rates(episodes: int) -> dict:
    """Success of a uniform-random policy (should be rare) and of the scripted oracle."""
    rng = np.random.default_rng(1)
    rates = {}
    policies = {"random": lambda e: rng.uniform(-1, 1, (e.num_envs, 4, 2)).astype(np.float32),
                "scripted": lambda e: scripted_actions(e, 4, 2)}
    for name, policy in policies.items():
        env = make_env(EnvConfig(id="PixelReach-v0"), 64, IMAGE_SIZE, 4, "chunk_level", seed=1)
        env.reset()
        done = []
        while len(done) < episodes:
            done += env.step_chunk(policy(env)).episodes
        rates[name] = {"episodes": len(done), "success_rate": float(np.mean([e["success"] for e in done])),
                       "mean_length": float(np.mean([e["length"] for e in done]))}
    return rates


def figures(results: dict) -> list[Figure]:
    out = []
    for row in results["pixel"] + results["maniskill"]:
        note = f"{row['steps_per_s_per_env']:.1f} per env"
        if "create_s" in row:
            note += f"; created in {row['create_s']:.1f} s"
        out.append(Figure("env throughput", f"{row['env']} {row['num_envs']} env(s) K={row['K']} steps/s",
                          row["steps_per_s"], "/s", note=note))
    for name, r in results["pixel_success"].items():
        out.append(Figure("env throughput", f"PixelReach-v0 {name} policy success", r["success_rate"], "%",
                          note=f"{r['episodes']} episodes, mean length {r['mean_length']:.1f} steps"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
