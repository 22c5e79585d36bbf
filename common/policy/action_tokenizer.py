"""Continuous actions <-> vocabulary ids (OpenVLA style).

Each action dimension in [low, high] is cut into n_bins uniform bins; bin b is the vocabulary id
first_id + b, where the action ids are the LAST n_bins ids of the vocabulary. Decoding returns the
bin centre, so decode(encode(a)) is within half a bin of clip(a) and encode(decode(t)) == t.
Accepts and returns numpy arrays or torch tensors (whichever came in).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ActionTokenizer:
    n_bins: int
    vocab_size: int
    low: float = -1.0
    high: float = 1.0

    def __post_init__(self):
        if self.n_bins < 2:
            raise ValueError(f"n_bins must be >= 2; got {self.n_bins}")
        if self.vocab_size <= self.n_bins:
            raise ValueError(f"the vocabulary ({self.vocab_size} ids) must be larger than n_bins "
                             f"({self.n_bins}): action tokens are its last n_bins ids")
        if not self.high > self.low:
            raise ValueError(f"action range must have high > low; got [{self.low}, {self.high}]")

    @property
    def first_id(self) -> int:
        return self.vocab_size - self.n_bins

    @property
    def bin_width(self) -> float:
        return (self.high - self.low) / self.n_bins

    # ---- bins (0 .. n_bins-1) <-> continuous values
    def to_bins(self, actions):
        a, as_np = _torch(actions)
        if not a.is_floating_point():
            a = a.float()
        if not torch.isfinite(a).all():
            raise ValueError("actions contain NaN or inf; cannot tokenize")
        bins = torch.floor((a.double() - self.low) / self.bin_width).long().clamp_(0, self.n_bins - 1)
        return bins.numpy() if as_np else bins

    def from_bins(self, bins):
        b, as_np = _torch(bins)
        self._check_range(b, 0, self.n_bins, "action bins")
        centres = (self.low + (b.double() + 0.5) * self.bin_width).float()
        return centres.numpy() if as_np else centres

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
        return {**asdict(self), "first_id": self.first_id}


def _torch(x) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        return x, False
    return torch.as_tensor(np.asarray(x)), True
