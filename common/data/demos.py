"""Demonstrations in ManiSkill's trajectory format: `trajectory.h5` + `trajectory.json`.

    write_demos(out_dir, episodes, env_info, source_type=..., source_desc=...)
    episodes = read_demos(path, DemoSpec(camera=..., image_size=..., action_dim=..., control_mode=...))

The layout is the one `mani_skill.utils.wrappers.RecordEpisode` writes, so files made by
ManiSkill's own tools (motion planning, `replay_trajectory`) load here too:

    trajectory.h5
      traj_<id>/
        obs/sensor_data/<camera>/rgb   uint8 [T+1, H, W, 3]  the reset observation, then one per step
        obs/agent/*, obs/extra/*       float32 [T+1, ...]    the robot's own state (optional; e.g.
                                                             qpos, qvel, tcp_pose): with
                                                             env.use_proprio its leaves, agent then
                                                             extra, each in name order, are the state
        actions                        float32 [T, D]        what was executed
        rewards                        float32 [T]           (optional)
        terminated, truncated, success bool [T]              (success optional)
        expert_actions                 float32 [T, D]        ours, optional: the demonstrator's own
                                                             action where a noisy one was executed
    trajectory.json
      {"env_info": {"env_id", "env_kwargs": {"obs_mode", "control_mode", ...}, "max_episode_steps"},
       "source_type", "source_desc",
       "episodes": [{"episode_id", "episode_seed", "reset_kwargs", "control_mode", "elapsed_steps",
                     "success", "instruction" (ours, optional)}]}

Supervised fine-tuning learns `expert_actions` where present, else `actions`. Every problem with
a file raises `DemoError` with one line naming the file, the field and what was expected.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

H5_NAME = "trajectory.h5"
JSON_NAME = "trajectory.json"


class DemoError(ValueError):
    """A demonstration file that cannot be used: which file, which field, what was expected."""


@dataclass
class DemoEpisode:
    """One demonstration: T steps, T+1 observations."""
    images: np.ndarray            # uint8 [T+1, H, W, 3]
    actions: np.ndarray           # float32 [T, D]: the labels (expert actions where recorded)
    rewards: Optional[np.ndarray]  # float32 [T] or None
    success: np.ndarray           # bool [T]
    instruction: Optional[str]
    seed: Optional[int]
    episode_id: int = 0
    executed_actions: Optional[np.ndarray] = None   # float32 [T, D] where they differ from the labels
    states: Optional[dict] = None  # {"agent/qpos": float32 [T+1, n], ...}: ManiSkill's obs/agent, obs/extra

    @property
    def num_steps(self) -> int:
        return len(self.actions)


@dataclass(frozen=True)
class DemoSpec:
    """What the policy needs of a demo file; a file that differs is refused."""
    camera: str = "base_camera"
    image_size: int = 64
    action_dim: int = 7
    control_mode: Optional[str] = None     # None: not checked (the pixel task has none)
    state_dim: int = 0                     # > 0: every episode must carry a state of this size
    env_id: Optional[str] = None           # None: not checked
    camera_settings: Optional[tuple] = None  # camera_settings(env) as sorted items; None: not checked


def camera_settings(env_cfg) -> dict:
    """The camera keys a config sets (env.camera_pose, camera_fov, render_size, robot_uids, and
    robot_visual when not ManiSkill's own "mesh"), as recorded in a demo file's
    env_info.env_kwargs.camera_settings: frames from another camera, or of another-looking robot,
    are refused."""
    out = {k: getattr(env_cfg, k) for k in ("camera_pose", "camera_fov", "render_size", "robot_uids")
           if getattr(env_cfg, k) is not None}
    if "camera_pose" in out:
        out["camera_pose"] = [float(v) for v in out["camera_pose"]]
    if env_cfg.robot_visual != "mesh":
        out["robot_visual"] = env_cfg.robot_visual
    return out


# ------------------------------------------------------------------------------------ writing
def write_demos(out_dir, episodes: list[DemoEpisode], env_info: dict, camera: str = "base_camera",
                source_type: str = "scripted", source_desc: str = "") -> Path:
    """Write `episodes` as trajectory.h5 + trajectory.json in `out_dir` (replacing earlier files).
    Both are written under temporary names and renamed, so a reader never sees half a file."""
    import h5py

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h5_tmp, json_tmp = out / (H5_NAME + ".tmp"), out / (JSON_NAME + ".tmp")
    records = []
    with h5py.File(h5_tmp, "w") as f:
        for i, ep in enumerate(episodes):
            g = f.create_group(f"traj_{i}", track_order=True)
            g.create_dataset(f"obs/sensor_data/{camera}/rgb", data=ep.images, dtype=np.uint8,
                             compression="gzip", compression_opts=5)
            executed = ep.actions if ep.executed_actions is None else ep.executed_actions
            g.create_dataset("actions", data=executed, dtype=np.float32)
            if ep.executed_actions is not None:
                g.create_dataset("expert_actions", data=ep.actions, dtype=np.float32)
            ended = np.arange(ep.num_steps) == ep.num_steps - 1     # an episode ends at its last step
            g.create_dataset("terminated", data=ended & ep.success, dtype=bool)
            g.create_dataset("truncated", data=ended & ~ep.success, dtype=bool)
            g.create_dataset("success", data=ep.success, dtype=bool)
            if ep.rewards is not None:
                g.create_dataset("rewards", data=ep.rewards, dtype=np.float32)
            for key, value in (ep.states or {}).items():
                g.create_dataset(f"obs/{key}", data=value, dtype=np.float32)
            records.append({"episode_id": i, "episode_seed": ep.seed,
                            "reset_kwargs": {"seed": ep.seed} if ep.seed is not None else {},
                            "control_mode": env_info.get("env_kwargs", {}).get("control_mode"),
                            "elapsed_steps": ep.num_steps, "success": bool(ep.success[-1:].any()),
                            "instruction": ep.instruction})
    meta = {"env_info": env_info, "source_type": source_type, "source_desc": source_desc,
            "episodes": records}
    json_tmp.write_text(json.dumps(meta, indent=2))
    os.replace(h5_tmp, out / H5_NAME)
    os.replace(json_tmp, out / JSON_NAME)
    return out


# ------------------------------------------------------------------------------------ reading
def find_files(path) -> tuple[Path, Path]:
    """(h5, json) for a directory holding one trajectory file pair, or for the .h5 / .json itself.
    ManiSkill's tools name converted files e.g. trajectory.rgb.pd_ee_delta_pose.physx_cpu.h5."""
    p = Path(path)
    if p.is_dir():
        h5s = sorted(p.glob("*.h5"))
        if (p / H5_NAME).exists():
            h5s = [p / H5_NAME]
        if not h5s:
            raise DemoError(_no_trajectory_file(p))
        if len(h5s) > 1:
            raise DemoError(f"{p}: {len(h5s)} .h5 files ({', '.join(h.name for h in h5s)}); name one")
        h5 = h5s[0]
    elif p.suffix in (".h5", ".json"):
        h5 = p.with_suffix(".h5")
    else:
        raise DemoError(f"{p}: no such demonstration directory or .h5 file")
    js = h5.with_suffix(".json")
    for f in (h5, js):
        if not f.is_file():
            raise DemoError(f"{f}: missing (a demonstration set is a .h5 file and the .json beside it)")
    return h5, js


def _no_trajectory_file(p: Path) -> str:
    """Why directory `p` holds no trajectory file, in one line: a LeRobot dataset is named as one
    (its reader, not this one, takes it), so a broken one is not reported as missing .h5 files."""
    from asyncvla.common.data.lerobot import layout

    if layout.is_lerobot(p):
        return (f"{p}: a LeRobot dataset ({layout.INFO}), not ManiSkill's trajectory files; "
                f"allowed here: a directory with {H5_NAME} + {JSON_NAME}, or the .h5 file")
    if layout.lacks_info(p):
        return (f"{p / layout.INFO}: missing; {p} has LeRobot's layout (meta/, data/) but no "
                f"{layout.INFO} (codebase_version, fps, features), which every LeRobot dataset needs: "
                "restore it, or write the dataset again (it is written last, so an interrupted write "
                "leaves none)")
    return f"{p}: no trajectory .h5 file in this directory (expected {H5_NAME} + {JSON_NAME})"


def read_meta(path) -> dict:
    """The trajectory.json of a demonstration set, checked for the keys the reader uses."""
    _, js = find_files(path)
    try:
        meta = json.loads(js.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DemoError(f"{js}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("episodes"), list):
        raise DemoError(f"{js}: field 'episodes': expected a list of episode records")
    if not isinstance(meta.get("env_info"), dict):
        raise DemoError(f"{js}: field 'env_info': expected a mapping with env_id and env_kwargs")
    return meta


def read_demos(path, spec: DemoSpec, max_steps: Optional[int] = None) -> list[DemoEpisode]:
    """Load every episode (in file order, at most `max_steps` steps in all, whole episodes only)."""
    import h5py

    h5_path, js = find_files(path)
    meta = read_meta(path)
    _check_env_info(js, meta["env_info"], spec)
    try:
        f = h5py.File(h5_path, "r")
    except OSError as e:
        raise DemoError(f"{h5_path}: not a readable HDF5 file ({str(e).splitlines()[0]}); "
                        "it may be truncated") from None
    episodes, total = [], 0
    with f:
        for n, rec in enumerate(meta["episodes"]):
            ep = _read_episode(f, h5_path, js, n, rec, spec)
            if max_steps is not None and total + ep.num_steps > max_steps:
                break
            episodes.append(ep)
            total += ep.num_steps
    if not episodes:
        raise DemoError(f"{js}: field 'episodes': no episode to load" +
                        (f" within max_steps={max_steps}" if max_steps is not None else ""))
    return episodes


def _check_env_info(js: Path, info: dict, spec: DemoSpec) -> None:
    kwargs = info.get("env_kwargs") or {}
    if spec.env_id is not None and info.get("env_id") not in (None, spec.env_id):
        raise DemoError(f"{js}: field 'env_info.env_id': expected {spec.env_id!r}, got {info.get('env_id')!r}")
    mode = kwargs.get("control_mode")
    if spec.control_mode is not None and mode is not None and mode != spec.control_mode:
        raise DemoError(f"{js}: field 'env_info.env_kwargs.control_mode': expected {spec.control_mode!r} "
                        f"(env.control_mode), got {mode!r}; convert it with "
                        "python -m mani_skill.trajectory.replay_trajectory --target-control-mode")
    if spec.camera_settings is not None:
        recorded, wanted = kwargs.get("camera_settings") or {}, dict(spec.camera_settings)
        if recorded != wanted:
            raise DemoError(f"{js}: field 'env_info.env_kwargs.camera_settings': the demos were rendered with "
                            f"{recorded or 'the task camera as it is'}, this config sets "
                            f"{wanted or 'none'} (env.camera_pose, env.camera_fov, env.render_size, "
                            "env.robot_visual, env.robot_uids); "
                            "collect them again with this config")
    obs_mode = kwargs.get("obs_mode")
    if obs_mode is not None and "rgb" not in str(obs_mode):
        raise DemoError(f"{js}: field 'env_info.env_kwargs.obs_mode': expected an RGB mode (rgb, rgbd, "
                        f"rgb+...), got {obs_mode!r}; the policy learns from camera images")


def _read_episode(f, h5_path: Path, js: Path, n: int, rec: dict, spec: DemoSpec) -> DemoEpisode:
    if not isinstance(rec, dict) or "episode_id" not in rec:
        raise DemoError(f"{js}: field 'episodes[{n}].episode_id': missing")
    name = f"traj_{rec['episode_id']}"
    if name not in f:
        raise DemoError(f"{h5_path}: group '{name}' (episodes[{n}] of {js.name}) is missing; "
                        "the file may be truncated")
    g = f[name]
    where = f"{h5_path}: '{name}/"

    def field(key, required=True):
        if key not in g:
            if required:
                raise DemoError(f"{where}{key}' is missing")
            return None
        try:
            return np.asarray(g[key][()])
        except (OSError, KeyError) as e:
            raise DemoError(f"{where}{key}' cannot be read ({str(e).splitlines()[0]}); "
                            "the file may be truncated") from None

    actions = field("actions")
    expert = field("expert_actions", required=False)
    labels = expert if expert is not None else actions
    label_key = "expert_actions" if expert is not None else "actions"
    if labels.ndim != 2 or labels.shape[1] != spec.action_dim:
        raise DemoError(f"{where}{label_key}' has shape {list(labels.shape)}; expected [T, {spec.action_dim}] "
                        f"(policy.action_dim={spec.action_dim})")
    T = len(labels)
    if T == 0:
        raise DemoError(f"{where}{label_key}' is empty; expected at least one step")
    if not np.isfinite(labels).all():
        raise DemoError(f"{where}{label_key}' holds NaN or inf")
    images = field(f"obs/sensor_data/{spec.camera}/rgb")
    s = spec.image_size
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (s, s, 3):
        raise DemoError(f"{where}obs/sensor_data/{spec.camera}/rgb' is {images.dtype} {list(images.shape)}; "
                        f"expected uint8 [T+1, {s}, {s}, 3] (policy.image_size={s})")
    if len(images) != T + 1:
        raise DemoError(f"{where}obs/sensor_data/{spec.camera}/rgb' has {len(images)} frames; expected "
                        f"T+1 = {T + 1} (one per step and the reset observation)")
    rewards = field("rewards", required=False)
    success = field("success", required=False)
    for key, arr in (("rewards", rewards), ("success", success)):
        if arr is not None and arr.shape != (T,):
            raise DemoError(f"{where}{key}' has shape {list(arr.shape)}; expected [{T}]")
    if success is None:
        success = np.zeros(T, bool)
        success[-1] = bool(rec.get("success", False))
    states = _read_states(g, where, T, spec.state_dim) if spec.state_dim else None
    return DemoEpisode(images=images, actions=labels.astype(np.float32),
                       rewards=None if rewards is None else rewards.astype(np.float32),
                       success=success.astype(bool), instruction=rec.get("instruction"),
                       seed=rec.get("episode_seed"), episode_id=int(rec["episode_id"]),
                       executed_actions=None if expert is None else actions.astype(np.float32),
                       states=states)


def read_states(g) -> dict:
    """{"agent/qpos": float32 [T+1, n], ...}: every dataset under obs/agent and obs/extra of one
    episode's HDF5 group (as ManiSkill records them), in name order."""
    states = {}
    for group in STATE_GROUPS:
        if f"obs/{group}" in g:
            g[f"obs/{group}"].visititems(lambda name, node: states.__setitem__(
                f"{group}/{name}", np.asarray(node[()], np.float32)) if hasattr(node, "shape") else None)
    return states


def _read_states(g, where: str, T: int, state_dim: int) -> dict:
    """read_states, checked against policy.state_dim."""
    states = read_states(g)
    size = sum(int(np.prod(v.shape[1:])) for v in states.values())
    if size != state_dim:
        raise DemoError(f"{where}obs/agent' + 'obs/extra' hold {size} state values per step "
                        f"({', '.join(states) or 'none'}); policy.state_dim={state_dim} (env.use_proprio)")
    for key, v in states.items():
        if len(v) != T + 1:
            raise DemoError(f"{where}obs/{key}' has {len(v)} rows; expected T+1 = {T + 1}")
        if not np.isfinite(v).all():
            raise DemoError(f"{where}obs/{key}' holds NaN or inf")
    return states


STATE_GROUPS = ("agent", "extra")


def state_leaves(tree: dict, prefix: str = "") -> dict:
    """{"agent/qpos": array, ...}: the leaves of a nested observation dict by their paths."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(state_leaves(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def pick_state(states: dict, layout, task: str) -> np.ndarray:
    """float32 [N, S]: the keys of `layout` ((key, size) pairs in order: env.state_keys) from `states`
    ({"agent/qpos": [N, ...]} of task `task`), zeros for a key the task lacks, so that tasks with
    different observations share one state; a key the task gives with another size is named."""
    n = len(next(iter(states.values())))
    parts = []
    for key, size in layout:
        if key not in states:
            parts.append(np.zeros((n, size), np.float32))
            continue
        value = np.asarray(states[key], np.float32).reshape(n, -1)
        if value.shape[1] != size:
            raise ValueError(f"env.state_keys gives {key} {size} values, but {task} has {value.shape[1]}")
        parts.append(value)
    return np.concatenate(parts, axis=1) if parts else np.zeros((n, 0), np.float32)


def flat_states(states: dict) -> np.ndarray:
    """float32 [T+1, S]: the leaves of obs/agent then obs/extra, each group in name order, as the
    env's `flat_state` orders a live observation."""
    keys = sorted(states, key=lambda k: (STATE_GROUPS.index(k.split("/")[0]), k))
    return np.concatenate([states[k].reshape(len(states[k]), -1) for k in keys], axis=1).astype(np.float32)
