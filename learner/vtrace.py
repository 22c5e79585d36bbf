"""V-trace off-policy targets (IMPALA, Espeholt et al. 2018) and the reward bookkeeping before them.

All tensors are time-major: per-step inputs are [T, B], the bootstrap value is [B]. Everything
here is a pure function without gradient.

Episode ends. `discounts` is γ·(1 − done): a zero cuts both the bootstrap and the traces, so
nothing flows across an episode boundary. A *terminated* step simply gets discount 0. A
*truncated* step (time limit) must still bootstrap, but from V(final observation) of the episode
that ended, not from V(x_{t+1}): after an auto-reset x_{t+1} is the first observation of the
next episode. The caller therefore folds the bootstrap into the reward, r_t + γ·V(final), and
sets the discount to 0 (`bootstrap_truncated`). The truncated step's target is then exactly
r_t + γ·V(final) plus its own δ correction, and no value of the next episode leaks into it.

Rewards per policy step. With reward_type chunk_level the env already returns one reward per
chunk (the plain sum over its executed steps). With action_level it returns one per env step;
`chunk_rewards` discounts them inside the chunk, Σ_k γ_env^k r_k, and consecutive policy steps
are then γ_env^K apart (the caller's discount).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import torch


class VTraceReturns(NamedTuple):
    vs: torch.Tensor              # [T, B] V-trace value targets v_s
    pg_advantages: torch.Tensor   # [T, B] min(ρ̄, ρ_s)(r_s + γ_s v_{s+1} − V(x_s))
    rhos: torch.Tensor            # [T, B] unclipped importance weights π/μ of the whole policy step


@torch.no_grad()
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
    _check_vtrace_inputs(behavior_logp, target_logp, rewards, values, bootstrap_value, discounts,
                         rho_bar, c_bar, lam)
    log_rhos = target_logp.detach() - behavior_logp.detach()
    if log_rhos.dim() == values.dim() + 1:
        log_rhos = log_rhos.sum(-1)
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


@torch.no_grad()
def bootstrap_truncated(rewards: torch.Tensor, gamma: Union[float, torch.Tensor],
                        terminated: torch.Tensor, truncated: torch.Tensor,
                        final_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and discounts for `vtrace` with time-limit truncations bootstrapped correctly.

    rewards [T, B]; gamma: discount per policy step (float or [T, B]); terminated, truncated bool
    [T, B]; final_values [T, B]: V(final observation) of the episode that ended at a truncated
    step (read only there; other entries may hold anything, even NaN).
    Returns (rewards + γ·V(final) at truncated-not-terminated steps, γ·(1 − (terminated|truncated))).
    A step that is both terminated and truncated is terminal: no bootstrap.
    """
    if not (rewards.shape == terminated.shape == truncated.shape == final_values.shape):
        raise ValueError(f"bootstrap_truncated: rewards {tuple(rewards.shape)}, terminated "
                         f"{tuple(terminated.shape)}, truncated {tuple(truncated.shape)} and "
                         f"final_values {tuple(final_values.shape)} must all be [T, B]")
    terminated, truncated = terminated.bool(), truncated.bool()
    gamma = torch.as_tensor(gamma, dtype=rewards.dtype, device=rewards.device)
    bootstrap = truncated & ~terminated
    # where(), not a product with a mask: a NaN/inf placeholder outside truncations must not leak.
    extra = torch.where(bootstrap, gamma * final_values.detach().to(rewards.dtype),
                        torch.zeros_like(rewards))
    discounts = gamma * (~(terminated | truncated)).to(rewards.dtype)
    return rewards.detach() + extra, discounts


@torch.no_grad()
def chunk_rewards(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """Action-level rewards [T, B, K] -> one per policy step [T, B]: Σ_k γ^k r_k.

    γ is the per-env-step discount; steps after an episode end inside the chunk carry reward 0
    (the env stops stepping there), so they add nothing.
    """
    if rewards.dim() != 3:
        raise ValueError(f"chunk_rewards: rewards must be [T, B, K] (action_level), got "
                         f"{tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"chunk_rewards: gamma={gamma} must be in [0, 1]")
    k = torch.arange(rewards.shape[-1], device=rewards.device, dtype=rewards.dtype)
    return (rewards.detach() * gamma ** k).sum(-1)


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
