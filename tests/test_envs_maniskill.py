"""The ManiSkill wrapper on real ManiSkill3 (CPU physics, software renderer).

Creating an env costs seconds, so envs are shared: PickCube-v1 with one env runs in this process
(after the first, more in-process envs are cheap), PushCube-v1 with two envs runs in worker
processes. Short time limits force truncations.
"""

import gc
import multiprocessing as mp
import time

import numpy as np
import pytest

from asyncvla.actors.envs import ChunkEnv, make_env
from asyncvla.actors.envs.base import resize_images
from asyncvla.actors.envs.starts import RETRY_TRIES, episode_seed
from asyncvla.common.config import EnvConfig
from tests.support.paths import MANISKILL

K, SIZE = 4, 64
FRAMED = "[0.5,0,0.35,0.05,0,0.02]"     # a camera over the workspace: eye, target (metres)


def maniskill_env(env_id, num_envs=1, reward_type="chunk_level", seed=0, **cfg):
    cfg.setdefault("max_episode_steps", 6)
    return make_env(EnvConfig(id=env_id, **cfg), num_envs, SIZE, K, reward_type, seed, action_dim=7)


def actions(seed, num_envs, scale=1.0):
    return (scale * np.random.default_rng(seed).uniform(-1, 1, (num_envs, K, 7))).astype(np.float32)


@pytest.fixture(scope="module")
def pick():
    env = maniskill_env("PickCube-v1", reward_type="action_level", seed=1, use_proprio=True)
    yield env
    env.close()


@pytest.fixture(scope="module")
def push_holder():
    holder = {"env": maniskill_env("PushCube-v1", num_envs=2, seed=2)}
    yield holder
    if "env" in holder:
        holder["env"].close()


def test_observations(pick, push_holder):
    push = push_holder["env"]
    for env, B in ((pick, 1), (push, 2)):
        obs = env.reset()
        assert env.num_envs == B and env.action_dim == 7
        assert obs["image"].shape == (B, SIZE, SIZE, 3) and obs["image"].dtype == np.uint8
        assert obs["image"].std() > 5                      # a rendered scene, not a blank frame
        assert env.render_frames().shape == (B, 128, 128, 3)
    assert "state" not in push.reset() and push.state_dim == 0
    assert pick.state_dim > 0 and pick.reset()["state"].shape == (1, pick.state_dim)
    assert pick.reset()["state"].dtype == np.float32
    assert pick.instructions == ["pick up the red cube and move it to the goal position"]
    assert push.instructions == ["push the blue cube to the red and white target"] * 2


def test_chunks_truncation_and_final_observation_in_workers(push_holder):
    env = push_holder["env"]
    env.reset()
    first = env.step_chunk(actions(0, 2))
    assert first.env_steps == 2 * K and first.reward.shape == (2,) and first.reward.dtype == np.float32
    assert not (first.truncated | first.terminated).any() and len(first.done_index) == 0
    assert first.final_obs["image"].shape == (0, SIZE, SIZE, 3)
    assert first.success.dtype == np.bool_ and first.terminated.dtype == np.bool_
    second = env.step_chunk(actions(1, 2))                 # the time limit (6) falls inside the chunk
    assert second.env_steps == 2 * 2
    assert second.truncated.all() and not second.terminated.any()
    np.testing.assert_array_equal(second.done_index, [0, 1])
    assert second.final_obs["image"].shape == (2, SIZE, SIZE, 3)
    assert [(e["env"], e["length"]) for e in second.episodes] == [(0, 6), (1, 6)]
    np.testing.assert_allclose([e["return"] for e in second.episodes], first.reward + second.reward,
                               rtol=1e-5)
    # after the auto-reset the robot is back at its start pose: the new first frame differs
    assert not np.array_equal(second.obs["image"], second.final_obs["image"])
    third = env.step_chunk(actions(2, 2))
    assert third.env_steps == 2 * K and not third.truncated.any()


