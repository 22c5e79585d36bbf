"""`asyncvla convert SRC --out DIR`: demonstrations in ManiSkill's trajectory format (SRC: a directory
with trajectory.h5 + trajectory.json, e.g. from `asyncvla collect`, or the .h5 file) -> a LeRobot
v3.0 dataset in DIR, which LeRobot's tools open and `asyncvla sft CONFIG sft.data=DIR` reads.

The camera's frames become observation.images.<camera> (H.264 mp4, yuv420p), obs/agent and
obs/extra the observation.state, the labels (the demonstrator's actions) the action, rewards and
success next.reward and next.success; each episode's instruction is its task (episodes without one
take --task, else the built-in instruction of the file's env id). The observation after an
episode's last step has no action and is not written.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from asyncvla.launch.collect_cmd import LEROBOT_FPS

    p = sub.add_parser("convert", help="convert demonstrations (ManiSkill's .h5) to a LeRobot v3.0 dataset",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="demonstrations: a directory with trajectory.h5 + trajectory.json, or the .h5")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory of the LeRobot dataset")
    p.add_argument("--fps", type=int, default=LEROBOT_FPS,
                   help=f"frames per second the demos were recorded at (default {LEROBOT_FPS}: ManiSkill's "
                        "tabletop tasks act at 20 Hz)")
    p.add_argument("--camera", help="the camera to take (obs/sensor_data/<camera>); default: the only or first one")
    p.add_argument("--task", help="the task text of episodes that carry no instruction")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.common.data.demos import DemoError

    try:
        if args.fps < 1:
            raise ValueError(f"--fps={args.fps}: allowed: an integer >= 1")
        n, frames = convert(args.src, args.out, args.fps, args.camera, args.task)
    except (DemoError, ValueError) as e:
        print(f"asyncvla convert: {e}", file=sys.stderr)
        return 2
    print(f"asyncvla convert: {n} episodes, {frames} frames -> {args.out}")
    return 0


def convert(src, out, fps: int, camera=None, task=None) -> tuple[int, int]:
    """Write the episodes of `src` as a LeRobot v3.0 dataset in `out`; (episodes, frames)."""
    from asyncvla.common.data.demos import read_demos, read_meta
    from asyncvla.common.data.lerobot.write import write_lerobot

    spec = source_spec(src, camera)
    episodes = read_demos(src, spec)
    if task is None and any(not ep.instruction for ep in episodes):
        from asyncvla.actors.envs.instructions import instruction_for
        task = instruction_for(read_meta(src)["env_info"].get("env_id"))
    write_lerobot(out, episodes, fps=fps, camera=spec.camera, default_task=task, progress=True)
    return len(episodes), sum(ep.num_steps for ep in episodes)


def source_spec(src, camera=None):
    """A DemoSpec that takes the file as it is: its camera, image size, action and state sizes read
    from the first episode (read_demos then holds every other episode to them)."""
    import h5py
    import numpy as np

    from asyncvla.common.data.demos import DemoError, DemoSpec, find_files, read_meta, read_states

    h5_path, _ = find_files(src)
    episodes = read_meta(src)["episodes"]
    if not episodes:
        raise DemoError(f"{h5_path}: no episodes to convert")
    with h5py.File(h5_path, "r") as f:
        name = f"traj_{episodes[0].get('episode_id')}"
        if name not in f:
            raise DemoError(f"{h5_path}: group '{name}' is missing; the file may be truncated")
        g = f[name]
        cameras = sorted(g["obs/sensor_data"]) if "obs/sensor_data" in g else []
        if camera is None and not cameras:
            raise DemoError(f"{h5_path}: '{name}/obs/sensor_data' holds no camera; allowed: RGB demos")
        camera = camera or cameras[0]
        if camera not in cameras:
            raise DemoError(f"{h5_path}: --camera={camera!r} is not in '{name}/obs/sensor_data'; it has: "
                            f"{', '.join(cameras) or 'none'}")
        size = g[f"obs/sensor_data/{camera}/rgb"].shape[1]
        labels = g["expert_actions"] if "expert_actions" in g else g["actions"]
        state_dim = sum(int(np.prod(v.shape[1:])) for v in read_states(g).values())
        return DemoSpec(camera=camera, image_size=size, action_dim=labels.shape[1], state_dim=state_dim)
