"""Demonstrations and the supervised warm start: collect, sft (and its LeRobot datasets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .fields import opt


@dataclass
class CollectConfig:
    method: str = opt("auto", "who demonstrates: scripted (the pixel task's oracle, or a ManiSkill task's "
                      "scripted expert reading the privileged state, in the control mode RL uses: "
                      "actors/experts.py), motion_planning (ManiSkill's planner, converted to "
                      "env.control_mode), or auto (scripted for the pixel task, motion_planning for "
                      "ManiSkill tasks)", choices=["auto", "scripted", "motion_planning"])
    num_episodes: int = opt(200, "successful demonstration episodes to record", ge=1)
    action_noise: float = opt(0.3, "probability that a step executes a random action instead of the "
                              "demonstrator's (whose action stays the label): demos then cover states "
                              "off the demonstrator's path", ge=0.0, le=1.0)
    num_envs: int = opt(16, "envs stepped together while collecting (the pixel task's oracle)", ge=1)
    num_procs: int = opt(2, "worker processes of ManiSkill demonstrations (scripted: one env each; "
                         "motion_planning: planning and converting)", ge=1)
    seed: int = opt(7, "base seed of the demonstration episodes (apart from training's and "
                    "evaluation's)", ge=0)


@dataclass
class LeRobotConfig:
    """How a dataset in LeRobot's format (sft.data names a directory with meta/info.json) maps onto
    what the policy reads (common/data/lerobot/read.py)."""
    camera: Optional[str] = opt(None, "the video feature the policy sees (e.g. observation.images.top); "
                                "null: the first video feature in meta/info.json")
    state: List[str] = opt(["observation.state"], "features concatenated, in this order, into the robot "
                           "state (read only when policy.state_dim > 0)")
    action: str = opt("action", "the feature holding the actions (policy.action_dim values per frame)")
    action_norm: str = opt("stats", "stats: a new policy bins each action dimension over the dataset's "
                           "own [q01, q99] (meta/stats.json; [min, max] where it has no quantiles), so "
                           "it acts in the dataset's units; none: the range comes from sft.action_range",
                           choices=["stats", "none"])


@dataclass
class SFTConfig:
    data: Optional[str] = opt(None, "demonstrations: a directory with trajectory.h5 + trajectory.json "
                              "(ManiSkill's format, e.g. from `asyncvla collect`) or the .h5 file, or "
                              "a LeRobot dataset directory (v2.1 or v3.0: meta/info.json; sft.lerobot)")
    max_demo_steps: Optional[int] = opt(None, "use at most this many demo steps (whole episodes, in "
                                        "file order; null: all)", ge=1)
    steps: int = opt(300, "optimizer steps", ge=1)
    batch_size: int = opt(64, "samples per optimizer step (all ranks)", ge=1)
    lr: float = opt(1e-3, "learning rate of the policy", gt=0.0)
    value_lr: float = opt(1e-3, "learning rate of the value head (critic warm-up)", gt=0.0)
    zero_stage: Optional[int] = opt(None, "DeepSpeed ZeRO stage of SFT's engine; null: learner.zero_stage. "
                                    "A model that fits one rank trains faster unpartitioned (0)",
                                    choices=[0, 1, 2, 3])
    micro_batch_size: Optional[int] = opt(None, "samples per forward/backward on one rank; null: "
                                          "learner.micro_batch_size", ge=1)
    action_range: str = opt("config", "binned range of each action dim of a new policy: config "
                            "(policy.action_low / action_high) or q99 (the demos' 1st-99th "
                            "percentiles, as OpenVLA normalises; saved with the policy). A LeRobot "
                            "dataset's stats take its place (sft.lerobot.action_norm=stats); a policy "
                            "continued from policy.pretrained_path keeps its own",
                            choices=["config", "q99"])
    value_loss_coef: float = opt(0.5, "weight of the critic's regression onto the demos' discounted "
                                 "returns (0: no critic warm-up)", ge=0.0)
    val_fraction: float = opt(0.1, "share of the episodes held out for validation loss and token "
                              "accuracy", ge=0.0, lt=1.0)
    eval_interval: int = opt(100, "evaluate success (sampled, as actors act) every this many steps "
                             "and at the end (0: only at the end)", ge=0)
    eval_episodes: int = opt(64, "episodes per success evaluation (fixed initial states)", ge=1)
    save_interval: int = opt(100, "checkpoint every this many steps (a rerun continues from the "
                             "latest complete one)", ge=1)
    augment_shift: int = opt(0, "random-shift augmentation: pad each training image by this many "
                             "edge pixels and crop it back at a random offset (DrQ; 0 = none)", ge=0)
    seed: int = opt(0, "seed of the split and of the minibatch order", ge=0)
    lerobot: LeRobotConfig = field(default_factory=LeRobotConfig)
