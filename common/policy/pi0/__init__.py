"""π0 and π0.5 (Physical Intelligence's VLAs, as LeRobot 0.4.3 ports them) loaded from a LeRobot
policy directory, without LeRobot: they load and act; RL on them is not supported yet (kind.py).

    spec.py       the directory: config.json (type "pi0" / "pi05"), the Gemma variants, statistics,
                  the tokenizer's place
    network.py    the network under LeRobot's module names (its tensors load by name), flow matching
    policy.py     PI0: acting as LeRobot's PI0Policy / PI05Policy with their processors do
    kind.py       the policy kind kinds.py registers: preflight, and the refusal to train
    released.py   pi0_base's and pi05_base's shape, as data
"""

from ..lerobot_dir import LeRobotDirError
from .policy import PI0
from .spec import PI0Spec, read_policy_dir

__all__ = ["PI0", "LeRobotDirError", "PI0Spec", "read_policy_dir"]
