"""PPO loss on V-trace targets: a clipped surrogate, value loss to v_s, entropy bonus.

Two policy objectives (`algorithm.policy_loss`):
  behavior_clip  clip r = π_θ/μ around the behaviour policy μ that sampled the data.
  decoupled      clip r = π_θ/π_prox around the proximal policy π_prox, the learner's weights at
                 the start of the update (the log-probs `compute_targets` already computes), and
                 weight each element by w = π_prox/μ; elements with w > behave_weight_threshold
                 are masked out (AReaL's decoupled PPO; RLinf's `decoupled_actor_critic`).
With stale data μ lags π_θ by a version or more, so r = π_θ/μ starts each update away from 1 and
behavior_clip cuts the step short; decoupled clips only how far this update moves.

Shapes. `advantages`, `values`, `old_values`, `value_targets` and `rhos` share one shape S
([T, B], or flattened [n]). `new_logp`/`behavior_logp` are S (one log-prob per policy step) or
S + [M] (token, action or chunk log-probs); the advantage of a policy step is then broadcast over
its M parts, each part gets its own clipped ratio, and the policy loss is the mean over all
S×M elements (so every token/action counts equally). `entropy` is S or S + [M], averaged likewise.
An optional `mask` of shape S (1 trains a policy step, 0 leaves it out: a column dropped as
poisoned, or padding) turns every mean into one over the kept steps only.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from asyncvla.common.advantages import make_estimator

# Log-ratios beyond ±20 (ratio ≈ 5e8) carry no useful signal; clamping keeps exp() finite so a
# clipped-away inf cannot turn into a NaN gradient (inf·0).
_MAX_LOG_RATIO = 20.0
POLICY_LOSSES = ("behavior_clip", "decoupled")


def ppo_loss(new_logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor,
             values: torch.Tensor, old_values: torch.Tensor, value_targets: torch.Tensor,
             entropy: torch.Tensor, rhos: torch.Tensor, rho_bar: float = 1.0, *,
             ratio_clip_eps: float = 0.2, clip_ratio_c: Optional[float] = None,
             entropy_bonus: float = 0.0, value_loss_coef: float = 0.5, value_loss_type: str = "mse",
             huber_delta: float = 1.0, value_clip: Optional[float] = None,
             normalize_advantages: bool = True, advantage_scale: float = 1.0,
             advantage_stats: Optional[Tuple[float, float]] = None, policy_loss_type: str = "behavior_clip",
             prox_logp: Optional[torch.Tensor] = None,
             behave_weight_threshold: float = 2.0,
             mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """Total loss = policy_loss + value_loss_coef·value_loss − entropy_bonus·mean(entropy).

    new_logp, values, entropy: from π_θ (with gradient). behavior_logp: log μ of the actor.
    advantages, value_targets, rhos: the advantage estimator's (common/advantages/). old_values: V of the
    policy that computed the targets (centre of value clipping). The policy term is
    `clipped_surrogate`'s, on advantages first normalised (mean 0, std 1 over the elements passed
    in, or with `advantage_stats` = (mean, std) of a larger batch when the loss is called per micro
    batch), then multiplied by advantage_scale; the value term is `_value_loss`'s.
    mask (shape S, 0/1): only the steps it keeps count, in every mean and in the advantages' own
    normalisation; with none kept the loss is 0 (and still carries a graph). The masked steps'
    inputs must be finite (0 times NaN is NaN).
    Returns (loss, stats) with the stats as python floats.
    """
    _check_loss_args(ratio_clip_eps, clip_ratio_c, value_loss_type, huber_delta, value_clip,
                     advantage_scale, policy_loss_type, behave_weight_threshold)
    _check_loss_shapes(new_logp, behavior_logp, advantages, values, old_values, value_targets, entropy,
                       rhos)
    decoupled = policy_loss_type == "decoupled"
    if decoupled and (prox_logp is None or prox_logp.shape != new_logp.shape):
        raise ValueError(f"ppo_loss: the decoupled loss needs prox_logp shaped like new_logp "
                         f"{tuple(new_logp.shape)}, got {None if prox_logp is None else tuple(prox_logp.shape)}")
    if mask is not None and mask.shape != advantages.shape:
        raise ValueError(f"ppo_loss: mask {tuple(mask.shape)} must match advantages {tuple(advantages.shape)}")

    keep = torch.ones_like(advantages) if mask is None else mask.detach().to(advantages.dtype)
    per_part = new_logp.dim() == advantages.dim() + 1
    adv = _scaled_advantages(advantages, keep, normalize_advantages, advantage_stats, advantage_scale, per_part)
    kept = keep.unsqueeze(-1).expand_as(new_logp) if per_part else keep       # per element
    entropy_keep = keep.unsqueeze(-1).expand_as(entropy) if entropy.dim() == keep.dim() + 1 else keep

    pg, ratio, log_ratio, behaviour = clipped_surrogate(
        new_logp, behavior_logp, adv, ratio_clip_eps, clip_ratio_c,
        prox_logp if decoupled else None, behave_weight_threshold)
    policy_loss = _mean(pg, kept)
    value_loss = _value_loss(values, old_values.detach(), value_targets.detach(), value_loss_type,
                             huber_delta, value_clip, keep)
    entropy_mean = _mean(entropy, entropy_keep)
    loss = policy_loss + value_loss_coef * value_loss - entropy_bonus * entropy_mean
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy_mean.item(),
                 **_ratio_stats(ratio, log_ratio, kept if mask is not None else None, ratio_clip_eps),
                 **_target_stats(rhos, rho_bar, value_targets, values, keep)}
        if behaviour is not None:    # how far the data's behaviour policy is from π_prox, and what was masked
            w, log_w, in_weight = behaviour
            stats["behav_approx_kl"] = _mean(((w - 1) - log_w).detach(), kept).item()
            stats["behav_clip_fraction"] = _mean((~in_weight).float(), kept).item()
    return loss, stats


def clipped_surrogate(new_logp, behavior_logp, adv, ratio_clip_eps: float, clip_ratio_c: Optional[float],
                      prox_logp: Optional[torch.Tensor] = None, behave_weight_threshold: float = 2.0):
    """PPO's clipped policy term per element, and (ratio, log ratio, behaviour weights or None).

    Ratio r = π_θ/μ; per element max(−A·r, −A·clip(r, 1±ratio_clip_eps)). Dual clip
    (clip_ratio_c = c > 1): where A < 0 that is further capped at −c·A, so a huge ratio on a bad
    action cannot blow up the loss. Decoupled (prox_logp = log π_prox, shaped as new_logp): the
    ratio is r = π_θ/π_prox, and each element's clipped term is multiplied by the behaviour weight
    w = π_prox/μ, or by 0 where w > behave_weight_threshold (masked, not truncated: an element whose
    probability moved that far since it was sampled says little about π_θ, and a truncated weight
    would still push on it); the behaviour weights come back as (w, log w, w ≤ threshold)."""
    anchor = behavior_logp.detach() if prox_logp is None else prox_logp.detach()
    log_ratio = (new_logp - anchor).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - ratio_clip_eps, 1.0 + ratio_clip_eps))
    if clip_ratio_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -clip_ratio_c * adv), pg)
    if prox_logp is None:
        return pg, ratio, log_ratio, None
    log_w = (prox_logp.detach() - behavior_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    w = torch.exp(log_w)
    in_weight = w <= behave_weight_threshold
    return torch.where(in_weight, w * pg, torch.zeros_like(pg)), ratio, log_ratio, (w, log_w, in_weight)


def _ratio_stats(ratio, log_ratio, kept: Optional[torch.Tensor], ratio_clip_eps: float) -> dict:
    """How far π_θ moved from the anchor, over the kept elements (all when `kept` is None)."""
    r = ratio.detach()[kept.bool()] if kept is not None else ratio.detach()
    lr = log_ratio.detach()[kept.bool()] if kept is not None else log_ratio.detach()
    return {"approx_kl": _mean_or_nan((r - 1) - lr),                # k3 estimator of KL(μ‖π)
            "clip_fraction": _mean_or_nan(((r - 1).abs() > ratio_clip_eps).float()),
            "ratio_mean": _mean_or_nan(r),
            "ratio_max": r.max().item() if r.numel() else 1.0}


def _target_stats(rhos, rho_bar: float, value_targets, values, keep) -> dict:
    """V-trace's importance weights, and how much of the targets' variance the critic explains
    (1 − Var[v_s − V]/Var[v_s]: 1 perfect, 0 no better than a constant; nan if v_s is constant)."""
    k64, vt = keep.double(), value_targets.detach().double()
    var_vs = masked_mean_std(vt, k64)[1] ** 2
    return {"rho_mean": _mean(rhos.double(), k64).item(),
            "rho_clipped_fraction": _mean((rhos > rho_bar).double(), k64).item(),
            "explained_variance": (1.0 - masked_mean_std(vt - values.detach().double(), k64)[1] ** 2 / var_vs).item()
            if var_vs > 0 else math.nan}


def masked_mean_std(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) std of the elements of `x` where `keep` (same shape, 0/1) is 1; (0, 0)
    when none is."""
    n = keep.sum().clamp(min=1)
    mean = (x * keep).sum() / n
    return mean, (((x - mean) ** 2 * keep).sum() / n).sqrt()


