"""SmolVLA at its published shape, lerobot/smolvla_base, built without a download: the two
config.json files it is made from, written out here as data.

    SMOLVLM2_500M_VIDEO_INSTRUCT   config.json of HuggingFaceTB/SmolVLM2-500M-Video-Instruct, the VLM
                                   smolvla_base cuts to its first 16 layers (the fields that shape
                                   it; the rest are transformers' defaults)
    SMOLVLA_BASE                   config.json of lerobot/smolvla_base, as SmolVLASpec reads it

Where the numbers come from. The VLM's: a Llama text model 960 wide (32 layers, 15 query and 5
key/value heads of 64, MLP 2560, vocabulary 49,280, rope_theta 100,000, untied output head), the
SigLIP-B/16 vision tower at 512 px and a pixel-shuffle connector of scale 4: the shapes of
SmolVLM-500M-Instruct's config.json (families/released.py), which SmolVLM2-500M-Video-Instruct
keeps, and the full VLM built from this dict has SmolVLM-500M-Instruct's published count,
507,482,304. SmolVLA's: LeRobot 0.4.3's SmolVLAConfig defaults, which are smolvla_base's shape
(chunk 50, 10 denoising steps, state and action padded to 32, images resized with padding to
512 x 512, the VLM's first 16 layers, an expert 0.75 as wide with as many layers, self-attention
every 2nd layer and cross-attention between); its features, three cameras
observation.images.camera1/2/3 (as LeRobot 0.4.3's tests name smolvla_base's inputs) of
256 x 256 and a 6-dim state and action, are as remembered, not checked against the file here, and
do not change the network's parameters (state and action are padded to 32, the cameras share
the vision tower). LeRobot's docs call smolvla_base "our pretrained 450M model".

The parameter count of this shape equals LeRobot's own SmolVLAPolicy built on the meta device from
the same two dicts (tests/golden/smolvla/smolvla_base_params.json, written by
tests/interop/smolvla_side.py count; tests/test_smolvla_released.py).

The module imports nothing at load time (the interop generator reads the dicts from this file).
"""

from __future__ import annotations

import copy

SMOLVLM2_500M_VIDEO_INSTRUCT = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "model_type": "smolvlm",
    "image_token_id": 49190,
    "scale_factor": 4,
    "tie_word_embeddings": False,
    "vocab_size": 49280,
    "text_config": {
        "model_type": "llama",
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "head_dim": 64,
        "vocab_size": 49280,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "smolvlm_vision",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "patch_size": 16,
        "image_size": 512,
    },
}

_CAMERA = {"type": "VISUAL", "shape": [3, 256, 256]}
SMOLVLA_BASE = {
    "type": "smolvla",
    "input_features": {
        "observation.state": {"type": "STATE", "shape": [6]},
        "observation.images.camera1": _CAMERA,
        "observation.images.camera2": _CAMERA,
        "observation.images.camera3": _CAMERA,
    },
    "output_features": {"action": {"type": "ACTION", "shape": [6]}},
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
    "chunk_size": 50,
    "n_action_steps": 50,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "resize_imgs_with_padding": [512, 512],
    "empty_cameras": 0,
    "tokenizer_max_length": 48,
    "num_steps": 10,
    "vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct",
    "add_image_special_tokens": False,
    "attention_mode": "cross_attn",
    "prefix_length": -1,
    "pad_language_to": "longest",
    "num_expert_layers": -1,
    "num_vlm_layers": 16,
    "self_attn_every_n_layers": 2,
    "expert_width_multiplier": 0.75,
    "min_period": 0.004,
    "max_period": 4.0,
}

# The parts a count is split into: parameter name prefixes (LeRobot's names, without "model.").
PARTS = {"vlm": "vlm_with_expert.vlm.", "lm_expert": "vlm_with_expert.lm_expert."}   # the rest: "projections"


def vlm_config():
    """SmolVLM2-500M-Video-Instruct's config as transformers' SmolVLMConfig."""
    from transformers import AutoConfig
    config = copy.deepcopy(SMOLVLM2_500M_VIDEO_INSTRUCT)
    config.pop("architectures")
    return AutoConfig.for_model(config.pop("model_type"), **config)


def smolvla_base_net(device="meta"):
    """asyncvla's SmolVLANet at smolvla_base's shape, float32; on the meta device (the default) it
    has shapes and no storage. (smolvla_base adds no image special tokens, so the tokenizer's ids
    for them are not needed.)"""
    import torch

    from .checkpoint import SmolVLASpec
    from .network import SmolVLANet
    spec = SmolVLASpec.from_config(copy.deepcopy(SMOLVLA_BASE), "lerobot/smolvla_base config.json (released.py)")
    with torch.device(device):
        return SmolVLANet(vlm_config(), spec)


def parameter_counts(net) -> dict[str, int]:
    """{"total", "vlm", "lm_expert", "projections" (state, action and time projections)}: numbers
    of parameters."""
    counts = dict.fromkeys(("total", *PARTS, "projections"), 0)
    for name, p in net.named_parameters():           # (each tensor once)
        counts["total"] += p.numel()
        part = next((k for k, prefix in PARTS.items() if name.startswith(prefix)), "projections")
        counts[part] += p.numel()
    return counts
