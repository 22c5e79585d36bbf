"""GAE (Schulman et al. 2016): generalised advantage estimation from the critic's values, on the learner.

    δ_t = r_t + γ_t V(x_{t+1}) − V(x_t)
    A_t = δ_t + γ_t λ A_{t+1},  A_T = 0          (γ_t = 0 at an episode end: nothing crosses it)
    value target_t = A_t + V(x_t)                (the λ-return)

as PPO uses it: the data is taken as on-policy, with no importance weights in the targets (stale
data from the actors is only bounded by learner.max_policy_lag, and clipped by the PPO ratio).
V-trace with ρ̄ = c̄ = 1 and π = μ gives the same value targets but not the same advantages: its
advantage r + γ v_{s+1} − V(x) weighs the tail by γ, GAE's by γλ.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import Estimator, TargetInputs, Targets, register, step_log_ratio

if TYPE_CHECKING:
    import torch


@register
class GAE(Estimator):
    """GAE(γ, algorithm.gae_lambda) from the critic's values, on the learner."""
    name = "gae"

    def targets(self, x: TargetInputs) -> Targets:
        import torch
        adv = gae(x.rewards, x.values[:-1], x.values[-1], x.discounts, self.alg.gae_lambda)
        rhos = step_log_ratio(x.behavior_logp, x.target_logp).exp()
        return Targets(advantages=adv, value_targets=adv + x.values[:-1].detach(), rhos=rhos,
                       mask=torch.ones_like(adv), stats={})


def gae(rewards: "torch.Tensor", values: "torch.Tensor", bootstrap_value: "torch.Tensor",
        discounts: "torch.Tensor", lam: float) -> "torch.Tensor":
    """Advantages [T, B] from rewards, values, discounts [T, B] and bootstrap_value [B] (V of the
    observation after the segment), without gradient. The backward recursion over T is a loop
    over time only: every column at once."""
    import torch
    if values.dim() != 2 or rewards.shape != values.shape or discounts.shape != values.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and discounts "
                         f"{tuple(discounts.shape)} must all be [T, B]")
    if bootstrap_value.shape != values.shape[1:]:
        raise ValueError(f"gae: bootstrap_value {tuple(bootstrap_value.shape)} must be [B] = {tuple(values.shape[1:])}")
    if not (0.0 <= lam <= 1.0 and math.isfinite(lam)):
        raise ValueError(f"gae: lam={lam} must be in [0, 1]")
    values, bootstrap_value = values.detach(), bootstrap_value.detach()
    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = rewards.detach() + discounts.detach() * values_tp1 - values
    adv = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * lam * acc
        adv[t] = acc
    return adv
