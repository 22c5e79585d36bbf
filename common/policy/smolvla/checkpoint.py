"""A LeRobot SmolVLA policy directory, read without LeRobot: its settings, its tensors by name and
its normaliser statistics.

A directory as LeRobot 0.4's `SmolVLAPolicy.save_pretrained` (and its processors' save_pretrained)
writes it:
    config.json                     "type": "smolvla", the features, chunk size, denoising steps, the
                                    VLM's name (`vlm_model_name`) and how much of it is used
    model.safetensors               every tensor, named "model.<module path>"
    policy_preprocessor.json        the input pipeline; its normaliser step names the .safetensors
    policy_postprocessor.json       file of its statistics ("state_file"), as does the output
    *_normalizer_processor.safetensors / *_unnormalizer_processor.safetensors
Older checkpoints keep the statistics as buffers inside model.safetensors instead
(normalize_inputs.buffer_observation_state.mean, ...): both are read.

The VLM's own config and tokenizer are not in the directory: LeRobot reads them from
`vlm_model_name` again, a local directory or a Hugging Face Hub id (found here only in the local
Hugging Face cache: no download). A relative path is taken from the policy directory.

Every problem is one line (LeRobotDirError) naming the file, the key or the tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG, WEIGHTS = "config.json", "model.safetensors"
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"
SUPPORTED_TYPES = ("smolvla",)
STATE_KEY, ACTION_KEY = "observation.state", "action"
NORM_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
NORM_EPS = 1e-8        # LeRobot's normaliser adds it to std (and puts it for a zero range)


class LeRobotDirError(ValueError):
    """A LeRobot policy directory asyncvla cannot use, in one line."""


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
        if kind not in SUPPORTED_TYPES:
            raise LeRobotDirError(f"{where}: \"type\": {kind!r} is a LeRobot policy asyncvla cannot load; "
                                  f"supported: {list(SUPPORTED_TYPES)}")
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
        modes = dict(config.get("normalization_mapping") or {})
        for ftype, mode in modes.items():
            if mode not in NORM_MODES:
                raise LeRobotDirError(f"{where}: normalization_mapping.{ftype}={mode!r}; allowed: {list(NORM_MODES)}")
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
class LeRobotPolicyDir:
    """What a LeRobot SmolVLA directory holds: its spec, its tensors (names without the "model."
    prefix), the statistics of each normalised feature ({feature: {stat: tensor}}), and where the
    VLM's config and tokenizer are."""
    path: Path
    config: dict
    spec: SmolVLASpec
    weights: dict[str, torch.Tensor]
    stats: dict[str, dict[str, torch.Tensor]]
    vlm_dir: Path


def read_policy_dir(path, weights: bool = True) -> LeRobotPolicyDir:
    """The directory's contents; without `weights`, the tensors' shapes only (as meta tensors), read
    from model.safetensors' header."""
    path = Path(path)
    if not path.is_dir():
        raise LeRobotDirError(f"{path}: not a directory (a LeRobot policy directory holds {CONFIG} and {WEIGHTS})")
    config = _json(path / CONFIG)
    spec = SmolVLASpec.from_config(config, str(path / CONFIG))
    if not (path / WEIGHTS).is_file():
        raise LeRobotDirError(f"{path / WEIGHTS}: missing (the policy's tensors)")
    raw = load_file(str(path / WEIGHTS)) if weights else _header(path / WEIGHTS)
    tensors = {k.removeprefix("model."): v for k, v in raw.items() if k.startswith("model.")}
    stats = _stats(path, spec, raw)
    return LeRobotPolicyDir(path, config, spec, tensors, stats, _vlm_dir(path, spec.vlm_model_name))


