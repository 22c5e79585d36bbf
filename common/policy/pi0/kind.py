"""π0 / π0.5 as a policy kind of common/policy/kinds.py: what `asyncvla train` may be pointed at.

A LeRobot π0 / π0.5 directory loads and acts (policy.py's PI0), but RL on it is not supported yet:
`build` and `from_pretrained` refuse in one line, and `preflight` says so (with what else keeps the
directory from loading: its type and settings, its statistics, its tensors' names and shapes,
checked against the network its config.json describes built on the meta device), so that a run is
refused before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..lerobot_dir import WEIGHTS, LeRobotDirError
from .network import build_net
from .spec import read_policy_dir

UNSUPPORTED = ("π0/π0.5 directories load and act (asyncvla.common.policy.pi0.PI0) but RL on them is not "
               "supported yet")


def directory_problems(path) -> list[str]:
    """What keeps a π0 / π0.5 directory from loading, one line (none: it loads)."""
    try:
        d = read_policy_dir(path, weights=False)
        with torch.device("meta"):
            net = build_net(d.spec, str(Path(path) / "config.json"))
        net.check_weights(d.weights, str(Path(path) / WEIGHTS))
    except (LeRobotDirError, OSError, ValueError) as e:
        return [str(e)]
    return []


class PI0Policy:
    STARTS_TRAINED = True       # a trained VLA (were RL supported, `asyncvla pipeline` would go straight to it)

    @classmethod
    def preflight(cls, cfg) -> list[str]:
        key = f"policy.pretrained_path={cfg.pretrained_path!r}"
        return [f"{key}: {p}" for p in (*directory_problems(cfg.pretrained_path), UNSUPPORTED)]

    @classmethod
    def build(cls, cfg, device="cpu", dtype=None):
        raise LeRobotDirError(f"policy.pretrained_path={cfg.pretrained_path!r}: {UNSUPPORTED}")

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=None):
        raise LeRobotDirError(f"{path}: {UNSUPPORTED}")