def test_chunk_matches_plain_maniskill_stepping(pick):
    """The wrapper skips rendering inside a chunk; the result must equal stepping ManiSkill plainly."""
    import gymnasium as gym
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    plain = CPUGymWrapper(gym.make("PickCube-v1", num_envs=1, obs_mode="rgb", control_mode="pd_ee_delta_pose",
                                   reward_mode="normalized_dense", sim_backend="physx_cpu",
                                   render_backend="cpu", max_episode_steps=6))
    try:
        obs = pick.reset(seed=5)
        ref, _ = plain.reset(seed=episode_seed(5, 0, 0))
        rgb = lambda o: resize_images(o["sensor_data"]["base_camera"]["rgb"][None], SIZE)
        np.testing.assert_array_equal(obs["image"], rgb(ref))
        a = actions(3, 1)
        step = pick.step_chunk(a)
        rewards = []
        for k in range(K):
            ref, r, *_ = plain.step(a[0, k])
            rewards.append(r)
        np.testing.assert_allclose(step.reward[0], rewards, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(step.obs["image"], rgb(ref))
        assert step.reward.shape == (1, K)
        # the episode ends after 2 more steps: action-level rewards are 0 after the end
        end = pick.step_chunk(actions(4, 1))
        assert end.truncated[0] and end.env_steps == 2 and (end.reward[0, 2:] == 0).all()
        assert end.final_obs["state"].shape == (1, pick.state_dim)
    finally:
        plain.close()


def test_termination_kept_apart_from_truncation():
    """Put the cube on the goal: the next step succeeds and terminates, long before the time limit."""
    import torch
    from mani_skill.utils.structs.pose import Pose

    def place_cube_on_goal(env):
        base = env._envs[0].runner.base
        goal = base.goal_region.pose.p.clone()
        goal[..., 2] = base.cube_half_size
        base.obj.set_pose(Pose.create_from_pq(p=goal, q=torch.tensor([[1.0, 0, 0, 0]])))

    env = maniskill_env("PushCube-v1", reward_type="action_level", max_episode_steps=50)
    ignoring = maniskill_env("PushCube-v1", max_episode_steps=50, ignore_terminations=True)
    try:
        env.reset(), ignoring.reset()
        place_cube_on_goal(env), place_cube_on_goal(ignoring)
        still = np.zeros((1, K, 7), np.float32)
        step = env.step_chunk(still)
        assert step.terminated[0] and not step.truncated[0] and step.success[0]
        assert step.env_steps == 1 and (step.reward[0, 1:] == 0).all()
        assert step.episodes[0]["success"] and step.episodes[0]["length"] == 1
        kept = ignoring.step_chunk(still)
        assert kept.success[0] and not kept.terminated[0] and kept.env_steps == K and not kept.episodes
    finally:
        env.close(), ignoring.close()


def test_same_seed_same_observations(pick):
    twin = maniskill_env("PickCube-v1", reward_type="action_level", seed=1, use_proprio=True)
    try:
        a = actions(7, 1)
        o1, o2 = pick.reset(seed=9), twin.reset(seed=9)
        np.testing.assert_array_equal(o1["image"], o2["image"])
        s1, s2 = pick.step_chunk(a), twin.step_chunk(a)
        np.testing.assert_array_equal(s1.obs["image"], s2.obs["image"])
        np.testing.assert_array_equal(s1.reward, s2.reward)
        assert not np.array_equal(pick.reset(seed=10)["image"], o1["image"])
        # without fixed reset states each reset() starts a fresh episode
        assert not np.array_equal(pick.reset()["image"], pick.reset()["image"])
    finally:
        twin.close()


def test_fixed_reset_states_repeat_and_no_auto_reset_waits():
    env = maniskill_env("PickCube-v1", seed=4, use_fixed_reset_state_ids=True, auto_reset=False,
                        max_episode_steps=2)
    try:
        first = env.reset()["image"]
        step = env.step_chunk(actions(0, 1))
        assert step.truncated[0] and step.env_steps == 2
        np.testing.assert_array_equal(step.obs["image"], step.final_obs["image"])
        frozen = env.step_chunk(actions(1, 1))           # an ended env waits for reset()
        assert frozen.env_steps == 0 and not frozen.truncated[0] and not frozen.episodes
        np.testing.assert_array_equal(env.reset()["image"], first)
    finally:
        env.close()


def test_a_failed_start_is_replayed_from_its_seed():
    """env.retry_failed_starts=1: an unsolved episode's initial state comes back, RETRY_TRIES
    times in all, whichever episode the env had already been told to start next."""
    env = maniskill_env("PickCube-v1", seed=6, max_episode_steps=2, retry_failed_starts=1.0)
    try:
        starts = [env.reset()["image"][0]]
        n = 2 * (RETRY_TRIES + 1)
        for _ in range(n):
            step = env.step_chunk(np.zeros((1, K, 7), np.float32))     # holding still never solves
            assert step.truncated[0] and not step.episodes[0]["success"]
            starts.append(step.obs["image"][0])
        assert sum(np.array_equal(s, starts[0]) for s in starts[:n]) == RETRY_TRIES + 1
        assert not any(np.array_equal(starts[n], s) for s in starts[:n])   # then a fresh start
    finally:
        env.close()


def test_errors_are_named():
    with pytest.raises(ValueError, match="env.camera='wrist'"):
        maniskill_env("PickCube-v1", camera="wrist")
    with pytest.raises(ValueError, match="no built-in instruction"):
        maniskill_env("PlaceNothing-v1")
    before = set(mp.active_children())
    with pytest.raises(RuntimeError, match=r"\(PlaceNothing-v1\) failed: .*doesn't exist"):
        maniskill_env("PlaceNothing-v1", num_envs=2, instruction="do it")
    assert not set(mp.active_children()) - before      # no worker left behind


def test_workers_end_on_close_and_on_garbage_collection(push_holder):
    env = push_holder.pop("env")
    procs = [w.proc for w in env._envs]
    assert all(p.is_alive() for p in procs)
    del env
    gc.collect()
    deadline = time.monotonic() + 15
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in procs)


