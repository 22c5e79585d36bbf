"""Retrying failed starts (env.retry_failed_starts): which seed each episode gets, checked
against the plain seed sequence, and on the pixel task that a failed episode's initial state
comes back. (ManiSkill's own: tests/test_envs_maniskill.py.)"""

import numpy as np
import pytest

from asyncvla.actors.envs import make_env
from asyncvla.actors.envs.starts import RETRY_TRIES, StartSchedule, episode_seed
from asyncvla.common.config import ConfigError, EnvConfig, load_config


def run_episodes(seeds: StartSchedule, outcomes, env=0) -> list[int]:
    """The seeds env `env` starts its episodes with, the k-th ending as outcomes[k] (True: solved),
    handed out as the CPU envs do: the next seed is peeked while the current episode runs."""
    started = [seeds.take(env)]
    for solved in outcomes:
        nxt = seeds.peek(env)
        assert seeds.peek(env) == nxt                   # stable until taken
        seeds.ended(env, solved)
        assert seeds.take(env) == nxt
        started.append(nxt)
    return started


def test_without_replay_the_seeds_are_the_plain_sequence():
    seeds = StartSchedule(5, num_envs=2, fixed=False)
    assert run_episodes(seeds, [False] * 6, env=1) == [episode_seed(5, 1, k) for k in range(7)]


def test_a_failed_start_is_replayed_until_solved_at_most_REPLAY_TRIES_times():
    fresh = [episode_seed(3, 0, k) for k in range(20)]
    # p = 1, every episode fails: a start comes back every other episode (the next seed was
    # already chosen when an episode ends), each RETRY_TRIES more times, then fresh ones follow.
    started = run_episodes(StartSchedule(3, 1, fixed=False, retry_failed=1.0), [False] * 10)
    a, b = fresh[0], fresh[1]
    assert started[:2 * (RETRY_TRIES + 1)] == [a, b] * (RETRY_TRIES + 1)
    assert a not in started[2 * (RETRY_TRIES + 1):] and b not in started[2 * (RETRY_TRIES + 1):]
    # a solved start is not retried
    started = run_episodes(StartSchedule(3, 1, fixed=False, retry_failed=1.0), [True, False, True, True])
    assert started.count(fresh[0]) == 1 and started.count(fresh[1]) == 2
    # in between, the share of retried episodes follows p
    seeds = StartSchedule(3, 1, fixed=False, retry_failed=0.3)
    started = run_episodes(seeds, np.random.default_rng(0).random(4000) < 0.5)
    retries = len(started) - len(set(started))
    assert 0.15 < retries / len(started) < 0.35, retries


def test_replay_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="fixed reset states"):
        StartSchedule(1, 2, fixed=True, retry_failed=0.5)
    with pytest.raises(ValueError, match="group_size"):
        StartSchedule(1, 2, fixed=False, group_size=4, retry_failed=0.5)
    for others, words in ((["algorithm.adv_type=grpo"], "adv_type=grpo"),
                          (["env.use_fixed_reset_state_ids=true"], "use_fixed_reset_state_ids"),
                          (["env.sim_backend=physx_cuda"], "physx_cuda"),
                          ([], None)):
        overrides = ["env.retry_failed_starts=0.5", *others]
        if words is None:
            assert load_config(None, overrides).env.retry_failed_starts == 0.5
            continue
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert "env.retry_failed_starts=0.5" in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="env.retry_failed_starts=1.5"):
        load_config(None, ["env.retry_failed_starts=1.5"])


def test_pixel_task_replays_the_initial_state_of_a_failed_episode():
    env = make_env(EnvConfig(id="PixelReach-v0", max_episode_steps=4, retry_failed_starts=1.0,
                             use_proprio=True), 1, 32, 4, "chunk_level", 0, action_dim=2)
    starts, retried = [env.reset()["state"][0]], []
    for _ in range(2 * (RETRY_TRIES + 1)):   # the pixel env picks its next start as one ends
        step = env.step_chunk(np.zeros((1, 4, 2), np.float32))     # standing still never solves
        assert step.truncated[0] and not step.episodes[0]["success"]
        retried.append(step.episodes[0]["retried"])
        starts.append(step.obs["state"][0])
    n = 2 * (RETRY_TRIES + 1)
    assert sum(np.array_equal(s, starts[0]) for s in starts[:n]) == RETRY_TRIES + 1
    assert not any(np.array_equal(starts[n], s) for s in starts[:n])      # then a fresh start
    # each ended episode says whether it was a retry: those whose start came before
    assert retried == [any(np.array_equal(starts[k], s) for s in starts[:k]) for k in range(n)]
