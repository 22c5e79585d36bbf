"""A LeRobot SmolVLA policy directory, read without LeRobot: its settings, its tensors by name and
its normaliser statistics.

The directory's layout and what every LeRobot policy directory has in common (config.json,
model.safetensors by name, the normaliser statistics of the processor files or of older
checkpoints' buffers, LeRobotDirError) are read by ../lerobot_dir.py; its names are imported here
too, so that they import from this module as they always did. SmolVLA's own: config.json's
"type": "smolvla", the features, chunk size, denoising steps, the VLM's name (`vlm_model_name`)
and how much of it is used.

The VLM's own config and tokenizer are not in the directory: LeRobot reads them from
`vlm_model_name` again, a local directory or a Hugging Face Hub id (found here only in the local
Hugging Face cache: no download). A relative path is taken from the policy directory.

Every problem is one line (LeRobotDirError) naming the file, the key or the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..lerobot_dir import (ACTION_KEY, CONFIG, NORM_EPS, NORM_MODES, POSTPROCESSOR, PREPROCESSOR,
                           STATE_KEY, SUPPORTED_TYPES, WEIGHTS, LeRobotDirError, check_tensors, normalize,
                           stats_needed, type_error)
from ..lerobot_dir import buffer_stats as _buffer_stats
from ..lerobot_dir import features as _features
from ..lerobot_dir import header as _header
from ..lerobot_dir import int_setting as _int
from ..lerobot_dir import LeRobotDir, model_tensors, norm_modes, read_weights
from ..lerobot_dir import read_json as _json
from ..lerobot_dir import read_stats as _stats

TYPE = "smolvla"
# (names that moved to ../lerobot_dir.py, still importable from here)
__all__ = ["ACTION_KEY", "CONFIG", "NORM_EPS", "NORM_MODES", "POSTPROCESSOR", "PREPROCESSOR", "STATE_KEY",
           "SUPPORTED_TYPES", "WEIGHTS", "LeRobotDirError", "LeRobotPolicyDir", "SmolVLASpec", "check_tensors",
           "ffn_width", "normalize", "read_policy_dir", "stats_needed", "_buffer_stats", "_header", "_json",
           "_stats"]


@dataclass(frozen=True)
class SmolVLASpec:
    """The settings of config.json that shape SmolVLA's network and its inputs and outputs."""
    image_keys: tuple[str, ...]                  # VISUAL input features, in config order
    image_shapes: tuple[tuple[int, ...], ...]    # [C, H, W] of each
    state_dim: int                               # observation.state's size (0: none)
    action_dim: int
    chunk_size: int
    n_action_steps: int
    max_state_dim: int
    max_action_dim: int
    resize_imgs_with_padding: tuple[int, int] | None   # (width, height)
    tokenizer_max_length: int
    pad_language_to: str
    num_steps: int
    vlm_model_name: str
    num_vlm_layers: int
    num_expert_layers: int
    self_attn_every_n_layers: int
    expert_width_multiplier: float
    attention_mode: str
    add_image_special_tokens: bool
    prefix_length: int
    min_period: float
    max_period: float
    empty_cameras: int = 0
    normalization: dict = field(default_factory=dict)     # feature type -> mode

    @classmethod
    def from_config(cls, config: dict, where: str) -> "SmolVLASpec":
        kind = config.get("type")
        if kind != TYPE:
            raise type_error(where, kind, TYPE)
        for key, unsupported in (("adapt_to_pi_aloha", True), ("use_delta_joint_actions_aloha", True)):
            if config.get(key) == unsupported:
                raise LeRobotDirError(f"{where}: {key}={unsupported} (Aloha's joint conventions) is not supported")
        if config.get("attention_mode", "cross_attn") != "cross_attn":
            raise LeRobotDirError(f"{where}: attention_mode={config['attention_mode']!r} is not supported; "
                                  "allowed: cross_attn (SmolVLA's own)")
        inputs, outputs = _features(config, "input_features", where), _features(config, "output_features", where)
        images = [(k, tuple(f["shape"])) for k, f in inputs.items() if f["type"] == "VISUAL"]
        if not images:
            raise LeRobotDirError(f"{where}: input_features has no VISUAL feature (a camera)")
        state = inputs.get(STATE_KEY)
        if ACTION_KEY not in outputs:
            raise LeRobotDirError(f"{where}: output_features lacks {ACTION_KEY!r}")
        modes = norm_modes(config, where)
        resize = config.get("resize_imgs_with_padding")
        spec = cls(
            image_keys=tuple(k for k, _ in images), image_shapes=tuple(s for _, s in images),
            state_dim=int(state["shape"][0]) if state else 0, action_dim=int(outputs[ACTION_KEY]["shape"][0]),
            chunk_size=_int(config, "chunk_size", where, 50), n_action_steps=_int(config, "n_action_steps", where, 50),
            max_state_dim=_int(config, "max_state_dim", where, 32),
            max_action_dim=_int(config, "max_action_dim", where, 32),
            resize_imgs_with_padding=tuple(resize) if resize else None,
            tokenizer_max_length=_int(config, "tokenizer_max_length", where, 48),
            pad_language_to=config.get("pad_language_to", "longest"),
            num_steps=_int(config, "num_steps", where, 10), vlm_model_name=str(config.get("vlm_model_name", "")),
            num_vlm_layers=int(config.get("num_vlm_layers", 16)), num_expert_layers=int(config.get("num_expert_layers", -1)),
            self_attn_every_n_layers=int(config.get("self_attn_every_n_layers", 2)),
            expert_width_multiplier=float(config.get("expert_width_multiplier", 0.75)),
            attention_mode="cross_attn", add_image_special_tokens=bool(config.get("add_image_special_tokens", False)),
            prefix_length=int(config.get("prefix_length", -1)), min_period=float(config.get("min_period", 4e-3)),
            max_period=float(config.get("max_period", 4.0)), empty_cameras=int(config.get("empty_cameras", 0)),
            normalization=modes)
        if spec.state_dim > spec.max_state_dim or spec.action_dim > spec.max_action_dim:
            raise LeRobotDirError(f"{where}: the state ({spec.state_dim}) or action ({spec.action_dim}) is longer than "
                                  f"max_state_dim={spec.max_state_dim} / max_action_dim={spec.max_action_dim}")
        if spec.empty_cameras:
            raise LeRobotDirError(f"{where}: empty_cameras={spec.empty_cameras} is not supported (0 allowed)")
        return spec

    def mode(self, ftype: str) -> str:
        return self.normalization.get(ftype, "IDENTITY")