def test_batched_env_matches_the_cpu_path(pick):
    """The GPU path's class (one batched env) run with one CPU env: same rewards, observations,
    truncation and final observation as the per-env CPU path for the same seed and actions."""
    from asyncvla.actors.envs.maniskill import ManiSkillBatchedEnv

    cfg = EnvConfig(id="PickCube-v1", max_episode_steps=6, use_proprio=True)
    batched = ManiSkillBatchedEnv(cfg, 1, SIZE, K, "action_level", seed=1, action_dim=7)
    assert isinstance(batched, ChunkEnv) and isinstance(pick, ChunkEnv)
    try:
        o1, o2 = pick.reset(seed=3), batched.reset(seed=3)
        for key in ("image", "state"):
            np.testing.assert_array_equal(o1[key], o2[key])
        assert batched.state_dim == pick.state_dim
        for i in range(2):
            a = actions(20 + i, 1, scale=0.5)
            s1, s2 = pick.step_chunk(a), batched.step_chunk(a)
            np.testing.assert_allclose(s1.reward, s2.reward, rtol=1e-5, atol=1e-6)
            for f in ("terminated", "truncated", "success", "done_index"):
                np.testing.assert_array_equal(getattr(s1, f), getattr(s2, f))
            assert s1.env_steps == s2.env_steps == (K if i == 0 else 2)
        np.testing.assert_array_equal(s1.final_obs["image"], s2.final_obs["image"])
        np.testing.assert_allclose(s1.final_obs["state"], s2.final_obs["state"], rtol=1e-5, atol=1e-6)
        assert s2.truncated[0] and s2.episodes[0]["length"] == 6
        assert s2.obs["image"].shape == (1, SIZE, SIZE, 3)
        assert batched.render_frames().shape == (1, 128, 128, 3)
    finally:
        batched.close()


def test_scripted_push_cube_demos_in_the_rl_control_mode(tmp_path):
    """`asyncvla collect` with collect.method=scripted on PushCube-v1: the expert, reading the
    privileged poses inside the env's worker, solves every episode in pd_ee_delta_pos in well
    under the motion planner's ~70 steps; the file holds the policy's observations (64 px image,
    robot state) and the clean 4-D labels, each episode ending in success."""
    import json
    import subprocess
    import sys

    from asyncvla.common.data.demos import DemoError, DemoSpec, read_demos

    out = tmp_path / "demos"
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "collect", str(MANISKILL),
                        "collect.method=scripted", "env.control_mode=pd_ee_delta_pos", "policy.action_dim=4",
                        "collect.action_noise=0.1", "collect.num_procs=1", f"env.camera_pose={FRAMED}",
                        "env.camera_fov=0.8", "env.render_size=64", "--episodes", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 kept" in r.stdout and "solved (100.0 %)" in r.stdout, r.stdout
    meta = json.loads((out / "trajectory.json").read_text())
    assert meta["env_info"]["env_kwargs"]["control_mode"] == "pd_ee_delta_pos"
    assert meta["source_type"] == "scripted"
    camera = {"camera_pose": [0.5, 0.0, 0.35, 0.05, 0.0, 0.02], "camera_fov": 0.8, "render_size": 64,
              "robot_visual": "hull"}                      # (configs/maniskill.yaml draws the robot's hulls)
    assert meta["env_info"]["env_kwargs"]["camera_settings"] == camera
    spec = DemoSpec(action_dim=4, control_mode="pd_ee_delta_pos", state_dim=25, env_id="PushCube-v1",
                    camera_settings=tuple(sorted(camera.items())))
    episodes = read_demos(out, spec)     # (what SFT reads: the 25-D robot state)
    with pytest.raises(DemoError, match="camera_settings.*this config sets none"):     # another camera's frames
        read_demos(out, DemoSpec(action_dim=4, control_mode="pd_ee_delta_pos", state_dim=25, camera_settings=()))
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.actions.shape[1] == 4 and np.abs(ep.actions).max() <= 1.0 and (ep.actions[:, 3] == -1).all()
        assert ep.success[-1] and ep.num_steps < 40
        assert ep.images.shape[1:] == (64, 64, 3) and len(ep.images) == ep.num_steps + 1


