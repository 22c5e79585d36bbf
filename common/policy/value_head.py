"""Small heads beside the VLM: the critic V(x) and the proprio-state projector."""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """MLP on the hidden state of the last prompt token -> V(x), computed and returned in fp32."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, width)
        self.fc2 = nn.Linear(width, 1)
        # A small last layer keeps initial values near 0, the scale of normalised returns.
        nn.init.normal_(self.fc2.weight, std=0.01)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The head may have been cast (e.g. a bf16 DeepSpeed engine); follow its own dtype.
        x = hidden.to(self.fc1.weight.dtype)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).squeeze(-1).float()


class StateEncoder(nn.Module):
    """Projects the robot's proprio state [B, S] to one token embedding [B, 1, H] of the prompt."""

    def __init__(self, state_dim: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(state_dim, hidden_size)

    def forward(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj(state.to(self.proj.weight.dtype)).unsqueeze(1).to(dtype)
