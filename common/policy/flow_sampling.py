"""Sampling a flow head's action chunk as a chain with a log-prob, and scoring a stored chain.

A rollout integrates N steps from noise (t = 1) to the chunk (t = 0) and keeps the whole chain
x_0 .. x_N ([B, N+1, K, D]) with a mask of the steps that were Gaussian ([B, N]):
    flow_sde    one step per sample, drawn uniformly, is the Flow-SDE step; the others are Euler;
    flow_noise  every step is Gaussian, around the Euler step, with the expert's learned std;
    greedy      no step is (the ODE): evaluation only, no log-prob.
The chain's log-prob per chunk entry [B, K, D] is the mean over its Gaussian steps of
log N(x_{i+1}; mean_i, std_i^2). `chain_logprob` recomputes it from a stored chain with the
current weights in one expert pass over the Gaussian steps: with the actor's weights it is the
actor's number, which is what the importance ratios of V-trace and PPO need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .flow import bounded_log_std, gaussian_entropy, gaussian_logprob, ode_step, sde_step, time_grid

NOISE_METHODS = ("flow_sde", "flow_noise")


@dataclass(frozen=True)
class FlowSampling:
    """How a chain is drawn (policy.flow.*)."""
    num_steps: int = 4
    noise_method: str = "flow_sde"
    noise_level: float = 0.5            # Flow-SDE's a in sigma_t = a sqrt(t / (1 - t))
    log_std_min: float = -5.0           # Flow-Noise's learned log-std range
    log_std_max: float = -1.0

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"policy.flow.num_steps={self.num_steps} must be >= 1")
        if self.noise_method not in NOISE_METHODS:
            raise ValueError(f"policy.flow.noise_method={self.noise_method!r} is not allowed; choose one of "
                             f"{list(NOISE_METHODS)}")
        if not self.noise_level > 0:
            raise ValueError(f"policy.flow.noise_level={self.noise_level} must be > 0")
        if not self.log_std_min < self.log_std_max:
            raise ValueError(f"policy.flow.log_std_min={self.log_std_min} must be < "
                             f"policy.flow.log_std_max={self.log_std_max}")

    @property
    def t_cap(self) -> float:
        """Flow-SDE's sigma is infinite at t = 1: the first step's denominator takes the grid's
        next time (0 with a single step, whose sigma is then noise_level)."""
        return 1.0 - 1.0 / self.num_steps


class FlowChain(NamedTuple):
    chain: torch.Tensor        # float32 [B, N+1, K, D]: x at t = 1 (noise) ... t = 0 (the chunk)
    stochastic: torch.Tensor   # bool [B, N]: step i (x_i -> x_{i+1}) was Gaussian
    logp: torch.Tensor         # float32 [B, K, D]: mean log-prob of the Gaussian steps (0 if none)


def velocity_and_raw(expert, s: FlowSampling, x, t, prefix_kv, prefix_mask):
    """The expert's velocity [B, K, D] at time t, and Flow-Noise's raw log-std logits (else None)."""
    if s.noise_method == "flow_sde":
        return expert(x, _per_row(t, x), prefix_kv, prefix_mask), None
    return expert.velocity_and_noise(x, _per_row(t, x), prefix_kv, prefix_mask)


def step_moments(s: FlowSampling, x, velocity, raw, t, t_next):
    """Mean and std [B, K, D] of the Gaussian step from t to t_next ([B] or numbers)."""
    if s.noise_method == "flow_sde":
        return sde_step(x, velocity, t, t_next, s.noise_level, s.t_cap)
    return ode_step(x, velocity, t, t_next), bounded_log_std(raw, s.log_std_min, s.log_std_max).exp()


@torch.no_grad()
def sample_chain(expert, s: FlowSampling, prefix_kv, prefix_mask, shape, greedy: bool = False,
                 generator: torch.Generator | None = None) -> FlowChain:
    """Draw a chunk of `shape` (B, K, D) from noise; see the module doc for which steps are Gaussian."""
    b, n = shape[0], s.num_steps
    dev = prefix_mask.device

    def randn():          # drawn where the generator lives, so a CPU generator serves a GPU policy
        return torch.randn(shape, generator=generator, device=generator.device if generator else dev).to(dev)

    if greedy:
        stochastic = torch.zeros(b, n, dtype=torch.bool)
    elif s.noise_method == "flow_sde":
        k = torch.randint(0, n, (b,), generator=generator, device=generator.device if generator else "cpu")
        stochastic = torch.nn.functional.one_hot(k.cpu(), n).bool()
    else:
        stochastic = torch.ones(b, n, dtype=torch.bool)
    stochastic = stochastic.to(dev)
    grid = time_grid(n)
    x = randn()
    chain, logp = [x], torch.zeros(shape, device=dev)
    for i in range(n):
        t, t_next = grid[i].item(), grid[i + 1].item()
        velocity, raw = velocity_and_raw(expert, s, x, t, prefix_kv, prefix_mask)
        x_next = ode_step(x, velocity, t, t_next)
        gauss = stochastic[:, i, None, None]
        if gauss.any():
            mean, std = step_moments(s, x, velocity, raw, t, t_next)
            drawn = mean + std * randn()
            logp = logp + torch.where(gauss, gaussian_logprob(drawn, mean, std), 0.0)
            x_next = torch.where(gauss, drawn, x_next)
        x = x_next
        chain.append(x)
    count = stochastic.sum(1).clamp(min=1).to(logp.dtype)
    return FlowChain(torch.stack(chain, 1).float(), stochastic, logp / count[:, None, None])


def chain_logprob(expert, s: FlowSampling, prefix_kv, prefix_mask, chain: torch.Tensor,
                  stochastic: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob [B, K, D] of a stored chain under the current weights (with grad), and the entropy
    of its Gaussian steps [B, K, D], both averaged over each sample's Gaussian steps, in one expert
    pass over those steps only."""
    b, n = stochastic.shape
    if chain.shape[:2] != (b, n + 1):
        raise ValueError(f"chain of shape {tuple(chain.shape)} does not fit stochastic {tuple(stochastic.shape)} "
                         f"([B, N+1, K, D] and [B, N])")
    rows, steps = stochastic.nonzero(as_tuple=True)
    if rows.numel() == 0:
        raise ValueError("no Gaussian step in the chain: a greedy (ODE) chunk has no log-prob")
    grid = time_grid(n).to(chain.device)
    kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in prefix_kv]
    x, x_next = chain[rows, steps], chain[rows, steps + 1]
    t, t_next = grid[steps], grid[steps + 1]
    velocity, raw = velocity_and_raw(expert, s, x, t, kv, prefix_mask.index_select(0, rows))
    mean, std = step_moments(s, x, velocity, raw, t, t_next)
    per_step_logp, per_step_entropy = gaussian_logprob(x_next, mean, std), gaussian_entropy(std)
    logp = torch.zeros((b,) + tuple(chain.shape[2:]), device=chain.device).index_add(0, rows, per_step_logp)
    entropy = torch.zeros_like(logp).index_add(0, rows, per_step_entropy)
    count = stochastic.sum(1).clamp(min=1).to(logp.dtype)[:, None, None]
    return logp / count, entropy / count


def _per_row(t, x: torch.Tensor) -> torch.Tensor:
    """The denoising time as one value per row [B]."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    return t.expand(x.shape[0]) if t.dim() == 0 else t
