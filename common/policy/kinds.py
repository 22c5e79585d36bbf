"""Policy kinds: what a policy directory holds decides which class loads it. Everything outside
this package builds and loads policies through `build_policy` and `load_policy`, never by kind.

    vla       VLAPolicy (model.py): a VLM backbone with asyncvla's own heads, built here (a tiny
              backbone, a Hugging Face VLM directory, or a saved policy continued)
    smolvla   SmolVLAPolicy (smolvla/kind.py): a trained SmolVLA from a LeRobot policy directory
    pi0       PI0Policy (pi0/kind.py): a LeRobot π0 or π0.5 directory, which loads and acts
              (pi0.PI0) but is refused for RL (preflight and build say so)

A saved policy's policy.json names its kind ("vla" when it names none: policies saved before
kinds existed); a LeRobot policy directory is its config.json's "type", whose kind is
lerobot_dir.LEROBOT_TYPES' (the one list of the LeRobot types asyncvla loads).
"""

from __future__ import annotations

import json
import os

import torch

from .lerobot_dir import LEROBOT_TYPES, SUPPORTED_TYPES, LeRobotDirError
from .model import VLAPolicy
from .pi0.kind import PI0Policy
from .smolvla.kind import SmolVLAPolicy

KINDS = {"vla": VLAPolicy, "smolvla": SmolVLAPolicy, "pi0": PI0Policy}
POLICY_FILE = "policy.json"
assert set(LEROBOT_TYPES.values()) <= set(KINDS), "a LeRobot type maps to a kind that is not registered"


def kind_of(path) -> str:
    """The kind of policy the directory holds ("vla" for anything that is not a saved policy of
    another kind or a LeRobot policy directory, e.g. a Hugging Face VLM)."""
    if path is None:
        return "vla"
    saved, config = os.path.join(path, POLICY_FILE), os.path.join(path, "config.json")
    if os.path.isfile(saved):
        try:
            with open(saved) as f:
                return json.load(f).get("kind", "vla")
        except ValueError as e:
            raise ValueError(f"{POLICY_FILE} is not readable JSON ({e})") from None
    if os.path.isfile(config):
        try:
            with open(config) as f:
                lerobot_type = json.load(f).get("type")
        except ValueError as e:
            raise ValueError(f"config.json is not readable JSON ({e})") from None
        if lerobot_type is not None:
            if lerobot_type not in SUPPORTED_TYPES:
                raise LeRobotDirError(f"{config}: \"type\": {lerobot_type!r} is a LeRobot policy asyncvla cannot "
                                      f"load; supported: {list(SUPPORTED_TYPES)}")
            return LEROBOT_TYPES[lerobot_type]
    return "vla"


def preflight(cfg) -> list[str]:
    """What keeps policy.pretrained_path from loading for a run with these policy settings, in
    lines naming the key, the file or the tensor (checked before any process starts)."""
    key = f"policy.pretrained_path={cfg.pretrained_path!r}"
    if not os.path.isdir(cfg.pretrained_path):
        return [f"{key}: no such directory"]
    try:
        kind = kind_of(cfg.pretrained_path)
    except (OSError, ValueError) as e:          # (LeRobotDirError: a LeRobot type not supported)
        return [f"{key}: {e}"]
    if kind not in KINDS:
        return [f"{key}: {POLICY_FILE} names the policy kind {kind!r}; known: {list(KINDS)}"]
    return KINDS[kind].preflight(cfg)


def starts_trained(path) -> bool:
    """Whether policy.pretrained_path holds a policy that already acts, trained elsewhere (a LeRobot
    directory), so that `asyncvla pipeline` runs no demonstrations and no SFT before RL."""
    return KINDS[kind_of(path)].STARTS_TRAINED


def build_policy(cfg, device="cpu", dtype: torch.dtype | None = None):
    """The policy the run's policy settings describe (policy.pretrained_path picks the kind)."""
    return KINDS[kind_of(cfg.pretrained_path)].build(cfg, device=device, dtype=dtype)


def load_policy(path, device="cpu", dtype: torch.dtype | None = None):
    """A policy directory written by `save_pretrained`, of any kind."""
    return KINDS[kind_of(path)].from_pretrained(str(path), device=device, dtype=dtype)
