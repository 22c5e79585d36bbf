"""Released checkpoints of each family, built on the meta device (no weights): their parameter counts
against the published ones, and what LoRA trains on them. No download is possible here, so this is
how the real sizes are checked: the configs are those of the checkpoints' config.json (values the
files leave to transformers' defaults written out), the counts those published for the checkpoints
(tied weights counted once, as the Hub's "Model size").

    python -m asyncvla.common.policy.families.released      # the table of the README's Models section
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Released:
    name: str
    family: str
    published_params: int       # the checkpoint's published parameter count
    source: str                 # where that count is published
    config: dict                # its config.json (transformers' defaults it relies on written out)


# Both SmolVLMs see through SigLIP-B/16 at 512 px (93 M parameters).
SIGLIP_B16_512 = {'hidden_size': 768, 'intermediate_size': 3072, 'num_hidden_layers': 12, 'num_attention_heads': 12,
                  'patch_size': 16, 'image_size': 512}

SMOLVLM_256M_INSTRUCT = Released(
    'HuggingFaceTB/SmolVLM-256M-Instruct', 'idefics3', 256_484_928,
    'Hugging Face API (safetensors parameter count) of the checkpoint; 513 MB in bf16',
    {'model_type': 'idefics3',
     'image_token_id': 49190,
     'scale_factor': 4,
     'tie_word_embeddings': False,
     'vocab_size': 49280,
     'text_config': {'model_type': 'llama',
                     'hidden_size': 576,
                     'intermediate_size': 1536,
                     'num_hidden_layers': 30,
                     'num_attention_heads': 9,
                     'num_key_value_heads': 3,
                     'head_dim': 64,
                     'vocab_size': 49280,
                     'max_position_embeddings': 8192,
                     'rms_norm_eps': 1e-05,
                     'rope_theta': 100000,
                     'tie_word_embeddings': False},
     'vision_config': SIGLIP_B16_512})

SMOLVLM_500M_INSTRUCT = Released(
    'HuggingFaceTB/SmolVLM-500M-Instruct', 'idefics3', 507_482_304,
    'Hugging Face API (safetensors parameter count) of the checkpoint; 1.02 GB in bf16',
    {'model_type': 'idefics3',
     'image_token_id': 49190,
     'scale_factor': 4,
     'tie_word_embeddings': False,
     'vocab_size': 49280,
     'text_config': {'model_type': 'llama',
                     'hidden_size': 960,
                     'intermediate_size': 2560,
                     'num_hidden_layers': 32,
                     'num_attention_heads': 15,
                     'num_key_value_heads': 5,
                     'head_dim': 64,
                     'vocab_size': 49280,
                     'max_position_embeddings': 8192,
                     'rms_norm_eps': 1e-05,
                     'rope_theta': 100000,
                     'tie_word_embeddings': False},
     'vision_config': SIGLIP_B16_512})

PALIGEMMA_3B_PT_224 = Released(
    'google/paligemma-3b-pt-224', 'paligemma', 2_923_466_480,
    "Hugging Face model size of PaliGemma-3B (2.92B); with pi0's 257,152-token vocabulary 2,923,335,408 "
    "(keras-hub's pali_gemma_3b_224 preset)",
    {'model_type': 'paligemma',
     'bos_token_id': 2,
     'eos_token_id': 1,
     'pad_token_id': 0,
     'hidden_size': 2048,
     'image_token_index': 257152,
     'projection_dim': 2048,
     'vocab_size': 257216,
     'text_config': {'model_type': 'gemma',
                     'hidden_size': 2048,
                     'intermediate_size': 16384,
                     'num_hidden_layers': 18,
                     'num_attention_heads': 8,
                     'num_key_value_heads': 1,
                     'num_image_tokens': 256,
                     'vocab_size': 257216},
     'vision_config': {'model_type': 'siglip_vision_model',
                       'hidden_size': 1152,
                       'intermediate_size': 4304,
                       'num_hidden_layers': 27,
                       'num_attention_heads': 16,
                       'patch_size': 14,
                       'num_image_tokens': 256,
                       'projection_dim': 2048,
                       'projector_hidden_act': 'gelu_fast',
                       'vision_use_head': False}})

QWEN2_5_VL_3B_INSTRUCT = Released(
    'Qwen/Qwen2.5-VL-3B-Instruct', 'qwen2_5_vl', 3_754_622_976,
    "Hugging Face model size (3.75B); mteb's ModelMeta of GVE-3B, adapted from it: n_parameters=3754622976",
    {'model_type': 'qwen2_5_vl',
     'bos_token_id': 151643,
     'eos_token_id': 151645,
     'vision_start_token_id': 151652,
     'vision_end_token_id': 151653,
     'vision_token_id': 151654,
     'image_token_id': 151655,
     'video_token_id': 151656,
     'hidden_act': 'silu',
     'hidden_size': 2048,
     'intermediate_size': 11008,
     'num_hidden_layers': 36,
     'num_attention_heads': 16,
     'num_key_value_heads': 2,
     'vocab_size': 151936,
     'max_position_embeddings': 128000,
     'max_window_layers': 70,
     'rms_norm_eps': 1e-06,
     'rope_theta': 1000000.0,
     'sliding_window': 32768,
     'use_sliding_window': False,
     'tie_word_embeddings': True,
     'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 24, 24]},
     'vision_config': {'depth': 32,
                       'hidden_act': 'silu',
                       'hidden_size': 1280,
                       'intermediate_size': 3420,
                       'num_heads': 16,
                       'in_chans': 3,
                       'out_hidden_size': 2048,
                       'patch_size': 14,
                       'spatial_merge_size': 2,
                       'spatial_patch_size': 14,
                       'temporal_patch_size': 2,
                       'window_size': 112,
                       'fullatt_block_indexes': [7, 15, 23, 31],
                       'tokens_per_second': 2}})

RELEASED = (SMOLVLM_256M_INSTRUCT, SMOLVLM_500M_INSTRUCT, PALIGEMMA_3B_PT_224, QWEN2_5_VL_3B_INSTRUCT)


def build_on_meta(released: Released) -> torch.nn.Module:
    """The checkpoint's model with no storage behind its parameters."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    config = copy.deepcopy(released.config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())            # (tied weights once)


def lora_trainable(model: torch.nn.Module, targets: str, rank: int) -> int:
    """Numbers LoRA of `rank` adds on the modules `targets` matches: rank x (in + out) each."""
    pattern = re.compile(targets)
    return sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if pattern.fullmatch(n) and isinstance(m, torch.nn.Linear))


def table(rank: int = 32) -> list[dict]:
    from . import family_by_name
    rows = []
    for r in RELEASED:
        model = build_on_meta(r)
        targets = family_by_name(r.family).lora_targets
        rows.append({"checkpoint": r.name, "family": r.family, "params": parameter_count(model),
                     "published": r.published_params, f"lora_r{rank}": lora_trainable(model, targets, rank),
                     "targets": targets})
    return rows


if __name__ == "__main__":
    for row in table():
        print(f"{row['checkpoint']:38s} {row['params']:>15,} (published {row['published']:,}, "
              f"{row['params'] / row['published'] - 1:+.3%})  LoRA r32 {row['lora_r32']:>12,}  {row['targets']}")
