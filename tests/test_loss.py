"""PPO loss: clip region gradients, dual clip, value clipping, statistics on hand-computed cases."""

import math

import pytest
import torch

from asyncvla.common.config import AlgorithmConfig
from asyncvla.learner.loss import ppo_loss, ppo_loss_from_config

F64 = torch.float64


def t(*x):
    return torch.tensor(x, dtype=F64)


def policy_only(new_logp, advantages, **kw):
    """The loss with only the policy term switched on (ratio = exp(new_logp), μ = 1)."""
    n = advantages.shape
    args = dict(behavior_logp=torch.zeros_like(new_logp), values=torch.zeros(n, dtype=F64),
                old_values=torch.zeros(n, dtype=F64), value_targets=torch.zeros(n, dtype=F64),
                entropy=torch.zeros(n, dtype=F64), rhos=torch.ones(n, dtype=F64),
                value_loss_coef=0.0, normalize_advantages=False)
    args.update(kw)
    return ppo_loss(new_logp=new_logp, advantages=advantages, **args)


def test_no_gradient_outside_the_clip_region_in_the_clipped_direction_only():
    ratios = t(1.5, 0.5, 1.5, 0.5, 1.1, 0.9)
    adv = t(1.0, -1.0, -1.0, 1.0, 1.0, -1.0)
    logp = ratios.log().requires_grad_()
    loss, _ = policy_only(logp, adv, ratio_clip_eps=0.2)
    loss.backward()
    # d(−A·r)/d log π = −A·r, divided by the 6 elements of the mean
    expected = t(0.0,            # r > 1+ε, A > 0: clipped
                 0.0,            # r < 1−ε, A < 0: clipped
                 1.5, -0.5,      # outside the region but moving back toward it: not clipped
                 -1.1, 0.9) / 6  # inside the region
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def test_dual_clip_caps_negative_advantage_losses_at_c_times_abs_a():
    ratios, adv = t(10.0, 2.0, 10.0), t(-2.0, -1.0, 1.0)
    logp = ratios.log().requires_grad_()
    loss, _ = policy_only(logp, adv, ratio_clip_eps=0.2, clip_ratio_c=3.0)
    loss.backward()
    # per element: min(−A·r, c·|A|) = min(20, 6) = 6;  min(2, 3) = 2;  A > 0 untouched: −1.2
    assert loss.item() == pytest.approx((6.0 + 2.0 - 1.2) / 3)
    assert torch.allclose(logp.grad, t(0.0, 2.0, 0.0) / 3, atol=1e-12)
    plain, _ = policy_only(ratios.log(), adv, ratio_clip_eps=0.2)
    assert plain.item() == pytest.approx((20.0 + 2.0 - 1.2) / 3)


def value_only(values, old_values, targets, **kw):
    n = values.shape
    return ppo_loss(new_logp=torch.zeros(n, dtype=F64), behavior_logp=torch.zeros(n, dtype=F64),
                    advantages=torch.zeros(n, dtype=F64), values=values, old_values=old_values,
                    value_targets=targets, entropy=torch.zeros(n, dtype=F64),
                    rhos=torch.ones(n, dtype=F64), value_loss_coef=1.0, normalize_advantages=False, **kw)


def test_value_clipping_takes_the_larger_of_clipped_and_unclipped_losses():
    values = t(2.0, 2.0).requires_grad_()
    old, targets = t(0.0, 0.0), t(3.0, 1.0)
    loss, stats = value_only(values, old, targets, value_clip=0.5)
    loss.backward()
    # elem 0: max(0.5·1², 0.5·(0.5−3)²) = 3.125 on the clipped (constant) branch -> no gradient
    # elem 1: max(0.5·1², 0.5·(0.5−1)²) = 0.5 on the unclipped branch -> gradient (V − v_s)/2
    assert stats["value_loss"] == pytest.approx((3.125 + 0.5) / 2)
    assert torch.allclose(values.grad, t(0.0, 0.5), atol=1e-12)
    _, unclipped = value_only(t(2.0, 2.0), old, targets)
    assert unclipped["value_loss"] == pytest.approx((0.5 + 0.5) / 2)


