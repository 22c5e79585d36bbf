"""V-trace (IMPALA, Espeholt et al. 2018): the learner's off-policy-corrected targets and advantages.

The actors' data comes from policies a few versions behind the learner's (learner.max_policy_lag).
V-trace weighs each step by its clipped importance weight π/μ, so the value targets are those of
the current policy π, and the advantage of a step is min(ρ̄, ρ)(r + γ v_{s+1} − V(x)).
algorithm.off_policy_correction none sets every weight to 1 (λ-returns and one-step advantages
on stale data, the ablation). Reward bookkeeping before it: learner/rewards.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from . import Estimator, TargetInputs, Targets, register, step_log_ratio

if TYPE_CHECKING:
    import torch


@register
class VTrace(Estimator):
    """V-trace targets from the critic's values, on the learner."""
    name = "vtrace"

    def targets(self, x: TargetInputs) -> Targets:
        import torch
        a = self.alg
        corrected = a.off_policy_correction == "vtrace"
        vt = vtrace(behavior_logp=x.behavior_logp, target_logp=x.target_logp if corrected else x.behavior_logp,
                    rewards=x.rewards, values=x.values[:-1], bootstrap_value=x.values[-1], discounts=x.discounts,
                    rho_bar=a.rho_bar, c_bar=a.c_bar, lam=a.vtrace_lambda)
        return Targets(advantages=vt.pg_advantages, value_targets=vt.vs, rhos=vt.rhos,
                       mask=torch.ones_like(vt.vs), stats={})


class VTraceReturns(NamedTuple):
    vs: torch.Tensor              # [T, B] V-trace value targets v_s
    pg_advantages: torch.Tensor   # [T, B] min(ρ̄, ρ_s)(r_s + γ_s v_{s+1} − V(x_s))
    rhos: torch.Tensor            # [T, B] unclipped importance weights π/μ of the whole policy step


def vtrace(behavior_logp: torch.Tensor, target_logp: torch.Tensor, rewards: torch.Tensor,
           values: torch.Tensor, bootstrap_value: torch.Tensor, discounts: torch.Tensor,
           rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages.

    behavior_logp, target_logp: log μ(a_t|x_t) and log π(a_t|x_t), [T, B] or [T, B, M] with M
        token/action/chunk log-probs per policy step. With [T, B, M] the step's log-ratio is the
        SUM over M: the policy step's probability is the product of its parts, so its importance
        weight is the product of the per-part ratios.
    rewards, values, discounts: [T, B]; discounts = γ·(1 − terminated), truncation handled by the
        caller (module docstring, `bootstrap_truncated`).
    bootstrap_value: [B], V(x_T) of the observation after the segment.

    ρ_t = π/μ;  δ_t = min(ρ̄, ρ_t)(r_t + γ_t V(x_{t+1}) − V(x_t));  c_t = λ·min(c̄, ρ_t);
    v_s − V(x_s) = δ_s + γ_s c_s (v_{s+1} − V(x_{s+1})),  v_T = V(x_T) = bootstrap_value;
    pg_advantages_s = min(ρ̄, ρ_s)(r_s + γ_s v_{s+1} − V(x_s)).
    Computed in the inputs' dtype; the outputs carry no gradient.
    """
    import torch
    _check_vtrace_inputs(behavior_logp, target_logp, rewards, values, bootstrap_value, discounts,
                         rho_bar, c_bar, lam)
    log_rhos = step_log_ratio(behavior_logp, target_logp)
    values, bootstrap_value = values.detach(), bootstrap_value.detach()
    rewards, discounts = rewards.detach(), discounts.detach()

    rhos = torch.exp(log_rhos)
    # Clip in log space: a product of many token ratios can overflow exp(); the clipped weights
    # stay exact and finite even then (only the returned, unclipped rhos may be inf).
    clipped_rhos = torch.exp(torch.clamp(log_rhos, max=math.log(rho_bar)))
    cs = lam * torch.exp(torch.clamp(log_rhos, max=math.log(c_bar)))

    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)

    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = torch.empty_like(values)
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v

    vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    pg_advantages = clipped_rhos * (rewards + discounts * vs_tp1 - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages, rhos=rhos)



def _check_vtrace_inputs(behavior_logp, target_logp, rewards, values, bootstrap_value, discounts,
                         rho_bar, c_bar, lam) -> None:
    if values.dim() != 2:
        raise ValueError(f"vtrace: values must be [T, B], got {tuple(values.shape)}")
    T, B = values.shape
    for name, x in (("rewards", rewards), ("discounts", discounts)):
        if x.shape != values.shape:
            raise ValueError(f"vtrace: {name} {tuple(x.shape)} must match values [T, B] = {(T, B)}")
    if bootstrap_value.shape != (B,):
        raise ValueError(f"vtrace: bootstrap_value {tuple(bootstrap_value.shape)} must be [B] = {(B,)}")
    if behavior_logp.shape != target_logp.shape:
        raise ValueError(f"vtrace: behavior_logp {tuple(behavior_logp.shape)} and target_logp "
                         f"{tuple(target_logp.shape)} must have the same shape")
    if behavior_logp.shape[:2] != (T, B) or behavior_logp.dim() not in (2, 3):
        raise ValueError(f"vtrace: log-probs {tuple(behavior_logp.shape)} must be [T, B] or "
                         f"[T, B, M] with [T, B] = {(T, B)}")
    if not (rho_bar > 0 and c_bar > 0):
        raise ValueError(f"vtrace: rho_bar={rho_bar} and c_bar={c_bar} must be > 0")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"vtrace: lam={lam} must be in [0, 1]")
