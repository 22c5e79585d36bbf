"""Value normalisation: the value head predicts returns in units of their running mean and std.

Why. The learner clips the global gradient norm, over the policy and the value head together
(`learner.clip_grad`; DeepSpeed has one norm). With returns of scale R the value loss's gradient
grows like R: with ManiSkill's dense reward (returns ~20-30) it was 40-500 times the policy's,
so the clip shrank the policy's step by that much, and by a factor that changed whenever the
critic's error did. Its drop as the critic learnt gave the policy steps many times larger than
Adam's running scale expected. Normalised targets keep the value loss O(1) whatever the reward.

How (MAPPO's ValueNorm). A debiased exponential average of the V-trace targets' mean and mean
square, updated once per learner update over every rank's targets (so every rank holds the same
statistics). The learner denormalises the head's outputs before V-trace, then trains the head on
the targets normalised with the statistics updated by them. Before the first update the
statistics are the identity (mean 0, std 1).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# std >= 0.1: after batches of equal returns (a sparse reward, nothing solved yet) the first success
# is then at most 10 stds out, not thousands; returns of a smaller scale are simply normalised less.
MIN_VAR = 1e-2


class ValueNorm:
    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"algorithm.value_norm_decay={decay} must be in [0, 1)")
        self.decay = decay
        self.mean_acc = self.sq_acc = self.weight = 0.0     # the averages before debiasing

    @property
    def mean(self) -> float:
        return self.mean_acc / self.weight if self.weight > 0 else 0.0

    @property
    def std(self) -> float:
        if self.weight == 0:
            return 1.0
        return math.sqrt(max(self.sq_acc / self.weight - self.mean ** 2, MIN_VAR))

    @torch.no_grad()
    def update(self, targets: torch.Tensor) -> None:
        """Fold in one update's targets (this rank's; summed over ranks when distributed)."""
        x = targets.detach().double().flatten()
        sums = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=torch.float64,
                                                                   device=x.device)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        total, total_sq, n = (float(s) for s in sums)
        if n == 0:
            return
        b = self.decay
        self.mean_acc = b * self.mean_acc + (1 - b) * total / n
        self.sq_acc = b * self.sq_acc + (1 - b) * total_sq / n
        self.weight = b * self.weight + (1 - b)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> dict:
        return {"decay": self.decay, "mean_acc": self.mean_acc, "sq_acc": self.sq_acc, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.mean_acc, self.sq_acc, self.weight = state["mean_acc"], state["sq_acc"], state["weight"]
