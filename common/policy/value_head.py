"""Small heads beside the VLM: the critic V(x), the proprio-state projector and the CNN image tokens."""

from __future__ import annotations

import torch
from torch import nn


VALUE_ENCODERS = ("none", "cnn")


class ValueHead(nn.Module):
    """MLP -> V(x), computed and returned in fp32, on the hidden state of the last prompt token
    and, with encoder="cnn", on the image's features from a small CNN of the critic's own.

    Why the CNN: a VLM that has seen no robot data (a random-init tiny one above all) barely tells
    scenes apart in that hidden state, so a head on it alone explains ~0 of the returns' variance
    and the advantages are noise. A CNN learns the few numbers a value needs (where things are)
    in a few hundred steps; the policy keeps acting from the VLM alone. With the CNN the head reads
    the VLM's state without training it (detached): value-loss gradients through a VLM that is
    still learning to see slowed its supervised learning of actions."""

    def __init__(self, hidden_size: int, width: int, encoder: str = "none"):
        super().__init__()
        if encoder not in VALUE_ENCODERS:
            raise ValueError(f"policy.value_encoder={encoder!r} is not allowed; choose one of "
                             f"{list(VALUE_ENCODERS)}")
        self.encoder = ImageEncoder(width) if encoder == "cnn" else None
        self.fc1 = nn.Linear(hidden_size + (width if self.encoder is not None else 0), width)
        self.fc2 = nn.Linear(width, 1)
        # A small last layer keeps initial values near 0, the scale of normalised returns.
        nn.init.normal_(self.fc2.weight, std=0.01)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, hidden: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        # The head may have been cast (e.g. a bf16 DeepSpeed engine); follow its own dtype.
        x = hidden.to(self.fc1.weight.dtype)
        if self.encoder is not None:
            x = torch.cat([x.detach(), self.encoder(image).to(x.dtype)], -1)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).squeeze(-1).float()


class ImageEncoder(nn.Module):
    """uint8 images [B, H, W, 3] -> features [B, width]: three strided convolutions, pooled to 8x8."""

    def __init__(self, width: int):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(16, 32, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(8), nn.Flatten())
        self.proj = nn.Linear(32 * 8 * 8, width)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        x = image.permute(0, 3, 1, 2).to(w.dtype) / 255.0
        return torch.relu(self.proj(self.convs(x)))


class StateEncoder(nn.Module):
    """Projects the robot's proprio state [B, S] to one token embedding [B, 1, H] of the prompt."""

    def __init__(self, state_dim: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(state_dim, hidden_size)

    def forward(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj(state.to(self.proj.weight.dtype)).unsqueeze(1).to(dtype)


class ImageTokens(nn.Module):
    """uint8 images [B, H, W, 3] -> n prompt tokens [B, n, H_text]: a small CNN's feature map pooled
    to a g x g grid (n = g * g, row-major), each cell projected to the text width plus a learned
    embedding of its place. The VLM reads them beside its own vision tower's tokens: a CNN's
    locality lets it find a small object in a few hundred steps, where a random-init ViT with
    8-pixel patches takes thousands."""

    def __init__(self, num_tokens: int, hidden_size: int, channels: int = 64):
        super().__init__()
        grid = int(round(num_tokens ** 0.5))
        if grid * grid != num_tokens:
            raise ValueError(f"policy.cnn_image_tokens={num_tokens} must be a square (1, 4, 16, 64)")
        self.convs = nn.Sequential(
            nn.Conv2d(3, 32, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(32, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(grid))
        self.proj = nn.Linear(channels, hidden_size)
        self.place = nn.Parameter(torch.zeros(num_tokens, hidden_size))

    def forward(self, image: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w = self.proj.weight
        x = self.convs(image.permute(0, 3, 1, 2).to(w.dtype) / 255.0)     # [B, C, g, g]
        return (self.proj(x.flatten(2).transpose(1, 2)) + self.place).to(dtype)
