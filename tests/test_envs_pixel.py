"""The built-in pixel task through make_env: observations, chunk semantics, auto-reset, rewards,
seeding, and that it is neither trivial (random policy) nor impossible (scripted policy)."""

import numpy as np
import pytest

from asyncvla.actors.envs import ChunkEnv, make_env
from asyncvla.actors.envs import pixel_task as P
from asyncvla.common.config import EnvConfig


def pixel_env(num_envs=4, image_size=64, K=4, reward_type="chunk_level", seed=0, action_dim=2, **cfg):
    return make_env(EnvConfig(id="PixelReach-v0", **cfg), num_envs, image_size, K, reward_type, seed,
                    action_dim=action_dim)


def random_actions(rng, env, K=4):
    return rng.uniform(-1, 1, (env.num_envs, K, env.action_dim)).astype(np.float32)


def test_observation_and_instruction():
    env = pixel_env(num_envs=8, image_size=48, use_proprio=True)
    assert isinstance(env, ChunkEnv)
    obs = env.reset()
    assert obs["image"].shape == (8, 48, 48, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (8, 2) and obs["state"].dtype == np.float32 and env.state_dim == 2
    assert len(env.instructions) == 8
    for b, text in enumerate(env.instructions):
        colour = text.split()[-2]
        assert text == f"move the white dot to the {colour} square"
        # the named colour is what the image shows, and the agent dot is drawn
        pixels = obs["image"][b].reshape(-1, 3)
        assert (pixels == P.TARGET_COLOURS[colour]).all(axis=1).sum() > 10
        assert (pixels == P.AGENT_COLOUR).all(axis=1).sum() > 5
    many = pixel_env(num_envs=16)
    many.reset()
    assert len(set(many.instructions)) > 1      # target colours vary between episodes
    assert pixel_env(instruction="go").instructions == ["go"] * 4


def test_render_puts_shapes_where_they_are():
    agent, target = np.array([[0.2, 0.7]]), np.array([[0.8, 0.3]])
    img = P.render(agent, target, np.array([2]), 64)[0]
    assert (img[int(0.7 * 64), int(0.2 * 64)] == P.AGENT_COLOUR).all()      # row = y, column = x
    assert (img[int(0.3 * 64), int(0.8 * 64)] == P.TARGET_COLOURS["blue"]).all()
    assert (img[5, 32] == P.BACKGROUND).all()
    # pixel counts match the shapes' areas
    assert abs((img == P.AGENT_COLOUR).all(-1).sum() - np.pi * (P.AGENT_RADIUS * 64) ** 2) < 8
    assert abs((img == P.TARGET_COLOURS["blue"]).all(-1).sum() - (2 * P.TARGET_HALF_SIZE * 64) ** 2) < 20


def test_chunk_steps_and_reward_shapes():
    rng = np.random.default_rng(0)
    chunk, action = pixel_env(seed=5), pixel_env(seed=5, reward_type="action_level", action_dim=7)
    chunk.reset(), action.reset()
    a = random_actions(rng, action)
    s1, s2 = chunk.step_chunk(a[:, :, :2]), action.step_chunk(a)   # the extra dims are ignored
    assert s1.reward.shape == (4,) and s2.reward.shape == (4, 4)
    assert s1.reward.dtype == s2.reward.dtype == np.float32
    assert s1.env_steps == s2.env_steps == 16
    np.testing.assert_allclose(s1.reward, s2.reward.sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s1.obs["image"], s2.obs["image"])
    for s in (s1, s2):
        assert s.terminated.dtype == s.truncated.dtype == s.success.dtype == np.bool_
        assert s.done_index.dtype == np.int64 and len(s.done_index) == 0
        assert s.final_obs["image"].shape == (0, 64, 64, 3)


def test_truncation_auto_reset_keeps_final_observation():
    env = pixel_env(num_envs=3, max_episode_steps=6, reward_type="action_level")
    env.reset()
    still = np.zeros((3, 4, 2), np.float32)     # never reaches the target
    first = env.step_chunk(still)
    assert first.env_steps == 12 and not first.truncated.any()
    agent_before = env.agent_position
    second = env.step_chunk(still)
    assert second.env_steps == 6                 # 2 steps each, then the time limit
    assert second.truncated.all() and not second.terminated.any()
    np.testing.assert_array_equal(second.done_index, [0, 1, 2])
    assert (second.reward[:, 2:] == 0).all()
    # the final observation is the last frame of the old episode; obs is the new episode's first
    np.testing.assert_array_equal(second.final_obs["image"], first.obs["image"])
    assert not np.array_equal(second.obs["image"], second.final_obs["image"])
    assert not np.allclose(env.agent_position, agent_before)
    assert [e["length"] for e in second.episodes] == [6, 6, 6]
    assert [e["env"] for e in second.episodes] == [0, 1, 2]
    assert not any(e["success"] for e in second.episodes)


def test_termination_on_success_stops_inside_the_chunk():
    env = pixel_env(num_envs=8, K=8, reward_type="action_level")
    env.reset()
    d0 = np.linalg.norm(env.agent_position - env.target_position, axis=1)
    step = env.step_chunk(P.scripted_actions(env, 8, 2))
    ended = step.terminated
    assert ended.any() and not step.truncated.any()
    assert (step.success == ended).all()
    lengths = {e["env"]: e["length"] for e in step.episodes}
    assert sorted(lengths) == list(np.flatnonzero(ended))
    for b, n in lengths.items():
        assert (step.reward[b, n:] == 0).all() and step.reward[b, n - 1] > P.SUCCESS_BONUS * 0.9
        # dense shaping telescopes: return = scale * (d0 - d_end) + bonus
        ret = next(e["return"] for e in step.episodes if e["env"] == b)
        assert ret == pytest.approx(step.reward[b].sum(), abs=1e-5)
        assert 0 < ret - P.SUCCESS_BONUS <= P.PROGRESS_SCALE * d0[b] + 1e-6
    assert step.env_steps == int(sum(lengths.values()) + 8 * (~ended).sum())


def test_dense_reward_is_progress_plus_bonus():
    env = pixel_env(num_envs=6, K=1, reward_type="action_level", seed=3)
    env.reset()
    rng = np.random.default_rng(1)
    for _ in range(20):
        before = np.linalg.norm(env.agent_position - env.target_position, axis=1)
        a = random_actions(rng, env, K=1)
        expect_pos = np.clip(env.agent_position + P.SPEED * a[:, 0], P.AGENT_RADIUS, 1 - P.AGENT_RADIUS)
        after = np.linalg.norm(expect_pos - env.target_position, axis=1)
        step = env.step_chunk(a)
        want = P.PROGRESS_SCALE * (before - after) + P.SUCCESS_BONUS * (after < P.SUCCESS_RADIUS)
        np.testing.assert_allclose(step.reward[:, 0], want, rtol=1e-5, atol=1e-6)


def test_sparse_reward_and_ignore_terminations():
    env = pixel_env(num_envs=8, K=8, reward_type="action_level", reward_mode="sparse",
                    ignore_terminations=True, max_episode_steps=30)
    env.reset()
    step = env.step_chunk(P.scripted_actions(env, 8, 2))
    assert set(np.unique(step.reward)) <= {0.0, 1.0}
    assert step.success.any() and not step.terminated.any() and step.env_steps == 64


def test_without_auto_reset_an_ended_env_waits_for_reset():
    env = pixel_env(num_envs=2, max_episode_steps=4, auto_reset=False)
    env.reset()
    a = np.zeros((2, 4, 2), np.float32)
    first = env.step_chunk(a)
    assert first.truncated.all() and len(first.episodes) == 2
    np.testing.assert_array_equal(first.obs["image"], first.final_obs["image"])
    frozen = env.step_chunk(a)
    assert frozen.env_steps == 0 and not frozen.truncated.any() and (frozen.reward == 0).all()
    env.reset()
    assert env.step_chunk(a).env_steps == 8


def test_same_seed_same_episodes_and_fixed_reset_states():
    rng = np.random.default_rng(0)
    actions = [random_actions(rng, pixel_env()) for _ in range(30)]

    def run(env):
        out = [env.reset()["image"]]
        for a in actions:
            out.append(env.step_chunk(a).obs["image"])
        return np.stack(out)

    a, b, c = run(pixel_env(seed=7)), run(pixel_env(seed=7)), run(pixel_env(seed=8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], c[0])

    fixed = pixel_env(seed=7, use_fixed_reset_state_ids=True)
    np.testing.assert_array_equal(fixed.reset()["image"], fixed.reset()["image"])
    fresh = pixel_env(seed=7)
    assert not np.array_equal(fresh.reset()["image"], fresh.reset()["image"])
    np.testing.assert_array_equal(fresh.reset(seed=7)["image"], fixed.reset()["image"])
    # env i's episodes never depend on how many envs run beside it
    np.testing.assert_array_equal(pixel_env(num_envs=2, seed=7).reset()["image"], a[0, :2])


def success_rate(env, policy, episodes=600):
    env.reset()
    done = []
    while len(done) < episodes:
        done += env.step_chunk(policy(env)).episodes
    return np.mean([e["success"] for e in done])


def test_random_policy_rarely_succeeds_scripted_policy_does():
    rng = np.random.default_rng(0)
    env = pixel_env(num_envs=64, seed=11)
    random_rate = success_rate(env, lambda e: random_actions(rng, e))
    scripted_rate = success_rate(env, lambda e: P.scripted_actions(e, 4, 2))
    assert random_rate < 0.10, random_rate
    assert scripted_rate > 0.90, scripted_rate


def test_bad_arguments_are_named():
    env = pixel_env()
    with pytest.raises(RuntimeError, match="reset"):
        env.step_chunk(np.zeros((4, 4, 2), np.float32))
    env.reset()
    with pytest.raises(ValueError, match=r"\[B, K, D\]"):
        env.step_chunk(np.zeros((4, 3, 2), np.float32))
    with pytest.raises(ValueError, match="reward_type"):
        pixel_env(reward_type="episode_level")
    with pytest.raises(ValueError, match="action_dim"):
        pixel_env(action_dim=1)
    env.close()


def test_sim_latency_makes_each_chunk_take_k_modelled_steps_and_changes_nothing_else():
    import time
    from asyncvla.actors.envs.latency import SimLatency
    plain, slow = pixel_env(num_envs=2, seed=3), SimLatency(pixel_env(num_envs=2, seed=3), latency_ms=20.0)
    a, b = plain.reset(), slow.reset()
    assert np.array_equal(a["image"], b["image"]) and slow.num_envs == 2 and slow.instructions == plain.instructions
    actions = random_actions(np.random.default_rng(0), plain)
    t0 = time.perf_counter()
    for _ in range(3):
        s_plain, s_slow = plain.step_chunk(actions), slow.step_chunk(actions)
        assert np.array_equal(s_plain.reward, s_slow.reward)
        assert np.array_equal(s_plain.obs["image"], s_slow.obs["image"])
    assert time.perf_counter() - t0 >= 3 * 4 * 0.020            # K = 4 steps of 20 ms, three chunks
    with pytest.raises(ValueError, match="must be >= 0"):
        SimLatency(plain, latency_ms=-1.0)
