"""π0's and π0.5's network, as LeRobot 0.4.3 (openpi's PyTorch port) defines it, on transformers'
PaliGemma and Gemma modules, under LeRobot's module names so that its model.safetensors loads by
name (`load_weights`).

    paligemma_with_expert.paligemma      PaliGemmaForConditionalGeneration: SigLIP + projector +
                                         the Gemma language model (its lm_head tied to embed_tokens)
    paligemma_with_expert.gemma_expert   GemmaForCausalLM without embed_tokens: the action expert
    π0:   state_proj, action_in_proj, action_out_proj, action_time_mlp_in / _out
    π0.5: action_in_proj, action_out_proj, time_mlp_in / _out; the expert's RMS norms are adaRMS
          (a `dense` layer of the time features gives scale, shift and a residual gate)

    prefix  = [image tokens of each camera (SigLIP, projected), instruction tokens (x sqrt(width))]
              every prefix token attends to every non-padding prefix token; run once per chunk by the
              language model, keeping every layer's keys and values
    suffix  π0:   [state token, chunk_size action tokens: MLP([action_in_proj(x_t), sin-cos(t)])]
            π0.5: [chunk_size action tokens: action_in_proj(x_t)], the time MLP conditioning adaRMS
            the state token attends to the prefix and itself, action tokens to the prefix, the
            state and every action token; run by the expert at each step, its keys and values
            appended to the prefix's layer by layer
Flow matching as LeRobot's sample_actions: x at t = 1 is the noise, num_inference_steps Euler steps of
dt = -1 / num_inference_steps along the predicted velocity give the chunk at t = 0.

Numerics kept from openpi's patched transformers (LeRobot runs on it): no sqrt(width) scaling of the
language model's inputs inside it (the instruction embeddings are scaled once, outside) and no
1 / sqrt(width) of the image features; RMS norms x * rsqrt(mean(x^2) + eps) * (1 + w) in float32;
eager attention with masked scores at -2.3819763e38 added, softmax in float32; rotary angles of
wavelength 10,000; sine-cosine time features in float64.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..lerobot_dir import LeRobotDirError, check_tensors
from .spec import Gemma, PI0Spec

MASK_VALUE = -2.3819763e38          # LeRobot's OPENPI_ATTENTION_MASK_VALUE
ROPE_WAVELENGTH = 10_000.0
PALIGEMMA = "paligemma_with_expert.paligemma."
# tied tensors: {alias: name} (PaliGemma's output head is its input embedding; a file may hold either)
TIED = {PALIGEMMA + "lm_head.weight": PALIGEMMA + "model.language_model.embed_tokens.weight"}


class AdaRMSNorm(nn.Module):
    """openpi's adaptive Gemma RMS norm (π0.5's expert): dense(cond) -> scale, shift, gate;
    x * rsqrt(mean(x^2) + eps) * (1 + scale) + shift, and the gate for the residual."""

    def __init__(self, dim: int, eps: float, cond_dim: int):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, dim * 3, bias=True)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        modulation = self.dense(cond)
        if x.ndim == 3:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = torch.chunk(modulation, 3, dim=-1)
        normed = normed * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


def rms_norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None = None):
    """(normed x, residual gate or None) of a Gemma RMS norm (transformers') or an AdaRMSNorm."""
    if isinstance(norm, AdaRMSNorm):
        return norm(x, cond)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    normed = x * torch.rsqrt(var + eps) * (1.0 + norm.weight.float())
    return normed.to(x.dtype), None


def residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Gemma's: halves rotated as pairs) of x [B, heads, L, D] at positions [B, L]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (ROPE_WAVELENGTH ** (torch.arange(0, x.shape[-1], 2, dtype=torch.int64,
                                                       device=x.device).float() / x.shape[-1]))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [B, H, Lq, D], k and v [B, Hkv, Lk, D], allowed bool [B, Lq, Lk] -> [B, Lq, H * D]
    (transformers' eager attention with LeRobot's additive mask)."""
    b, heads, lq, d = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    scores = scores + torch.where(allowed[:, None], 0.0, MASK_VALUE).to(scores.dtype)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, lq, heads * d)


def attention_mask(pad: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """bool [B, L, L] (LeRobot's make_att_2d_masks): token i sees token j when neither is padding
    and j's block (the running sum of `blocks`, 1 where a new block starts) is not after i's."""
    block = torch.cumsum(blocks.long(), dim=1)
    return (block[:, None, :] <= block[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def time_features(t: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine features [B, width] of the times t [B] (in float64, as LeRobot computes them),
    in t's dtype."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)


def gemma_config(v: Gemma, **extra):
    from transformers import GemmaConfig
    return GemmaConfig(head_dim=v.head_dim, hidden_size=v.width, intermediate_size=v.mlp_dim,
                       num_attention_heads=v.num_heads, num_hidden_layers=v.depth, num_key_value_heads=v.num_kv_heads,
                       vocab_size=v.vocab_size, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                       **extra)


def paligemma_config(spec: PI0Spec):
    """PaliGemma's config as LeRobot's PaliGemmaWithExpertModel sets it."""
    from transformers import PaliGemmaConfig
    v, vision = spec.paligemma, spec.paligemma.vision
    text = gemma_config(v).to_dict()
    vision_config = dict(model_type="siglip_vision_model", hidden_size=vision.hidden_size,
                         intermediate_size=vision.intermediate_size, num_hidden_layers=vision.num_hidden_layers,
                         num_attention_heads=vision.num_attention_heads, patch_size=vision.patch_size,
                         image_size=spec.image_resolution[0], projection_dim=v.width, vision_use_head=False,
                         projector_hidden_act="gelu_fast", hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    return PaliGemmaConfig(text_config=text, vision_config=vision_config, image_token_index=v.vocab_size,
                           vocab_size=v.vocab_size, projection_dim=v.width, hidden_size=v.width)


class VisionTower(nn.Module):
    """SigLIP under the name LeRobot's transformers gives it (vision_tower.vision_model.*), for a
    transformers whose SiglipVisionModel holds its layers directly."""

    def __init__(self, vision_model: nn.Module):
        super().__init__()
        self.vision_model = vision_model

    def forward(self, pixel_values):
        return self.vision_model(pixel_values=pixel_values)


class PaliGemmaWithExpert(nn.Module):
    def __init__(self, spec: PI0Spec):
        super().__init__()
        from transformers import GemmaForCausalLM, PaliGemmaForConditionalGeneration
        self.paligemma = PaliGemmaForConditionalGeneration(paligemma_config(spec))
        tower = self.paligemma.model.vision_tower
        if not any(n.startswith("vision_model.") for n, _ in tower.named_parameters()):
            self.paligemma.model.vision_tower = VisionTower(tower)
        self.paligemma.lm_head.weight = self.paligemma.model.language_model.embed_tokens.weight
        self.gemma_expert = GemmaForCausalLM(gemma_config(spec.expert))
        self.gemma_expert.model.embed_tokens = None
        if spec.pi05:
            model, width, eps = self.gemma_expert.model, spec.expert.width, self.gemma_expert.config.rms_norm_eps
            for layer in model.layers:
                layer.input_layernorm = AdaRMSNorm(width, eps, width)
                layer.post_attention_layernorm = AdaRMSNorm(width, eps, width)
            model.norm = AdaRMSNorm(width, eps, width)

    @property
    def language_model(self):
        return self.paligemma.model.language_model

    @property
    def expert(self):
        return self.gemma_expert.model


class PI0Net(nn.Module):
    def __init__(self, spec: PI0Spec):
        super().__init__()
        self.spec = spec
        width = spec.expert.width
        self.paligemma_with_expert = PaliGemmaWithExpert(spec)
        self.action_in_proj = nn.Linear(spec.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, spec.max_action_dim)
        if spec.pi05:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(spec.max_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)

    # ------------------------------------------------------------------------------ weights
    def expected(self, found: dict) -> dict:
        """The tensors the network reads from a file holding `found` (names without "model."): its
        state_dict, less a tied alias the file does not hold (LeRobot's files hold lm_head.weight
        and not embed_tokens.weight, or both)."""
        own = dict(self.state_dict(keep_vars=True))
        for alias, name in TIED.items():
            if alias in own and name in own:
                drop = alias if alias not in found else name if name not in found else None
                if drop is not None:
                    own.pop(drop)
        return own

    def check_weights(self, found: dict, where: str) -> None:
        check_tensors(self.expected(found), found, where, "π0.5" if self.spec.pi05 else "π0")

    @torch.no_grad()
    def load_weights(self, found: dict, where: str) -> None:
        """Every tensor by LeRobot's name (without "model."): a missing or unexpected one, or one of
        another shape, is refused in one line (LeRobotDirError)."""
        own = self.expected(found)
        check_tensors(own, found, where, "π0.5" if self.spec.pi05 else "π0")
        for name in own:                  # (a tied pair in state_dict order: the later one stays, as in torch)
            own[name].copy_(found[name].to(own[name].dtype))

    # ------------------------------------------------------------------------------ acting
    def embed_prefix(self, images: list, image_masks: list, ids: torch.Tensor, mask: torch.Tensor):
        """(tokens [B, L, width], padding mask [B, L]) of the cameras' images and the instruction."""
        model = self.paligemma_with_expert.paligemma.model
        embs, pads = [], []
        for image, present in zip(images, image_masks):
            tokens = model.multi_modal_projector(model.vision_tower(image).last_hidden_state)
            embs.append(tokens)
            pads.append(present[:, None].expand(tokens.shape[0], tokens.shape[1]))
        words = model.language_model.embed_tokens(ids)
        embs.append(words * math.sqrt(words.shape[-1]))
        pads.append(mask)
        return torch.cat(embs, dim=1), torch.cat(pads, dim=1)

    def prefix(self, images, image_masks, ids, mask):
        """The language model over the prefix: every layer's (rotated keys, values) and the prefix's
        padding mask."""
        embs, pad = self.embed_prefix(images, image_masks, ids, mask)
        allowed = attention_mask(pad, torch.zeros_like(pad))
        positions = torch.cumsum(pad.long(), dim=1) - 1
        h, cache = embs, []
        for layer in self.paligemma_with_expert.language_model.layers:
            x, _ = rms_norm(layer.input_layernorm, h)
            q, k, v = self._qkv(layer.self_attn, x, positions)
            cache.append((k, v))
            h = h + layer.self_attn.o_proj(attention(q, k, v, allowed))
            x, _ = rms_norm(layer.post_attention_layernorm, h)
            h = h + layer.mlp(x)
        return cache, pad

    def _qkv(self, attn, x, positions):
        b, length = x.shape[:2]
        head_dim = self.spec.expert.head_dim
        q = attn.q_proj(x).view(b, length, -1, head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, length, -1, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, length, -1, head_dim).transpose(1, 2)
        return rotate(q, positions), rotate(k, positions), v

    def embed_suffix(self, state, x_t, t):
        """(tokens [B, L, width], which start a new attention block [L], the adaRMS condition or None)."""
        actions = self.action_in_proj(x_t)
        times = time_features(t, actions.shape[-1], self.spec.min_period, self.spec.max_period)
        chunk = x_t.shape[1]
        if self.spec.pi05:
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(times))))
            return actions, [1] + [0] * (chunk - 1), cond
        mixed = torch.cat([actions, times[:, None, :].expand_as(actions)], dim=2)
        actions = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(mixed)))
        state_token = self.state_proj(state)[:, None, :]
        return torch.cat([state_token, actions], dim=1), [1, 1] + [0] * (chunk - 1), None

    def velocity(self, cache, prefix_pad, state, x_t, t):
        """The expert's velocity [B, chunk_size, max_action_dim] at x_t and times t [B]."""
        embs, blocks, cond = self.embed_suffix(state, x_t, t)
        b, length = embs.shape[:2]
        pad = torch.ones(b, length, dtype=torch.bool, device=embs.device)
        own = attention_mask(pad, torch.tensor(blocks, device=embs.device)[None].expand(b, length))
        allowed = torch.cat([prefix_pad[:, None, :].expand(b, length, prefix_pad.shape[1]), own], dim=2)
        positions = prefix_pad.long().sum(-1)[:, None] + torch.cumsum(pad.long(), dim=1) - 1
        h = embs
        expert = self.paligemma_with_expert.expert
        for layer, (pk, pv) in zip(expert.layers, cache):
            x, gate = rms_norm(layer.input_layernorm, h, cond)
            q, k, v = self._qkv(layer.self_attn, x, positions)
            out = attention(q, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), allowed)
            h = residual(h, layer.self_attn.o_proj(out), gate)
            x, gate = rms_norm(layer.post_attention_layernorm, h, cond)
            h = residual(h, layer.mlp(x), gate)
        h, _ = rms_norm(expert.norm, h, cond)
        return self.action_out_proj(h[:, -self.spec.chunk_size:].float())

    def sample(self, images, image_masks, ids, mask, state, noise, num_steps: int | None = None) -> torch.Tensor:
        """The chunk [B, chunk_size, max_action_dim] (normalised): Euler steps from the noise at t = 1
        to t = 0, the prefix's keys and values computed once."""
        num_steps = num_steps or self.spec.num_inference_steps
        cache, prefix_pad = self.prefix(images, image_masks, ids, mask)
        dt = -1.0 / num_steps
        x = noise
        for step in range(num_steps):
            t = torch.full((noise.shape[0],), 1.0 + step * dt, dtype=torch.float32, device=noise.device)
            x = x + dt * self.velocity(cache, prefix_pad, state, x, t)
        return x


def build_net(spec: PI0Spec, where: str) -> PI0Net:
    """The network (random init, drawn without touching the caller's random stream)."""
    if spec.expert.num_heads * spec.expert.head_dim == 0:
        raise LeRobotDirError(f"{where}: the expert has no attention heads")
    with torch.random.fork_rng(devices=[]):
        return PI0Net(spec)
