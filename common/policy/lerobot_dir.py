"""What every LeRobot policy directory has in common, read without LeRobot: config.json, the tensors
of model.safetensors by name, the normaliser statistics, and one-line refusals (LeRobotDirError).

A directory as LeRobot 0.4's `PreTrainedPolicy.save_pretrained` (and its processors'
save_pretrained) writes it:
    config.json                     "type" (the policy: "smolvla", "pi0", "pi05", ...), the features,
                                    the normalisation of each feature type, the policy's settings
    model.safetensors               every tensor, named "model.<module path>"
    policy_preprocessor.json        the input pipeline; its normaliser step names the .safetensors
    policy_postprocessor.json       file of its statistics ("state_file"), as does the output
    *_normalizer_processor.safetensors / *_unnormalizer_processor.safetensors
Older checkpoints keep the statistics as buffers inside model.safetensors instead
(normalize_inputs.buffer_observation_state.mean, ...): both are read.

The policy-specific readers (smolvla/checkpoint.py, pi0/spec.py) build on these. The LeRobot types
asyncvla loads, and the policy kind each loads as, are LEROBOT_TYPES (kinds.py registers the kinds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG, WEIGHTS = "config.json", "model.safetensors"
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"
STATE_KEY, ACTION_KEY = "observation.state", "action"
NORM_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
NORM_EPS = 1e-8        # LeRobot's normaliser adds it to std (and puts it for a zero range)
STAT_NAMES = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
              "QUANTILE10": ("q10", "q90"), "IDENTITY": ()}

# LeRobot config.json "type" -> the asyncvla policy kind (common/policy/kinds.py) that loads it.
LEROBOT_TYPES = {"smolvla": "smolvla", "pi0": "pi0", "pi05": "pi0"}
SUPPORTED_TYPES = tuple(LEROBOT_TYPES)


class LeRobotDirError(ValueError):
    """A LeRobot policy directory asyncvla cannot use, in one line."""


def type_error(where: str, kind, reader: str | None = None) -> LeRobotDirError:
    """The refusal of a config.json "type": one LeRobot asyncvla does not load at all, or (with
    `reader`, the type a reader reads) one another reader loads."""
    if reader is not None and kind in SUPPORTED_TYPES:
        return LeRobotDirError(f"{where}: \"type\": {kind!r} is not a {reader} policy ({kind!r} loads as asyncvla's "
                               f"{LEROBOT_TYPES[kind]!r} kind)")
    return LeRobotDirError(f"{where}: \"type\": {kind!r} is a LeRobot policy asyncvla cannot load; "
                           f"supported: {list(SUPPORTED_TYPES)}")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise LeRobotDirError(f"{path}: missing")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LeRobotDirError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise LeRobotDirError(f"{path}: holds {type(value).__name__}, not an object")
    return value


def features(config: dict, key: str, where: str) -> dict:
    """config[key] ("input_features" / "output_features"): {name: {"type", "shape"}}, checked."""
    found = config.get(key)
    if not isinstance(found, dict):
        raise LeRobotDirError(f"{where}: {key} is missing or not an object")
    for name, f in found.items():
        if not isinstance(f, dict) or "type" not in f or not isinstance(f.get("shape"), list):
            raise LeRobotDirError(f"{where}: {key}.{name} needs a type and a shape list")
    return found


def int_setting(config: dict, key: str, where: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LeRobotDirError(f"{where}: {key}={value!r}; allowed: an integer >= 1")
    return value


def norm_modes(config: dict, where: str) -> dict:
    """config.json's normalization_mapping ({feature type: mode}), checked."""
    modes = dict(config.get("normalization_mapping") or {})
    for ftype, mode in modes.items():
        if mode not in NORM_MODES:
            raise LeRobotDirError(f"{where}: normalization_mapping.{ftype}={mode!r}; allowed: {list(NORM_MODES)}")
    return modes