def _mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The mean of x over the kept elements (0 when none is)."""
    return (x * keep).sum() / keep.sum().clamp(min=1)


def _mean_or_nan(x: torch.Tensor) -> float:
    return x.mean().item() if x.numel() else math.nan


def ppo_loss_from_config(alg, **tensors) -> tuple[torch.Tensor, dict]:
    """`ppo_loss` with the coefficients of an AlgorithmConfig (`cfg.algorithm`), as its advantage
    estimator allows: without a critic no value loss; advantages that come normalised (GRPO's,
    within their groups) are not normalised again."""
    est = make_estimator(alg)
    return ppo_loss(**tensors, rho_bar=alg.rho_bar, ratio_clip_eps=alg.ratio_clip_eps,
                    clip_ratio_c=alg.clip_ratio_c, entropy_bonus=alg.entropy_bonus,
                    value_loss_coef=alg.value_loss_coef if est.critic else 0.0, value_loss_type=alg.value_loss_type,
                    huber_delta=alg.huber_delta, value_clip=alg.value_clip,
                    normalize_advantages=alg.normalize_advantages and est.renormalize,
                    advantage_scale=alg.advantage_scale,
                    policy_loss_type=alg.policy_loss, behave_weight_threshold=alg.behave_weight_threshold)


def _scaled_advantages(advantages, keep, normalize: bool, stats, scale: float, per_part: bool) -> torch.Tensor:
    """Advantages normalised over the kept elements (or by `stats` = (mean, std)), times `scale`;
    with `per_part`, one per policy step shared by its M log-prob parts ([..., 1])."""
    adv = advantages.detach()
    if normalize:
        mean, std = stats if stats is not None else masked_mean_std(adv, keep)
        adv = (adv - mean) / (std + 1e-8)
    adv = adv * scale
    return adv.unsqueeze(-1) if per_part else adv


def _value_loss(values, old_values, targets, kind, huber_delta, value_clip, keep) -> torch.Tensor:
    """0.5·(V − v_s)² ("mse") or Huber with huber_delta (equal to mse for |V − v_s| ≤ delta), over
    the kept steps. With value_clip, as in PPO2: max(loss(V), loss(V_old + clip(V − V_old, ±value_clip)))."""
    def per_element(v):
        if kind == "huber":
            return F.huber_loss(v, targets, reduction="none", delta=huber_delta)
        return 0.5 * (v - targets) ** 2

    loss = per_element(values)
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.maximum(loss, per_element(clipped))
    return _mean(loss, keep)


def _check_loss_args(ratio_clip_eps, clip_ratio_c, value_loss_type, huber_delta, value_clip,
                     advantage_scale, policy_loss_type, behave_weight_threshold) -> None:
    if policy_loss_type not in POLICY_LOSSES:
        raise ValueError(f"ppo_loss: policy_loss_type={policy_loss_type!r}; allowed: {', '.join(POLICY_LOSSES)}")
    if not behave_weight_threshold > 1:
        raise ValueError(f"ppo_loss: behave_weight_threshold={behave_weight_threshold} must be > 1")
    if not ratio_clip_eps > 0:
        raise ValueError(f"ppo_loss: ratio_clip_eps={ratio_clip_eps} must be > 0")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"ppo_loss: clip_ratio_c={clip_ratio_c} must be > 1 or None (disabled)")
    if value_loss_type not in ("mse", "huber"):
        raise ValueError(f"ppo_loss: value_loss_type={value_loss_type!r}; allowed: 'mse', 'huber'")
    if not huber_delta > 0:
        raise ValueError(f"ppo_loss: huber_delta={huber_delta} must be > 0")
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"ppo_loss: value_clip={value_clip} must be > 0 or None (disabled)")
    if not advantage_scale > 0:
        raise ValueError(f"ppo_loss: advantage_scale={advantage_scale} must be > 0")


def _check_loss_shapes(new_logp, behavior_logp, advantages, values, old_values, value_targets,
                       entropy, rhos) -> None:
    S = advantages.shape
    for name, x in (("values", values), ("old_values", old_values),
                    ("value_targets", value_targets), ("rhos", rhos)):
        if x.shape != S:
            raise ValueError(f"ppo_loss: {name} {tuple(x.shape)} must match advantages {tuple(S)}")
    if new_logp.shape != behavior_logp.shape:
        raise ValueError(f"ppo_loss: new_logp {tuple(new_logp.shape)} and behavior_logp "
                         f"{tuple(behavior_logp.shape)} must have the same shape")
    for name, x in (("log-probs", new_logp), ("entropy", entropy)):
        if not (x.shape == S or (x.dim() == len(S) + 1 and x.shape[:-1] == S)):
            raise ValueError(f"ppo_loss: {name} {tuple(x.shape)} must be {tuple(S)} or "
                             f"{tuple(S)} + [M] (advantages {tuple(S)})")
