"""The whole config (one section per field), its validation and its structural keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from .algorithm import AlgorithmConfig, check_estimator, check_value_augment
from .data import CollectConfig, SFTConfig
from .env import EnvConfig, check_camera, check_retry, check_tasks
from .fields import ConfigError, check_field, walk
from .launch import LaunchConfig, check_placement
from .learner import LearnerConfig, check_lr_decay
from .policy import PolicyConfig, check_action_range, check_flow, check_gaussian, check_tiny_vocab
from .runtime import ActorConfig, CheckpointConfig, EvalConfig, LoggingConfig, TransportConfig


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def validate(config: Config, on_this_machine: bool = True) -> None:
    """Range and choice checks declared on the fields, plus checks across sections; with
    `on_this_machine`, also that launch.placement names cores this machine has (not for a config
    received from another machine, which names that machine's cores)."""
    problems = []
    for key, value, meta in walk(config):
        problems += check_field(key, value, meta)
    problems += check_action_range(config.policy)
    problems += check_tiny_vocab(config.policy)
    problems += check_flow(config.policy.flow)
    problems += check_gaussian(config.policy.gaussian)
    problems += check_value_augment(config)
    problems += check_estimator(config)
    problems += check_retry(config)
    problems += check_lr_decay(config.learner)
    problems += check_camera(config.env)
    problems += check_tasks(config.env)
    if on_this_machine:
        problems += check_placement(config.launch)
    if problems:
        raise ConfigError("\n".join(problems))


def structural_keys(cls: type | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """The dotted keys of the config dataclass `cls` (Config by default) declared structural=True
    (`opt`), relative to it, less those under `exclude`: the one declaration that a resumed run
    (learner/checkpoint/) and a saved policy loaded as policy.pretrained_path (VLAPolicy.build)
    are both checked against."""
    def keys(c, prefix):
        for f in dataclasses.fields(c):
            if dataclasses.is_dataclass(f.default_factory):          # a section: field(default_factory=Section)
                yield from keys(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata.get("structural"):
                yield prefix + f.name
    return [k for k in keys(cls or Config, "") if not any(k == e or k.startswith(e + ".") for e in exclude)]
