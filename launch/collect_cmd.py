"""`asyncvla collect CONFIG --episodes N --out DIR`: record demonstrations for supervised fine-tuning.

collect.method=scripted (the pixel task's, and `auto`'s there):
  PixelReach-v0: the oracle (heads straight for the target);
  ManiSkill tasks with a scripted expert (PushCube-v1, in env.control_mode=pd_ee_delta_pos): the
  expert reads the privileged object and goal poses (the policy never does) and acts in the
  control mode RL uses; one env per worker process (collect.num_procs).
  Either way `collect.action_noise` of the steps execute a random action while the
  demonstrator's own action stays the label.
collect.method=motion_planning (`auto`'s for ManiSkill tasks): ManiSkill's own motion-planning
  solutions (PushCube-v1, PickCube-v1, ...), in collect.num_procs processes, converted to
  env.control_mode with RGB by ManiSkill's replay tool, which keeps only episodes that replay to
  success (actors/motion_planning.py; the raw plans stay in DIR/raw).
Only successful episodes are kept; the line at the end gives their share. The output is ManiSkill's trajectory format,
DIR/trajectory.h5 + DIR/trajectory.json, with images at the policy's size (policy.image_size), the
instruction of each episode and its seed; `asyncvla sft CONFIG sft.data=DIR` reads it.
--format lerobot writes a LeRobot v3.0 dataset instead (H.264 video at --fps; common/data/lerobot/write.py),
which `asyncvla sft` reads as well and LeRobot's own tools open.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("collect", help="record demonstrations (ManiSkill trajectory format) for SFT",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. collect.action_noise=0.2")
    p.add_argument("--episodes", type=int, help="successful episodes to keep (collect.num_episodes)")
    p.add_argument("--noise", type=float, help="share of random executed actions (collect.action_noise)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--format", choices=["maniskill", "lerobot"], default="maniskill",
                   help="maniskill: trajectory.h5 + .json (default); lerobot: a LeRobot v3.0 dataset")
    p.add_argument("--fps", type=int, default=LEROBOT_FPS,
                   help=f"--format lerobot: frames per second recorded (default {LEROBOT_FPS}: ManiSkill's "
                        "tabletop tasks act at 20 Hz)")
    p.set_defaults(func=run)


LEROBOT_FPS = 20


def run(args) -> int:
    from asyncvla.common.config import ConfigError, load_config, parse_overrides

    overrides = parse_overrides(args.overrides)
    if args.episodes is not None:
        overrides.append(f"collect.num_episodes={args.episodes}")
    if args.noise is not None:
        overrides.append(f"collect.action_noise={args.noise}")
    try:
        cfg = load_config(args.config, overrides)
        if args.fps < 1:
            raise ValueError(f"--fps={args.fps}: allowed: an integer >= 1")
        stats = collect(cfg, args.out, args.format, args.fps)
    except (ConfigError, ValueError) as e:
        print(f"asyncvla collect: {e}", file=sys.stderr)
        return 2
    converted = f"{stats['converted']} replayed to success in {cfg.env.control_mode}, " if "converted" in stats else ""
    share = f" ({100 * stats['solved'] / stats['attempted']:.1f} %)" if stats["attempted"] else ""
    print(f"asyncvla collect: {stats['attempted']} episodes attempted, {stats['solved']} solved{share}, {converted}"
          f"{stats['kept']} kept ({stats['steps']} steps) -> {args.out}")
    return 0


def collect(cfg, out_dir, fmt: str = "maniskill", fps: int = LEROBOT_FPS) -> dict:
    """Record cfg.collect.num_episodes demonstrations into out_dir (`fmt`: maniskill or lerobot);
    returns the counts."""
    from tqdm import tqdm

    from pathlib import Path

    from asyncvla.actors.collect import collect_demos, env_info
    from asyncvla.actors.envs import PIXEL_REACH_ID
    from asyncvla.actors.envs.tasks import tasks_of
    from asyncvla.common.data.demos import camera_settings, write_demos

    c = cfg.collect
    method = c.method if c.method != "auto" else "scripted" if cfg.env.id == PIXEL_REACH_ID else "motion_planning"
    if method == "motion_planning" and cfg.env.id == PIXEL_REACH_ID:
        raise ValueError(f"collect.method=motion_planning is for ManiSkill tasks; {PIXEL_REACH_ID} has a "
                         "scripted oracle: collect.method=scripted")
    if method == "motion_planning" and len(cfg.env.tasks) > 1:
        raise ValueError(f"collect.method=motion_planning plans one task; env.tasks has {len(cfg.env.tasks)}: "
                         "use collect.method=scripted, or collect each task alone (env.tasks=[] env.id=TASK)")
    if method == "motion_planning" and cfg.env.robot_visual != "mesh":
        raise ValueError(f"env.robot_visual={cfg.env.robot_visual!r}: collect.method=motion_planning renders "
                         "its demos with ManiSkill's replay tool, which draws the robot's visual meshes; "
                         "set env.robot_visual=mesh, or use collect.method=scripted")
    camera = camera_settings(cfg.env)
    if method == "motion_planning" and camera:
        key = next(iter(camera))
        raise ValueError(f"env.{key}={getattr(cfg.env, key)!r}: collect.method=motion_planning renders "
                         "the task's own camera and robot (ManiSkill's replay tool); leave env.camera_pose, "
                         "env.camera_fov, env.render_size and env.robot_uids unset, or use "
                         "collect.method=scripted")
    if method == "scripted":
        # (ManiSkill: one env, so one worker process, per collect.num_procs)
        num_envs = c.num_envs if cfg.env.id == PIXEL_REACH_ID else c.num_procs
        with tqdm(total=c.num_episodes, desc="collect", unit="episode", dynamic_ncols=True) as bar:
            episodes, stats = collect_demos(cfg, c.num_episodes, c.action_noise, c.seed, num_envs,
                                            progress=bar.update)
        source = ("scripted", f"scripted demonstrator of {', '.join(t.id for t in tasks_of(cfg.env))} in "
                              f"{cfg.env.control_mode}, "
                              f"action_noise={c.action_noise}")
    else:
        from asyncvla.actors.motion_planning import check_task, collect_motion_planning
        check_task(cfg.env.id)
        with tqdm(total=c.num_episodes, desc="motion plans", unit="episode", dynamic_ncols=True) as bar:
            episodes, stats = collect_motion_planning(cfg, c.num_episodes, Path(out_dir) / "raw", c.seed,
                                                      c.num_procs, progress=bar.update, say=bar.write)
        source = ("motionplanning", f"ManiSkill's motion-planning solution of {cfg.env.id}, converted to "
                                    f"{cfg.env.control_mode} by mani_skill.trajectory.replay_trajectory")
    if fmt == "lerobot":
        from asyncvla.common.data.lerobot.write import write_lerobot
        from asyncvla.launch.sft_cmd import default_instruction
        write_lerobot(out_dir, episodes, fps=fps, camera=cfg.env.camera, default_task=default_instruction(cfg))
    else:
        write_demos(out_dir, episodes, env_info(cfg), camera=cfg.env.camera, source_type=source[0],
                    source_desc=source[1])
    return stats
