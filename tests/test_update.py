"""The learner's update and its per-update report, on 2 ZeRO-3 ranks (gloo on CPU) beside
hand computations (tests/ds_worker.py `update`):

* compute_targets: V-trace targets and advantages equal plain loops over (t, b) on an un-sharded
  copy of the policy, truncated steps bootstrapped from V(final observation); GAE's equal a plain
  loop over the same values; GRPO's are the ones the actors sent, without the finals' forward pass;
* ppo_epochs: one pass, one minibatch — its loss statistics equal the loss of the copy's outputs;
* the report: every rank's episodes, lags, drops and losses count (sums, maxima, means over
  ranks), every rank gets the same combined figures, and no rank's metric state grows.
"""

import numpy as np
import pytest

from tests.support.engines import launch
from tests import ds_worker as W


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("update", tmp_path_factory.mktemp("update"), 2, timeout=300)


def test_targets_equal_a_hand_computed_vtrace(ranks):
    for r in ranks:
        t, hand = r["targets"], r["hand"]
        np.testing.assert_allclose(t["old_values"], hand["values"][:-1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t["vs"], hand["vs"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t["advantages"], hand["advantages"], rtol=1e-4, atol=1e-5)
        assert np.abs(hand["advantages"]).max() > 1e-3          # not a trivially zero case


def test_value_norm_targets_are_the_hand_targets_in_the_updated_statistics(ranks):
    means_stds = {r["norm"] for r in ranks}
    assert len(means_stds) == 1                           # every rank folded in every rank's targets
    (mean, std), = means_stds
    all_vs = np.concatenate([r["hand_normed"]["vs"].ravel() for r in ranks])
    # decay 0.5 after one batch of mean 2 and mean square 13 (accumulators 1, 6.5, weight 0.5)
    m = 0.5 * 1.0 + 0.5 * all_vs.mean()
    sq = 0.5 * 6.5 + 0.5 * (all_vs ** 2).mean()
    w = 0.5 * 0.5 + 0.5
    assert mean == pytest.approx(m / w, rel=1e-5)
    assert std == pytest.approx(np.sqrt(sq / w - (m / w) ** 2), rel=1e-5)
    for r in ranks:
        t, hand = r["normed"], r["hand_normed"]
        np.testing.assert_allclose(t["advantages"], hand["advantages"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t["vs"], (hand["vs"] - mean) / std, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t["old_values"], (hand["values"][:-1] - mean) / std, rtol=1e-4, atol=1e-5)
        assert not np.allclose(hand["vs"], r["hand"]["vs"], atol=1e-2)    # the affine map mattered


def test_gae_targets_equal_a_hand_loop_over_the_same_values_and_rewards(ranks):
    for r in ranks:
        hand, got = r["hand"], r["gae"]
        V, rew, disc = hand["values"], hand["rewards"], hand["discounts"]     # (truncations bootstrapped)
        T, B = rew.shape
        adv = np.zeros((T, B))
        for b in range(B):
            acc = 0.0
            for t in reversed(range(T)):
                acc = rew[t, b] + disc[t, b] * V[t + 1, b] - V[t, b] + disc[t, b] * 0.7 * acc
                adv[t, b] = acc
        np.testing.assert_allclose(got["advantages"], adv, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["vs"], adv + V[:-1], rtol=1e-4, atol=1e-5)
        assert got["mask"].min() == 1
        assert not np.allclose(got["advantages"], r["targets"]["advantages"], atol=1e-3)   # not V-trace's


def test_grpo_trains_on_the_actors_advantages_and_runs_no_critic(ranks):
    for r in ranks:
        g = r["grpo"]
        np.testing.assert_array_equal(g["advantages"], g["sent"])
        np.testing.assert_array_equal(g["mask"], g["sent_mask"])
        np.testing.assert_array_equal(g["vs"], g["old_values"])        # no value targets (the value loss is off)
        rows = r["rows"]
        assert rows["finals"] > 0 and rows["vtrace"] - rows["grpo"] >= rows["finals"]   # no truncation bootstraps


def test_ppo_epoch_statistics_equal_the_loss_on_the_unsharded_copy(ranks):
    for r in ranks:
        for k in ("policy_loss", "value_loss", "entropy", "explained_variance", "clip_fraction"):
            assert r["stats"][k] == pytest.approx(r["ref_stats"][k], rel=1e-4, abs=1e-5), k
        assert np.isfinite(r["stats"]["grad_norm"])


def test_report_combines_every_rank_and_holds_no_growing_state(ranks):
    def combined(report):                          # all but the local clock's rates
        return {k: v for k, v in report.items() if not k.startswith("time/")}
    first, last = ranks[0]["reports"], ranks[1]["reports"]
    assert [combined(x) for x in first] == [combined(x) for x in last]   # every rank: the same figures
    rep = last[-1]
    seg = ranks[0]
    # rank 0 received 1 segment with lag 1 per update, rank 1 two with lag 2
    assert rep["rollout/policy_lag_mean"] == pytest.approx((1 * 1 + 2 * 2) / 3)
    assert rep["rollout/policy_lag_max"] == 2
    assert rep["env/episode_success"] == pytest.approx(seg["segment_success"] / seg["segment_episodes"])
    assert rep["rollout/env_steps"] == W.REPORTS * 3 * seg["segment_env_steps"]
    assert rep["train/actor/policy_loss"] == pytest.approx(0.5)          # the mean of 0 and 1
    assert rep["train/actor/ratio_max"] == 3.0                           # the larger
    assert rep["system/dropped_stale"] == 1 and rep["system/dropped_invalid"] == 2
    assert last[0]["time_up"] == 0 and rep["time_up"] == 1               # rank 1's budget stops both
    for r in ranks:
        assert len(set(r["sizes"])) == 1, r["sizes"][:5]                 # flat over 200 updates


def test_finite_guard_counts_skipped_steps_and_stops_on_the_nth_in_a_row():
    from asyncvla.learner.update import FiniteGuard, NonFiniteError

    guard = FiniteGuard(max_in_a_row=3)
    for finite in (False, False, True, False, False):     # a finite step resets the run of bad ones
        guard.after_step(7, finite, "" if finite else "loss nan")
    assert guard.skipped == 4 and guard.in_a_row == 2
    with pytest.raises(NonFiniteError) as e:
        guard.after_step(8, False, "gradient norm non-finite")
    assert str(e.value).startswith("update 8: 3 optimizer steps in a row were non-finite (last: gradient norm")
    assert "learner.max_nonfinite_steps=3" in str(e.value) and "\n" not in str(e.value)


def test_the_time_budget_is_the_runs_so_a_resumed_run_trains_for_what_is_left():
    """learner.max_time_s counts the seconds of every process of the run, as max_steps counts its
    updates: the checkpoint keeps them (TrainState.saved / load) and a resumed budget adds to them."""
    import threading

    from asyncvla.common.config import Config
    from asyncvla.learner.run_state import Budget, TrainState

    cfg = Config()
    cfg.learner.max_time_s = 100.0
    saved = TrainState(step=7, version=3, env_steps=900, time_s=99.999).saved(cfg, None)
    resumed = TrainState()
    resumed.load(saved)
    assert (resumed.step, resumed.version, resumed.env_steps, resumed.time_s) == (7, 3, 900, 99.999)
    budget = Budget(cfg, threading.Event(), None)
    budget.start(resumed)
    assert 99.999 <= budget.elapsed() < 100.5
    budget.start(TrainState(time_s=100.0))               # the checkpoint's seconds alone spend it
    assert budget.time_up()
    budget.start(TrainState())                           # a fresh run starts at 0
    assert budget.elapsed() < 1.0 and not budget.time_up()
    older = {k: v for k, v in saved.items() if k != "time_s"}    # a checkpoint from before time_s
    resumed.load(older)
    assert resumed.time_s == 0.0


def test_a_non_finite_loss_back_propagates_nan_everywhere_it_reaches():
    """An inf loss can give finite gradients (here: a sum with an inf constant); poisoned, every
    gradient is NaN, so the optimizer's global norm check skips the step."""
    import torch

    from asyncvla.learner.update import poisoned, step_verdict

    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum() + float("inf")
    loss.backward(retain_graph=True)
    assert torch.isfinite(w.grad).all()                  # the hazard: the step would be taken
    w.grad = None
    poisoned(loss).backward()
    assert torch.isnan(w.grad).all()
    assert step_verdict(False, "inf", float("inf"), "cpu") == (False, "loss inf")
    assert step_verdict(True, "", float("nan"), "cpu") == (False, "gradient norm non-finite")
    assert step_verdict(True, "", 0.5, "cpu") == (True, "")
    assert step_verdict(False, "nan", None, "cpu") == (False, "loss nan")      # no norm kept: the losses decide


def test_a_column_that_passed_validation_yet_overflows_the_policy_is_dropped_at_update_time(tmp_path):
    """Defence in depth, on 2 ZeRO-3 ranks with the flow head: rank 1's batch holds a column whose
    chain is finite but times 2e30 (as a hostile peer sent them; validation bypassed here). Each
    update finds that column from its non-finite log-probs, leaves it out of the loss (its inputs
    replaced, so the forward passes stay finite) and names its actor; no optimizer step is skipped
    (a FiniteGuard that stops at the first would raise), and the weights stay finite."""
    ranks = launch("poison", tmp_path, 2, timeout=300)
    assert ranks[0]["poisoned"] == [0.0, 0.0] and ranks[0]["poisoned_by"] == [[], []]
    assert ranks[1]["poisoned"] == [1.0, 0.0]             # dropped in the first; the second sees its stand-in
    assert ranks[1]["poisoned_by"][0] == ["poisoner"]
    for r in ranks:
        assert r["skipped"] == 0 and r["weights_finite"] and r["loss_finite"]
        assert r["chain_max"] < 100


def test_an_actor_is_banned_once_when_its_poisoned_columns_reach_the_limit():
    from asyncvla.learner.ingest import PoisonCounts
    counts = PoisonCounts(limit=3)
    assert counts.add(["a", "b"]) == [] and counts.add(["a"]) == []
    assert counts.add(["a", "b", "b"]) == ["a", "b"]
    assert counts.add(["a", "b"]) == []                    # named once
    assert PoisonCounts(limit=0).add(["a"] * 100) == []    # 0: never
