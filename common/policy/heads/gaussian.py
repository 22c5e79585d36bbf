"""The Gaussian head: a diagonal Gaussian over the continuous K x D chunk, as ManiSkill's and
CleanRL's continuous PPO act.

The mean of entry i is read off the hidden state of action query i (one pass over the prompt and
N = K*D learned queries, queries.py, as the parallel head); the log-std is one learned number per
entry, independent of the state, squashed into [policy.gaussian.log_std_min, log_std_max]. Both
live in the unit action space ([-1, 1] is the policy's action range); the env clips what falls
outside it. The replay is the sampled point itself (before any clipping), so its density is
recomputed exactly. SFT maximises the demos' log-likelihood, which also fits the std to the
demos' spread around the mean. policy.temperature does not apply (as for the flow head).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asyncvla.common.transport.protocol import Field

from . import Acted, ActionHead, Scored, SFTLoss, register
from ..flow import bounded_log_std, gaussian_entropy, gaussian_logprob
from .queries import ActionQueries, query_pass


class GaussianParams(nn.Module):
    """Hidden states at the N queries [B, N, H] -> (mean [B, N], std [N])."""

    def __init__(self, hidden_size: int, num_entries: int, log_std_init: float, log_std_min: float,
                 log_std_max: float):
        super().__init__()
        self.mean = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.mean.weight, std=0.01)        # a small start: the mean near the range's middle
        nn.init.zeros_(self.mean.bias)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        frac = (log_std_init - log_std_min) / (log_std_max - log_std_min)   # raw value that gives log_std_init
        self.raw_log_std = nn.Parameter(torch.full((num_entries,), math.log(frac / (1 - frac))))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.mean(hidden.to(self.mean.weight.dtype)).squeeze(-1).float()
        return mean, bounded_log_std(self.raw_log_std.float(), self.log_std_min, self.log_std_max).exp()


@register
class GaussianHead(ActionHead):
    name = "gaussian"
    densities = True

    def modules(self, hidden_size, init_std):
        n, g = self.cfg.num_action_chunks * self.cfg.action_dim, self.cfg.gaussian
        return {"action_queries": ActionQueries(n, hidden_size, init_std),
                "gaussian": GaussianParams(hidden_size, n, g.log_std_init, g.log_std_min, g.log_std_max)}

    def replay_fields(self) -> dict:
        return {"gaussian_action": Field("float32", ("K", "D"), "step", "unit")}

    def act(self, policy, prompt, temperature, greedy, generator) -> Acted:
        mean, std, values = self._distribution(policy, prompt)
        if greedy:
            x = mean
        else:
            noise = torch.randn(mean.shape, generator=generator,
                                device=generator.device if generator is not None else mean.device)
            x = mean + std * noise.to(mean.device)
        b, k, d = mean.shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        actions = policy.action_tokenizer.from_unit(x).reshape(b, k, d)
        return Acted(actions, {"gaussian_action": x.reshape(b, k, d)}, gaussian_logprob(x, mean, std), values)

    def evaluate(self, policy, prompt, replay, temperature) -> Scored:
        mean, std, values = self._distribution(policy, prompt)
        x = torch.as_tensor(replay["gaussian_action"]).to(mean.device, torch.float32).reshape(mean.shape)
        return Scored(gaussian_logprob(x, mean, std), gaussian_entropy(std).expand_as(mean), values)

    def sft_loss(self, policy, prompt, actions, generator) -> SFTLoss:
        """The demo chunk's negative log-likelihood per entry, averaged (env units mapped to the
        unit range with the policy's action range)."""
        mean, std, values = self._distribution(policy, prompt)
        target = policy.action_tokenizer.to_unit(actions.to(mean.device, torch.float32).reshape(mean.shape))
        return SFTLoss(-gaussian_logprob(target, mean, std).mean(1), values,
                       {"action_error": (target - mean).detach().abs().mean(1)})

    @staticmethod
    def _distribution(policy, prompt):
        hidden, values = query_pass(policy, prompt, policy.action_queries)
        mean, std = policy.gaussian(hidden)
        return mean, std.expand_as(mean), values
