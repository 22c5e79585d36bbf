"""SmolVLA's network, as LeRobot 0.4 defines it, on transformers' SmolVLM and Llama modules.

    prefix  = [image tokens of each camera (SigLIP + connector, x sqrt(width)),
               instruction tokens (x sqrt(width)), one state token (state_proj)]
    suffix  = chunk_size action tokens: MLP([action_in_proj(x_t), sin-cos(t)])
The VLM is cut to its first `num_vlm_layers`; the action expert is a narrower Llama of as many
layers (width x expert_width_multiplier). Prefix tokens attend to the image and instruction both
ways and the state token to everything before it; each action token attends to the whole prefix
and to the action tokens up to itself. Layers alternate: in a self-attention layer (every
`self_attn_every_n_layers`-th, from layer 0) the expert's queries meet the VLM layer's keys and
values of the prefix and the expert's own of the suffix; in a cross-attention layer they meet only
the prefix's, passed through the expert's own key and value projections (keys as the VLM layer
rotated them). The prefix runs once per chunk and keeps every layer's keys and values (`prefix`);
each of the `num_steps` Euler steps from noise (t = 1) to the chunk (t = 0) runs only the expert
(`velocity`).

Two details that differ from the Llama of transformers, kept because LeRobot's weights were
trained with them: rotary position angles use a wavelength of 10,000 whatever the VLM's rope_theta,
and attention is computed in float32 with masked scores at float32's minimum. Module names follow
LeRobot's, so its model.safetensors loads by name (`load_weights`).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

from .checkpoint import LeRobotDirError, SmolVLASpec, check_tensors, ffn_width

ROPE_WAVELENGTH = 10_000.0


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, L, heads, D] at positions [B, L] (halves rotated as
    pairs, float32 angles)."""
    half = x.shape[-1] // 2
    exponents = torch.arange(half, dtype=torch.float32, device=x.device) * (2.0 / x.shape[-1])
    angles = positions[..., None].float() / (ROPE_WAVELENGTH ** exponents)
    sin, cos = torch.sin(angles)[..., None, :], torch.cos(angles)[..., None, :]
    x1, x2 = x.float().split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [B, Lq, H, D], k and v [B, Lk, Hkv, D] (each key head serving H / Hkv query heads),
    allowed bool [B, Lq, Lk] -> [B, Lq, H * D]. Scores and softmax in float32."""
    b, lq, heads, d = q.shape
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.matmul(q.float().transpose(1, 2), k.float().permute(0, 2, 3, 1)) * d ** -0.5
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    probs = F.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2).reshape(b, lq, heads * d)


def attention_mask(pad: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """bool [B, L, L]: token i sees token j when j is not padding and j's block (the running sum of
    `blocks`, 1 where a new block starts) is not after i's."""
    block = torch.cumsum(blocks.long(), dim=1)
    return (block[:, None, :] <= block[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def time_features(t: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine features [B, width] of the denoising times t [B] (periods from min to max; in
    float64, as LeRobot computes them on a CPU)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


class VLMWithExpert(nn.Module):
    """The VLM (transformers' SmolVLM, text layers cut) beside the action expert (a Llama without
    token embeddings), under LeRobot's names: `vlm`, `lm_expert`."""

    def __init__(self, vlm_config, spec: SmolVLASpec):
        super().__init__()
        from transformers import AutoModel, SmolVLMForConditionalGeneration
        self.vlm = SmolVLMForConditionalGeneration(vlm_config)
        text = self.vlm.model.text_model
        if spec.num_vlm_layers > 0:
            text.layers = text.layers[:spec.num_vlm_layers]
        self.num_vlm_layers = len(text.layers)
        tc = vlm_config.text_config
        expert_config = copy.deepcopy(tc)
        expert_config.hidden_size = int(tc.hidden_size * spec.expert_width_multiplier)
        expert_config.intermediate_size = ffn_width(expert_config.hidden_size)
        expert_config.num_hidden_layers = self.num_vlm_layers
        if spec.num_expert_layers > 0:
            if self.num_vlm_layers % spec.num_expert_layers:
                raise LeRobotDirError(f"num_expert_layers={spec.num_expert_layers} must divide the VLM's "
                                      f"{self.num_vlm_layers} layers")
            expert_config.num_hidden_layers = spec.num_expert_layers
        self.lm_expert = AutoModel.from_config(expert_config)
        self.lm_expert.embed_tokens = None
        self.self_attn_every = spec.self_attn_every_n_layers
        self.head_dim = tc.head_dim
        kv_width = tc.num_key_value_heads * tc.head_dim
        # A cross-attention layer turns the VLM's keys and values into the expert's.
        for i, layer in enumerate(self.lm_expert.layers):
            if not self.is_self_attention(i):
                attn = layer.self_attn
                bias = getattr(expert_config, "attention_bias", False)
                attn.k_proj = nn.Linear(kv_width, attn.k_proj.out_features, bias=bias)
                attn.v_proj = nn.Linear(kv_width, attn.v_proj.out_features, bias=bias)
        self.expert_width = expert_config.hidden_size
        step = self.num_vlm_layers // len(self.lm_expert.layers)
        # VLM layer i pairs with expert layer i // step when i is a multiple of step, else none
        self.expert_of = [i // step if i % step == 0 else None for i in range(self.num_vlm_layers)]
        for i, e in enumerate(self.expert_of):
            if e is None and self.is_self_attention(i):
                raise LeRobotDirError(f"num_expert_layers={spec.num_expert_layers} leaves self-attention layer {i} "
                                      "without an expert layer")

    def is_self_attention(self, layer: int) -> bool:
        return self.self_attn_every > 0 and layer % self.self_attn_every == 0

    @property
    def text(self):
        return self.vlm.model.text_model

    def embed_image(self, pixels: torch.Tensor) -> torch.Tensor:
        vision = self.vlm.model.vision_model
        hidden = vision(pixel_values=pixels.to(vision.embeddings.patch_embedding.weight.dtype)).last_hidden_state
        return self.vlm.model.connector(hidden)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text.get_input_embeddings()(ids)

    def prefix(self, embeds: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor):
        """Run the prefix through the VLM's layers: every layer's (rotated keys, values), and the
        last layer's normalised hidden states [B, P, W]."""
        h, cache = embeds, []
        for layer in self.text.layers:
            q, k, v = _qkv(layer, layer.input_layernorm(h), self.head_dim)
            q, k = rotate(q, positions), rotate(k, positions)
            cache.append((k, v))
            h = _finish(layer, h, attention(q, k, v, allowed))
        return cache, self.text.norm(h)

    def suffix(self, embeds: torch.Tensor, cache: list, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The action tokens through the expert, reading the prefix's cache; `allowed` [B, S, P + S],
        `positions` [B, S] (after the prefix's)."""
        h, prefix_len = embeds, cache[0][0].shape[1]
        for i, e in enumerate(self.expert_of):
            if e is None:
                continue
            layer = self.lm_expert.layers[e]
            x = layer.input_layernorm(h)
            prefix_k, prefix_v = cache[i]
            if self.is_self_attention(i):
                q, k, v = _qkv(layer, x, self.head_dim)
                q, k = rotate(q, positions), rotate(k, positions)
                out = attention(q, torch.cat([prefix_k, k], 1), torch.cat([prefix_v, v], 1), allowed)
            else:
                attn = layer.self_attn
                q = attn.q_proj(x).unflatten(-1, (-1, self.head_dim))
                k = attn.k_proj(prefix_k.flatten(2).to(attn.k_proj.weight.dtype)).unflatten(-1, (-1, self.head_dim))
                v = attn.v_proj(prefix_v.flatten(2).to(attn.v_proj.weight.dtype)).unflatten(-1, (-1, self.head_dim))
                q = rotate(q, positions - positions.min(dim=1, keepdim=True).values)
                out = attention(q, k, v, allowed[:, :, :prefix_len])
            h = _finish(layer, h, out)
        return self.lm_expert.norm(h)


class SmolVLANet(nn.Module):
    """VLMWithExpert plus the state, action and time projections (LeRobot's VLAFlowMatching)."""

    def __init__(self, vlm_config, spec: SmolVLASpec, fake_image_token: int | None = None,
                 global_image_token: int | None = None):
        super().__init__()
        self.spec = spec
        self.vlm_with_expert = VLMWithExpert(vlm_config, spec)
        width, expert = vlm_config.text_config.hidden_size, self.vlm_with_expert.expert_width
        self.state_proj = nn.Linear(spec.max_state_dim, width)
        self.action_in_proj = nn.Linear(spec.max_action_dim, expert)
        self.action_out_proj = nn.Linear(expert, spec.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * expert, expert)
        self.action_time_mlp_out = nn.Linear(expert, expert)
        if spec.add_image_special_tokens and (fake_image_token is None or global_image_token is None):
            raise LeRobotDirError("add_image_special_tokens=true needs the tokenizer's fake_image_token and "
                                  "global_image_token")
        self.image_open = [fake_image_token, global_image_token]
        self.image_close = [fake_image_token]

    # ------------------------------------------------------------------------------- prefix
    def embed_prefix(self, images: list, image_masks: list, ids: torch.Tensor, id_mask: torch.Tensor,
                     state: torch.Tensor):
        """images: [B, 3, h, w] in [-1, 1] per camera, image_masks bool [B] per camera; ids, id_mask
        [B, L]; state [B, max_state_dim] (normalised, zero-padded) -> embeddings [B, P, W], padding
        mask bool [B, P], block starts [B, P]."""
        vwe, b = self.vlm_with_expert, ids.shape[0]
        embeds, pad, blocks = [], [], []

        def add(x: torch.Tensor, mask: torch.Tensor, starts_block: bool):
            embeds.append(x)
            pad.append(mask)
            blocks.append(torch.full(mask.shape, int(starts_block), dtype=torch.long, device=mask.device))

        def special(tokens: list):
            x = vwe.embed_tokens(torch.tensor(tokens, device=ids.device))[None].expand(b, -1, -1)
            add(x, torch.ones(b, len(tokens), dtype=torch.bool, device=ids.device), False)

        for pixels, present in zip(images, image_masks):
            if self.spec.add_image_special_tokens:
                special(self.image_open)
            x = vwe.embed_image(pixels)
            x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype, device=x.device)
            add(x, present[:, None].expand(b, x.shape[1]), False)
            if self.spec.add_image_special_tokens:
                special(self.image_close)
        words = vwe.embed_tokens(ids)
        add(words * math.sqrt(words.shape[-1]), id_mask.bool(), False)
        add(self.state_proj(state)[:, None], torch.ones(b, 1, dtype=torch.bool, device=ids.device), True)
        embeds, pad, blocks = torch.cat(embeds, 1), torch.cat(pad, 1), torch.cat(blocks, 1)
        short = self.spec.prefix_length - embeds.shape[1]
        if short > 0:                       # (a fixed prefix length: padded at the end)
            embeds, pad, blocks = F.pad(embeds, (0, 0, 0, short)), F.pad(pad, (0, short)), F.pad(blocks, (0, short))
        return embeds, pad, blocks

    def prefix(self, images, image_masks, ids, id_mask, state):
        """The prefix pass: (every layer's keys and values, the prefix padding mask [B, P], the
        state token's last hidden state [B, W], which has seen the whole prefix)."""
        embeds, pad, blocks = self.embed_prefix(images, image_masks, ids, id_mask, state)
        cache, hidden = self.vlm_with_expert.prefix(embeds, attention_mask(pad, blocks), torch.cumsum(pad, 1) - 1)
        state_token = blocks.argmax(1)             # (the one token that starts a block of its own)
        return cache, pad, hidden[torch.arange(hidden.shape[0], device=hidden.device), state_token]

    # ------------------------------------------------------------------------------- suffix
    def embed_suffix(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Noisy chunk [B, chunk, max_action_dim] at times t [B] -> action tokens [B, chunk, W_e]."""
        a = self.action_in_proj(x_t)
        tau = time_features(t, a.shape[-1], self.spec.min_period, self.spec.max_period).to(a.dtype)
        h = self.action_time_mlp_in(torch.cat([a, tau[:, None].expand_as(a)], dim=-1))
        return self.action_time_mlp_out(F.silu(h))

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cache: list, prefix_pad: torch.Tensor) -> torch.Tensor:
        """One denoising step's velocity [B, chunk, max_action_dim] (float32)."""
        embeds = self.embed_suffix(x_t, t)
        b, s = embeds.shape[:2]
        suffix_pad = torch.ones(b, s, dtype=torch.bool, device=embeds.device)
        own = attention_mask(suffix_pad, torch.ones(b, s, dtype=torch.long, device=embeds.device))
        allowed = torch.cat([prefix_pad[:, None, :].expand(b, s, -1), own], dim=2)
        positions = prefix_pad.sum(-1, keepdim=True) + torch.cumsum(suffix_pad, 1) - 1
        out = self.vlm_with_expert.suffix(embeds, cache, allowed, positions)
        out = out[:, -self.spec.chunk_size:].float()          # (as LeRobot: the projection reads float32)
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype))

    @torch.no_grad()
    def sample(self, images, image_masks, ids, id_mask, state, noise: torch.Tensor) -> torch.Tensor:
        """The chunk [B, chunk, max_action_dim] (normalised units) from `noise` by num_steps Euler
        steps of the velocity, from t = 1 to t = 0."""
        cache, pad, _ = self.prefix(images, image_masks, ids, id_mask, state)
        dt, x = -1.0 / self.spec.num_steps, noise
        for i in range(self.spec.num_steps):
            t = torch.full((x.shape[0],), 1.0 + i * dt, dtype=torch.float32, device=x.device)
            x = x + dt * self.velocity(x, t, cache, pad)
        return x

    # -------------------------------------------------------------------------------- weights
    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """Every tensor by its LeRobot name (without "model."), checked first (`check_tensors`)."""
        check_tensors(self.state_dict(), weights, where)
        with torch.no_grad():
            for name, p in self.state_dict(keep_vars=True).items():
                p.copy_(weights[name].to(p.dtype))


def _qkv(layer, x: torch.Tensor, head_dim: int):
    attn = layer.self_attn
    x = x.to(attn.q_proj.weight.dtype)
    return tuple(proj(x).unflatten(-1, (-1, head_dim)) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))


def _finish(layer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer: output projection and residual, then the MLP and residual. The
    stream takes the layer's dtype, as LeRobot adds the residuals in place (in a bfloat16 layer the
    float32 prefix becomes bfloat16)."""
    out = layer.self_attn.o_proj(attended.to(layer.self_attn.o_proj.weight.dtype))
    out = out + h.to(out.dtype)
    return out + layer.mlp(layer.post_attention_layernorm(out)).to(out.dtype)
