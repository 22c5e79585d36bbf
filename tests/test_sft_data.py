"""SFT samples: action chunks, Monte-Carlo returns and the random shift against naive loops, and the
episode split."""

import numpy as np
import pytest
import torch

from asyncvla.common.data.demos import DemoEpisode
from asyncvla.learner.sft import explained_variance, sft_loss
from asyncvla.learner.sft_data import (action_chunks, action_range_q99, build_samples, random_shift,
                                       returns_to_go, split_by_episode)


def test_action_chunks_match_a_naive_loop():
    a = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    K = 4
    want = np.zeros((7, K, 3), np.float32)
    for t in range(7):
        for k in range(K):
            want[t, k] = a[min(t + k, 6)]
    assert np.array_equal(action_chunks(a, K), want)


@pytest.mark.parametrize("K", [1, 3, 4])
def test_chunk_level_returns_match_the_definition(K):
    r = np.random.default_rng(K).normal(size=11).astype(np.float32)
    gamma = 0.9
    want = []
    for t in range(11):
        g, j = 0.0, 0
        while t + j * K < 11:
            g += gamma ** j * sum(r[t + j * K + i] for i in range(K) if t + j * K + i < 11)
            j += 1
        want.append(g)
    assert np.allclose(returns_to_go(r, gamma, K, "chunk_level"), want, atol=1e-5)


def test_action_level_returns_match_the_definition():
    r = np.random.default_rng(1).normal(size=9).astype(np.float32)
    want = [sum(0.8 ** i * r[t + i] for i in range(9 - t)) for t in range(9)]
    assert np.allclose(returns_to_go(r, 0.8, 4, "action_level"), want, atol=1e-5)


def episode(T, i, instruction="reach"):
    rng = np.random.default_rng(i)
    return DemoEpisode(images=rng.integers(0, 255, (T + 1, 8, 8, 3), dtype=np.uint8),
                       actions=rng.uniform(-1, 1, (T, 2)).astype(np.float32),
                       rewards=np.ones(T, np.float32), success=np.eye(T, dtype=bool)[-1],
                       instruction=instruction, seed=i, episode_id=i)


def test_samples_and_split_keep_episodes_whole():
    eps = [episode(T, i) for i, T in enumerate([5, 3, 6, 4, 2])]
    s = build_samples(eps, K=2, gamma=1.0, reward_type="chunk_level", default_instruction=None)
    assert len(s) == 20 and s.actions.shape == (20, 2, 2) and s.images.shape == (20, 8, 8, 3)
    assert s.returns[0] == 5.0 and s.returns[4] == 1.0          # undiscounted: steps to go
    train, val = split_by_episode(s, 5, 0.4, seed=0)
    assert len(train) + len(val) == 20
    assert not set(train.episode) & set(val.episode) and len(set(val.episode)) == 2
    train, val = split_by_episode(s, 5, 0.0, seed=0)
    assert val is None and len(train) == 20


def test_each_sample_carries_the_state_of_its_own_step():
    eps = [episode(T, i) for i, T in enumerate([4, 3])]
    for ep in eps:
        T = ep.num_steps
        ep.states = {"extra/tcp": np.full((T + 1, 1), 100.0 + ep.episode_id, np.float32),
                     "agent/qpos": np.arange(2 * (T + 1), dtype=np.float32).reshape(T + 1, 2)}
    s = build_samples(eps, K=2, gamma=1.0, reward_type="chunk_level", default_instruction=None)
    assert s.states.shape == (7, 3)
    assert s.states[5].tolist() == [2.0, 3.0, 101.0]      # episode 1, step 1: agent, then extra
    assert np.array_equal(s.subset(np.array([5])).states, s.states[5:6])
    eps[1].states = None
    with pytest.raises(ValueError, match="some demo episodes carry a state"):
        build_samples(eps, K=2, gamma=1.0, reward_type="chunk_level", default_instruction=None)


def test_episode_without_instruction_takes_the_default_or_fails():
    eps = [episode(3, 0, instruction=None)]
    assert build_samples(eps, 1, 0.9, "chunk_level", "push the cube").instructions == ["push the cube"] * 3
    with pytest.raises(ValueError, match="env.instruction"):
        build_samples(eps, 1, 0.9, "chunk_level", None)


def test_sft_loss_and_explained_variance():
    logp = torch.log(torch.tensor([[0.5, 0.25], [1.0, 0.5]]))
    loss, stats = sft_loss(-logp.mean(1), torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]), value_loss_coef=2.0)
    ce = -logp.mean()
    assert torch.isclose(loss, ce + 2.0 * 0.5) and np.isclose(stats["value_loss"], 0.5)
    y = np.array([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(y, y) == 1.0 and explained_variance(np.full(4, 2.5), y) == 0.0
    assert np.isnan(explained_variance(y, np.ones(4)))


def test_q99_action_range_is_per_dimension_and_keeps_constant_dims_whole():
    rng = np.random.default_rng(0)
    actions = np.stack([rng.uniform(-0.1, 0.2, 5000), rng.normal(0, 0.02, 5000), np.ones(5000)], 1)
    actions[0, 0] = -5.0                                     # outliers do not stretch the range
    low, high = action_range_q99(actions)
    for d in range(2):
        assert low[d] == pytest.approx(np.percentile(actions[:, d], 1), abs=1e-6)
        assert high[d] == pytest.approx(np.percentile(actions[:, d], 99), abs=1e-6)
    assert -0.1 < low[0] < -0.09 and 0.19 < high[0] < 0.2
    assert (low[2], high[2]) == (-1.0, 1.0)                 # a gripper held closed


def test_random_shift_matches_a_naive_pad_and_crop():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 12, 10, 3), dtype=np.uint8)
    out = random_shift(images, 3, np.random.default_rng(7))
    dy, dx = np.random.default_rng(7).integers(0, 7, size=(2, 5))
    for i in range(5):
        padded = np.pad(images[i], ((3, 3), (3, 3), (0, 0)), mode="edge")
        assert np.array_equal(out[i], padded[dy[i]:dy[i] + 12, dx[i]:dx[i] + 10])
    assert out.dtype == np.uint8 and (dy != 3).any()                # not all left in place
    assert random_shift(images, 0, rng) is images
