"""Fixed 2-D sine-cosine position embeddings for a random-init vision tower's patches.

A random-init tower learns where things are slowly: its position signal is ~10x weaker than a
patch's content. This fixed pattern makes positions readable at once. It depends on torch only, so
the LeRobot side environment (tests/interop/) loads this file by path for its tiny SmolVLM.
"""

from __future__ import annotations

import torch


def sincos_positions(side: int, dim: int) -> torch.Tensor:
    """[side*side, dim] 2-D sine-cosine position embeddings, row-major like the patches: a quarter
    of the channels each for sin/cos of the row and of the column, at geometric frequencies."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float64),
                                torch.arange(side, dtype=torch.float64), indexing="ij")

    def axis(coord):
        angle = coord.reshape(-1, 1) * omega
        return torch.cat([angle.sin(), angle.cos()], 1)
    return torch.cat([axis(rows), axis(cols)], 1).float()
