"""StartSchedule (actors/envs/starts.py): one object says where every episode starts, built by
make_env for its purpose; the envs only ask it for the next start and say how an episode ended."""

import pytest

from asyncvla.actors.envs.starts import HELD_OUT_BIT, StartSchedule, episode_seed, group_seed
from asyncvla.common.config import EnvConfig


def starts_of(schedule, n, env=0, restart_every=None, success=False):
    out = []
    for k in range(n):
        if restart_every and k % restart_every == 0:
            schedule.restart()
        out.append(schedule.take(env))
        schedule.ended(env, success)
    return out


def test_each_purpose_takes_from_the_env_config_only_what_is_its_own():
    cfg = EnvConfig(id="PixelReach-v0", retry_failed_starts=1.0)
    train = StartSchedule.for_purpose("train", cfg, seed=3, num_envs=2)
    assert train.retry_failed == 1.0 and not train.fixed
    # evaluation: the same starts after every reset, never a retry, whatever training is told, and
    # none of them a start that training or collection can draw (those stay below 2^31)
    evaluate = StartSchedule.for_purpose("evaluate", cfg, seed=3, num_envs=2)
    held_out = [episode_seed(3, 0, 0) | HELD_OUT_BIT, episode_seed(3, 0, 1) | HELD_OUT_BIT]
    assert starts_of(evaluate, 4, restart_every=2) == held_out * 2
    assert all(s >= HELD_OUT_BIT for s in held_out) and max(episode_seed(3, i, k) for i in range(4)
                                                            for k in range(100)) < HELD_OUT_BIT
    # demonstrations: fresh starts, no retries, no groups
    collect = StartSchedule.for_purpose("collect", cfg, seed=3, num_envs=2, group_size=4)
    assert starts_of(collect, 3, restart_every=1) == [episode_seed(3, 0, k) for k in range(3)]
    grouped = StartSchedule.for_purpose("train", EnvConfig(id="PixelReach-v0"), seed=3, num_envs=2, group_size=4)
    assert starts_of(grouped, 5) == [group_seed(3, 0)] * 4 + [group_seed(3, 1)]
    fixed = StartSchedule.for_purpose("train", EnvConfig(id="PixelReach-v0", use_fixed_reset_state_ids=True), 3, 2)
    assert starts_of(fixed, 4, restart_every=2) == [episode_seed(3, 0, 0), episode_seed(3, 0, 1)] * 2
    with pytest.raises(ValueError, match=r"purpose='eval': one of \['train', 'evaluate', 'collect'\]"):
        StartSchedule.for_purpose("eval", cfg, 3, 2)
