"""The math of a flow-matching action head (pi0's convention), as pure functions.

t = 1 is noise and t = 0 the action: x_t = t * eps + (1 - t) * a, and the network predicts the
velocity v ~ eps - a. Sampling integrates from t = 1 to t = 0 over `time_grid(N)`, N Euler steps.

An Euler (ODE) step is deterministic, so a chain of them has no log-prob for PPO. Two ways give
the chain one, both with Gaussian steps x_next = mean + std * noise:
    Flow-SDE    the ODE turned into an SDE with the same marginals (Flow-GRPO): the mean and std of
                `sde_step` from the velocity alone, std set by `noise_level`;
    Flow-Noise  the Euler step's mean with a std from a small learned network (ReinFlow), its
                log-std squashed into a range by `bounded_log_std`.
A chain's log-prob is its Gaussian steps' log-probs (`gaussian_logprob`), averaged over the
denoising steps and summed over the chunk's actions and dims (`aggregate_steps`).
"""

from __future__ import annotations

import math

import torch

from .logprobs import reduce_logprobs

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def time_grid(num_steps: int) -> torch.Tensor:
    """The N + 1 times of N Euler steps from noise to action: 1, 1 - 1/N, ..., 1/N, 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64).float()


def sample_time(shape, generator: torch.Generator | None = None, alpha: float = 1.5,
                t_min: float = 1e-3) -> torch.Tensor:
    """Training times as pi0 draws them: Beta(alpha, 1), with more weight near the noise end for
    alpha > 1, mapped into [t_min, 1] so that no sample sits exactly on the action. Drawn by
    inversion (P(X <= x) = x ** alpha), so a generator makes it reproducible."""
    if not alpha > 0:
        raise ValueError(f"alpha={alpha} must be > 0")
    return t_min + (1.0 - t_min) * torch.rand(shape, generator=generator).pow(1.0 / alpha)


def interpolate(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t and the velocity target eps - a; t broadcasts from the leading (batch) dims."""
    t = _expand(t, actions)
    return t * noise + (1.0 - t) * actions, noise - actions


def flow_matching_loss(velocity: torch.Tensor, actions: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the predicted velocity and eps - a (pi0's SFT loss)."""
    return (velocity.float() - (noise - actions).float()).pow(2).mean()


def ode_step(x: torch.Tensor, velocity: torch.Tensor, t, t_next) -> torch.Tensor:
    """One Euler step of dx/dt = v from t down to t_next."""
    return x + (_expand(t_next, x) - _expand(t, x)) * velocity


def sde_sigma(t, noise_level: float, t_cap: float) -> torch.Tensor:
    """sigma_t = noise_level * sqrt(t / (1 - t)). The first step starts at t = 1, where 1 - t is 0:
    there the denominator takes t_cap (the grid's next time) and the numerator keeps t = 1, as
    Flow-GRPO and RLinf anchor it (capping t in both would make that step's sigma sqrt(t_cap) times
    smaller: 29 % at N = 2)."""
    t = torch.as_tensor(t, dtype=torch.float32)
    return noise_level * torch.sqrt(t / (1.0 - t.clamp(max=t_cap)))


def sde_step(x: torch.Tensor, velocity: torch.Tensor, t, t_next, noise_level: float,
             t_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Flow-SDE step from t to t_next < t (Flow-GRPO's ODE-to-SDE conversion).

    With x0 = x - t v (the action the velocity points at), x1 = x + (1 - t) v (the noise) and
    d = t - t_next:  mean = x0 (1 - t + d) + x1 (t - d - sigma^2 d / (2 t)),  std = sigma sqrt(d).
    At noise_level = 0 the mean is the Euler step and the std 0."""
    t, t_next = _expand(t, x), _expand(t_next, x)
    d = t - t_next
    sigma = sde_sigma(t, noise_level, t_cap)
    x0, x1 = x - t * velocity, x + (1.0 - t) * velocity
    mean = x0 * (1.0 - t + d) + x1 * (t - d - sigma ** 2 * d / (2.0 * t))
    return mean, (sigma * torch.sqrt(d)).expand_as(mean)


def bounded_log_std(raw: torch.Tensor, log_std_min: float, log_std_max: float) -> torch.Tensor:
    """A learned log-std squashed into [log_std_min, log_std_max] (Flow-Noise's noise network)."""
    if not log_std_min < log_std_max:
        raise ValueError(f"log_std_min={log_std_min} must be < log_std_max={log_std_max}")
    return log_std_min + (log_std_max - log_std_min) * torch.sigmoid(raw)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2), in fp32 (std > 0: an ODE step has no log-prob)."""
    std = std.float()
    return -0.5 * ((x.float() - mean.float()) / std) ** 2 - torch.log(std) - LOG_SQRT_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Elementwise entropy of N(., std^2): log std + log sqrt(2 pi e)."""
    return torch.log(std.float()) + LOG_SQRT_2PI + 0.5


def aggregate_steps(step_logp: torch.Tensor, level: str) -> torch.Tensor:
    """[..., J, K, D] log-probs of J Gaussian denoising steps of a K x D chunk -> the policy's
    log-prob at `level` (as reduce_logprobs: token_level [..., K*D], action_level [..., K],
    chunk_level [..., 1]): the mean over the steps, then sums over dims and actions."""
    if step_logp.dim() < 3:
        raise ValueError(f"expected [..., steps, K, D]; got shape {tuple(step_logp.shape)}")
    K, D = step_logp.shape[-2:]
    per_entry = step_logp.mean(dim=-3)
    return reduce_logprobs(per_entry.flatten(-2), level, K, D)


def _expand(t, like: torch.Tensor) -> torch.Tensor:
    """t (a number, or one value per leading index) shaped to broadcast against `like`."""
    t = torch.as_tensor(t, dtype=like.dtype if like.is_floating_point() else torch.float32, device=like.device)
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim()))