def read_weights(path: Path, weights: bool = True) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors by their full names; without `weights`, their shapes only (meta
    tensors read from the header)."""
    if not (path / WEIGHTS).is_file():
        raise LeRobotDirError(f"{path / WEIGHTS}: missing (the policy's tensors)")
    return load_file(str(path / WEIGHTS)) if weights else header(path / WEIGHTS)


def header(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors as meta tensors of their shapes (no data read)."""
    from safetensors import safe_open
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            out[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    return out


def check_tensors(own: dict, found: dict, where: str, network: str = "SmolVLA") -> None:
    """The tensors a network has ({name: tensor}) against a file's (names without "model."): one
    line naming what is missing, unexpected or of another shape."""
    missing, unexpected = sorted(own.keys() - found.keys()), sorted(found.keys() - own.keys())
    if missing or unexpected:
        parts = [f"{len(names)} {what} (model.{names[0]}{', ...' if len(names) > 1 else ''})"
                 for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise LeRobotDirError(f"{where}: its tensors do not fit {network} as its config.json describes it: "
                              + "; ".join(parts))
    for name, tensor in found.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise LeRobotDirError(f"{where}: tensor model.{name} has shape {list(tensor.shape)}; its config "
                                  f"gives {list(own[name].shape)}")


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


def normalized_state(state, stats: dict, spec, device) -> torch.Tensor:
    """[B, state_dim] in the robot's units -> normalised with the directory's statistics and
    zero-padded to [B, max_state_dim], as LeRobot's processors and prepare_state make it."""
    s = torch.as_tensor(state, dtype=torch.float32, device=device)
    if spec.state_dim:
        s = normalize(s, stats.get(STATE_KEY, {}), spec.mode("STATE"))
    return torch.nn.functional.pad(s, (0, spec.max_state_dim - s.shape[-1]))


@dataclass
class LeRobotDir:
    """What any LeRobot policy directory holds: its config, the policy's spec read from it, its
    tensors (names without the "model." prefix) and the statistics of each normalised feature
    ({feature: {stat: tensor}}). Each policy's reader adds where its VLM or tokenizer is."""
    path: Path
    config: dict
    spec: object
    weights: dict[str, torch.Tensor]
    stats: dict[str, dict[str, torch.Tensor]]


class LeRobotFlowVLA:
    """A LeRobot flow-matching VLA loaded into asyncvla (SmolVLA, π0, π0.5): its directory, spec and
    network, and the acting they share. A subclass gives `images(frames)` (its cameras as its
    network reads them) and `tokenize`; its network gives `sample(pixels, present, ids, mask,
    state, noise)` and an `action_in_proj`."""

    def __init__(self, d, net, tokenizer=None):
        self.dir, self.spec, self.net, self.tokenizer = d, d.spec, net, tokenizer

    @property
    def device(self) -> torch.device:
        return self.net.action_in_proj.weight.device

    def normalized_state(self, state) -> torch.Tensor:
        return normalized_state(state, self.dir.stats, self.spec, self.device)

    @torch.no_grad()
    def act_chunk(self, frames: dict, state, ids, mask, noise=None):
        """The action chunk [B, chunk_size, action_dim] in the dataset's units (numpy). `noise`
        [B, chunk_size, max_action_dim] (LeRobot's `noise` argument) fixes the draw; without it a
        standard normal draw is taken."""
        dtype = self.net.action_in_proj.weight.dtype
        pixels, present = self.images(frames)
        state = self.normalized_state(state)
        ids = torch.as_tensor(ids, device=self.device)
        mask = torch.as_tensor(mask, device=self.device).bool()
        shape = (ids.shape[0], self.spec.chunk_size, self.spec.max_action_dim)
        noise = torch.randn(shape) if noise is None else torch.as_tensor(noise, dtype=torch.float32)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise has shape {list(noise.shape)}; this policy draws {list(shape)}")
        chunk = self.net.sample([p.to(dtype) for p in pixels], present, ids, mask, state.to(dtype),
                                noise.to(self.device, dtype))
        actions = normalize(chunk[..., :self.spec.action_dim].float(), self.dir.stats.get(ACTION_KEY, {}),
                            self.spec.mode("ACTION"), inverse=True)
        return actions.cpu().numpy()


def stats_needed(spec) -> dict[str, tuple[str, ...]]:
    """{feature: the statistics its normalisation reads} for the features asyncvla normalises (a
    spec: `mode(feature type)`, `state_dim`, `image_keys`)."""
    out = {ACTION_KEY: STAT_NAMES[spec.mode("ACTION")]}
    if spec.state_dim:
        out[STATE_KEY] = STAT_NAMES[spec.mode("STATE")]
    for key in spec.image_keys:
        out[key] = STAT_NAMES[spec.mode("VISUAL")]
    return {k: v for k, v in out.items() if v}


def read_stats(path: Path, spec, raw: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The normaliser statistics: from the processor files the pipelines' normaliser steps name,
    else from the buffers older checkpoints keep in model.safetensors (`raw`: its tensors by full
    name, or their meta stand-ins); each one the spec's normalisation needs is there, finite and
    of its feature's size."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for pipeline, step_names in ((PREPROCESSOR, ("normalizer_processor",)),
                                 (POSTPROCESSOR, ("unnormalizer_processor",))):
        if not (path / pipeline).is_file():
            continue
        for step in read_json(path / pipeline).get("steps", []):
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
        found = buffer_stats(raw, spec)
    for feature, stat_names in stats_needed(spec).items():
        ftype = {ACTION_KEY: "ACTION", STATE_KEY: "STATE"}.get(feature, "VISUAL")
        for stat in stat_names:
            if stat not in found.get(feature, {}):
                raise LeRobotDirError(f"{path}: no normaliser statistic {feature}.{stat} (its normalisation "
                                      f"is {spec.mode(ftype)}); looked in {PREPROCESSOR} / {POSTPROCESSOR}'s "
                                      f"state files and {WEIGHTS}'s buffers")
            if not torch.isfinite(found[feature][stat]).all():
                raise LeRobotDirError(f"{path}: normaliser statistic {feature}.{stat} holds NaN or inf "
                                      "(a checkpoint saved without dataset statistics)")
            size = {ACTION_KEY: spec.action_dim, STATE_KEY: spec.state_dim}.get(feature)
            if size is not None and found[feature][stat].numel() != size:
                raise LeRobotDirError(f"{path}: normaliser statistic {feature}.{stat} has "
                                      f"{found[feature][stat].numel()} values; its {feature} has {size} dimensions")
    return found


def buffer_stats(raw: dict, spec) -> dict[str, dict[str, torch.Tensor]]:
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


def model_tensors(raw: dict) -> dict[str, torch.Tensor]:
    """The network's tensors of model.safetensors, by name without the "model." prefix."""
    return {k.removeprefix("model."): v for k, v in raw.items() if k.startswith("model.")}


def processor_step(path: Path, registry_name: str) -> dict | None:
    """The config of policy_preprocessor.json's first step of that registry name (None: no such
    file or step)."""
    if not (path / PREPROCESSOR).is_file():
        return None
    for step in read_json(path / PREPROCESSOR).get("steps", []):
        if step.get("registry_name") == registry_name:
            return step.get("config") or {}
    return None
