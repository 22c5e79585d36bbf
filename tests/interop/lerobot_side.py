"""lerobot's side of the LeRobot interop test (tests/test_lerobot_interop.py): runs in the interop
environment (`make interop-env`: lerobot 0.4.3 and what its dataset module imports), never in the
project's own, and touches nothing of ours. Two commands, both on files:

    python lerobot_side.py read DATASET OUT.npz
        LeRobotDataset(root=DATASET) as lerobot loads it: every frame's episode index, action,
        state, task and decoded camera image (uint8 HWC), and the dataset's episode count.
    python lerobot_side.py write EPISODES.npz DATASET
        A new dataset written by lerobot's own writer (LeRobotDataset.create, add_frame per frame,
        save_episode per episode, finalize) from the episodes in EPISODES.npz (see `write`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def read(root: str, out: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("local/interop", root=root, video_backend="pyav")
    camera = ds.meta.video_keys[0]
    frames = [ds[i] for i in range(len(ds))]
    image = np.stack([(f[camera].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for f in frames])
    state = (np.stack([f["observation.state"].numpy() for f in frames]) if "observation.state" in ds.features
             else np.zeros((len(frames), 0), np.float32))
    np.savez(out, episode=np.array([int(f["episode_index"]) for f in frames]),
             action=np.stack([f["action"].numpy() for f in frames]), state=state, image=image,
             task=np.array([f["task"] for f in frames]),
             meta=json.dumps({"num_episodes": ds.num_episodes, "num_frames": ds.num_frames, "camera": camera,
                              "fps": ds.fps, "codebase_version": ds.meta.info["codebase_version"]}))


def write(episodes: str, root: str) -> None:
    """EPISODES.npz: image [N, H, W, 3] uint8, action [N, D], state [N, S] (S may be 0), episode [N]
    (0, 0, ..., 1, ...), task [N], and fps, camera."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    data = np.load(episodes)
    image, action, state, episode = data["image"], data["action"], data["state"], data["episode"]
    camera = f"observation.images.{data['camera']}"
    features = {camera: {"dtype": "video", "shape": image.shape[1:], "names": ["height", "width", "channels"]},
                "action": {"dtype": "float32", "shape": action.shape[1:], "names": None}}
    if state.shape[1]:
        features["observation.state"] = {"dtype": "float32", "shape": state.shape[1:], "names": None}
    ds = LeRobotDataset.create("local/interop", fps=int(data["fps"]), features=features, root=root,
                               use_videos=True, video_backend="pyav", vcodec=str(data["vcodec"]))
    for n in np.unique(episode):
        for i in np.flatnonzero(episode == n):
            frame = {camera: image[i], "action": action[i].astype(np.float32), "task": str(data["task"][i])}
            if state.shape[1]:
                frame["observation.state"] = state[i].astype(np.float32)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


if __name__ == "__main__":
    command, src, dst = sys.argv[1:4]
    {"read": read, "write": write}[command](src, dst)
    print(f"lerobot_side: {command} {Path(src).name} -> {Path(dst).name}: ok")
