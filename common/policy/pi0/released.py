"""π0 and π0.5 at their published shape (lerobot/pi0_base, lerobot/pi05_base), built without a
download: the config.json each is made from, written out here as data (LeRobot 0.4.3's keys).

Where the numbers come from. The network's: LeRobot 0.4.3's PI0Config / PI05Config defaults, which
are openpi's: a PaliGemma whose language model is gemma_2b (width 2048, 18 layers, MLP 16,384, 8
query heads and 1 key/value head of 256, vocabulary 257,152) and whose vision tower is SigLIP
so400m/14 at 224 px (1152 wide, 27 layers, MLP 4304, 16 heads, projected to 2048); an action expert
gemma_300m (width 1024, 18 layers, MLP 4096, 8 query heads and 1 key/value head of 256); chunk 50, 10
denoising steps, state and action padded to 32. π0.5 differs by its time conditioning (adaRMS in the
expert, no state projection: the state is written into the prompt as 256-bin tokens), its default
statistics (QUANTILES for state and action) and its prompt length (200). The features (three
224 x 224 cameras, a 32-dim state and action) are as remembered of the published config.json files,
not checked against them here; they do not change the parameters (state and action are padded to
32, the cameras share the vision tower).

The parameter names, shapes and counts at this shape are checked against LeRobot's own PI0Policy /
PI05Policy built on the meta device from the same dicts (tests/golden/pi0/pi0_params.json and
pi05_params.json, written by tests/interop/pi0_side.py count; tests/test_pi0_lerobot.py).

The module imports nothing at load time (the interop generator reads the dicts from this file).
"""

from __future__ import annotations

import copy

_CAMERA = {"type": "VISUAL", "shape": [3, 224, 224]}
_FEATURES = {
    "input_features": {
        "observation.images.base_0_rgb": _CAMERA,
        "observation.images.left_wrist_0_rgb": _CAMERA,
        "observation.images.right_wrist_0_rgb": _CAMERA,
        "observation.state": {"type": "STATE", "shape": [32]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [32]}},
}
_COMMON = {
    "paligemma_variant": "gemma_2b",
    "action_expert_variant": "gemma_300m",
    "dtype": "float32",
    "n_obs_steps": 1,
    "chunk_size": 50,
    "n_action_steps": 50,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "num_inference_steps": 10,
    "time_sampling_beta_alpha": 1.5,
    "time_sampling_beta_beta": 1.0,
    "time_sampling_scale": 0.999,
    "time_sampling_offset": 0.001,
    "min_period": 0.004,
    "max_period": 4.0,
    "image_resolution": [224, 224],
    "empty_cameras": 0,
}
PI0_BASE = {"type": "pi0", **copy.deepcopy(_FEATURES), **_COMMON,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
            "tokenizer_max_length": 48}
PI05_BASE = {"type": "pi05", **copy.deepcopy(_FEATURES), **_COMMON,
             "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
             "tokenizer_max_length": 200}
RELEASED = {"pi0": PI0_BASE, "pi05": PI05_BASE}

# The parts a count is split into: parameter name prefixes (LeRobot's names, without "model.").
PARTS = {
    "vision_tower": "paligemma_with_expert.paligemma.model.vision_tower.",
    "multi_modal_projector": "paligemma_with_expert.paligemma.model.multi_modal_projector.",
    "language_model": "paligemma_with_expert.paligemma.model.language_model.",
    "paligemma_lm_head": "paligemma_with_expert.paligemma.lm_head.",
    "gemma_expert": "paligemma_with_expert.gemma_expert.model.",
    "gemma_expert_lm_head": "paligemma_with_expert.gemma_expert.lm_head.",
}   # the rest: "projections" (state, action and time projections)


def released_net(kind: str = "pi0", device="meta"):
    """asyncvla's PI0Net at lerobot/pi0_base's (kind "pi0") or pi05_base's ("pi05") shape, float32;
    on the meta device (the default) it has shapes and no storage."""
    import torch

    from .spec import PI0Spec
    from .network import PI0Net
    spec = PI0Spec.from_config(copy.deepcopy(RELEASED[kind]), f"lerobot/{kind}_base config.json (released.py)")
    with torch.device(device):
        return PI0Net(spec)


def parameter_counts(named) -> dict[str, int]:
    """{"total", each of PARTS, "projections"}: numbers of parameters of (name, tensor) pairs (each
    tensor once: a tied tensor is counted under the first name it has)."""
    counts = dict.fromkeys(("total", *PARTS, "projections"), 0)
    for name, p in named:
        counts["total"] += p.numel()
        part = next((k for k, prefix in PARTS.items() if name.startswith(prefix)), "projections")
        counts[part] += p.numel()
    return counts
