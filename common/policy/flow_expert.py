"""The action expert of a flow head: a small transformer that denoises a K x D action chunk.

Its K action tokens (the noisy actions plus the denoising time) attend, in every layer, to
themselves in both directions and to the VLM prefix (image, instruction, state). The prefix enters
as the VLM's hidden states of a matching layer (expert layer l reads VLM layer round((l+1) L / L_e),
the last one at the top), projected to the expert's width and turned into keys and values by the
expert's own projections. That is pi0's layout (the expert's layer l attends to the VLM's layer-l
keys and values) reached through `output_hidden_states`, which every transformers VLM returns, so
one expert serves every backbone family and depth. The prefix is computed once per `act` and its
keys and values once per layer (`prefix_kv`); each of the N denoising steps runs only the expert.

Shapes follow pi0's Gemma-300M expert when configured so: width 1024, 18 layers, gated MLP 4096,
8 query heads sharing 1 key/value head of size 256.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def time_embedding(t: torch.Tensor, width: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine features of t in [0, 1] -> [B, width] (pi0's periods: fine enough for small steps)."""
    half = width // 2
    fraction = torch.linspace(0.0, 1.0, half, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.float()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


class ExpertLayer(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, mlp: int):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm, self.mlp_norm, self.prefix_norm = RMSNorm(width), RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.gate = nn.Linear(width, mlp, bias=False)
        self.up = nn.Linear(width, mlp, bias=False)
        self.down = nn.Linear(mlp, width, bias=False)

    def kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, W] -> keys and values [B, kv_heads, T, head_dim]."""
        b, n, _ = h.shape
        shape = (b, n, self.kv_heads, self.head_dim)
        return self.k(h).view(shape).transpose(1, 2), self.v(h).view(shape).transpose(1, 2)

    def prefix_kv(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv(self.prefix_norm(prefix))

    def forward(self, x: torch.Tensor, prefix_kv, prefix_mask: torch.Tensor) -> torch.Tensor:
        """x [B, K, W]; prefix_kv from `prefix_kv`; prefix_mask [B, P] (1 = token)."""
        b, k, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, k, self.heads, self.head_dim).transpose(1, 2)
        ka, va = self.kv(h)
        keys, values = torch.cat([prefix_kv[0], ka], 2), torch.cat([prefix_kv[1], va], 2)
        repeat = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        allowed = torch.cat([prefix_mask.bool(), prefix_mask.new_ones(b, k, dtype=torch.bool)], 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None, :])
        x = x + self.o(out.transpose(1, 2).reshape(b, k, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FlowExpert(nn.Module):
    """velocity = expert(noisy actions [B, K, D], time [B], prefix hidden states) -> [B, K, D].

    `prefix_kv(hidden_states, vlm_layers)` turns the VLM's hidden states (the tuple transformers
    returns, embeddings first) into every layer's keys and values, once per observation;
    `forward(x, t, kv, mask)` is one denoising step. With `learn_noise`, `log_std_raw` gives
    Flow-Noise's per-entry noise logits from the same pass."""

    def __init__(self, action_dim: int, num_actions: int, prefix_width: int, width: int, depth: int,
                 heads: int, kv_heads: int, head_dim: int, mlp: int, learn_noise: bool = False):
        super().__init__()
        self.width, self.depth = width, depth
        self.action_in = nn.Linear(action_dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(2 * width, width), nn.SiLU(), nn.Linear(width, width))
        self.position = nn.Parameter(torch.zeros(num_actions, width))
        self.prefix_in = nn.Linear(prefix_width, width, bias=False)
        self.layers = nn.ModuleList(ExpertLayer(width, heads, kv_heads, head_dim, mlp) for _ in range(depth))
        self.out_norm = RMSNorm(width)
        self.velocity_out = nn.Linear(width, action_dim)
        self.noise_out = nn.Linear(width, action_dim) if learn_noise else None

    def set_learn_noise(self, on: bool):
        """Add (freshly initialised) or drop Flow-Noise's noise network, so that one flow-matching
        SFT checkpoint warm-starts RL with either noise method."""
        if on and self.noise_out is None:
            w = self.velocity_out.weight
            self.noise_out = nn.Linear(self.width, w.shape[0]).to(device=w.device, dtype=w.dtype)
        elif not on:
            self.noise_out = None

    def vlm_layer_of(self, layer: int, vlm_layers: int) -> int:
        """Index into hidden_states (0 = embeddings) that expert layer `layer` reads."""
        return max(1, round((layer + 1) * vlm_layers / self.depth))

    def prefix_kv(self, hidden_states, vlm_layers: int) -> list:
        dtype = self.prefix_in.weight.dtype          # (a bf16 VLM beside an fp32 expert, or the reverse)
        return [layer.prefix_kv(self.prefix_in(hidden_states[self.vlm_layer_of(i, vlm_layers)].to(dtype)))
                for i, layer in enumerate(self.layers)]

    def hidden(self, x: torch.Tensor, t: torch.Tensor, prefix_kv: list, prefix_mask: torch.Tensor) -> torch.Tensor:
        a = self.action_in(x.to(self.velocity_out.weight.dtype))     # (the chain is fp32; a bf16 expert)
        tau = time_embedding(t, self.width).to(a.dtype)[:, None].expand_as(a)
        h = self.time_mlp(torch.cat([a, tau], -1)) + self.position
        for layer, kv in zip(self.layers, prefix_kv):
            h = layer(h, kv, prefix_mask)
        return self.out_norm(h)

    def forward(self, x, t, prefix_kv, prefix_mask) -> torch.Tensor:
        return self.velocity_out(self.hidden(x, t, prefix_kv, prefix_mask))

    def velocity_and_noise(self, x, t, prefix_kv, prefix_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity and Flow-Noise's raw log-std logits [B, K, D] from one pass (learn_noise only)."""
        if self.noise_out is None:
            raise ValueError("this expert was built without learn_noise (policy.flow.noise_method: flow_sde)")
        h = self.hidden(x, t, prefix_kv, prefix_mask)
        return self.velocity_out(h), self.noise_out(h)
