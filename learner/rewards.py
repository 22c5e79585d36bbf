"""The rewards per policy step that an estimator reads, and episode ends within a segment.

All tensors are time-major: per-step inputs are [T, B]. Pure functions without gradient.

Episode ends. `discounts` is γ·(1 − done): a zero cuts both the bootstrap and the traces, so
nothing flows across an episode boundary. A *terminated* step simply gets discount 0. A
*truncated* step (time limit) must still bootstrap, but from V(final observation) of the episode
that ended, not from V(x_{t+1}): after an auto-reset x_{t+1} is the first observation of the
next episode. The caller therefore folds the bootstrap into the reward, r_t + γ·V(final), and
sets the discount to 0 (`bootstrap_truncated`). The truncated step's target is then exactly
r_t + γ·V(final) plus its own correction, and no value of the next episode leaks into it.

Rewards per policy step. With reward_type chunk_level the env already returns one reward per
chunk (the plain sum over its executed steps). With action_level it returns one per env step;
`chunk_rewards` discounts them inside the chunk, Σ_k γ_env^k r_k, and consecutive policy steps
are then γ_env^K apart (the caller's discount).
"""

from __future__ import annotations

from typing import Union

import torch


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