def check_tensors(own: dict, found: dict, where: str) -> None:
    """The tensors a network has ({name: tensor}) against a file's (names without "model."): one
    line naming what is missing, unexpected or of another shape."""
    missing, unexpected = sorted(own.keys() - found.keys()), sorted(found.keys() - own.keys())
    if missing or unexpected:
        parts = [f"{len(names)} {what} (model.{names[0]}{', ...' if len(names) > 1 else ''})"
                 for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise LeRobotDirError(f"{where}: its tensors do not fit SmolVLA as its config.json describes it: "
                              + "; ".join(parts))
    for name, tensor in found.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise LeRobotDirError(f"{where}: tensor model.{name} has shape {list(tensor.shape)}; its config "
                                  f"gives {list(own[name].shape)}")


def _header(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors as meta tensors of their shapes and dtypes (no data read)."""
    from safetensors import safe_open
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            out[name] = torch.empty(piece.get_shape(), device="meta")
    return out


def normalize(x: torch.Tensor, stats: dict, mode: str, inverse: bool = False) -> torch.Tensor:
    """LeRobot's normaliser for one feature: MEAN_STD (x - mean) / (std + eps); MIN_MAX, QUANTILES
    (q01, q99) and QUANTILE10 (q10, q90) map their range onto [-1, 1] (a zero range counts as eps);
    IDENTITY leaves x. `inverse` undoes it."""
    if mode == "IDENTITY":
        return x
    s = {k: v.to(x.device, x.dtype) for k, v in stats.items()}
    if mode == "MEAN_STD":
        return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + NORM_EPS)
    low, high = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[mode]
    span = s[high] - s[low]
    span = torch.where(span == 0, torch.full_like(span, NORM_EPS), span)
    return (x + 1) / 2 * span + s[low] if inverse else 2 * (x - s[low]) / span - 1


def stats_needed(spec: SmolVLASpec) -> dict[str, tuple[str, ...]]:
    """{feature: the statistics its normalisation reads} for the features asyncvla normalises."""
    needs = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
             "QUANTILE10": ("q10", "q90"), "IDENTITY": ()}
    out = {ACTION_KEY: needs[spec.mode("ACTION")]}
    if spec.state_dim:
        out[STATE_KEY] = needs[spec.mode("STATE")]
    for key in spec.image_keys:
        out[key] = needs[spec.mode("VISUAL")]
    return {k: v for k, v in out.items() if v}


# ------------------------------------------------------------------------------------ helpers
def _json(path: Path) -> dict:
    if not path.is_file():
        raise LeRobotDirError(f"{path}: missing")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LeRobotDirError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise LeRobotDirError(f"{path}: holds {type(value).__name__}, not an object")
    return value


def _features(config: dict, key: str, where: str) -> dict:
    features = config.get(key)
    if not isinstance(features, dict):
        raise LeRobotDirError(f"{where}: {key} is missing or not an object")
    for name, f in features.items():
        if not isinstance(f, dict) or "type" not in f or not isinstance(f.get("shape"), list):
            raise LeRobotDirError(f"{where}: {key}.{name} needs a type and a shape list")
    return features


def _int(config: dict, key: str, where: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LeRobotDirError(f"{where}: {key}={value!r}; allowed: an integer >= 1")
    return value


def _stats(path: Path, spec: SmolVLASpec, raw: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The normaliser statistics: from the processor files the pipelines' normaliser steps name,
    else from the buffers older checkpoints keep in model.safetensors."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for pipeline, step_names in ((PREPROCESSOR, ("normalizer_processor",)),
                                 (POSTPROCESSOR, ("unnormalizer_processor",))):
        if not (path / pipeline).is_file():
            continue
        for step in _json(path / pipeline).get("steps", []):
            if step.get("registry_name") in step_names and step.get("state_file"):
                state = path / step["state_file"]
                if not state.is_file():
                    raise LeRobotDirError(f"{state}: missing (named as the state_file of {path / pipeline}'s "
                                          f"{step['registry_name']} step)")
                for name, tensor in load_file(str(state)).items():
                    feature, _, stat = name.rpartition(".")
                    found.setdefault(feature, {})[stat] = tensor.float()
    if not found:
        if any(v.is_meta for v in raw.values()):           # (the header only: read the buffers' values)
            raw = {k: v for k, v in load_file(str(path / WEIGHTS)).items() if not k.startswith("model.")}
        found = _buffer_stats(raw, spec)
    for feature, stat_names in stats_needed(spec).items():
        for stat in stat_names:
            if stat not in found.get(feature, {}):
                raise LeRobotDirError(f"{path}: no normaliser statistic {feature}.{stat} (its normalisation "
                                      f"is {spec.mode('ACTION' if feature == ACTION_KEY else 'STATE')}); looked in "
                                      f"{PREPROCESSOR} / {POSTPROCESSOR}'s state files and {WEIGHTS}'s buffers")
            if not torch.isfinite(found[feature][stat]).all():
                raise LeRobotDirError(f"{path}: normaliser statistic {feature}.{stat} holds NaN or inf "
                                      "(a checkpoint saved without dataset statistics)")
            size = {ACTION_KEY: spec.action_dim, STATE_KEY: spec.state_dim}.get(feature)
            if size is not None and found[feature][stat].numel() != size:
                raise LeRobotDirError(f"{path}: normaliser statistic {feature}.{stat} has "
                                      f"{found[feature][stat].numel()} values; its {feature} has {size} dimensions")
    return found


def _buffer_stats(raw: dict, spec: SmolVLASpec) -> dict[str, dict[str, torch.Tensor]]:
    """Older LeRobot checkpoints: normalize_inputs.buffer_observation_state.mean, ... (a feature's
    dots written as underscores)."""
    escaped = {k.replace(".", "_"): k for k in (STATE_KEY, ACTION_KEY, *spec.image_keys)}
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        module, _, rest = name.partition(".")
        if module not in ("normalize_inputs", "normalize_targets", "unnormalize_outputs"):
            continue
        buffer, _, stat = rest.rpartition(".")
        feature = escaped.get(buffer.removeprefix("buffer_"))
        if feature is not None:
            found.setdefault(feature, {})[stat] = tensor.float()
    return found


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
