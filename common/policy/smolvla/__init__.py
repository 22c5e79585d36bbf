"""SmolVLA (LeRobot's 450 M-parameter VLA) loaded from a LeRobot policy directory, without LeRobot.

    checkpoint.py   the directory: config.json, model.safetensors, normaliser statistics
    network.py      the network under LeRobot's module names (its tensors load by name)
    policy.py       SmolVLA: acting as LeRobot's SmolVLAPolicy does (normalisation, tokens, pixels)
"""

from .checkpoint import LeRobotDirError, SmolVLASpec, read_policy_dir  # noqa: F401
from .policy import SmolVLA  # noqa: F401