@dataclass
class LeRobotPolicyDir(LeRobotDir):
    """A LeRobot SmolVLA directory (spec: a SmolVLASpec), and where its VLM's config and tokenizer are."""
    vlm_dir: Path


def read_policy_dir(path, weights: bool = True) -> LeRobotPolicyDir:
    """The directory's contents; without `weights`, the tensors' shapes only (as meta tensors), read
    from model.safetensors' header."""
    path = Path(path)
    if not path.is_dir():
        raise LeRobotDirError(f"{path}: not a directory (a LeRobot policy directory holds {CONFIG} and {WEIGHTS})")
    config = _json(path / CONFIG)
    spec = SmolVLASpec.from_config(config, str(path / CONFIG))
    raw = read_weights(path, weights)
    tensors = model_tensors(raw)
    stats = _stats(path, spec, raw)
    return LeRobotPolicyDir(path, config, spec, tensors, stats, _vlm_dir(path, spec.vlm_model_name))


# ------------------------------------------------------------------------------------ helpers
def _vlm_dir(path: Path, name: str) -> Path:
    """Where vlm_model_name's config and tokenizer are: a directory (relative ones from the policy
    directory), or a Hub id already in the local Hugging Face cache."""
    if not name:
        raise LeRobotDirError(f"{path / CONFIG}: vlm_model_name is empty (the VLM whose config and tokenizer "
                              "SmolVLA uses)")
    for candidate in (Path(name), path / name):
        if (candidate / CONFIG).is_file():
            return candidate
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise LeRobotDirError(f"{path / CONFIG}: vlm_model_name={name!r} is neither a directory with a "
                              f"{CONFIG} nor in the local Hugging Face cache (no download here): point it at "
                              "the VLM's directory") from None


def ffn_width(width: int) -> int:
    """The expert's MLP width for a given hidden width: LeRobot's rule (2/3 of 4x, rounded up to a
    multiple of 256)."""
    hidden = int(4 * int(2 * width / 3))
    return 256 * math.ceil(hidden / 256)