def test_huber_value_loss():
    _, stats = value_only(t(3.0, 0.5, -2.0), t(0.0, 0.0, 0.0), t(0.0, 0.0, 0.0),
                          value_loss_type="huber", huber_delta=1.0)
    assert stats["value_loss"] == pytest.approx((2.5 + 0.125 + 1.5) / 3)
    _, big_delta = value_only(t(3.0, 0.5), t(0.0, 0.0), t(0.0, 0.0), value_loss_type="huber",
                              huber_delta=10.0)
    assert big_delta["value_loss"] == pytest.approx((4.5 + 0.125) / 2)    # = mse inside delta


def test_statistics_match_a_hand_computed_case():
    logp = t(math.log(1.5), math.log(0.9)).requires_grad_()
    entropy = t(0.5, 1.5).requires_grad_()
    values = t(1.0, 2.0).requires_grad_()
    loss, s = ppo_loss(new_logp=logp, behavior_logp=t(0.0, 0.0), advantages=t(1.0, -2.0),
                       values=values, old_values=t(1.0, 2.0), value_targets=t(2.0, 4.0),
                       entropy=entropy, rhos=t(2.0, 3.0), rho_bar=2.0, ratio_clip_eps=0.2,
                       entropy_bonus=0.1, value_loss_coef=0.5, normalize_advantages=False)
    # policy: max(−1.5, −1.2) = −1.2;  max(1.8, 1.8) = 1.8  -> 0.3
    # value: 0.5·(1² + 2²)/2 = 1.25;  entropy 1.0;  total 0.3 + 0.5·1.25 − 0.1·1.0
    assert s["policy_loss"] == pytest.approx(0.3)
    assert s["value_loss"] == pytest.approx(1.25)
    assert s["entropy"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(0.825)
    assert s["approx_kl"] == pytest.approx(((0.5 - math.log(1.5)) + (-0.1 - math.log(0.9))) / 2)
    assert s["clip_fraction"] == pytest.approx(0.5)
    assert s["ratio_mean"] == pytest.approx(1.2) and s["ratio_max"] == pytest.approx(1.5)
    assert s["rho_mean"] == pytest.approx(2.5)
    assert s["rho_clipped_fraction"] == pytest.approx(0.5)               # ρ = ρ̄ exactly is not clipped
    assert s["explained_variance"] == pytest.approx(1 - 0.25 / 1.0)   # Var[1, 2] / Var[2, 4]
    assert all(type(v) is float for v in s.values())
    loss.backward()
    assert torch.allclose(entropy.grad, t(-0.05, -0.05))                # −entropy_bonus / n


def test_advantage_normalisation_and_scale():
    adv = t(1.0, 2.0, 3.0, 4.0)
    logp = torch.zeros(4, dtype=F64, requires_grad=True)
    loss, _ = policy_only(logp, adv, normalize_advantages=True, advantage_scale=2.0)
    loss.backward()
    norm = (adv - 2.5) / math.sqrt(1.25)                                # population std
    assert torch.allclose(logp.grad, -2.0 * norm / 4, atol=1e-6)
    # statistics of a larger batch, for a loss called per micro batch
    logp2 = torch.zeros(4, dtype=F64, requires_grad=True)
    policy_only(logp2, adv, normalize_advantages=True, advantage_stats=(1.0, 0.5))[0].backward()
    assert torch.allclose(logp2.grad, -((adv - 1.0) / 0.5) / 4, atol=1e-6)
    single = torch.zeros(1, dtype=F64, requires_grad=True)
    policy_only(single, t(5.0), normalize_advantages=True)[0].backward()
    assert torch.isfinite(single.grad).all()                           # one sample: no NaN


def test_token_level_inputs_broadcast_the_step_advantage():
    g = torch.Generator().manual_seed(0)
    T, B, M = 3, 2, 4
    new = torch.randn(T, B, M, generator=g, dtype=F64) * 0.3
    beh = torch.randn(T, B, M, generator=g, dtype=F64) * 0.3
    ent = torch.rand(T, B, M, generator=g, dtype=F64)
    step = {k: torch.randn(T, B, generator=g, dtype=F64)
            for k in ("advantages", "values", "old_values", "value_targets")}
    step["rhos"] = torch.rand(T, B, generator=g, dtype=F64) * 2
    kw = dict(ratio_clip_eps=0.1, clip_ratio_c=2.0, entropy_bonus=0.01, value_clip=0.3,
              normalize_advantages=True, advantage_scale=1.5)
    loss, stats = ppo_loss(new_logp=new, behavior_logp=beh, entropy=ent, **step, **kw)
    # same thing written per token: every per-step tensor repeated over M, then flattened.
    # Repeating changes neither the mean nor the population std, so normalisation agrees too.
    rep = {k: v.unsqueeze(-1).expand(T, B, M).reshape(-1) for k, v in step.items()}
    loss_flat, stats_flat = ppo_loss(new_logp=new.reshape(-1), behavior_logp=beh.reshape(-1),
                                     entropy=ent.reshape(-1), **rep, **kw)
    assert loss.item() == pytest.approx(loss_flat.item(), rel=1e-12)
    for k in stats:
        assert stats[k] == pytest.approx(stats_flat[k], rel=1e-9), k
    # and written out directly
    a = (step["advantages"] - step["advantages"].mean()) / step["advantages"].std(unbiased=False) * 1.5
    r = torch.exp(new - beh)
    pg = torch.maximum(-a[..., None] * r, -a[..., None] * r.clamp(0.9, 1.1))
    pg = torch.where(a[..., None] < 0, torch.minimum(pg, -2.0 * a[..., None]), pg)
    assert stats["policy_loss"] == pytest.approx(pg.mean().item(), rel=1e-6)


def test_huge_log_ratio_gives_finite_gradients():
    logp = t(300.0, -300.0).requires_grad_()       # chunk-level sums can drift this far
    loss, _ = policy_only(logp, t(1.0, -1.0), clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_from_config_uses_the_algorithm_section():
    alg = AlgorithmConfig(clip_ratio_c=3.0, value_clip=0.2, value_loss_type="huber", entropy_bonus=0.01,
                          rho_bar=1.3)
    g = torch.Generator().manual_seed(1)
    x = {k: torch.randn(5, generator=g, dtype=F64)
         for k in ("new_logp", "behavior_logp", "advantages", "values", "old_values", "value_targets",
                   "entropy", "rhos")}
    a, sa = ppo_loss_from_config(alg, **x)
    b, sb = ppo_loss(**x, rho_bar=1.3, ratio_clip_eps=alg.ratio_clip_eps, clip_ratio_c=3.0,
                     entropy_bonus=0.01, value_loss_coef=alg.value_loss_coef, value_loss_type="huber",
                     huber_delta=alg.huber_delta, value_clip=0.2,
                     normalize_advantages=alg.normalize_advantages, advantage_scale=alg.advantage_scale)
    assert a.item() == b.item() and sa == sb


def test_errors_name_the_argument_and_what_is_allowed():
    x = dict(new_logp=t(0.0), behavior_logp=t(0.0), advantages=t(1.0), values=t(0.0),
             old_values=t(0.0), value_targets=t(0.0), entropy=t(0.0), rhos=t(1.0))
    with pytest.raises(ValueError, match="value_loss_type='l1'.*'huber'"):
        ppo_loss(**x, value_loss_type="l1")
    with pytest.raises(ValueError, match="clip_ratio_c=0.5"):
        ppo_loss(**x, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="rhos"):
        ppo_loss(**dict(x, rhos=t(1.0, 1.0)))
    with pytest.raises(ValueError, match="log-probs"):
        ppo_loss(**dict(x, new_logp=torch.zeros(2, 3, dtype=F64), behavior_logp=torch.zeros(2, 3, dtype=F64)))


# ------------------------------------------------------------------------------ decoupled PPO
def naive_decoupled_policy_loss(new_logp, prox_logp, behavior_logp, adv, eps, threshold, c=None):
    """Decoupled PPO one element at a time: w·max(−A·r, −A·clip(r)) with r = π/π_prox and
    w = π_prox/μ, or 0 where w > threshold; dual clip on −A·c for A < 0; mean over all elements."""
    total, masked, n = 0.0, 0, 0
    for lp, prox, mu, a in zip(new_logp.flatten().tolist(), prox_logp.flatten().tolist(),
                               behavior_logp.flatten().tolist(), adv.flatten().tolist()):
        r, w = math.exp(lp - prox), math.exp(prox - mu)
        term = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
        if c is not None and a < 0:
            term = min(term, -c * a)
        if w > threshold:
            masked += 1
        else:
            total += w * term
        n += 1
    return total / n, masked / n


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_decoupled_loss_matches_a_naive_per_element_loop(clip_ratio_c):
    g = torch.Generator().manual_seed(0)
    S, M = (6, 5), 4                                     # [T, B] policy steps, M token log-probs each
    behavior = -torch.rand(*S, M, generator=g, dtype=F64) * 3
    prox = behavior + torch.randn(*S, M, generator=g, dtype=F64) * 0.6     # some w above 2
    new = prox + torch.randn(*S, M, generator=g, dtype=F64) * 0.3
    adv = torch.randn(*S, generator=g, dtype=F64)
    n = adv.shape
    loss, stats = ppo_loss(new_logp=new, behavior_logp=behavior, prox_logp=prox, advantages=adv,
                           values=torch.zeros(n, dtype=F64), old_values=torch.zeros(n, dtype=F64),
                           value_targets=torch.zeros(n, dtype=F64), entropy=torch.zeros(n, dtype=F64),
                           rhos=torch.ones(n, dtype=F64), value_loss_coef=0.0, normalize_advantages=False,
                           policy_loss_type="decoupled", behave_weight_threshold=2.0, ratio_clip_eps=0.2,
                           clip_ratio_c=clip_ratio_c)
    expected, masked = naive_decoupled_policy_loss(new, prox, behavior, adv.unsqueeze(-1).expand(*S, M),
                                                   0.2, 2.0, clip_ratio_c)
    assert 0 < masked < 0.5                              # the case exercises the mask
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["behav_clip_fraction"] == pytest.approx(masked)
    w = (prox - behavior).exp()
    assert stats["behav_approx_kl"] == pytest.approx(((w - 1) - w.log()).mean().item())
    assert stats["approx_kl"] > 0 and stats["approx_kl"] < stats["behav_approx_kl"]


def test_decoupled_clips_around_the_proximal_policy_not_the_behaviour_one():
    # Data one version old: μ = 1, π_prox = π_θ at the update's start = 1.3 (w = 1.3, kept).
    # behavior_clip: r = 1.3 > 1 + ε with A > 0 — clipped, no gradient from the first step on.
    # decoupled: r = π_θ/π_prox = 1 — inside the region, gradient −A·w·r per element.
    adv = t(1.0, 1.0)
    new = t(math.log(1.3), math.log(1.3)).requires_grad_()
    loss, _ = policy_only(new, adv, ratio_clip_eps=0.2)
    loss.backward()
    assert torch.all(new.grad == 0)
    new.grad = None
    prox = t(math.log(1.3), math.log(3.0))                 # the second element: w = 3 > 2, masked
    loss, stats = policy_only(new, adv, ratio_clip_eps=0.2, policy_loss_type="decoupled", prox_logp=prox,
                              behave_weight_threshold=2.0)
    loss.backward()
    assert torch.allclose(new.grad, t(-1.3, 0.0) / 2, atol=1e-12)
    assert stats["behav_clip_fraction"] == 0.5


def test_decoupled_loss_refuses_missing_or_misshapen_proximal_log_probs():
    adv = t(1.0, -1.0)
    with pytest.raises(ValueError, match="prox_logp"):
        policy_only(t(0.0, 0.0), adv, policy_loss_type="decoupled")
    with pytest.raises(ValueError, match="prox_logp"):
        policy_only(t(0.0, 0.0), adv, policy_loss_type="decoupled", prox_logp=t(0.0))
    with pytest.raises(ValueError, match="policy_loss_type"):
        policy_only(t(0.0, 0.0), adv, policy_loss_type="ppo")
    with pytest.raises(ValueError, match="behave_weight_threshold"):
        policy_only(t(0.0, 0.0), adv, policy_loss_type="decoupled", prox_logp=t(0.0, 0.0),
                    behave_weight_threshold=1.0)


def test_decoupled_loss_from_config_uses_the_algorithm_keys():
    alg = AlgorithmConfig(policy_loss="decoupled", behave_weight_threshold=1.5, normalize_advantages=False,
                          value_loss_coef=0.0)
    n = (3,)
    prox = t(0.0, 0.3, 0.6)                                # w = 1, 1.35, 1.82: the last masked at 1.5
    _, stats = ppo_loss_from_config(alg, new_logp=prox.clone(), behavior_logp=torch.zeros(n, dtype=F64),
                                    prox_logp=prox, advantages=t(1.0, 1.0, 1.0), values=torch.zeros(n, dtype=F64),
                                    old_values=torch.zeros(n, dtype=F64), value_targets=torch.zeros(n, dtype=F64),
                                    entropy=torch.zeros(n, dtype=F64), rhos=torch.ones(n, dtype=F64))
    assert stats["behav_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["policy_loss"] == pytest.approx(-(1.0 + math.exp(0.3)) / 3)


@pytest.mark.parametrize("policy_loss", ["behavior_clip", "decoupled"])
@pytest.mark.parametrize("per_part", [False, True])
def test_a_mask_gives_the_loss_and_gradients_of_the_kept_steps_alone(per_part, policy_loss):
    """mask=0 steps count nowhere: the masked loss, its gradients on the kept steps and every
    statistic equal those of ppo_loss on the kept steps only; the masked steps get no gradient."""
    g = torch.Generator().manual_seed(3)
    T, B, M = 4, 3, 5
    shape = (T, B, M) if per_part else (T, B)
    new = (torch.randn(shape, generator=g, dtype=F64) * 0.3).requires_grad_()
    values = torch.randn(T, B, generator=g, dtype=F64).requires_grad_()
    ins = dict(behavior_logp=torch.randn(shape, generator=g, dtype=F64) * 0.3,
               prox_logp=torch.randn(shape, generator=g, dtype=F64) * 0.3,
               entropy=torch.rand(shape, generator=g, dtype=F64),
               **{k: torch.randn(T, B, generator=g, dtype=F64) for k in ("advantages", "old_values", "value_targets")},
               rhos=torch.rand(T, B, generator=g, dtype=F64) * 2)
    kw = dict(ratio_clip_eps=0.2, clip_ratio_c=3.0, entropy_bonus=0.01, value_clip=0.3, normalize_advantages=True,
              policy_loss_type=policy_loss, behave_weight_threshold=1.5)
    mask = torch.ones(T, B, dtype=F64)
    mask[1, 0] = mask[3, 2] = mask[0, 1] = 0
    keep = mask.bool()
    loss, stats = ppo_loss(new_logp=new, values=values, mask=mask, **ins, **kw)
    loss.backward()
    sub_new, sub_values = new.detach()[keep].clone().requires_grad_(), values.detach()[keep].clone().requires_grad_()
    sub_loss, sub_stats = ppo_loss(new_logp=sub_new, values=sub_values, **{k: v[keep] for k, v in ins.items()}, **kw)
    sub_loss.backward()
    assert loss.item() == pytest.approx(sub_loss.item(), rel=1e-12)
    for k in stats:
        assert stats[k] == pytest.approx(sub_stats[k], rel=1e-9, nan_ok=True), k
    assert torch.allclose(new.grad[keep], sub_new.grad) and torch.allclose(values.grad[keep], sub_values.grad)
    assert (new.grad[~keep] == 0).all() and (values.grad[~keep] == 0).all()
    # nothing kept: a zero loss that still back-propagates (every rank's micro batch must)
    none, _ = ppo_loss(new_logp=new, values=values, mask=torch.zeros(T, B, dtype=F64), **ins, **kw)
    assert none.item() == 0 and none.requires_grad
    with pytest.raises(ValueError, match="mask"):
        ppo_loss(new_logp=new, values=values, mask=mask[:2], **ins, **kw)
