"""Qwen2.5-VL: a windowed ViT with 2-D rotary positions, a 2x2 patch merger, a Qwen2 LM with M-RoPE.

The processor's dynamic resolution is fixed to the policy's image: its side is policy.image_size
rounded to a multiple of patch_size x spatial_merge_size (28 for the released checkpoints), so
every picture gives the same n = (side / 28)^2 image tokens. Pixels go to the vision tower as the
processor flattens them: each 14 x 14 patch twice (temporal_patch_size = 2, a still image), in
the order of the 2 x 2 blocks the merger joins.

Prompt: <|vision_start|> <|image_pad|> x n <|vision_end|>, then the instruction. Positions are
three ids per token (time, row, column): text tokens have all three equal; image token (r, c) has
(s, s + r, s + c) where s is the first image token's position; text after the image continues
from s + max(rows, columns), as the model's own get_rope_index numbers them.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig

from . import Family, known_ids, need
from .idefics3 import token_ids

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"


class Qwen2_5_VL(Family):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    image_token = IMAGE_PAD
    special_tokens = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)

    def tiny_config(self, bcfg, image_size: int, tokenizer) -> Qwen2_5_VLConfig:
        head_dim = bcfg.text_hidden_size // bcfg.text_heads
        need(head_dim % 4 == 0, f"policy.backbone.text_hidden_size / text_heads = {head_dim} must be a multiple of "
                                "4 for Qwen2.5-VL's 3-axis rotary positions")
        half = head_dim // 2
        section = [half - 2 * (half // 3), half // 3, half // 3]            # time, rows, columns
        ids, tid = token_ids(tokenizer), tokenizer.convert_tokens_to_ids
        return Qwen2_5_VLConfig(
            text_config=dict(hidden_size=bcfg.text_hidden_size, intermediate_size=bcfg.intermediate_size,
                             num_hidden_layers=bcfg.text_layers, num_attention_heads=bcfg.text_heads,
                             num_key_value_heads=bcfg.text_heads, vocab_size=bcfg.vocab_size,
                             max_position_embeddings=4096, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                             pad_token_id=ids["pad"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}),
            vision_config=dict(depth=bcfg.vision_layers, hidden_size=bcfg.vision_hidden_size,
                               intermediate_size=4 * bcfg.vision_hidden_size, num_heads=bcfg.vision_heads,
                               out_hidden_size=bcfg.text_hidden_size, patch_size=bcfg.patch_size,
                               spatial_merge_size=2, temporal_patch_size=2, window_size=4 * bcfg.patch_size,
                               fullatt_block_indexes=[bcfg.vision_layers - 1]),
            image_token_id=tid(IMAGE_PAD), video_token_id=tid(VIDEO_PAD), vision_start_token_id=tid(VISION_START),
            vision_end_token_id=tid(VISION_END), tie_word_embeddings=False)

    def image_processor(self, bcfg, image_size: int):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        unit = 2 * bcfg.patch_size
        side = max(unit, round(image_size / unit) * unit)
        return Qwen2VLImageProcessorPil(patch_size=bcfg.patch_size, merge_size=2, temporal_patch_size=2,
                                        min_pixels=side * side, max_pixels=side * side)

    def model_size(self, config, image_size: int) -> int:
        unit = _unit(config.vision_config)
        return max(unit, round(image_size / unit) * unit)

    def image_seq_len(self, config, model_size: int) -> int:
        return (model_size // _unit(config.vision_config)) ** 2

    def image_features(self, vlm, pixels):
        vc = vlm.config.vision_config
        patches, grid = patchify(pixels, vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
        merged = vlm.model.visual(patches, grid_thw=grid).pooler_output
        return merged.reshape(pixels.shape[0], -1, merged.shape[-1])

    def vision_dtype(self, vlm):
        return vlm.model.visual.patch_embed.proj.weight.dtype

    def position_embedding(self, vlm):
        return None                  # (rotary: nothing to initialise)

    def markers(self, tokenizer):
        return known_ids(tokenizer, VISION_START), known_ids(tokenizer, VISION_END)

    def positions(self, attn, layout, config, model_size):
        text = (attn.cumsum(1) - 1).clamp(min=0)
        side = model_size // _unit(config.vision_config)
        s, n = layout.image_start, layout.image_seq_len
        k = torch.arange(n, device=attn.device)
        start = text[:, s:s + 1]
        pos = text.unsqueeze(0).repeat(3, 1, 1)
        pos[:, :, s + n:] -= n - side                                    # after the image: from s + side
        pos[0, :, s:s + n] = start
        pos[1, :, s:s + n] = start + k // side
        pos[2, :, s:s + n] = start + k % side
        return pos


def _unit(vision_config) -> int:
    return vision_config.patch_size * vision_config.spatial_merge_size


def patchify(pixels: torch.Tensor, patch: int, temporal: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 3, H, W] -> the processor's flattened patches [B * h * w, 3 * temporal * patch^2] (each
    merge x merge block of patches together, row-major) and grid_thw [B, 3] = (1, h, w)."""
    b, c, height, width = pixels.shape
    h, w = height // patch, width // patch
    x = pixels.unsqueeze(1).expand(b, temporal, c, height, width)
    x = x.reshape(b, temporal, c, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)             # b, h/m, w/m, m, m, c, t, p, p
    grid = torch.tensor([[1, h, w]] * b, device=pixels.device)
    return x.reshape(b * h * w, c * temporal * patch * patch), grid


FAMILY = Qwen2_5_VL()
