"""Continuous actions <-> vocabulary ids (OpenVLA style).

Each action dimension d in [low[d], high[d]] is cut into n_bins uniform bins; bin b is the
vocabulary id first_id + b, where the action ids are the LAST n_bins ids of the vocabulary. Decoding
returns the bin centre, so decode(encode(a)) is within half a bin of clip(a) and
encode(decode(t)) == t. Accepts and returns numpy arrays or torch tensors (whichever came in).

The range is per dimension because demonstrations rarely use the env's whole [-1, 1]: ManiSkill's
motion-planner demos in pd_ee_delta_pose move |a| < 0.1 on most steps, which 32 bins over [-1, 1]
round to the zero bin. As OpenVLA does, SFT can set each dimension's range to the demos' 1st-99th
percentiles; the range is saved with the policy. One value for low/high means every dimension.
Arrays are laid out [..., K * D] or [..., D]: dimension d is at positions d, D + d, 2D + d, ...
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ActionTokenizer:
    n_bins: int
    vocab_size: int
    low: tuple[float, ...] = (-1.0,)
    high: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        object.__setattr__(self, "low", _floats(self.low))
        object.__setattr__(self, "high", _floats(self.high))
        if self.n_bins < 2:
            raise ValueError(f"n_bins must be >= 2; got {self.n_bins}")
        if self.vocab_size <= self.n_bins:
            raise ValueError(f"the vocabulary ({self.vocab_size} ids) must be larger than n_bins "
                             f"({self.n_bins}): action tokens are its last n_bins ids")
        if len(self.low) != len(self.high):
            raise ValueError(f"action range: low has {len(self.low)} values, high {len(self.high)}")
        if not all(h > lo for lo, h in zip(self.low, self.high)):
            raise ValueError(f"action range must have high > low in every dimension; got low={list(self.low)} "
                             f"high={list(self.high)}")

    @property
    def first_id(self) -> int:
        return self.vocab_size - self.n_bins

    def bin_width(self, n: int) -> torch.Tensor:
        """Bin width at each of n positions (float64 [n])."""
        low, high = self._bounds(n)
        return (high - low) / self.n_bins

    def _bounds(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """low and high repeated over n positions of dimension-minor layout."""
        if n % len(self.low):
            raise ValueError(f"actions have {n} values along the last axis, not a multiple of the "
                             f"{len(self.low)} action dims the range is given for")
        reps = n // len(self.low)
        return (torch.tensor(self.low, dtype=torch.float64).repeat(reps),
                torch.tensor(self.high, dtype=torch.float64).repeat(reps))

    # ---- bins (0 .. n_bins-1) <-> continuous values
    def to_bins(self, actions):
        a, as_np = _torch(actions)
        if not a.is_floating_point():
            a = a.float()
        if not torch.isfinite(a).all():
            raise ValueError("actions contain NaN or inf; cannot tokenize")
        low, _ = self._bounds(a.shape[-1])
        bins = torch.floor((a.double() - low) / self.bin_width(a.shape[-1])).long().clamp_(0, self.n_bins - 1)
        return bins.numpy() if as_np else bins

    def from_bins(self, bins):
        b, as_np = _torch(bins)
        self._check_range(b, 0, self.n_bins, "action bins")
        low, _ = self._bounds(b.shape[-1])
        centres = (low + (b.double() + 0.5) * self.bin_width(b.shape[-1])).float()
        return centres.numpy() if as_np else centres

    # ---- continuous values <-> [-1, 1] (the flow head's space: the same range, not binned)
    def to_unit(self, actions):
        """float actions [..., n] in [low, high] -> [-1, 1] (clipped)."""
        a, as_np = _torch(actions)
        low, high = self._bounds(a.shape[-1])
        low, high = low.to(a.device), high.to(a.device)
        u = (2.0 * (a.double() - low) / (high - low) - 1.0).clamp_(-1.0, 1.0).float()
        return u.numpy() if as_np else u

    def from_unit(self, u):
        """[-1, 1] [..., n] -> float32 actions in [low, high] (clipped first)."""
        x, as_np = _torch(u)
        low, high = self._bounds(x.shape[-1])
        low, high = low.to(x.device), high.to(x.device)
        a = (low + (x.double().clamp(-1.0, 1.0) + 1.0) * 0.5 * (high - low)).float()
        return a.numpy() if as_np else a

    # ---- continuous values <-> vocabulary ids
    def encode(self, actions):
        """float actions [...] -> int64 token ids [...] (values outside [low, high] are clipped)."""
        return self.to_bins(actions) + self.first_id

    def decode(self, tokens):
        """int64 token ids [...] -> float32 bin centres [...]."""
        t, as_np = _torch(tokens)
        self._check_range(t, self.first_id, self.vocab_size, "action token ids")
        out = self.from_bins(t - self.first_id)
        return out.numpy() if as_np else out

    def _check_range(self, x: torch.Tensor, lo: int, hi: int, what: str):
        if x.is_floating_point() or x.dtype == torch.bool:
            raise ValueError(f"{what} must be integers; got dtype {x.dtype}")
        if x.numel() and (int(x.min()) < lo or int(x.max()) >= hi):
            raise ValueError(f"{what} must lie in [{lo}, {hi}); got values in "
                             f"[{int(x.min())}, {int(x.max())}]")

    def to_dict(self) -> dict:
        return {**asdict(self), "low": list(self.low), "high": list(self.high), "first_id": self.first_id}


def _floats(x) -> tuple[float, ...]:
    return tuple(float(v) for v in (x if isinstance(x, (list, tuple)) else [x]))


def _torch(x) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        return x, False
    return torch.as_tensor(np.asarray(x)), True
