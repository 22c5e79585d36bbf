"""Demonstrations: the scripted pixel-task demonstrator, ManiSkill's trajectory format both ways,
files written the way ManiSkill's own RecordEpisode writes them, and one-line errors for bad files."""

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from asyncvla.actors.collect import collect_demos, demonstrator_for, env_info
from asyncvla.actors.experts import push_cube_action
from asyncvla.actors.envs.pixel_task import PixelReachEnv
from asyncvla.common.config import EnvConfig, load_config
from asyncvla.actors.envs.maniskill import flat_state
from asyncvla.common.data.demos import (DemoError, DemoSpec, camera_settings, find_files, flat_states, read_demos,
                                  write_demos)
from tests.support.paths import PIXEL



def pixel_cfg(*overrides):
    return load_config(PIXEL, list(overrides))


def spec(cfg):
    return DemoSpec(camera=cfg.env.camera, image_size=cfg.policy.image_size,
                    action_dim=cfg.policy.action_dim, control_mode=cfg.env.control_mode, env_id=cfg.env.id)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    cfg = pixel_cfg()
    episodes, stats = collect_demos(cfg, num_episodes=6, action_noise=0.3, seed=3, num_envs=4)
    out = tmp_path_factory.mktemp("demos")
    write_demos(out, episodes, env_info(cfg), camera=cfg.env.camera)
    return out, episodes, stats


def test_collect_keeps_successful_episodes_with_oracle_labels(demo_dir):
    _, episodes, stats = demo_dir
    assert stats["kept"] == len(episodes) == 6 and stats["attempted"] >= stats["solved"] >= 6
    cfg = pixel_cfg()
    for ep in episodes:
        T = ep.num_steps
        assert ep.images.shape == (T + 1, cfg.policy.image_size, cfg.policy.image_size, 3)
        assert ep.success[-1] and not ep.success[:-1].any()       # success ends the episode
        assert ep.instruction.startswith("move the white dot to the ")
        # the labels are the oracle's, the executed actions sometimes random
        assert np.abs(ep.actions).max() <= 1.0 and ep.executed_actions.shape == ep.actions.shape
    noisy = np.concatenate([(e.actions != e.executed_actions).any(1) for e in episodes])
    assert 0.1 < noisy.mean() < 0.6


def test_demos_end_at_success_when_rl_ignores_terminations(demo_dir):
    """env.ignore_terminations is for RL's episodes: the same seeds give the same demos with it."""
    _, episodes, _ = demo_dir
    again, _ = collect_demos(pixel_cfg("env.ignore_terminations=true"), num_episodes=6, action_noise=0.3,
                             seed=3, num_envs=4)
    assert [e.num_steps for e in again] == [e.num_steps for e in episodes]
    assert all(e.success[-1] and not e.success[:-1].any() for e in again)


def test_labels_are_what_the_oracle_does_in_the_recorded_state(demo_dir):
    """Replay one episode's executed actions from its seed: every frame and label reappears."""
    _, episodes, _ = demo_dir
    ep = episodes[0]
    env = PixelReachEnv(1, 64, 1, "action_level", auto_reset=False)
    env._seeds.take = lambda i: ep.seed     # noqa: SLF001 (the next reset draws the recorded episode)
    obs = env.reset()
    assert (obs["image"][0] == ep.images[0]).all()
    oracle = demonstrator_for(EnvConfig(id="PixelReach-v0"))
    for t in range(ep.num_steps):
        assert np.allclose(oracle(env, 2)[0, 0], ep.actions[t])
        step = env.step_chunk(ep.executed_actions[t][None, None])
        frame = step.final_obs["image"][0] if len(step.done_index) else step.obs["image"][0]
        assert (frame == ep.images[t + 1]).all()
    assert step.terminated[0]


def test_round_trip_in_maniskill_layout(demo_dir):
    out, episodes, _ = demo_dir
    meta = json.loads((out / "trajectory.json").read_text())
    assert meta["env_info"]["env_id"] == "PixelReach-v0"
    assert [e["episode_id"] for e in meta["episodes"]] == list(range(6))
    for key in ("episode_seed", "reset_kwargs", "elapsed_steps", "success", "instruction"):
        assert key in meta["episodes"][0]
    with h5py.File(out / "trajectory.h5") as f:
        g = f["traj_0"]
        assert g["obs/sensor_data/base_camera/rgb"].shape[0] == g["actions"].shape[0] + 1
        for key in ("actions", "expert_actions", "rewards", "terminated", "truncated", "success"):
            assert key in g
    loaded = read_demos(out, spec(pixel_cfg()))
    assert len(loaded) == 6
    for a, b in zip(episodes, loaded):
        assert (a.images == b.images).all() and np.array_equal(a.actions, b.actions)
        assert np.array_equal(a.executed_actions, b.executed_actions)
        assert a.instruction == b.instruction and a.seed == b.seed
    few = read_demos(out, spec(pixel_cfg()), max_steps=episodes[0].num_steps + episodes[1].num_steps)
    assert len(few) == 2


