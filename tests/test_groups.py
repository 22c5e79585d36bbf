"""GRPO's pieces on the actor's side: the group-relative advantage against a naive loop, the
reset seeds that give a group's episodes one initial state, and the outbox that holds segments
until their groups have ended (on the pixel task: real envs, real rollouts)."""

import numpy as np
import pytest
import torch

from asyncvla.actors.envs.starts import StartSchedule, group_seed
from asyncvla.common.advantages import Outbox, make_estimator
from asyncvla.common.advantages.grpo import GroupOutbox, group_advantages
from asyncvla.common.config import load_config
from tests.support.paths import PIXEL


def naive_group_advantages(slots, returns, G, eps=1e-6):
    """One group at a time, with Python's statistics, as the definition reads."""
    import statistics
    adv, scored = [0.0] * len(slots), [False] * len(slots)
    for g in {s // G for s in slots}:
        members = [i for i, s in enumerate(slots) if s // G == g]
        if len(members) < G:
            continue                                  # the group has not ended yet
        rs = [returns[i] for i in members]
        mean, std = statistics.fmean(rs), statistics.stdev(rs)
        if std == 0:
            continue                                  # all equal: no signal
        for i in members:
            adv[i], scored[i] = (returns[i] - mean) / (std + eps), True
    return np.array(adv, np.float32), np.array(scored)


@pytest.mark.parametrize("G", [2, 3, 8])
def test_group_advantages_match_a_naive_loop_with_uneven_completion_and_equal_groups(G):
    rng = np.random.default_rng(G)
    n_groups = 6
    slots = np.arange(n_groups * G)
    returns = rng.integers(0, 2, len(slots)).astype(np.float64)        # binary success
    returns[:G] = 1.0                                                  # group 0: all solved
    returns[G:2 * G] = rng.normal(size=G) * 3                          # group 1: dense returns
    keep = np.ones(len(slots), bool)
    keep[-1] = False                                                   # the last group: one still running
    order = rng.permutation(np.flatnonzero(keep))                      # episodes end in any order
    adv, scored = group_advantages(slots[order], returns[order], G)
    want_adv, want_scored = naive_group_advantages(list(slots[order]), list(returns[order]), G)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
    assert np.array_equal(scored, want_scored)
    assert not scored[slots[order] < G].any()                          # the all-equal group trains nothing
    assert not scored[slots[order] >= (n_groups - 1) * G].any()        # nor the unfinished one
    assert scored[(slots[order] >= G) & (slots[order] < 2 * G)].all()
    for g in np.unique(slots[order][scored] // G):                     # each scored group: mean 0
        assert abs(adv[slots[order] // G == g].mean()) < 1e-5


def test_a_group_of_one_is_refused():
    with pytest.raises(ValueError, match="group_size=1"):
        group_advantages(np.arange(4), np.zeros(4), 1)


def test_grouped_reset_seeds_give_each_group_one_seed_and_every_slot_once():
    seeds = StartSchedule(7, num_envs=3, fixed=False, group_size=4)
    rng = np.random.default_rng(0)
    history = []
    for i in range(3):                                 # reset(): every env starts an episode
        seed = seeds.take(i)
        history.append((int(seeds.slot[i]), seed))
    for _ in range(40):                                # envs end their episodes at random times
        peeked = {i: seeds.peek(i) for i in range(3)}  # what step_chunk hands each env beforehand
        for i in np.flatnonzero(rng.random(3) < 0.4):
            assert seeds.take(int(i)) == peeked[i]     # the seed an env was told is the one it gets
            history.append((int(seeds.slot[i]), peeked[i]))
    slots = [s for s, _ in history]
    assert len(slots) == len(set(slots))               # no slot twice
    by_group = {}
    for s, seed in history:
        by_group.setdefault(s // 4, set()).add(seed)
    assert all(len(v) == 1 for v in by_group.values())  # one initial state per group ...
    assert by_group[0] == {group_seed(7, 0)} and group_seed(7, 0) != group_seed(7, 1)   # ... its own
    with pytest.raises(ValueError, match="fixed"):
        StartSchedule(7, 2, fixed=True, group_size=4)


def test_without_groups_seeds_are_per_env_as_before():
    from asyncvla.actors.envs.starts import episode_seed
    seeds = StartSchedule(3, num_envs=2, fixed=False)
    assert [seeds.take(0), seeds.take(1), seeds.take(0)] == [episode_seed(3, 0, 0), episode_seed(3, 1, 0),
                                                             episode_seed(3, 0, 1)]


def pixel_rollout(group_size=4, num_envs=3, T=4, segments=12):
    """Segments of a real pixel-task rollout with a tiny policy, with their slot info."""
    from asyncvla.actors import rollout
    from asyncvla.actors.envs import make_env
    from asyncvla.common.policy import VLAPolicy
    cfg = load_config(PIXEL, ["algorithm.adv_type=grpo", f"algorithm.group_size={group_size}",
                                                  "env.max_episode_steps=20"])
    torch.manual_seed(0)
    policy = VLAPolicy.build(cfg.policy)
    env = make_env(cfg.env, num_envs, cfg.policy.image_size, cfg.policy.num_action_chunks, "chunk_level", seed=5,
                   group_size=group_size)
    state, tokenize = rollout.start(env), rollout.InstructionCache(policy)
    out = [rollout.collect_segment(env, policy, tokenize, state, T, 1.0, torch.Generator().manual_seed(1),
                                   slots=True) for _ in range(segments)]
    env.close()
    return cfg, out


def test_the_outbox_holds_segments_until_their_groups_end_and_scores_every_step():
    cfg, collected = pixel_rollout()
    G = cfg.algorithm.group_size
    outbox = make_estimator(cfg.algorithm).make_outbox()
    assert isinstance(outbox, GroupOutbox)
    assert type(make_estimator(load_config(PIXEL).algorithm).make_outbox()) is Outbox
    returns, sent = {}, []
    for seq, (arrays, info) in enumerate(collected):
        returns.update(info["ended"])
        for meta, scored in outbox.add({"seq": seq}, arrays, info):
            sent.append((meta["seq"], scored, collected[meta["seq"]][1]["slots"]))
    assert sent and outbox.held == len(collected) - len(sent) > 0       # the newest wait for running episodes
    assert [s for s, _, _ in sent] == list(range(len(sent)))           # in the order collected
    for _, scored, slots in sent:
        assert scored["advantage"].shape == slots.shape and scored["advantage"].dtype == np.float32
        for (t, b), slot in np.ndenumerate(slots):                      # every step: its episode's group
            g = slot // G
            members = range(g * G, (g + 1) * G)
            assert all(s in returns for s in members)                   # sent only once the group ended
            rs = np.array([returns[s] for s in members])
            if rs.std() == 0:
                assert scored["advantage_mask"][t, b] == 0 and scored["advantage"][t, b] == 0
            else:
                want = (returns[slot] - rs.mean()) / (rs.std(ddof=1) + 1e-6)
                assert scored["advantage_mask"][t, b] == 1
                assert scored["advantage"][t, b] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(outbox._returns) < len(returns)                          # ended groups are forgotten