def test_camera_keys_reach_maniskill_and_a_camera_it_lacks_is_named():
    """env.camera_pose / camera_fov / render_size go to ManiSkill's sensor_configs: the frames come
    at the render size from the configured pose; a camera the task lacks is one line with its cameras."""
    framed = maniskill_env("PushCube-v1", camera_pose=[0.5, 0.0, 0.35, 0.05, 0.0, 0.02], camera_fov=0.8,
                           render_size=SIZE)
    default = maniskill_env("PushCube-v1", render_size=SIZE)
    try:
        a, b = framed.reset(seed=3)["image"], default.reset(seed=3)["image"]
        assert framed.render_frames().shape == (1, SIZE, SIZE, 3) and a.shape == b.shape == (1, SIZE, SIZE, 3)
        assert np.abs(a.astype(int) - b).mean() > 20            # another view of the same scene
    finally:
        framed.close()
        default.close()
    with pytest.raises(ValueError) as e:
        maniskill_env("PushCube-v1", camera="hand_camera", render_size=SIZE)
    assert str(e.value) == "env.camera='hand_camera' is not a camera of PushCube-v1; its cameras: ['base_camera']"


def test_a_groups_episodes_start_from_one_initial_state_whichever_env_runs_them():
    """GRPO (algorithm.group_size 3 on 2 envs in workers): slots 0-2 are group 0, run by env 0,
    env 1, then env 0 again a chunk later; their first observations are equal, and group 1's
    differ from them."""
    env = make_env(EnvConfig(id="PushCube-v1", max_episode_steps=4, use_proprio=True), 2, SIZE, K, "chunk_level",
                   seed=4, action_dim=7, group_size=3)
    try:
        first = {}
        obs = env.reset()
        for b, slot in enumerate(env.episode_slots):
            first[int(slot)] = {k: v[b] for k, v in obs.items()}
        for step in range(3):              # each chunk ends every episode (4 steps): new slots start
            out = env.step_chunk(actions(step, 2))
            assert list(out.done_index) == [0, 1]
            for b, slot in enumerate(env.episode_slots):
                first[int(slot)] = {k: v[b] for k, v in out.obs.items()}
        assert sorted(first) == list(range(8))
        for slot in (1, 2):                # group 0: env 1's first episode, env 0's second
            assert all(np.array_equal(first[slot][k], first[0][k]) for k in first[0]), slot
        assert not np.array_equal(first[3]["state"], first[0]["state"])      # group 1: another start
        assert all(np.array_equal(first[s][k], first[3][k]) for s in (4, 5) for k in first[3])
    finally:
        env.close()


def test_flat_shading_gives_each_triangle_its_own_corners_and_normal():
    """A tetrahedron: the same faces, corner for corner, each with the unit normal of its plane."""
    from asyncvla.actors.envs.robot_hulls import flat_shaded
    vertices = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    triangles = np.array([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]], np.uint32)
    v, tris, normals = flat_shaded(vertices, triangles)
    assert v.shape == normals.shape == (12, 3) and tris.dtype == np.uint32
    np.testing.assert_array_equal(v[tris], vertices[triangles])
    for face in range(4):
        a, b, c = v[tris[face]]
        n = normals[tris[face]]
        np.testing.assert_allclose(n, np.broadcast_to(n[0], (3, 3)))      # one normal per face
        np.testing.assert_allclose(np.linalg.norm(n[0]), 1.0, rtol=1e-6)
        np.testing.assert_allclose([n[0] @ (b - a), n[0] @ (c - a)], 0.0, atol=1e-6)
        assert n[0] @ (a - vertices.mean(0)) > 0          # outward, as the hull's winding says