def write_like_record_episode(out: Path, T=5, D=7, size=64, control_mode="pd_ee_delta_pose"):
    """A file as mani_skill.utils.wrappers.RecordEpisode lays it out (more obs keys, no
    instruction, no expert_actions, numpy bools), e.g. from ManiSkill's tools on another machine."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with h5py.File(out / "trajectory.rgb.pd_ee_delta_pose.physx_cpu.h5", "w") as f:
        for i in range(2):
            g = f.create_group(f"traj_{i}")
            g.create_dataset("obs/agent/qvel", data=rng.normal(size=(T + 1, 9)).astype(np.float32))
            g.create_dataset("obs/agent/qpos", data=rng.normal(size=(T + 1, 9)).astype(np.float32))
            g.create_dataset("obs/extra/tcp_pose", data=rng.normal(size=(T + 1, 7)).astype(np.float32))
            g.create_dataset("obs/sensor_data/base_camera/rgb",
                             data=rng.integers(0, 255, (T + 1, size, size, 3), dtype=np.uint8))
            g.create_dataset("obs/sensor_param/base_camera/intrinsic_cv", data=np.zeros((T + 1, 3, 3)))
            g.create_dataset("actions", data=rng.uniform(-1, 1, (T, D)).astype(np.float32))
            g.create_dataset("terminated", data=np.eye(T, dtype=bool)[-1])
            g.create_dataset("truncated", data=np.zeros(T, bool))
            g.create_dataset("success", data=np.eye(T, dtype=bool)[-1])
            g.create_dataset("env_states/actors/cube", data=np.zeros((T + 1, 13), np.float32))
    meta = {"env_info": {"env_id": "PushCube-v1", "max_episode_steps": 50,
                         "env_kwargs": {"obs_mode": "rgb", "control_mode": control_mode,
                                        "sim_backend": "physx_cpu"}},
            "commit_info": {}, "source_type": "motionplanning", "source_desc": "",
            "episodes": [{"episode_id": i, "episode_seed": 10 + i, "control_mode": control_mode,
                          "elapsed_steps": T, "reset_kwargs": {"seed": 10 + i}, "success": True}
                         for i in range(2)]}
    (out / "trajectory.rgb.pd_ee_delta_pose.physx_cpu.json").write_text(json.dumps(meta))
    return out


def test_reads_files_laid_out_by_maniskill(tmp_path):
    out = write_like_record_episode(tmp_path / "ms")
    eps = read_demos(out, DemoSpec(action_dim=7, image_size=64, control_mode="pd_ee_delta_pose",
                                   env_id="PushCube-v1"))
    assert len(eps) == 2 and eps[0].instruction is None and eps[1].seed == 11
    assert eps[0].rewards is None and eps[0].executed_actions is None and eps[0].actions.shape == (5, 7)
    assert find_files(out / "trajectory.rgb.pd_ee_delta_pose.physx_cpu.h5")[0].exists()
    assert eps[0].states is None                      # the policy reads no state: none is loaded


def test_frames_of_another_camera_are_refused(tmp_path):
    """A file that records no camera settings holds the task camera's frames: a config that sets
    env.render_size (or a pose, or a fov) would train on images it never sees, and is refused."""
    out = write_like_record_episode(tmp_path / "ms")
    with pytest.raises(DemoError, match=r"camera_settings.*\{'render_size': 64\}.*collect them again"):
        read_demos(out, DemoSpec(action_dim=7, image_size=64, camera_settings=(("render_size", 64),)))
    assert len(read_demos(out, DemoSpec(action_dim=7, image_size=64, camera_settings=()))) == 2
    # the robot drawn from its hulls is another image too; ManiSkill's own meshes record nothing
    hull = tuple(sorted(camera_settings(EnvConfig(robot_visual="hull")).items()))
    assert hull == (("robot_visual", "hull"),) and camera_settings(EnvConfig()) == {}
    with pytest.raises(DemoError, match=r"camera_settings.*\{'robot_visual': 'hull'\}.*env.robot_visual"):
        read_demos(out, DemoSpec(action_dim=7, image_size=64, camera_settings=hull))


def test_the_state_is_agent_then_extra_each_in_name_order(tmp_path):
    out = write_like_record_episode(tmp_path / "ms")
    want = DemoSpec(action_dim=7, image_size=64, control_mode="pd_ee_delta_pose", state_dim=25)
    ep = read_demos(out, want)[1]
    flat = flat_states(ep.states)
    with h5py.File(next(out.glob("*.h5"))) as f:
        g = f["traj_1/obs"]
        expect = np.concatenate([g["agent/qpos"][()], g["agent/qvel"][()], g["extra/tcp_pose"][()]], axis=1)
    assert flat.shape == (6, 25) and np.array_equal(flat, expect)
    live = {"extra": {"tcp_pose": expect[0, 18:]}, "agent": {"qvel": expect[0, 9:18], "qpos": expect[0, :9]}}
    assert np.array_equal(flat_state(live), flat[0])  # an env's observation, flattened the same way
    with pytest.raises(DemoError, match=r"hold 25 state values.*policy.state_dim=9"):
        read_demos(out, DemoSpec(action_dim=7, image_size=64, state_dim=9))


def test_pixel_demos_record_the_state_the_env_gives(tmp_path):
    cfg = pixel_cfg("env.use_proprio=true", "policy.state_dim=2")
    episodes, _ = collect_demos(cfg, num_episodes=2, action_noise=0.0, seed=3, num_envs=2)
    write_demos(tmp_path, episodes, env_info(cfg), camera=cfg.env.camera)
    loaded = read_demos(tmp_path, DemoSpec(action_dim=2, image_size=64, state_dim=2))
    first = PixelReachEnv(2, 64, 1, "action_level", use_proprio=True).reset(seed=3 * 100_003)["state"]
    for b, ep in enumerate(loaded):                   # the oracle solves both envs of the first round
        states = flat_states(ep.states)
        assert states.shape == (ep.num_steps + 1, 2) and np.array_equal(states[0], first[b])
        assert not np.array_equal(states[0], states[-1])      # the agent moved


@pytest.mark.parametrize("case, words", [
    ("no_dir", ["does-not-exist", "no such demonstration directory"]),
    ("no_json", ["trajectory.json", "missing"]),
    ("truncated", ["trajectory.h5", "truncated"]),
    ("missing_group", ["traj_1", "missing"]),
    ("action_dim", ["actions", "expected [T, 2]"]),
    ("image_size", ["rgb", "expected uint8 [T+1, 64, 64, 3]"]),
    ("control_mode", ["control_mode", "expected 'pd_joint_delta_pos'"]),
])
def test_bad_files_raise_one_line_errors_naming_file_and_field(tmp_path, demo_dir, case, words):
    src, _, _ = demo_dir
    d = tmp_path / "bad"
    want = DemoSpec(action_dim=2, image_size=64)
    if case == "no_dir":
        d = tmp_path / "does-not-exist"
    elif case in ("action_dim", "image_size", "control_mode"):
        d = write_like_record_episode(d, D=7 if case == "action_dim" else 2,
                                      size=32 if case == "image_size" else 64)
        if case == "control_mode":
            want = DemoSpec(action_dim=2, image_size=64, control_mode="pd_joint_delta_pos")
    else:
        d.mkdir()
        for name in ("trajectory.h5", "trajectory.json"):
            (d / name).write_bytes((src / name).read_bytes())
        if case == "no_json":
            (d / "trajectory.json").unlink()
        elif case == "truncated":
            data = (d / "trajectory.h5").read_bytes()
            (d / "trajectory.h5").write_bytes(data[: len(data) // 3])
        elif case == "missing_group":
            with h5py.File(d / "trajectory.h5", "a") as f:
                del f["traj_1"]
    with pytest.raises(DemoError) as e:
        read_demos(d, want)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_sft_command_on_a_corrupt_file_prints_one_line(tmp_path, demo_dir):
    src, _, _ = demo_dir
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "trajectory.json").write_bytes((src / "trajectory.json").read_bytes())
    (d / "trajectory.h5").write_bytes(b"not an hdf5 file at all")
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "sft", str(PIXEL), f"sft.data={d}",
                        f"logging.output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("asyncvla sft:")]
    assert len(lines) == 1 and "trajectory.h5" in lines[0] and "HDF5" in lines[0], r.stderr[-2000:]


def test_collect_without_a_demonstrator_names_the_envs_that_have_one():
    with pytest.raises(ValueError, match=r"there is one for PickCube-v1, PullCube-v1, PushCube-v1\).*motion_planning"):
        demonstrator_for(EnvConfig(id="OpenCabinetDrawer-v1"))
    with pytest.raises(ValueError, match="acts in env.control_mode='pd_ee_delta_pos', not 'pd_ee_delta_pose'"):
        demonstrator_for(EnvConfig(id="PushCube-v1", control_mode="pd_ee_delta_pose"))


def test_the_push_cube_expert_goes_behind_the_cube_then_down_then_pushes_to_the_goal():
    """The expert's decision on positions alone (no simulator): from above the table it heads for
    the spot 5 cm behind the cube at 6 cm height; over that spot it goes down; low behind the cube
    it pushes +x, steering y back onto the cube's line; the hand stays closed throughout."""
    cube, goal = np.array([0.0, 0.05, 0.02]), np.array([0.2, 0.05, 0.001])
    far = push_cube_action([0.2, -0.1, 0.18], cube, goal)
    assert far.dtype == np.float32 and far.shape == (4,) and far[3] == -1.0
    assert far[0] < 0 and far[1] > 0 and far[2] < 0 and np.abs(far).max() <= 1.0   # toward (-0.07, 0.05, 0.06)
    above = push_cube_action([-0.07, 0.05, 0.06], cube, goal)
    assert np.allclose(above[:2], 0.0) and above[2] == pytest.approx(-0.4)          # straight down to 2 cm
    push = push_cube_action([-0.06, 0.055, 0.02], cube, goal)
    assert push[0] == 1.0 and push[1] == pytest.approx(-0.05) and push[2] == 0.0
    beside = push_cube_action([0.01, 0.12, 0.02], cube, goal)                         # low but not behind it
    assert beside[2] > 0 and beside[0] < 0                                            # up and back round