def test_robot_drawn_from_its_hulls_looks_the_same_and_moves_the_same():
    """env.robot_visual=hull: the Panda's links render from their collision hulls (a few thousand
    triangles instead of ~135 k); the physics is the same, and the frames differ from the visual
    meshes' only where the arm is, and there only in shading, not in where it stands."""
    import sapien

    def push_cube(robot_visual):
        cfg = EnvConfig(id="PushCube-v1", control_mode="pd_ee_delta_pos", camera_fov=0.8,
                        camera_pose=[0.5, 0.0, 0.35, 0.05, 0.0, 0.02], render_size=SIZE, use_proprio=True,
                        robot_visual=robot_visual)
        return make_env(cfg, 1, SIZE, K, "chunk_level", seed=5, action_dim=4)

    mesh, hull = push_cube("mesh"), push_cube("hull")
    try:
        def robot_triangles(env):
            base = env._envs[0].runner.base
            total = 0
            for link in base.agent.robot.get_links():
                for body in link._objs[0].entity.components:
                    if isinstance(body, sapien.render.RenderBodyComponent) and body.is_enabled:
                        total += sum(len(p.get_triangles()) for s in body.render_shapes for p in s.parts)
            return total
        assert robot_triangles(mesh) > 100_000 and 0 < robot_triangles(hull) < 5_000
        a, b = mesh.reset(seed=3), hull.reset(seed=3)
        np.testing.assert_array_equal(a["state"], b["state"])
        down = np.tile(np.array([0.6, 0.0, -0.6, -1.0], np.float32), (1, K, 1))   # the hand into view
        for _ in range(3):
            a, b = mesh.step_chunk(down).obs, hull.step_chunk(down).obs
        np.testing.assert_allclose(a["state"], b["state"], atol=1e-5)
        diff = np.abs(a["image"].astype(int) - b["image"]).max(-1)
        assert 0 < (diff > 0).mean() and (diff > 40).mean() < 0.05
    finally:
        mesh.close()
        hull.close()


def test_wrist_camera_robot_renders_its_hand_camera_alone_and_its_camera_model_as_a_box():
    """env.robot_uids=panda_wristcam with env.camera=hand_camera: the policy sees the hand camera,
    which is the only camera rendered; with env.robot_visual=hull the camera model on the wrist
    (425 k triangles, no collision shape) is drawn as its bounding box, so the whole robot stays
    under 5 k triangles. An unknown robot is named with ManiSkill's robots."""
    import sapien

    from asyncvla.actors.envs.maniskill import camera_problem

    cfg = EnvConfig(id="PickCube-v1", control_mode="pd_ee_delta_pos", robot_uids="panda_wristcam",
                    camera="hand_camera", render_size=SIZE, use_proprio=True, robot_visual="hull")
    env = make_env(cfg, 1, SIZE, K, "chunk_level", seed=5, action_dim=4)
    try:
        base = env._envs[0].runner.base
        assert list(base._sensors) == ["hand_camera"]
        camera_link = next(link for link in base.agent.robot.get_links() if link.name == "camera_link")
        bodies = [b for b in camera_link._objs[0].entity.components
                  if isinstance(b, sapien.render.RenderBodyComponent) and b.is_enabled]
        assert [sum(len(p.get_triangles()) for s in b.render_shapes for p in s.parts) for b in bodies] == [12]
        first = env.reset(seed=3)["image"]
        down = np.tile(np.array([0.0, 0.0, -1.0, 1.0], np.float32), (1, K, 1))     # the hand down to the table
        later = env.step_chunk(down).obs["image"]
        assert first.shape == later.shape == (1, SIZE, SIZE, 3)
        assert (np.abs(first.astype(int) - later).max(-1) > 40).mean() > 0.1         # the view moved with the hand
    finally:
        env.close()
    assert camera_problem("PickCube-v1", "hand_camera", robot_uids="panda_wristcam") is None
    assert "its cameras: ['base_camera']" in camera_problem("PickCube-v1", "hand_camera")
    problem = camera_problem("PickCube-v1", "hand_camera", robot_uids="panda_wrist")
    assert "env.robot_uids='panda_wrist' is not a ManiSkill robot" in problem and "'panda_wristcam'" in problem
